"""`PublisherTurn`: of two plugin instances on a node (a rolling update), only the newest ready
one publishes, so two versions with different slice content never write the pool in turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.resourceapi import Device, DeviceTaint
from gpu_dra.driver.slices import DesiredPool, DeviceOrder, build_pool
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry, PluginInstance
from gpu_dra.kubelet_plugin.publishing import NodeTaints, PublisherTurn
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.slices.kubeapi import ResourceSlice, SliceSelector
from gpu_dra.kubelet_plugin.slices.metrics import SliceMetrics
from gpu_dra.kubelet_plugin.slices.publisher import PublisherSettings, SlicePublisher
from gpu_dra.kubelet_plugin.startup.slice_publishing import node_taints, sweep_until_clean
from tests.fakes.slice_api import InMemorySliceApi

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
SELECTOR = SliceSelector(driver=DRIVER, node_name=NODE)
FAST = PublisherSettings(backoff_initial_s=0.001, backoff_max_s=0.01, debounce_s=0.0)
INTERVAL_S = 0.05


def pool_of(version: str) -> DesiredPool:
    """The node's pool, its devices carrying ``version`` as an attribute."""
    devices = [
        Device(name=f"gpu-{i}", attributes={"driverBuild": {"string": version}}) for i in range(2)
    ]
    return build_pool(DRIVER, NODE, NODE, devices, (), order=DeviceOrder.GIVEN)


def turn(api: InMemorySliceApi, instance: PluginInstance, version: str) -> PublisherTurn:
    """A plugin version's publishing: its devices carry ``version`` as an attribute (different
    content per version, as after an upgrade that changes attributes)."""
    metrics = SliceMetrics(CollectorRegistry())
    pool = pool_of(version)

    def new_publisher() -> SlicePublisher:
        publisher = SlicePublisher(
            api, driver=DRIVER, node_name=NODE, metrics=metrics, settings=FAST
        )
        publisher.set_desired(pool)
        return publisher

    return PublisherTurn(new_publisher, instance.newest_ready, interval_s=INTERVAL_S)


def published(api: InMemorySliceApi) -> set[str]:
    slices: Sequence[ResourceSlice] = api.slices(SELECTOR)
    return {d["attributes"]["driverBuild"]["string"] for s in slices for d in s["spec"]["devices"]}


async def until(what: str, probe: Callable[[], bool], limit_s: float = 5.0) -> None:
    started = time.monotonic()
    while not probe():
        assert time.monotonic() - started < limit_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def quiet_for(api: InMemorySliceApi, quiet_s: float, limit_s: float = 5.0) -> None:
    """Wait until no slice was written for `quiet_s`."""
    started = time.monotonic()
    while True:
        writes = sum(api.writes.values())
        await asyncio.sleep(quiet_s)
        if sum(api.writes.values()) == writes:
            return
        assert time.monotonic() - started < limit_s, "the slices never stopped being written"


def test_the_newest_ready_instance_publishes_and_the_old_one_takes_over_when_it_goes(
    tmp_path: Path,
) -> None:
    api = InMemorySliceApi(nodes={NODE: "uid-node-a"})
    registry = InstanceRegistry(tmp_path)

    async def scenario() -> None:
        old = registry.register("old-pod")
        old.mark_ready()
        old_turn = turn(api, old, "v1")
        old_running = asyncio.create_task(old_turn.run())
        await until("v1 published", lambda: published(api) == {"v1"})

        new = registry.register("new-pod")
        new_turn = turn(api, new, "v2")
        new_running = asyncio.create_task(new_turn.run())
        await asyncio.sleep(INTERVAL_S * 4)
        # Still recovering: the old instance keeps publishing, the new one does not write.
        assert published(api) == {"v1"}
        assert not new_turn.publishing

        new.mark_ready()
        await until("v2 published", lambda: published(api) == {"v2"})
        await until("the old instance to stop", lambda: not old_turn.publishing)
        # A write of the new publisher may still be under way (a loaded machine); then the
        # writes stop for good: two versions that wrote the pool in turn would never settle.
        await quiet_for(api, INTERVAL_S * 2)
        writes = sum(api.writes.values())
        await asyncio.sleep(INTERVAL_S * 6)
        assert sum(api.writes.values()) == writes, "the two versions write the pool in turn"
        assert published(api) == {"v2"}

        # The new pod went away (a failed upgrade): the old one publishes again.
        new_turn.stop()
        await new_running
        new.close()
        await until("v1 published again", lambda: published(api) == {"v1"})
        old_turn.stop()
        await old_running

    asyncio.run(scenario())


