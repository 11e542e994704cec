"""The list+watch loop on its own: callbacks in order, resume without a list, a failing callback
starts over from a list. (The claim cache and the slice publisher tests cover it in use.)"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from gpu_dra.kube.reflector import Reflector, ReflectorSettings
from gpu_dra.kubelet_plugin.kubeapi import ClaimEvent, ClaimList
from tests.fakes.claim_api import InMemoryClaimApi
from tests.fakes.claim_reader import resource_claim

FAST = ReflectorSettings(backoff_initial_s=0.01, backoff_max_s=0.05, close_timeout_s=5.0)
UID_A = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
UID_B = "5d2c9f71-3e8a-4b6d-8c1f-6a4e2b0d9c02"


class Recorder:
    """The callbacks: what they saw, in order; `fail_lists` makes the next `on_list` calls raise."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.fail_lists = 0
        self.lock = threading.Lock()

    def on_list(self, listing: ClaimList) -> None:
        with self.lock:
            if self.fail_lists:
                self.fail_lists -= 1
                raise RuntimeError("a bug in on_list")
            names = sorted(claim["metadata"]["name"] for claim in listing.items)
            self.seen.append(f"list {','.join(names)}")

    def on_event(self, event: ClaimEvent) -> None:
        with self.lock:
            self.seen.append(f"{event.type} {event.claim['metadata'].get('name', '')}")

    def on_watching(self, watching: bool) -> None:
        with self.lock:
            self.seen.append("open" if watching else "closed")


@pytest.fixture
def api() -> InMemoryClaimApi:
    return InMemoryClaimApi()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def reflector(
    api: InMemoryClaimApi, recorder: Recorder
) -> Iterator[Reflector[ClaimList, ClaimEvent]]:
    reflector = Reflector[ClaimList, ClaimEvent](
        "ResourceClaims",
        api.list_claims,
        lambda version, timeout: api.watch_claims(
            resource_version=version, timeout_seconds=timeout
        ),
        recorder.on_list,
        recorder.on_event,
        on_watching=recorder.on_watching,
        settings=FAST,
    )
    yield reflector
    reflector.close()


def test_callbacks_see_the_list_then_the_watch_and_a_resume_lists_nothing(
    api: InMemoryClaimApi, recorder: Recorder, reflector: Reflector[ClaimList, ClaimEvent]
) -> None:
    api.add(resource_claim(UID_A, "claim-a"))
    reflector.start("test-reflector")
    api.wait_watching()
    api.add(resource_claim(UID_B, "claim-b"))
    api.wait_watching()

    api.break_watches()
    api.wait_watching()

    assert recorder.seen == ["list claim-a", "open", "ADDED claim-b", "closed", "open"]
    assert api.calls["list"] == 1


def test_a_failing_callback_is_logged_and_the_loop_lists_again(
    api: InMemoryClaimApi, recorder: Recorder, reflector: Reflector[ClaimList, ClaimEvent]
) -> None:
    recorder.fail_lists = 1
    api.add(resource_claim(UID_A, "claim-a"))

    reflector.start("test-reflector")
    api.wait_watching()

    assert api.calls["list"] == 2
    assert recorder.seen == ["list claim-a", "open"]
    assert reflector.running


def test_stop_ends_the_thread_and_closes_the_watch(
    api: InMemoryClaimApi, reflector: Reflector[ClaimList, ClaimEvent]
) -> None:
    reflector.start("test-reflector")
    api.wait_watching()
    (watch,) = api.watches

    reflector.stop()

    assert reflector.join(5.0)
    assert watch.closed
    assert not reflector.running


def test_backoff_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="backoff"):
        ReflectorSettings(backoff_initial_s=1.0, backoff_max_s=0.5)
