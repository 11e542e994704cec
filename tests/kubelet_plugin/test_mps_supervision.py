"""Daemon supervision (issue 16, item 2): `DaemonSupervisor` over the real preparer and
`MpsDaemonManager` running the ``nvidia-cuda-mps-control`` test double, with `MpsEvents` posting
to an in-memory Event API. A tenant's ``quit`` and ``set_default_*`` are repaired by one pass,
without touching the other shares' directories, and reported to the pods and claims affected.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.mps import DaemonHandle, DaemonRepair
from gpu_dra.kubelet_plugin.mps.events import (
    REASON_RESTARTED,
    REASON_RESTORED,
    REASON_UNHEALTHY,
    MpsEvents,
)
from gpu_dra.kubelet_plugin.mps.supervisor import DaemonSupervisor
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from tests.doubles import nvidia_cuda_mps_control as double
from tests.fakes.event_api import RecordingEventApi
from tests.kubelet_plugin.nodes import UID_A, UID_B, UID_C, SharesNode, ok, wait_dead


class SupervisedNode(SharesNode):
    """`SharesNode` whose manager reports to `MpsEvents`, and a supervisor over its records."""

    max_percent = 50

    def __init__(self, root: Path, mps_root: Path) -> None:
        self.event_api = RecordingEventApi()
        super().__init__(root, mps_root)

    def preparer_options(self) -> dict[str, Any]:
        options = super().preparer_options()
        self.events = MpsEvents(self.event_api, self.api, self.checkpoint.all, node_name="node-a")
        self.mps.observer = self.events
        self.supervisor = DaemonSupervisor(self.mps, self.checkpoint.all, interval_s=0.05)
        return options

    def reserve(self, claim: ClaimRef, *pods: str) -> None:
        """The claim's ``status.reservedFor``: the pods using it, as the scheduler writes it."""
        stored = self.api.claims[claim.namespace, claim.name]
        stored["status"]["reservedFor"] = [
            {"resource": "pods", "name": pod, "uid": f"uid-{pod}"} for pod in pods
        ]

    def posted(self) -> list[tuple[str, str, str, str]]:
        """``(reason, kind, namespace, name)`` of every Event posted so far."""
        assert self.events.flush()
        return [
            (e["reason"], e["involvedObject"]["kind"], e["involvedObject"]["namespace"],
             e["involvedObject"]["name"])
            for e in self.event_api.events
        ]  # fmt: skip


@pytest.fixture
def node(tmp_path: Path, mps_root: Path) -> SupervisedNode:
    return SupervisedNode(tmp_path, mps_root)


def two_shares(node: SupervisedNode) -> tuple[ClaimRef, ClaimRef, DaemonHandle]:
    a = node.add_share(UID_A, "10Gi", "10", name="a", namespace="team-a")
    b = node.add_share(UID_B, "20Gi", "20", name="b", namespace="team-b")
    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])
    node.reserve(a, "pod-a1", "pod-a2")
    node.reserve(b, "pod-b")
    [handle] = {h.daemon_id: h for h in node.shared_handles().values()}.values()
    return a, b, handle


def test_a_daemon_a_tenant_quit_is_restarted_in_place_and_every_share_pod_is_told(
    node: SupervisedNode,
) -> None:
    a, b, handle = two_shares(node)
    pipe = handle.paths.pipe.stat().st_ino
    node.mps.client.run(handle.paths.pipe, "quit")  # tenant A's container
    assert wait_dead(handle.pid)

    started = time.monotonic()
    [repair] = node.supervisor.check()
    latency = time.monotonic() - started

    assert repair.restarted == f"control daemon pid {handle.pid} is gone"
    assert repair.handle.pid != handle.pid
    assert node.running() == [repair.handle.pid]
    assert handle.paths.pipe.stat().st_ino == pipe  # B's mount still names the directory
    assert double.read_state(handle.paths.pipe)["defaults"]["activeThreadPercentage"] == 50.0
    assert latency < 5.0, latency  # one check: find, restart, set up (a loaded CI is slow)
    assert node.posted() == [
        (REASON_RESTARTED, "Pod", "team-a", "pod-a1"),
        (REASON_RESTARTED, "Pod", "team-a", "pod-a2"),
        (REASON_RESTARTED, "Pod", "team-b", "pod-b"),
    ]
    message = node.event_api.events[0]["message"]
    assert f"control daemon pid {handle.pid} is gone" in message
    assert node.event_api.events[0]["type"] == "Warning"
    assert node.supervisor.check() == []  # healthy now: nothing more to do or say
    assert len(node.posted()) == 3
    node.unprepare(a, b)
    assert node.running() == []
    assert node.daemon_dirs() == []