def test_a_desired_pool_set_on_the_turn_reaches_the_running_publisher_and_every_later_one(
    tmp_path: Path,
) -> None:
    # The health monitor sets the pool (with taints) whether or not this instance publishes.
    api = InMemorySliceApi(nodes={NODE: "uid-node-a"})
    registry = InstanceRegistry(tmp_path)

    async def scenario() -> None:
        old = registry.register("old-pod")
        old.mark_ready()
        old_turn = turn(api, old, "v1")
        old_turn.set_desired(pool_of("v1-tainted"))  # before its first publisher
        old_running = asyncio.create_task(old_turn.run())
        await until("the set pool published", lambda: published(api) == {"v1-tainted"})

        old_turn.set_desired(pool_of("v1-healthy"))  # while it publishes
        await until("the new pool published", lambda: published(api) == {"v1-healthy"})

        new = registry.register("new-pod")
        new.mark_ready()
        new_turn = turn(api, new, "v2")
        new_running = asyncio.create_task(new_turn.run())
        await until("the old instance to stop", lambda: not old_turn.publishing)
        old_turn.set_desired(pool_of("v1-retainted"))  # while the new instance publishes
        await until("v2 published", lambda: published(api) == {"v2"})
        new_turn.stop()
        await new_running
        new.close()
        # The old instance takes over again with the pool set last, not its first one.
        await until("v1-retainted published", lambda: published(api) == {"v1-retainted"})
        old_turn.stop()
        await old_running

    asyncio.run(scenario())


# ---- the node's taints from several sources --------------------------------------------------
XID: DeviceTaint = {"key": "gpu.nvidia.com/xid", "value": "48", "effect": "NoSchedule"}
LEFTOVERS: DeviceTaint = {"key": "gpu.nvidia.com/mig-leftovers", "effect": "NoSchedule"}


def test_node_taints_merge_the_sources_and_republish_only_a_change() -> None:
    taints = NodeTaints({"health": {"gpu-1": [XID]}, "mig-leftovers": {"gpu-1": [LEFTOVERS]}})
    published: list[dict[str, list[DeviceTaint]]] = []
    taints.publish_with(lambda merged: published.append(dict(merged)))

    assert taints.merged() == {"gpu-1": [XID, LEFTOVERS]}
    taints.set("mig-leftovers", {"gpu-1": [LEFTOVERS]})  # the same: nothing to publish
    assert published == []
    taints.set("mig-leftovers", {})
    taints.set("health", {"gpu-2": [XID]})

    assert published == [{"gpu-1": [XID]}, {"gpu-2": [XID]}]


class SweepingPreparer:
    """`retry_mig_sweeps` answering the GPUs left, one answer per call."""

    def __init__(self, *answers: dict[str, str]) -> None:
        self.answers = list(answers)

    async def retry_mig_sweeps(self) -> dict[str, str]:
        return self.answers.pop(0)


def test_gpus_whose_mig_sweep_failed_stay_tainted_until_a_sweep_succeeds() -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    inventory = NodeInventory.from_discovery(
        discover_devices(host.nvml, host.pci), simulated=True, dynamic_mig=True
    )
    gpu_3, gpu_5 = inventory.gpus[3], inventory.gpus[5]
    unswept = {gpu_3.uuid: "NVML_ERROR_UNKNOWN", gpu_5.uuid: "NVML_ERROR_UNKNOWN"}
    settings = KubeletPluginSettings.parse(["--node-name=node-a", "--simulate=hgx-h100"], {})
    taints = node_taints(settings, inventory, {}, unswept)
    published: list[dict[str, list[DeviceTaint]]] = []
    taints.publish_with(lambda merged: published.append(dict(merged)))
    assert {name: [t["key"] for t in found] for name, found in taints.merged().items()} == {
        "gpu-3": ["gpu.nvidia.com/mig-leftovers"],
        "gpu-5": ["gpu.nvidia.com/mig-leftovers"],
    }
    preparer = SweepingPreparer({gpu_5.uuid: "NVML_ERROR_UNKNOWN"}, {})

    asyncio.run(
        sweep_until_clean(
            preparer,  # type: ignore[arg-type]
            taints,
            inventory,
            "gpu.nvidia.com",
            unswept,
            interval_s=0.01,
        )
    )

    assert [sorted(p) for p in published] == [["gpu-5"], []]
    assert preparer.answers == []
