"""`PublisherTurn`: of two plugin instances on a node (a rolling update), only the newest ready
one publishes, so two versions with different slice content never write the pool in turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from gpu_dra.controller.kubeapi import ResourceSlice, SliceSelector
from gpu_dra.controller.metrics import SliceMetrics
from gpu_dra.controller.publisher import PublisherSettings, SlicePublisher
from gpu_dra.driver.resourceapi import Device
from gpu_dra.driver.slices import DeviceOrder, build_pool
from gpu_dra.kubelet_plugin.instances import InstanceRegistry, PluginInstance
from gpu_dra.kubelet_plugin.publishing import PublisherTurn
from tests.fakes.slice_api import InMemorySliceApi

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
SELECTOR = SliceSelector(driver=DRIVER, node_name=NODE)
FAST = PublisherSettings(backoff_initial_s=0.001, backoff_max_s=0.01, debounce_s=0.0)
INTERVAL_S = 0.05


def turn(api: InMemorySliceApi, instance: PluginInstance, version: str) -> PublisherTurn:
    """A plugin version's publishing: its devices carry ``version`` as an attribute (different
    content per version, as after an upgrade that changes attributes)."""
    metrics = SliceMetrics(CollectorRegistry())
    devices = [
        Device(name=f"gpu-{i}", attributes={"driverBuild": {"string": version}}) for i in range(2)
    ]
    pool = build_pool(DRIVER, NODE, NODE, devices, (), order=DeviceOrder.GIVEN)

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
