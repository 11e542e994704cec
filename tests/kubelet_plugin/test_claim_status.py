"""Claim status: the ``status.devices`` entries of claims prepared by the real preparer (what
each device is, Ready, Healthy, Active), and the writer's rate limit, unchanged-skip, stable
transition times, failures that never stop it, and turn-taking."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.driver.health import DeviceHealth, HealthStatus, Problem, Severity, gpu_lost
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kube import errors
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.claim_status.content import Activity, claim_status
from gpu_dra.kubelet_plugin.claim_status.runtime import status_builder
from gpu_dra.kubelet_plugin.claim_status.writer import ClaimStatusWriter
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.tiers.state import TIME_SLICE_STATE_KEY
from gpu_dra.kubelet_plugin.utilization.claims import claim_devices
from gpu_dra.kubelet_plugin.utilization.monitor import UtilizationMonitor
from gpu_dra.kubelet_plugin.utilization.sampler import UtilizationSampler
from tests.kubelet_plugin.nodes import UID_A, UID_B, Node, SharesNode, hgx_h100_inventory, ok

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
def gpus(tmp_path: Path) -> Node:
    return Node(tmp_path / "node", hgx_h100_inventory())


def settings(**flags: str) -> KubeletPluginSettings:
    argv = ["--node-name=node-a", *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items())]
    return KubeletPluginSettings.parse(argv, env={})


def conditions(entry: Any) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in entry.conditions}


def test_a_whole_gpu_says_what_it_is_and_that_it_is_ready_healthy_and_in_use(gpus: Node) -> None:
    ok(gpus.prepare(gpus.add_gpus(UID_A, "train", "gpu-2"))[UID_A])
    entry = gpus.checkpoint.all()[UID_A]
    devices = claim_devices({UID_A: entry}, gpus.inventory, lambda ns, n: ())
    health = {"gpu-2": DeviceHealth()}
    activity = {"gpu-2": Activity(last_active=990.0, sampled_at=1000.0, idle_after_s=300)}
    (status,) = claim_status(
        entry, gpus.inventory, devices, driver="gpu.nvidia.com", node="node-a", health=health,
        activity=activity, time_slices={},
    )  # fmt: skip
    assert (status.driver, status.pool, status.device, status.share_id) == (
        "gpu.nvidia.com", "node-a", "gpu-2", None,
    )  # fmt: skip
    assert status.data == {
        "tier": "gpu",
        "uuid": gpus.uuid_of("gpu-2"),
        "productName": "NVIDIA H100 80GB HBM3",
        "sampledAt": "1970-01-01T00:16:40Z",  # the sample Active was derived from
    }
    assert conditions(status) == {
        "Ready": ("True", "Prepared"),
        "Healthy": ("True", "Healthy"),
        "Active": ("True", "InUse"),
    }


def test_idle_lost_and_unsampled_devices_say_so(gpus: Node) -> None:
    ok(gpus.prepare(gpus.add_gpus(UID_A, "notebook", "gpu-0", "gpu-1"))[UID_A])
    entry = gpus.checkpoint.all()[UID_A]
    devices = claim_devices({UID_A: entry}, gpus.inventory, lambda ns, n: ())
    lost = DeviceHealth((gpu_lost("NVML_ERROR_GPU_IS_LOST", NOW),))
    xid = DeviceHealth((Problem("xid", "48", Severity.DEGRADED, "critical XID 48", NOW),))
    assert lost.status is HealthStatus.UNHEALTHY
    idle = Activity(last_active=0.0, sampled_at=7200.0, idle_after_s=300)
    statuses = claim_status(
        entry, gpus.inventory, devices, driver="gpu.nvidia.com", node="node-a",
        health={"gpu-0": lost, "gpu-1": xid}, activity={"gpu-0": idle}, time_slices={},
    )  # fmt: skip
    by_device = {s.device: conditions(s) for s in statuses}
    assert by_device["gpu-0"]["Healthy"] == ("False", "GpuLost")
    assert by_device["gpu-0"]["Active"] == ("False", "Idle")
    assert by_device["gpu-1"]["Healthy"] == ("False", "Xid48")
    assert by_device["gpu-1"]["Active"] == ("Unknown", "NotSampled")
    (active,) = [c for c in statuses[0].conditions if c.type == "Active"]
    assert "no GPU activity since 1970-01-01T00:00:00Z" in active.message
    # While idle (only then: it would change at every sample otherwise), data says since when.
    assert statuses[0].data["idleSince"] == "1970-01-01T00:00:00Z"
    assert statuses[0].data["sampledAt"] == "1970-01-01T02:00:00Z"
    assert "idleSince" not in statuses[1].data
    assert "sampledAt" not in statuses[1].data  # not sampled: no sample to name
    # Monitor and sampler off: no Healthy or Active condition at all, not a guess.
    off = claim_status(
        entry, gpus.inventory, devices, driver="gpu.nvidia.com", node="node-a", health=None,
        activity=None, time_slices={},
    )  # fmt: skip
    assert [list(conditions(s)) for s in off] == [["Ready"], ["Ready"]]


def test_an_mps_share_carries_its_share_id_and_caps(tmp_path: Path, mps_root: Path) -> None:
    node = SharesNode(tmp_path / "node", mps_root)
    share = node.add_share(UID_A, "10Gi", "25", name="a")
    ok(node.prepare(share)[UID_A])
    entry = node.checkpoint.all()[UID_A]
    assert node.unprepare(share) == {UID_A: None}
    (status,) = status_builder(settings(), node.inventory, None, None)(entry)
    assert status.share_id == f"{UID_A[:8]}-0000-4000-8000-000000000000"
    assert status.data["tier"] == "mps-share"
    assert (status.data["memory"], status.data["computePercent"]) == ("10Gi", 25)
    assert status.data["memoryEnforcement"] in {"driver", "mps-client"}


def test_a_time_sliced_gpu_names_its_interval(gpus: Node) -> None:
    uuid = gpus.uuid_of("gpu-3")
    entry = CheckpointEntry(
        ClaimRef("default", UID_A, "sliced"),
        ClaimPhase.PREPARE_COMPLETED,
        (PreparedDevice(("gpu",), "node-a", "gpu-3", ("k8s.gpu.nvidia.com/claim=x",)),),
        {TIME_SLICE_STATE_KEY: {uuid: 2}},
    )
    (status,) = status_builder(settings(), gpus.inventory, None, None)(entry)
    assert (status.data["tier"], status.data["timeSliceInterval"]) == ("timeslicing", "Medium")


# ---- the writer -------------------------------------------------------------------------------


class FakeApi:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, list[Mapping[str, Any]]]] = []
        self.fail: str | None = None

    def apply_devices(
        self, namespace: str, name: str, uid: str, devices: Sequence[Mapping[str, Any]]
    ) -> None:
        if self.fail is not None:
            raise errors.ApiError(self.fail)
        self.calls.append((namespace, name, uid, [dict(d) for d in devices]))


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def writer_for(
    node: Node, health: dict[str, DeviceHealth], api: FakeApi, clock: Clock, **kw: Any
) -> ClaimStatusWriter:
    build = status_builder(settings(), node.inventory, lambda: health, None)
    return ClaimStatusWriter(
        api, node.checkpoint.all, build, registry=CollectorRegistry(), clock=clock,
        min_interval_s=30, **kw,
    )  # fmt: skip


def test_a_sampled_claim_is_rewritten_every_min_interval_with_its_newest_sample(
    gpus: Node, tmp_path: Path
) -> None:
    """``data.sampledAt`` follows the sampler, so the status of a sampled claim is a heartbeat:
    written at most once per interval, each time naming the newest sample; a sampler that stops
    leaves the last one, which readers then see grow old."""
    ok(gpus.prepare(gpus.add_gpus(UID_A, "notebook", "gpu-0"))[UID_A])
    api, clock = FakeApi(), Clock()
    nvml = SimulatedHost.load("hgx-h100", "node-a").nvml
    monitor = UtilizationMonitor(
        UtilizationSampler(nvml, proc_root=tmp_path / "proc", clock=clock),
        lambda: claim_devices(gpus.checkpoint.all(), gpus.inventory, lambda ns, n: ()),
        interval_s=10,
        idle_threshold_percent=5,
    )
    build = status_builder(settings(), gpus.inventory, None, monitor)
    writer = ClaimStatusWriter(api, gpus.checkpoint.all, build, clock=clock, min_interval_s=30)

    def sampled_at() -> str:
        (device,) = api.calls[-1][3]
        return str(device["data"]["sampledAt"])

    monitor.sample_once()
    assert writer.pass_once() == 1
    assert sampled_at() == "2027-01-15T08:00:00Z"
    clock.now += 10
    monitor.sample_once()
    assert writer.pass_once() == 0  # a newer sample, but 10 s after the last write
    clock.now += 20
    monitor.sample_once()
    assert writer.pass_once() == 1
    assert sampled_at() == "2027-01-15T08:00:30Z"
    clock.now += 60  # the sampler stopped: nothing new to write, the old sample stays
    assert writer.pass_once() == 0
    assert (len(api.calls), sampled_at()) == (2, "2027-01-15T08:00:30Z")


def healthy_of(call: tuple[str, str, str, list[Mapping[str, Any]]]) -> dict[str, Any]:
    (device,) = call[3]
    (condition,) = [c for c in device["conditions"] if c["type"] == "Healthy"]
    return dict(condition)


def test_the_writer_writes_once_then_only_changes_at_most_every_min_interval(gpus: Node) -> None:
    ok(gpus.prepare(gpus.add_gpus(UID_A, "train", "gpu-0"))[UID_A])
    api, clock = FakeApi(), Clock()
    health = {"gpu-0": DeviceHealth()}
    writer = writer_for(gpus, health, api, clock)
    assert writer.pass_once() == 1
    ((namespace, name, uid, devices),) = api.calls
    assert (namespace, name, uid) == ("default", "train", UID_A)
    assert devices[0]["data"]["uuid"] == gpus.uuid_of("gpu-0")
    first = healthy_of(api.calls[0])
    assert first["lastTransitionTime"] == "2027-01-15T08:00:00Z"
    clock.now += 100
    assert writer.pass_once() == 0  # nothing changed: nothing written
    # A change within the interval waits for it; then it is written once.
    health["gpu-0"] = DeviceHealth((Problem("xid", "48", Severity.DEGRADED, "XID 48", NOW),))
    assert writer.pass_once() == 1  # the last write was 100 s ago
    assert healthy_of(api.calls[-1])["status"] == "False"
    assert healthy_of(api.calls[-1])["lastTransitionTime"] == "2027-01-15T08:01:40Z"
    health["gpu-0"] = DeviceHealth()
    clock.now += 10
    assert writer.pass_once() == 0  # 10 s after the last write: waits
    clock.now += 25
    assert writer.pass_once() == 1
    assert (healthy_of(api.calls[-1])["status"], len(api.calls)) == ("True", 3)


def test_a_condition_keeps_its_transition_time_while_its_status_stays(gpus: Node) -> None:
    ok(gpus.prepare(gpus.add_gpus(UID_A, "train", "gpu-0"))[UID_A])
    api, clock = FakeApi(), Clock()
    health = {"gpu-0": DeviceHealth((Problem("xid", "48", Severity.DEGRADED, "XID 48", NOW),))}
    writer = writer_for(gpus, health, api, clock)
    writer.pass_once()
    clock.now += 60
    health["gpu-0"] = DeviceHealth((Problem("xid", "94", Severity.DEGRADED, "XID 94", NOW),))
    writer.pass_once()
    before, after = healthy_of(api.calls[0]), healthy_of(api.calls[1])
    assert (before["reason"], after["reason"]) == ("Xid48", "Xid94")
    assert before["lastTransitionTime"] == after["lastTransitionTime"]


def test_a_failed_write_is_counted_retried_later_and_logged_once(
    gpus: Node, caplog: pytest.LogCaptureFixture
) -> None:
    ok(gpus.prepare(gpus.add_gpus(UID_A, "train", "gpu-0"))[UID_A])
    api, clock = FakeApi(), Clock()
    writer = writer_for(gpus, {"gpu-0": DeviceHealth()}, api, clock)
    api.fail = "apply status.devices of ResourceClaim default/train: forbidden"
    assert writer.pass_once() == 1
    assert writer.pass_once() == 0  # not again at once
    clock.now += 31
    assert writer.pass_once() == 1
    assert writer.writes.labels(result="error")._value.get() == 2
    logged = [r for r in caplog.records if "status.devices not written" in r.getMessage()]
    assert len(logged) == 1
    assert "the claim works as prepared" in logged[0].getMessage()
    api.fail = None
    clock.now += 31
    assert writer.pass_once() == 1
    assert len(api.calls) == 1


def test_unprepared_claims_are_forgotten_and_only_the_publishing_instance_writes(
    gpus: Node,
) -> None:
    a = gpus.add_gpus(UID_A, "a", "gpu-0")
    b = gpus.add_gpus(UID_B, "b", "gpu-1")
    ok(gpus.prepare(a)[UID_A])
    ok(gpus.prepare(b)[UID_B])
    api, clock = FakeApi(), Clock()
    turn = {"mine": False}
    writer = writer_for(gpus, {}, api, clock, is_turn=lambda: turn["mine"], max_writes_per_pass=1)
    assert writer.pass_once() == 0
    turn["mine"] = True
    assert writer.pass_once() == 1  # at most one per pass
    assert writer.pass_once() == 1
    assert sorted(call[2] for call in api.calls) == [UID_A, UID_B]
    assert gpus.unprepare(a) == {UID_A: None}
    writer.pass_once()
    assert writer.claims == [UID_B]