def test_settings_a_tenant_changed_are_restored_and_every_share_claim_is_told(
    node: SupervisedNode,
) -> None:
    a, b, handle = two_shares(node)
    uuid = node.uuid_of("gpu-0")
    node.mps.client.run(handle.paths.pipe, "set_default_active_thread_percentage 100")

    [repair] = node.supervisor.check()

    assert repair == DaemonRepair(handle, None, ("active thread percentage 100, not 50",))
    assert double.read_state(handle.paths.pipe)["defaults"] == {
        "activeThreadPercentage": 50.0,
        "pinnedMemLimits": {uuid: f"{81559 // 2}M"},
    }
    assert node.running() == [handle.pid]  # not restarted
    assert node.posted() == [
        (REASON_RESTORED, "ResourceClaim", "team-a", "a"),
        (REASON_RESTORED, "ResourceClaim", "team-b", "b"),
    ]
    assert "active thread percentage 100, not 50" in node.event_api.events[0]["message"]
    node.unprepare(a, b)


def test_a_killed_daemon_pod_of_a_claim_without_pods_is_reported_on_the_claim(
    node: SupervisedNode,
) -> None:
    claim = node.add_share(UID_C, "10Gi", "10", name="c")
    ok(node.prepare(claim)[UID_C])  # reservedFor empty: no pod to tell
    [handle] = node.handles(UID_C)
    os.kill(handle.pid, signal.SIGKILL)
    assert wait_dead(handle.pid)

    node.supervisor.check()

    assert node.posted() == [(REASON_RESTARTED, "ResourceClaim", "default", "c")]
    node.unprepare(claim)


def test_a_daemon_that_cannot_be_restarted_is_reported_once_and_retried(
    node: SupervisedNode,
) -> None:
    a, b, handle = two_shares(node)
    node.mps.client.run(handle.paths.pipe, "quit")
    assert wait_dead(handle.pid)
    node.mps.base_env["GPU_DRA_MPS_DOUBLE_FAIL_START"] = "no GPU"

    assert node.supervisor.check() == []
    assert node.supervisor.check() == []  # the same failure again: no second Event

    assert node.posted() == [
        (REASON_UNHEALTHY, "ResourceClaim", "team-a", "a"),
        (REASON_UNHEALTHY, "ResourceClaim", "team-b", "b"),
    ]
    assert "no GPU" in node.event_api.events[0]["message"]
    assert handle.paths.pipe.is_dir()  # kept for the next try
    del node.mps.base_env["GPU_DRA_MPS_DOUBLE_FAIL_START"]
    [repair] = node.supervisor.check()
    assert repair.restarted is not None
    node.unprepare(a, b)
    assert node.running() == []


def test_daemons_of_prepares_under_way_and_of_unusable_records_are_left_alone(
    node: SupervisedNode,
) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    node.checkpoint.put(
        CheckpointEntry(claim=entry.claim, phase=ClaimPhase.PREPARE_STARTED, state=entry.state)
    )
    assert node.supervisor.daemons() == {}
    node.checkpoint.put(entry)
    other = ClaimRef("default", UID_B, "broken")
    node.checkpoint.put(
        CheckpointEntry(
            claim=other, phase=ClaimPhase.PREPARE_COMPLETED, state={"mpsDaemons": "garbage"}
        )
    )
    assert list(node.supervisor.daemons()) == [node.handles(UID_A)[0].daemon_id]
    node.checkpoint.remove(UID_B)
    node.unprepare(a)


