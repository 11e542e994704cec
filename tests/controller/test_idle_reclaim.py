"""The idle policy's passes (`controller/idle_reclaim.py`) against an in-memory API and a fake
clock: warn, then evict after the grace period; busy pods, pods of other namespaces and pods
with a busy claim untouched; a PodDisruptionBudget's refusal reported and retried; dry-run only
reports; activity clears the warning; every action counted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.controller.__main__ import run
from gpu_dra.controller.idle_reclaim import IdleReclaimer, idle_reclaim_loop
from gpu_dra.controller.metrics import CatalogMetrics, IdleReclaimMetrics
from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.driver.cluster.idle_policy import (
    CONDITION_TYPE,
    DEFAULT_MAX_SAMPLE_AGE_S,
    GRACE_ANNOTATION,
    WINDOW_ANNOTATION,
    rfc3339,
)
from gpu_dra.kube import errors
from tests.controller.asyncwait import until
from tests.fakes.deviceclass_api import RecordingDeviceClassApi
from tests.fakes.idle_api import FakeIdleApi, gpu_claim

T0 = 1_800_000_000.0
WINDOW = {WINDOW_ANNOTATION: "2h", GRACE_ANNOTATION: "30m"}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def api(clock: Clock) -> FakeIdleApi:
    """Claims as a live plugin keeps them: each names a sample of the clock's now."""
    fake = FakeIdleApi()
    fake.plugin_clock = clock
    return fake


@pytest.fixture
def reclaimer(api: FakeIdleApi, registry: CollectorRegistry, clock: Clock) -> IdleReclaimer:
    return IdleReclaimer(api, IdleReclaimMetrics(registry), driver="gpu.nvidia.com",
                         instance="controller-0", clock=clock)  # fmt: skip


def actions(registry: CollectorRegistry, namespace: str, action: str) -> float:
    value = registry.get_sample_value(
        "gpu_dra_idle_policy_actions_total", {"namespace": namespace, "action": action}
    )
    return value or 0.0


def ago(seconds: float) -> str:
    return rfc3339(T0 - seconds)


def notebook(api: FakeIdleApi, namespace: str, idle_for: float | None, name: str = "nb") -> None:
    """A pod `name` holding claim `name`: idle for `idle_for` seconds (None: in use)."""
    api.add_pod(namespace, name)
    devices = {"gpu-0": None if idle_for is None else ago(idle_for)}
    api.add_claim(gpu_claim(namespace, name, pods=(name,), devices=devices))


def test_an_idle_pod_is_warned_then_evicted_after_the_grace_period(
    api: FakeIdleApi, reclaimer: IdleReclaimer, registry: CollectorRegistry, clock: Clock
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=2 * 3600 + 60)

    reclaimer.reconcile()

    warned = api.condition("ml", "nb", CONDITION_TYPE)
    assert warned is not None
    assert (warned["status"], warned["reason"]) == ("True", "Idle")
    assert warned["lastTransitionTime"] == rfc3339(T0)
    assert f"idle since {ago(2 * 3600 + 60)}" in warned["message"]
    assert f"evicted at {rfc3339(T0 + 1800)} unless its GPU is used" in warned["message"]
    assert api.reasons() == [("Pod", "nb", "GpuClaimIdle"), ("ResourceClaim", "nb", "GpuClaimIdle")]
    assert all(e["type"] == "Warning" for e in api.events)
    assert actions(registry, "ml", "warned") == 1
    assert registry.get_sample_value("gpu_dra_idle_policy_idle_claims", {"namespace": "ml"}) == 1

    clock.now = T0 + 1799  # within the grace period: nothing more
    reclaimer.reconcile()
    assert api.evictions == []
    assert len(api.events) == 2

    clock.now = T0 + 1800
    reclaimer.reconcile()
    assert api.evictions == [("ml", "nb", "uid-nb", False)]
    assert api.reasons()[2:] == [
        ("Pod", "nb", "GpuClaimIdleEvicted"),
        ("ResourceClaim", "nb", "GpuClaimIdleEvicted"),
    ]
    assert actions(registry, "ml", "evicted") == 1

    reclaimer.reconcile()  # the evicted pod terminates: it is not evicted twice
    assert len(api.evictions) == 1


def test_a_busy_pod_and_a_pod_idle_for_less_than_the_window_are_untouched(
    api: FakeIdleApi, reclaimer: IdleReclaimer, registry: CollectorRegistry, clock: Clock
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=None, name="busy")
    notebook(api, "ml", idle_for=2 * 3600 - 60, name="recent")

    for step in range(3):
        clock.now = T0 + step * 20
        reclaimer.reconcile()

    assert api.writes("ml") == []
    assert api.condition("ml", "busy", CONDITION_TYPE) is None
    assert registry.get_sample_value("gpu_dra_idle_policy_idle_claims", {"namespace": "ml"}) == 0


