"""The health monitor on simulated NVML: injected events become device health and taints, a lost
GPU is found by probing, a recovery clears it, GPUs NVML cannot watch are Unknown, and dead MPS
share daemons mark their GPU's share device."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pynvml
import pytest

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.health import HealthPolicy, HealthStatus, TaintEffect, Target, device_taints
from gpu_dra.driver.nvml.interface import NVML_EVENT_TYPE_XID_CRITICAL_ERROR
from gpu_dra.driver.nvml.simulated import SimulatedHost, SimulatedNvml
from gpu_dra.driver.shares import MigShareSelection, PartitionShareSelection, ShareSelection
from gpu_dra.kubelet_plugin.device_health.monitor import EventObserver, HealthMonitor
from gpu_dra.kubelet_plugin.device_health.monitor_inputs import MonitorTiming, MpsLiveness
from gpu_dra.kubelet_plugin.node_devices import NodeInventory

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
XID = NVML_EVENT_TYPE_XID_CRITICAL_ERROR
FAST = MonitorTiming(wait_timeout_ms=50, mps_interval_s=0.05, backoff_initial_s=0.01)
NOW = datetime(2026, 7, 22, 12, 0, tzinfo=UTC)


@dataclass
class FakeLiveness:
    """`MpsLiveness` answering what the test sets."""

    dead: dict[str, str] = field(default_factory=dict)
    calls: int = 0

    def dead_shared_daemons(self) -> dict[str, str]:
        self.calls += 1
        return dict(self.dead)


@dataclass
class Node:
    nvml: SimulatedNvml
    inventory: NodeInventory
    monitor: HealthMonitor
    published: list[Mapping[str, list[object]]] = field(default_factory=list)

    def health(self, device: str) -> HealthStatus:
        return self.monitor.snapshot()[device].status

    def taints(self) -> Mapping[str, list[object]]:
        return device_taints(self.monitor.snapshot(), HealthPolicy(), DRIVER)


def build(
    profile: str = "hgx-h100",
    *,
    shares: str = "none",
    mig_shares: str = "none",
    liveness: MpsLiveness | None = None,
    prepare: Callable[[SimulatedNvml], None] | None = None,
    timing: MonitorTiming = FAST,
    observe_event: EventObserver | None = None,
) -> Node:
    host = SimulatedHost.load(profile, NODE)
    found = discover_devices(host.nvml, host.pci)
    inventory = NodeInventory.from_discovery(
        found,
        simulated=True,
        mps_shares=ShareSelection.parse(shares),
        mps_shares_on_mig=MigShareSelection.parse(mig_shares),
    )
    if prepare is not None:
        prepare(host.nvml)
    monitor = HealthMonitor(
        host.nvml,
        inventory.gpus,
        inventory.health_scopes(),
        policy=HealthPolicy(),
        shared_gpus=[gpu.uuid for gpu in inventory.mps_shares],
        shared_migs={
            m.uuid: Target(m.parent.uuid, (m.gi_id, m.ci_id)) for m in inventory.mig_mps_shares
        },
        mps=liveness,
        timing=timing,
        clock=lambda: NOW,
        observe_event=observe_event,
    )
    node = Node(host.nvml, inventory, monitor)
    monitor.add_listener(
        lambda snapshot: node.published.append(device_taints(snapshot, HealthPolicy(), DRIVER))
    )
    return node


@contextlib.asynccontextmanager
async def running(node: Node) -> AsyncIterator[Node]:
    task = asyncio.create_task(node.monitor.run())
    await asyncio.wait_for(node.monitor.started(), 2)
    await asyncio.sleep(0.05)  # the first wait is running
    try:
        yield node
    finally:
        node.monitor.stop()
        await asyncio.wait_for(task, 2)


async def until(condition: Callable[[], bool], what: str, limit_s: float = 3.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_an_xid_79_taints_the_gpus_device_no_execute_and_a_recovery_clears_it() -> None:
    async def scenario() -> None:
        async with running(build()) as node:
            assert all(h.status is HealthStatus.HEALTHY for h in node.monitor.snapshot().values())
            version = node.monitor.version
            node.nvml.inject_event(2, XID, 79)
            await until(lambda: node.health("gpu-2") is HealthStatus.UNHEALTHY, "gpu-2 unhealthy")
            assert node.monitor.version > version
            assert node.published[-1] == {
                "gpu-2": [
                    {
                        "key": "gpu.nvidia.com/xid",
                        "value": "79",
                        "effect": "NoExecute",
                        "timeAdded": "2026-07-22T12:00:00Z",
                    }
                ]
            }
            message = node.monitor.snapshot()["gpu-2"].message
            assert message == "critical XID 79 (GPU has fallen off the bus) reported by NVML"
            node.nvml.recover_gpu(2)
            await until(lambda: node.health("gpu-2") is HealthStatus.HEALTHY, "gpu-2 healthy")
            assert node.published[-1] == {}

    asyncio.run(scenario())


def test_application_error_xids_change_nothing() -> None:
    async def scenario() -> None:
        async with running(build()) as node:
            for code in (13, 31, 43, 45, 68, 109):
                node.nvml.inject_event(1, XID, code)
            node.nvml.inject_event(1, XID, 48)  # a marker after them
            await until(lambda: node.health("gpu-1") is HealthStatus.UNHEALTHY, "gpu-1 unhealthy")
            assert node.taints()["gpu-1"][0]["value"] == "48"  # type: ignore[index]
            assert len(node.published) == 1

    asyncio.run(scenario())


def test_a_mig_device_event_marks_that_mig_device_and_a_gpu_event_all_of_them() -> None:
    async def scenario() -> None:
        async with running(build("hgx-h100-mig")) as node:
            device = next(d for d in node.inventory.mig_devices if d.parent.index == 1)
            node.nvml.inject_event(
                1, XID, 94, gpu_instance_id=device.gi_id, compute_instance_id=device.ci_id
            )
            await until(lambda: bool(node.taints()), "a taint")
            (name,) = node.taints()
            assert node.inventory.by_name(name) == device
            assert node.taints()[name][0]["effect"] == "NoSchedule"  # type: ignore[index]
            node.nvml.inject_event(0, XID, 79)
            await until(lambda: len(node.taints()) == 8, "gpu-0's seven MIG devices too")

    asyncio.run(scenario())


def test_a_gpu_that_falls_off_the_bus_is_found_lost_by_probing() -> None:
    async def scenario() -> None:
        async with running(build()) as node:
            node.nvml.lose_gpu(5)
            await until(lambda: node.health("gpu-5") is HealthStatus.UNHEALTHY, "gpu-5 lost")
            (taint,) = node.taints()["gpu-5"]
            assert taint == {
                "key": "gpu.nvidia.com/gpu-lost",
                "effect": "NoExecute",
                "timeAdded": "2026-07-22T12:00:00Z",
            }
            assert "GPU_IS_LOST" in node.monitor.snapshot()["gpu-5"].message
            assert set(node.taints()) == {"gpu-5"}
            node.nvml.recover_gpu(5)
            await until(lambda: not node.taints(), "gpu-5 recovered")

    asyncio.run(scenario())


def test_a_gpu_that_cannot_be_registered_is_unknown_and_untainted() -> None:
    def refuse(nvml: SimulatedNvml) -> None:
        nvml.set_fault("device_register_events", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=3)

    async def scenario() -> None:
        async with running(build(prepare=refuse)) as node:
            assert node.health("gpu-3") is HealthStatus.UNKNOWN
            assert node.monitor.snapshot()["gpu-3"].message == (
                "health not monitored: nvmlDeviceRegisterEvents: NVML_ERROR_NOT_SUPPORTED"
            )
            assert node.health("gpu-2") is HealthStatus.HEALTHY
            assert node.taints() == {}

    asyncio.run(scenario())


def test_a_gpu_that_cannot_be_registered_is_reported_and_tainted_as_the_policy_says() -> None:
    """Registration failure is a health state with a policy: an unwatched GPU's devices get the
    ``unmonitored`` taint of `HealthPolicy.unmonitored_effect`, and it is reported once."""
    reported: list[dict[str, str]] = []
    host = SimulatedHost.load("hgx-h100", NODE)
    host.nvml.set_fault("device_register_events", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=3)
    inventory = NodeInventory.from_discovery(discover_devices(host.nvml, host.pci), simulated=True)
    strict = HealthPolicy(unmonitored_effect=TaintEffect.NO_SCHEDULE)
    monitor = HealthMonitor(
        host.nvml, inventory.gpus, inventory.health_scopes(), policy=strict, timing=FAST,
        clock=lambda: NOW, report_unwatched=lambda gpus: reported.append(dict(gpus)),
    )  # fmt: skip
    gpu_3 = inventory.by_name("gpu-3")
    assert gpu_3 is not None

    async def scenario() -> None:
        task = asyncio.create_task(monitor.run())
        await asyncio.wait_for(monitor.started(), 2)
        await until(lambda: bool(reported), "the report")
        monitor.stop()
        await asyncio.wait_for(task, 2)

    asyncio.run(scenario())
    assert reported == [{gpu_3.uuid: "nvmlDeviceRegisterEvents: NVML_ERROR_NOT_SUPPORTED"}]
    assert device_taints(monitor.snapshot(), strict, DRIVER) == {
        "gpu-3": [{"key": f"{DRIVER}/unmonitored", "effect": "NoSchedule",
                   "timeAdded": "2026-07-22T12:00:00Z"}]
    }  # fmt: skip


def test_without_nvml_events_every_device_is_unknown() -> None:
    def refuse(nvml: SimulatedNvml) -> None:
        nvml.set_fault("event_set_create", pynvml.NVML_ERROR_NOT_SUPPORTED)

    async def scenario() -> None:
        node = build(prepare=refuse)
        async with running(node):
            statuses = {h.status for h in node.monitor.snapshot().values()}
            assert statuses == {HealthStatus.UNKNOWN}
        assert not node.nvml.initialized  # released

    asyncio.run(scenario())


def test_repeated_wait_failures_make_health_unknown_until_waits_work_again() -> None:
    async def scenario() -> None:
        async with running(build()) as node:
            node.nvml.set_fault("event_set_wait", pynvml.NVML_ERROR_UNKNOWN)
            await until(lambda: node.health("gpu-0") is HealthStatus.UNKNOWN, "unknown")
            assert (
                "nvmlEventSetWait: NVML_ERROR_UNKNOWN" in node.monitor.snapshot()["gpu-0"].message
            )
            node.nvml.set_fault("event_set_wait", None)
            await until(lambda: node.health("gpu-0") is HealthStatus.HEALTHY, "healthy again", 5)

    asyncio.run(scenario())


def test_a_dead_share_daemon_marks_its_gpus_share_device_until_it_is_back() -> None:
    liveness = FakeLiveness()

    async def scenario() -> None:
        async with running(build(shares="0", liveness=liveness)) as node:
            uuid = node.inventory.gpus[0].uuid
            liveness.dead = {uuid: "pod mps-control-daemon-x is gone"}
            await until(lambda: node.health("gpu-0") is HealthStatus.UNHEALTHY, "gpu-0 degraded")
            assert node.taints() == {
                "gpu-0": [
                    {
                        "key": "gpu.nvidia.com/mps-daemon",
                        "value": "not-running",
                        "effect": "NoSchedule",
                        "timeAdded": "2026-07-22T12:00:00Z",
                    }
                ]
            }
            assert node.monitor.snapshot()["gpu-0"].message == (
                "MPS daemon not running: pod mps-control-daemon-x is gone"
            )
            liveness.dead = {}
            await until(lambda: node.health("gpu-0") is HealthStatus.HEALTHY, "gpu-0 healthy")

    asyncio.run(scenario())


def test_stop_returns_within_a_wait_and_releases_nvml() -> None:
    async def scenario() -> None:
        node = build()
        task = asyncio.create_task(node.monitor.run())
        await until(lambda: node.nvml.initialized, "NVML initialised")
        started = time.monotonic()
        node.monitor.stop()
        await asyncio.wait_for(task, 2)
        assert time.monotonic() - started < 1
        assert not node.nvml.initialized
        assert node.nvml.inject_event(0, XID, 79) == 0  # the event set is gone

    asyncio.run(scenario())


@pytest.mark.parametrize("alive_for", [0.0, 60.0])
def test_liveness_follows_completed_waits(alive_for: float) -> None:
    async def scenario() -> None:
        async with running(build()) as node:
            await asyncio.sleep(0.1)
            assert node.monitor.alive_within(0.5)
            assert node.monitor.alive_within(alive_for) is (alive_for > 0)

    asyncio.run(scenario())


def test_snapshot_listeners_get_only_changes() -> None:
    async def scenario() -> None:
        async with running(build()) as node:
            node.nvml.inject_event(4, XID, 48)
            node.nvml.inject_event(4, XID, 48)  # the same problem again
            node.nvml.inject_event(4, XID, 13)  # ignored
            node.nvml.inject_event(6, XID, 94)  # a marker
            await until(lambda: "gpu-6" in node.taints(), "gpu-6 tainted")
            assert [sorted(p) for p in node.published] == [["gpu-4"], ["gpu-4", "gpu-6"]]

    asyncio.run(scenario())


class BrokenLiveness:
    def dead_shared_daemons(self) -> dict[str, str]:
        raise RuntimeError("cannot read the checkpoint: corrupt")


def test_a_check_that_keeps_failing_makes_the_monitor_not_alive() -> None:
    async def scenario() -> None:
        node = build(shares="0", liveness=BrokenLiveness())
        async with running(node):
            await asyncio.sleep(0.4)  # NVML waits (50 ms) still complete, MPS checks fail
            assert not node.monitor.alive_within(0.3)
            assert node.monitor.alive_within(60)

    asyncio.run(scenario())


def test_a_dead_daemon_of_a_partitions_mig_device_marks_that_partition_only() -> None:
    """The MIG devices made from partitions offered as shares come and go: read each pass."""
    liveness = FakeLiveness()
    made: dict[str, Target] = {}
    partition = "gpu-1-mig-3g40gb-9-4"

    async def scenario() -> None:
        host = SimulatedHost.load("hgx-h100", NODE)
        found = discover_devices(host.nvml, host.pci, mig_profiles=True)
        inventory = NodeInventory.from_discovery(
            found,
            simulated=True,
            dynamic_mig=True,
            mps_shares_on_dynamic_mig=PartitionShareSelection.parse("3g.40gb"),
        )
        monitor = HealthMonitor(
            host.nvml,
            inventory.gpus,
            inventory.health_scopes(),
            policy=HealthPolicy(),
            partition_daemons=lambda: dict(made),
            mps=liveness,
            timing=FAST,
            clock=lambda: NOW,
        )
        async with running(Node(host.nvml, inventory, monitor)) as node:
            parent = next(g for g in inventory.gpus if g.minor == 1)
            made["MIG-made"] = Target(parent.uuid, placement=(9, 4))
            liveness.dead = {"MIG-made": "pod mps-control-daemon-z is gone"}
            await until(lambda: node.health(partition) is HealthStatus.UNHEALTHY, "degraded")
            assert list(node.taints()) == [partition]  # not gpu-1, not its other partitions
            made.clear()  # the last share went: no MIG device, no daemon to wait for
            await until(lambda: node.health(partition) is HealthStatus.HEALTHY, "healthy")
            assert node.taints() == {}

    asyncio.run(scenario())


def test_a_dead_share_daemon_of_a_mig_device_marks_that_mig_device_only() -> None:
    liveness = FakeLiveness()
    slice_name = "gpu-1-mig-2g20gb-14-0"

    async def scenario() -> None:
        node = build("hgx-h100-mig", mig_shares="2g.20gb", liveness=liveness)
        async with running(node) as node:
            [mig] = node.inventory.mig_mps_shares
            liveness.dead = {mig.uuid: "pod mps-control-daemon-y is gone"}
            await until(lambda: node.health(slice_name) is HealthStatus.UNHEALTHY, "degraded")
            assert list(node.taints()) == [slice_name]
            liveness.dead = {}
            await until(lambda: node.health(slice_name) is HealthStatus.HEALTHY, "healthy")

    asyncio.run(scenario())


def test_ecc_counters_show_a_double_bit_error_no_event_reported_and_log_single_bit_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An uncorrected error counted since the GPU's last reset (one that happened while no
    plugin watched: no event comes) degrades the GPU; more corrected errors are logged."""
    ticking = MonitorTiming(wait_timeout_ms=50, mps_interval_s=0.05, backoff_initial_s=0.01,
                            ecc_interval_s=0.05)  # fmt: skip

    def counted(nvml: SimulatedNvml) -> None:
        nvml.add_ecc_errors(4, uncorrected=2)

    async def scenario() -> None:
        node = build(prepare=counted)
        node.monitor._timing = ticking
        async with running(node):
            await until(lambda: node.health("gpu-4") is HealthStatus.UNHEALTHY, "gpu-4 degraded")
            assert node.monitor.snapshot()["gpu-4"].message == (
                "2 uncorrected (double-bit) ECC error(s) counted by NVML since the GPU's last reset"
            )
            assert node.taints()["gpu-4"][0]["key"] == f"{DRIVER}/ecc"  # type: ignore[index]
            node.nvml.add_ecc_errors(1, corrected=5)
            await until(lambda: "counted 5 more corrected" in caplog.text, "the log line")
            assert node.health("gpu-1") is HealthStatus.HEALTHY

    asyncio.run(scenario())


def test_a_gpu_whose_ecc_counters_nvml_does_not_offer_is_not_read_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_ecc(nvml: SimulatedNvml) -> None:
        nvml.set_fault("device_get_total_ecc_errors", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=2)

    caplog.set_level(logging.INFO)
    node = build(prepare=no_ecc)
    watch = node.monitor._ecc
    node.nvml.init()
    try:
        assert watch.poll(NOW) == []
        assert watch.poll(NOW) == []
    finally:
        node.nvml.shutdown()

    gpu_2 = node.inventory.gpus[2].uuid
    assert set(watch.counts) == {g.uuid for g in node.inventory.gpus} - {gpu_2}
    not_watched = [r.getMessage() for r in caplog.records if "not watched" in r.getMessage()]
    assert not_watched == [
        f"health: GPU {gpu_2} ECC counters not watched: nvmlDeviceGetTotalEccErrors answered "
        "NVML_ERROR_NOT_SUPPORTED"
    ]