def test_a_daemon_stopped_by_an_unprepare_is_not_restarted(node: SupervisedNode) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    entries = dict(node.checkpoint.all())  # what a pass read before the unprepare
    node.unprepare(a)
    stale = DaemonSupervisor(node.mps, lambda: entries, interval_s=1)

    assert stale.check() == []
    assert node.running() == []
    assert node.daemon_dirs() == []
    assert node.posted() == []


def test_a_refused_event_is_logged_and_supervision_goes_on(
    node: SupervisedNode, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, handle = two_shares(node)
    node.event_api.refuse = True
    node.mps.client.run(handle.paths.pipe, "set_default_active_thread_percentage 90")

    [repair] = node.supervisor.check()

    assert repair.restored
    assert node.posted() == []
    assert "MpsDaemonSettingsRestored on ResourceClaim team-a/a not recorded" in caplog.text
    node.unprepare(a, b)


def test_the_supervisor_runs_its_checks_every_interval(node: SupervisedNode) -> None:
    a, b, handle = two_shares(node)

    async def run_until_restarted() -> float:
        task = asyncio.create_task(node.supervisor.run())
        node.mps.client.run(handle.paths.pipe, "quit")
        started = time.monotonic()
        try:
            while node.running() in ([], [handle.pid]):
                await asyncio.sleep(0.01)
                assert time.monotonic() - started < 10
        finally:
            task.cancel()
        return time.monotonic() - started

    detected = asyncio.run(run_until_restarted())

    assert detected < 5.0, detected  # interval 0.05 s plus one restart
    node.unprepare(a, b)
    assert node.running() == []


def test_a_non_positive_interval_is_refused(node: SupervisedNode) -> None:
    with pytest.raises(ValueError, match="positive"):
        DaemonSupervisor(node.mps, node.checkpoint.all, interval_s=0)


class RecordingChecker:
    """A `DaemonChecker` that vouches for every daemon and only records what it was asked."""

    def __init__(self) -> None:
        self.checked: list[DaemonHandle] = []

    def vouches_for(self, daemon_id: str) -> bool:
        return True

    def check_soon(self, handle: DaemonHandle) -> bool:
        self.checked.append(handle)
        return True


def third_share(node: SupervisedNode) -> ClaimRef:
    """A third share of gpu-0 (team-c), prepared: it joins the daemon of `two_shares`."""
    c = node.add_share(UID_C, "10Gi", "10", name="c", namespace="team-c")
    ok(node.prepare(c)[UID_C])
    return c


def commands_sent(handle: DaemonHandle) -> list[str]:
    """The control commands the daemon received so far (the double's ``control.log``)."""
    log = (handle.paths.log / "control.log").read_text()
    return [line.split("Cmd:", 1)[1] for line in log.splitlines() if "Cmd:" in line]


def two_shares_checked(
    node: SupervisedNode,
) -> tuple[ClaimRef, ClaimRef, DaemonHandle, RecordingChecker]:
    """`two_shares`, then a `RecordingChecker` that vouches for their daemon."""
    a, b, handle = two_shares(node)
    checker = RecordingChecker()
    node.preparer.shared_daemons.set_checker(checker)
    return a, b, handle, checker


def test_a_share_joining_a_checked_live_daemon_sends_it_no_command_in_its_prepare(
    node: SupervisedNode,
) -> None:
    a, b, handle, checker = two_shares_checked(node)
    before = commands_sent(handle)

    c = third_share(node)

    assert commands_sent(handle) == before  # no read-back in the prepare
    assert [h.pid for h in checker.checked] == [handle.pid]
    assert node.shared_handles()[UID_C].pid == handle.pid
    node.unprepare(a, b, c)
    assert node.running() == []


def test_a_daemon_the_first_share_started_is_checked_beside_it(node: SupervisedNode) -> None:
    checker = RecordingChecker()
    node.preparer.shared_daemons.set_checker(checker)
    a = node.add_share(UID_A, "10Gi", "10", name="a", namespace="team-a")

    ok(node.prepare(a)[UID_A])

    [handle] = node.shared_handles().values()
    assert checker.checked == [handle]  # no warm daemon: the share started it
    node.unprepare(a)
    assert node.running() == []


def test_the_next_share_joins_a_daemon_the_first_started_without_reading_it_back(
    node: SupervisedNode, caplog: pytest.LogCaptureFixture
) -> None:
    """Warm daemons off (or a dynamic MIG partition's daemon): the supervisor checks the daemon
    the first share started at once, not at its next pass (30 s away), so the second share
    joins a daemon it vouches for and leaves the read-back to it."""
    supervisor = DaemonSupervisor(node.mps, node.checkpoint.all, interval_s=30)
    node.preparer.shared_daemons.set_checker(supervisor)
    a = node.add_share(UID_A, "10Gi", "10", name="a", namespace="team-a")
    ok(node.prepare(a)[UID_A])
    [handle] = node.shared_handles().values()
    deadline = time.monotonic() + 10
    while not supervisor.vouches_for(handle.daemon_id):
        assert time.monotonic() < deadline, "the started daemon was not checked beside its start"
        time.sleep(0.02)

    b = node.add_share(UID_B, "20Gi", "20", name="b", namespace="team-b")
    with caplog.at_level("INFO", logger="gpu_dra"):
        ok(node.prepare(b)[UID_B])

    assert node.shared_handles()[UID_B].pid == handle.pid
    assert f"joined daemon_id={handle.daemon_id} pid={handle.pid} (settings checked beside)" in (
        caplog.text
    )
    node.unprepare(a, b)
    assert node.running() == []


def test_the_supervisor_checks_a_joined_daemon_at_once_and_restores_its_settings(
    node: SupervisedNode,
) -> None:
    a, b, handle = two_shares(node)
    supervisor = DaemonSupervisor(node.mps, node.checkpoint.all, interval_s=30)
    node.preparer.shared_daemons.set_checker(supervisor)
    assert supervisor.check() == []  # it passed: a join may leave the check to the supervisor
    node.mps.client.run(handle.paths.pipe, "set_default_active_thread_percentage 100")

    c = third_share(node)
    deadline = time.monotonic() + 10
    while (REASON_RESTORED, "ResourceClaim", "team-a", "a") not in node.posted():
        assert time.monotonic() < deadline, "not restored and told after the join"
        time.sleep(0.02)

    assert double.read_state(handle.paths.pipe)["defaults"]["activeThreadPercentage"] == 50.0
    assert node.running() == [handle.pid]
    node.unprepare(a, b, c)


@pytest.mark.parametrize("why", ["never checked", "not repairing"])
def test_a_join_checks_the_settings_itself_when_the_supervisor_cannot(
    node: SupervisedNode, why: str
) -> None:
    a, b, handle = two_shares(node)
    repairing = True
    supervisor = DaemonSupervisor(
        node.mps, node.checkpoint.all, interval_s=30, repair=lambda: repairing
    )
    if why == "not repairing":
        assert supervisor.check() == []  # it passed the daemon, then lost its turn to repair
        repairing = False
    node.preparer.shared_daemons.set_checker(supervisor)
    node.mps.client.run(handle.paths.pipe, "set_default_active_thread_percentage 100")

    c = third_share(node)

    # Restored inside the prepare, before it returned.
    assert double.read_state(handle.paths.pipe)["defaults"]["activeThreadPercentage"] == 50.0
    node.unprepare(a, b, c)


def test_a_dead_daemon_is_restarted_in_the_join_even_with_a_checker(
    node: SupervisedNode,
) -> None:
    a, b, handle, checker = two_shares_checked(node)
    node.mps.client.run(handle.paths.pipe, "quit")  # a tenant
    assert wait_dead(handle.pid)

    c = third_share(node)

    assert checker.checked == []
    [pid] = node.running()
    assert pid != handle.pid
    assert node.shared_handles()[UID_C].pid == pid
    node.unprepare(a, b, c)
    assert node.running() == []