def test_pods_of_namespaces_that_did_not_opt_in_are_never_read_or_written(
    api: FakeIdleApi, reclaimer: IdleReclaimer, clock: Clock
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    api.add_namespace("other")
    notebook(api, "ml", idle_for=3 * 3600)
    notebook(api, "other", idle_for=30 * 86400)

    for step in range(3):
        clock.now = T0 + step * 1800
        reclaimer.reconcile()

    assert [ns for call, ns in api.calls if ns == "other"] == []
    assert api.condition("other", "nb", CONDITION_TYPE) is None
    assert api.evictions == [("ml", "nb", "uid-nb", False)]


def test_a_pod_with_one_busy_claim_is_not_idle(
    api: FakeIdleApi, reclaimer: IdleReclaimer, clock: Clock
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    api.add_pod("ml", "two")
    api.add_claim(gpu_claim("ml", "a", pods=("two",), devices={"gpu-0": ago(86400)}))
    api.add_claim(gpu_claim("ml", "b", pods=("two",), devices={"gpu-1": None}))

    for step in range(3):
        clock.now = T0 + step * 3600
        reclaimer.reconcile()

    assert api.writes("ml") == []


@pytest.mark.parametrize(
    "devices",
    [
        {"gpu-0": ago(86400), "gpu-1": None},  # one device in use
        {"gpu-0": ago(86400), "!gpu-1": ago(86400)},  # one device without a status entry
    ],
)
def test_a_claim_is_idle_only_when_every_device_says_so(
    api: FakeIdleApi, reclaimer: IdleReclaimer, devices: dict[str, str | None]
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    api.add_pod("ml", "nb")
    api.add_claim(gpu_claim("ml", "nb", pods=("nb",), devices=devices))

    reclaimer.reconcile()

    assert api.writes("ml") == []


def test_a_claim_of_another_driver_is_not_the_policys(
    api: FakeIdleApi, reclaimer: IdleReclaimer
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    api.add_pod("ml", "nb")
    api.add_claim(gpu_claim("ml", "nb", pods=("nb",), devices={"gpu-0": ago(86400)},
                            driver="other.example.com"))  # fmt: skip

    reclaimer.reconcile()

    assert api.writes("ml") == []


def test_activity_again_clears_the_warning_and_nothing_is_evicted(
    api: FakeIdleApi, reclaimer: IdleReclaimer, registry: CollectorRegistry, clock: Clock
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    reclaimer.reconcile()
    api.add_claim(gpu_claim("ml", "nb", pods=("nb",), devices={"gpu-0": None}))  # used again

    clock.now = T0 + 600
    reclaimer.reconcile()
    clock.now = T0 + 3 * 3600
    reclaimer.reconcile()

    cleared = api.condition("ml", "nb", CONDITION_TYPE)
    assert cleared is not None
    assert (cleared["status"], cleared["reason"]) == ("False", "Active")
    assert cleared["lastTransitionTime"] == rfc3339(T0 + 600)
    assert api.evictions == []
    assert ("Pod", "nb", "GpuClaimActive") in api.reasons()
    assert actions(registry, "ml", "cleared") == 1


def test_the_claims_are_read_again_just_before_the_eviction(
    api: FakeIdleApi, reclaimer: IdleReclaimer, clock: Clock
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    reclaimer.reconcile()

    def used_meanwhile(claim: dict[str, object]) -> dict[str, object]:
        return gpu_claim("ml", "nb", pods=("nb",), devices={"gpu-0": None})

    api.on_read_claim = used_meanwhile
    clock.now = T0 + 1800
    reclaimer.reconcile()

    assert api.evictions == []
    cleared = api.condition("ml", "nb", CONDITION_TYPE)
    assert cleared is not None
    assert cleared["reason"] == "Active"


def test_a_disruption_budget_blocks_the_eviction_which_is_reported_and_retried(
    api: FakeIdleApi, reclaimer: IdleReclaimer, registry: CollectorRegistry, clock: Clock
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    api.blocked.add(("ml", "nb"))
    reclaimer.reconcile()

    clock.now = T0 + 1800
    reclaimer.reconcile()
    clock.now = T0 + 1830
    reclaimer.reconcile()

    blocked = api.condition("ml", "nb", CONDITION_TYPE)
    assert blocked is not None
    assert (blocked["status"], blocked["reason"]) == ("True", "EvictionBlocked")
    assert blocked["lastTransitionTime"] == rfc3339(T0)  # still warned since then
    assert "disruption budget" in blocked["message"]
    assert api.reasons().count(("Pod", "nb", "GpuIdleEvictionBlocked")) == 1  # reported once
    assert actions(registry, "ml", "blocked") == 2  # each refused attempt
    assert api.evictions == []

    api.blocked.clear()  # the budget allows it now
    clock.now = T0 + 1860
    reclaimer.reconcile()
    assert api.evictions == [("ml", "nb", "uid-nb", False)]


def test_a_dry_run_namespace_is_told_what_would_happen_and_nothing_is_evicted(
    api: FakeIdleApi, reclaimer: IdleReclaimer, registry: CollectorRegistry, clock: Clock
) -> None:
    api.add_namespace("ml", "dry-run", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    notebook(api, "ml", idle_for=3 * 3600, name="guarded")
    api.blocked.add(("ml", "guarded"))

    reclaimer.reconcile()
    warned = api.condition("ml", "nb", CONDITION_TYPE)
    assert warned is not None
    assert warned["reason"] == "IdleDryRun"
    assert "would be evicted at" in warned["message"]
    assert "nothing is evicted" in warned["message"]

    for step in (1800, 1830, 7200):
        clock.now = T0 + step
        reclaimer.reconcile()

    # Only dry-run evictions: the apiserver checks the budgets and evicts nothing.
    assert api.evictions == [("ml", "nb", "uid-nb", True)]
    assert all("deletionTimestamp" not in p["metadata"] for p in api.pods.values())
    would = api.condition("ml", "nb", CONDITION_TYPE)
    assert would is not None
    assert would["reason"] == "WouldEvict"
    guarded = api.condition("ml", "guarded", CONDITION_TYPE)
    assert guarded is not None
    assert guarded["reason"] == "WouldBeBlocked"
    assert actions(registry, "ml", "would-evict") == 1  # once, not every pass
    assert actions(registry, "ml", "would-block") == 3  # each dry-run attempt
    assert actions(registry, "ml", "evicted") == 0
    assert ("Pod", "nb", "GpuClaimIdleWouldEvict") in api.reasons()


def test_a_namespace_switched_from_dry_run_to_enabled_is_warned_again_first(
    api: FakeIdleApi, reclaimer: IdleReclaimer, clock: Clock
) -> None:
    api.add_namespace("ml", "dry-run", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    reclaimer.reconcile()
    clock.now = T0 + 1800
    reclaimer.reconcile()

    api.add_namespace("ml", "enabled", WINDOW)
    clock.now = T0 + 1900
    reclaimer.reconcile()
    assert api.evictions == [("ml", "nb", "uid-nb", True)]
    warned = api.condition("ml", "nb", CONDITION_TYPE)
    assert warned is not None
    assert (warned["reason"], warned["lastTransitionTime"]) == ("Idle", rfc3339(T0 + 1900))

    clock.now = T0 + 1900 + 1800
    reclaimer.reconcile()
    assert api.evictions[-1] == ("ml", "nb", "uid-nb", False)


@pytest.mark.parametrize(
    ("label", "annotations", "complaint"),
    [
        ("yes", {}, "label gpu.nvidia.com/idle-reclaim='yes' is neither 'enabled' nor 'dry-run'"),
        ("enabled", {WINDOW_ANNOTATION: "soon"}, "annotation gpu.nvidia.com/idle-window: 'soon'"),
        ("enabled", {GRACE_ANNOTATION: "0m"}, "annotation gpu.nvidia.com/idle-grace: '0m'"),
    ],
)
def test_a_namespace_the_policy_cannot_read_is_left_alone_and_told_why(
    api: FakeIdleApi,
    reclaimer: IdleReclaimer,
    registry: CollectorRegistry,
    label: str,
    annotations: dict[str, str],
    complaint: str,
) -> None:
    api.add_namespace("ml", label, annotations)
    notebook(api, "ml", idle_for=30 * 86400)

    reclaimer.reconcile()
    reclaimer.reconcile()

    assert api.writes("ml") == ["event"]  # the one Event on the namespace, not repeated
    (event,) = api.events
    assert event["involvedObject"]["kind"] == "Namespace"
    assert event["reason"] == "GpuIdleReclaimInvalid"
    assert complaint in event["message"]
    mode = {"namespace": "ml", "mode": "invalid"}
    assert registry.get_sample_value("gpu_dra_idle_policy_namespaces", mode) == 1


def test_defaults_apply_where_the_namespace_sets_no_window(
    api: FakeIdleApi, registry: CollectorRegistry, clock: Clock
) -> None:
    reclaimer = IdleReclaimer(api, IdleReclaimMetrics(registry), driver="gpu.nvidia.com",
                              instance="c", default_window_s=600, default_grace_s=60,
                              clock=clock)  # fmt: skip
    api.add_namespace("ml", "enabled")
    notebook(api, "ml", idle_for=601)

    reclaimer.reconcile()
    clock.now = T0 + 60
    reclaimer.reconcile()

    assert api.evictions == [("ml", "nb", "uid-nb", False)]
    mode = {"namespace": "ml", "mode": "enabled"}
    assert registry.get_sample_value("gpu_dra_idle_policy_namespaces", mode) == 1


def test_a_pod_is_idle_no_longer_than_it_has_run(
    api: FakeIdleApi, reclaimer: IdleReclaimer, clock: Clock
) -> None:
    """A claim idle for a day, just taken over by a new pod: the window counts from its start."""
    api.add_namespace("ml", "enabled", WINDOW)
    api.add_pod("ml", "nb", started=ago(60))
    api.add_claim(gpu_claim("ml", "nb", pods=("nb",), devices={"gpu-0": ago(86400)}))

    reclaimer.reconcile()
    assert api.writes("ml") == []

    clock.now = T0 + 2 * 3600 - 60  # two hours after the pod started
    reclaimer.reconcile()
    warned = api.condition("ml", "nb", CONDITION_TYPE)
    assert warned is not None
    assert warned["reason"] == "Idle"


def test_an_eviction_waits_while_the_nodes_plugin_is_not_ready(
    api: FakeIdleApi, registry: CollectorRegistry, clock: Clock
) -> None:
    """A plugin that is down writes nothing: its last "idle" may be stale."""
    reclaimer = IdleReclaimer(
        api,
        IdleReclaimMetrics(registry),
        driver="gpu.nvidia.com",
        instance="c",
        clock=clock,
        plugin_selector="app.kubernetes.io/component=kubelet-plugin",
    )
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)  # its claim's pool: node-a
    api.add_plugin("node-b")
    api.add_plugin("node-a", ready=False)
    reclaimer.reconcile()  # warning needs no plugin check

    clock.now = T0 + 1800
    reclaimer.reconcile()
    reclaimer.reconcile()
    assert api.evictions == []
    assert actions(registry, "ml", "deferred") == 2

    api.plugins.clear()
    api.add_plugin("node-a")
    reclaimer.reconcile()
    assert api.evictions == [("ml", "nb", "uid-nb", False)]


def test_a_pod_recreated_under_the_same_name_is_not_the_claims_pod(
    api: FakeIdleApi, reclaimer: IdleReclaimer
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    api.add_pod("ml", "nb", uid="another-uid")

    reclaimer.reconcile()

    assert api.writes("ml") == []


def test_a_failed_call_is_counted_and_the_next_pass_tries_again(
    api: FakeIdleApi, reclaimer: IdleReclaimer, registry: CollectorRegistry
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    api.fail["patch-status"] = errors.ForbiddenError("patch pods/status: 403", status=403)

    result = reclaimer.reconcile()

    assert "403" in result.failures[0]
    assert registry.get_sample_value("gpu_dra_idle_policy_errors_total", {"call": "pod"}) == 1
    assert actions(registry, "ml", "warned") == 0
    del api.fail["patch-status"]
    reclaimer.reconcile()
    assert actions(registry, "ml", "warned") == 1


def test_a_pass_stops_before_the_next_pod_once_the_lease_is_lost(
    api: FakeIdleApi, reclaimer: IdleReclaimer
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)

    reclaimer.reconcile(acting=lambda: False)

    assert api.writes("ml") == []


def test_the_loop_passes_until_stopped(api: FakeIdleApi, reclaimer: IdleReclaimer) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(idle_reclaim_loop(reclaimer, 0.01, stop))
        await until("the first warning", lambda: api.events)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert api.condition("ml", "nb", CONDITION_TYPE) is not None


def test_the_controller_runs_the_policy_beside_the_catalog(
    api: FakeIdleApi, reclaimer: IdleReclaimer, tmp_path: Path
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    settings = ControllerSettings(
        deviceclasses_dir=tmp_path, idle_reclaim=True, idle_reclaim_interval_s=0.01
    )

    async def scenario() -> int:
        stop = asyncio.Event()
        catalog = RecordingDeviceClassApi()
        metrics = CatalogMetrics(CollectorRegistry())
        task = asyncio.create_task(run(settings, catalog, metrics, stop=stop, reclaimer=reclaimer))
        await until("the first warning", lambda: api.events)
        stop.set()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(scenario()) == 0
    assert api.condition("ml", "nb", CONDITION_TYPE) is not None


def stale_claims(registry: CollectorRegistry, namespace: str) -> float | None:
    return registry.get_sample_value("gpu_dra_idle_policy_stale_claims", {"namespace": namespace})


def test_a_pod_whose_claims_report_went_stale_is_left_alone_until_it_is_fresh(
    api: FakeIdleApi,
    reclaimer: IdleReclaimer,
    registry: CollectorRegistry,
    clock: Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The node's plugin stopped sampling at T0: its last "idle" is not read as idle, neither
    warned nor evicted (nor cleared), counted and logged once; when it reports again the policy
    goes on."""
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=2 * 3600 - 200)
    api.plugin_clock = lambda: T0  # its last sample

    clock.now = T0 + DEFAULT_MAX_SAMPLE_AGE_S  # at the bound: still trusted, not idle long enough
    reclaimer.reconcile()
    assert (api.writes("ml"), actions(registry, "ml", "stale")) == ([], 0)
    assert stale_claims(registry, "ml") == 0

    clock.now = T0 + 3600  # "idle" for 3 h, as of a sample an hour old
    reclaimer.reconcile()
    reclaimer.reconcile()
    assert api.writes("ml") == []
    assert api.condition("ml", "nb", CONDITION_TYPE) is None
    assert actions(registry, "ml", "stale") == 2
    assert stale_claims(registry, "ml") == 1
    assert registry.get_sample_value("gpu_dra_idle_policy_idle_claims", {"namespace": "ml"}) == 0
    (logged,) = [r.getMessage() for r in caplog.records if "left alone" in r.getMessage()]
    assert logged.startswith(
        "idle policy: ml/nb left alone (not warned, cleared or evicted): its activity report is "
        f"stale: claim nb: node-a/gpu-0: Active=False is from a sample of {rfc3339(T0)}, 1h ago, "
        "older than the policy's bound 2m6s"
    )

    api.plugin_clock = clock  # reporting again
    reclaimer.reconcile()
    assert api.condition("ml", "nb", CONDITION_TYPE) is not None
    assert actions(registry, "ml", "warned") == 1
    assert stale_claims(registry, "ml") == 0


def test_a_warned_pod_is_not_evicted_nor_cleared_on_a_stale_report(
    api: FakeIdleApi, reclaimer: IdleReclaimer, registry: CollectorRegistry, clock: Clock
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    reclaimer.reconcile()  # warned on a fresh report
    api.plugin_clock = lambda: T0 + 60  # the plugin's last sample

    clock.now = T0 + 1800  # the grace period is over
    reclaimer.reconcile()
    assert api.evictions == []
    warned = api.condition("ml", "nb", CONDITION_TYPE)
    assert warned is not None
    assert (warned["status"], warned["reason"]) == ("True", "Idle")  # kept, not cleared
    assert actions(registry, "ml", "stale") == 1

    api.plugin_clock = clock
    reclaimer.reconcile()
    assert api.evictions == [("ml", "nb", "uid-nb", False)]


def test_a_report_that_is_stale_when_read_again_before_the_eviction_stops_it(
    api: FakeIdleApi, reclaimer: IdleReclaimer, registry: CollectorRegistry, clock: Clock
) -> None:
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=3 * 3600)
    reclaimer.reconcile()

    def from_an_old_plugin(claim: dict[str, object]) -> dict[str, object]:
        return gpu_claim("ml", "nb", pods=("nb",), devices={"gpu-0": ago(3 * 3600)},
                         sampled_at=ago(3600))  # fmt: skip

    api.on_read_claim = from_an_old_plugin
    clock.now = T0 + 1800
    reclaimer.reconcile()
    assert api.evictions == []
    assert ("read", "ml") in api.calls
    warned = api.condition("ml", "nb", CONDITION_TYPE)
    assert warned is not None
    assert warned["reason"] == "Idle"
    assert actions(registry, "ml", "stale") == 1


def test_claims_of_a_plugin_that_names_no_sample_are_never_idle(
    api: FakeIdleApi, reclaimer: IdleReclaimer, registry: CollectorRegistry, clock: Clock
) -> None:
    """A kubelet plugin older than ``data.sampledAt`` (or any writer that leaves it out)."""
    api.plugin_clock = None
    api.add_namespace("ml", "enabled", WINDOW)
    notebook(api, "ml", idle_for=30 * 86400)
    for step in range(3):
        clock.now = T0 + step * 3600
        reclaimer.reconcile()
    assert api.writes("ml") == []
    assert actions(registry, "ml", "stale") == 3
