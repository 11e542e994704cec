"""`PublisherTurn`: of two plugin instances on a node (a rolling update), only the newest ready
one publishes, so two versions with different slice content never write the pool in turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from gpu_dra.driver.resourceapi import Device
from gpu_dra.driver.slices import DesiredPool, DeviceOrder, build_pool
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry, PluginInstance
from gpu_dra.kubelet_plugin.publishing import PublisherTurn
from gpu_dra.kubelet_plugin.slices.kubeapi import ResourceSlice, SliceSelector
from gpu_dra.kubelet_plugin.slices.metrics import SliceMetrics
from gpu_dra.kubelet_plugin.slices.publisher import PublisherSettings, SlicePublisher
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
