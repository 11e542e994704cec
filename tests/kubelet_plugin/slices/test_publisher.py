"""SlicePublisher against the in-memory apiserver: writes, generations, wipes, conflicts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.driver.resourceapi import CounterSet, Device
from gpu_dra.driver.slices import DesiredPool, DeviceOrder, build_pool
from gpu_dra.kube import errors
from gpu_dra.kubelet_plugin.slices.kubeapi import ResourceSlice, SliceSelector
from gpu_dra.kubelet_plugin.slices.metrics import SliceMetrics
from gpu_dra.kubelet_plugin.slices.plan import spec_hash_annotation
from gpu_dra.kubelet_plugin.slices.publisher import PublisherSettings, SlicePublisher
from tests.fakes.slice_api import InMemorySliceApi

DRIVER = "gpu.example.com"
NODE = "node-a"
NODE_UID = "uid-node-a"  # as the slice_api fixture knows it
SELECTOR = SliceSelector(driver=DRIVER, node_name=NODE)
FAST = PublisherSettings(
    conflict_attempts=4, backoff_initial_s=0.001, backoff_max_s=0.01, debounce_s=0.0
)


def gpu(index: int, *, memory: str = "80Gi") -> Device:
    return Device(
        name=f"gpu-{index}",
        attributes={"index": {"int": index}},
        capacity={"memory": {"value": memory}},
    )


def gpus(count: int) -> list[Device]:
    return [gpu(index) for index in range(count)]


def pool(devices: Sequence[Device], counter_sets: Sequence[CounterSet] = ()) -> DesiredPool:
    return build_pool(DRIVER, NODE, NODE, devices, counter_sets, order=DeviceOrder.GIVEN)


def publisher_for(
    api: InMemorySliceApi, metrics: SliceMetrics, desired: DesiredPool | None = None
) -> SlicePublisher:
    publisher = SlicePublisher(api, driver=DRIVER, node_name=NODE, metrics=metrics, settings=FAST)
    if desired is not None:
        publisher.set_desired(desired)
    return publisher


def generations(slices: Sequence[ResourceSlice]) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in slices}


def device_names(slices: Sequence[ResourceSlice]) -> list[str]:
    return [d["name"] for s in slices for d in s["spec"].get("devices", [])]


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def running(publisher: SlicePublisher) -> AsyncIterator[None]:
    task = asyncio.create_task(publisher.run())
    try:
        yield
    finally:
        publisher.stop()
        await asyncio.wait_for(task, timeout=5)


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


async def settled(
    registry: CollectorRegistry, api: InMemorySliceApi, quiet_s: float = 0.15
) -> None:
    """Wait until, for `quiet_s`, no reconcile finished and no API call was made."""

    def snapshot() -> tuple[float, dict[str, int]]:
        return sample(registry, "gpu_dra_resourceslice_reconciles_total"), dict(api.calls)

    while True:
        before = snapshot()
        await asyncio.sleep(quiet_s)
        if snapshot() == before:
            return


def test_first_publish_creates_every_slice_with_generation_and_count(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(200)))

    result = asyncio.run(publisher.sync())

    slices = slice_api.slices(SELECTOR)
    assert (result.created, result.updated, result.deleted) == (2, 0, 0)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 72]
    assert device_names(slices) == [f"gpu-{index}" for index in range(200)]
    assert generations(slices) == {result.generation} == {publisher.generation}
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}
    assert all(s["metadata"]["name"].startswith(f"{NODE}-{DRIVER}-") for s in slices)
    assert sample(registry, "gpu_dra_resourceslice_writes_total", verb="create") == 2


def test_slices_are_owned_by_their_node(slice_api: InMemorySliceApi, metrics: SliceMetrics) -> None:
    asyncio.run(publisher_for(slice_api, metrics, pool(gpus(2))).sync())

    (published,) = slice_api.slices(SELECTOR)
    assert published["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE_UID, "controller": True}
    ]
    assert published["spec"]["nodeName"] == NODE


def test_republishing_an_unchanged_pool_makes_no_writes(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(300)))

    async def scenario() -> None:
        await publisher.sync()
        writes = dict(slice_api.writes)
        publisher.set_desired(pool(gpus(300)))  # equal content, new objects
        second = await publisher.sync()
        third = await publisher.sync()
        assert second.writes == third.writes == 0
        assert dict(slice_api.writes) == writes

    asyncio.run(scenario())


def test_changed_device_attribute_bumps_generation_on_every_slice(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(300)))

    async def scenario() -> None:
        first = await publisher.sync()
        names_before = sorted(s["metadata"]["name"] for s in slice_api.slices(SELECTOR))
        changed = gpus(300)
        changed[5] = gpu(5, memory="40Gi")
        publisher.set_desired(pool(changed))

        result = await publisher.sync()

        slices = slice_api.slices(SELECTOR)
        assert (result.created, result.updated, result.deleted) == (0, 3, 0)
        assert generations(slices) == {first.generation + 1}
        assert sorted(s["metadata"]["name"] for s in slices) == names_before
        assert slices[0]["spec"]["devices"][5]["capacity"]["memory"]["value"] == "40Gi"

    asyncio.run(scenario())


def test_shrinking_pool_deletes_the_extra_slice(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(200)))

    async def scenario() -> None:
        await publisher.sync()
        publisher.set_desired(pool(gpus(100)))
        result = await publisher.sync()

        slices = slice_api.slices(SELECTOR)
        assert (result.created, result.updated, result.deleted) == (0, 1, 1)
        assert len(slices) == 1
        assert slices[0]["spec"]["pool"]["resourceSliceCount"] == 1
        assert device_names(slices) == [f"gpu-{index}" for index in range(100)]
        assert sample(registry, "gpu_dra_resourceslice_writes_total", verb="delete") == 1

    asyncio.run(scenario())


def test_growing_pool_updates_existing_slices_and_creates_the_new_one(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(100)))

    async def scenario() -> None:
        await publisher.sync()
        publisher.set_desired(pool(gpus(250)))
        result = await publisher.sync()

        slices = slice_api.slices(SELECTOR)
        assert (result.created, result.updated, result.deleted) == (1, 1, 0)
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}
        assert len(generations(slices)) == 1

    asyncio.run(scenario())


def test_tainted_devices_are_published_at_most_64_per_slice(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    devices = gpus(130)
    for device in devices:
        device["taints"] = [{"key": "gpu.example.com/unhealthy", "effect": "NoSchedule"}]

    asyncio.run(publisher_for(slice_api, metrics, pool(devices)).sync())

    assert [len(s["spec"]["devices"]) for s in slice_api.slices(SELECTOR)] == [64, 64, 2]


def test_counter_sets_are_published_in_their_own_slice(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    counters: list[CounterSet] = [
        {"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}
    ]
    partitions = [
        Device(
            name=f"gpu-0-mig-{index}",
            consumesCounters=[
                {"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "10Gi"}}}
            ],
        )
        for index in range(7)
    ]

    asyncio.run(publisher_for(slice_api, metrics, pool(partitions, counters)).sync())

    slices = slice_api.slices(SELECTOR)
    counter_slices = [s for s in slices if "sharedCounters" in s["spec"]]
    device_slices = [s for s in slices if s["spec"].get("devices")]
    assert len(slices) == 2
    assert [s["spec"]["sharedCounters"] for s in counter_slices] == [counters]
    assert "devices" not in counter_slices[0]["spec"]
    assert "sharedCounters" not in device_slices[0]["spec"]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {2}


def test_slices_of_another_pool_on_the_node_are_deleted(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    stale = build_pool(DRIVER, "old-pool-name", NODE, gpus(1), order=DeviceOrder.GIVEN)
    slice_api.put(
        ResourceSlice(
            apiVersion="resource.k8s.io/v1",
            kind="ResourceSlice",
            metadata={"name": "stale"},
            spec=stale.slices[0],
        )
    )

    asyncio.run(publisher_for(slice_api, metrics, pool(gpus(2))).sync())

    assert [s["spec"]["pool"]["name"] for s in slice_api.slices(SELECTOR)] == [NODE]


def test_slices_of_other_nodes_and_drivers_are_left_alone(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    other_node = build_pool(DRIVER, "node-b", "node-b", gpus(1), order=DeviceOrder.GIVEN)
    other_driver = build_pool("nic.example.com", NODE, NODE, gpus(1), order=DeviceOrder.GIVEN)
    for name, spec in (("b", other_node.slices[0]), ("nic", other_driver.slices[0])):
        slice_api.put(
            ResourceSlice(
                apiVersion="resource.k8s.io/v1",
                kind="ResourceSlice",
                metadata={"name": name},
                spec=spec,
            )
        )

    asyncio.run(publisher_for(slice_api, metrics, pool(gpus(2))).sync())

    assert len(slice_api.slices()) == 3
    assert slice_api.writes == {"create": 1}


def test_server_side_normalization_does_not_cause_rewrites(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(1)))

    async def scenario() -> None:
        await publisher.sync()
        (published,) = slice_api.slices(SELECTOR)
        # The apiserver canonicalizes quantities and drops fields of disabled gates.
        published["spec"]["devices"][0]["capacity"]["memory"]["value"] = "85899345920"
        slice_api.put(published)
        writes = dict(slice_api.writes)

        result = await publisher.sync()

        assert result.writes == 0
        assert dict(slice_api.writes) == writes

    asyncio.run(scenario())


def test_slice_without_content_hash_is_rewritten_once(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(1)))

    async def scenario() -> None:
        await publisher.sync()
        (published,) = slice_api.slices(SELECTOR)
        del published["metadata"]["annotations"][spec_hash_annotation(DRIVER)]
        slice_api.put(published)

        assert (await publisher.sync()).updated == 1
        assert (await publisher.sync()).writes == 0

    asyncio.run(scenario())


def test_conflict_on_update_is_retried_and_succeeds(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(2)))

    async def scenario() -> None:
        await publisher.sync()
        publisher.set_desired(pool(gpus(3)))
        slice_api.conflict_next_update(2)

        result = await publisher.sync()

        assert result.updated == 1
        assert device_names(slice_api.slices(SELECTOR)) == ["gpu-0", "gpu-1", "gpu-2"]
        assert (
            sample(registry, "gpu_dra_resourceslice_reconcile_errors_total", reason="conflict") == 2
        )

    asyncio.run(scenario())


def test_conflicts_beyond_the_retry_budget_fail_the_sync(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(2)))

    async def scenario() -> None:
        await publisher.sync()
        publisher.set_desired(pool(gpus(3)))
        slice_api.conflict_next_update(FAST.conflict_attempts)

        with pytest.raises(errors.ConflictError):
            await publisher.sync()

    asyncio.run(scenario())


def test_create_name_collision_is_retried(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    slice_api.fail_next("create", errors.AlreadyExistsError("exists", status=409))

    result = asyncio.run(publisher_for(slice_api, metrics, pool(gpus(2))).sync())

    assert result.created == 1
    assert len(slice_api.slices(SELECTOR)) == 1


def test_run_publishes_and_then_idles_without_writes_or_polling(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(130)))

    async def scenario() -> None:
        async with running(publisher):
            await eventually(lambda: len(slice_api.slices(SELECTOR)) == 2)
            await settled(registry, slice_api)
            calls = dict(slice_api.calls)

            await asyncio.sleep(0.3)

            assert dict(slice_api.calls) == calls  # watching, not polling
            assert dict(slice_api.writes) == {"create": 2}

    asyncio.run(scenario())


def test_republish_in_steady_state_lists_but_does_not_write(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(130)))

    async def scenario() -> None:
        async with running(publisher):
            await eventually(lambda: len(slice_api.slices(SELECTOR)) == 2)
            await settled(registry, slice_api)
            writes = dict(slice_api.writes)
            reconciles = sample(registry, "gpu_dra_resourceslice_reconciles_total")

            publisher.republish()
            await eventually(
                lambda: sample(registry, "gpu_dra_resourceslice_reconciles_total") > reconciles
            )
            await settled(registry, slice_api)

            assert dict(slice_api.writes) == writes

    asyncio.run(scenario())


def test_kubelet_wipe_is_republished_through_the_watch(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(130)))

    async def scenario() -> None:
        async with running(publisher):
            await eventually(lambda: len(slice_api.slices(SELECTOR)) == 2)
            await settled(registry, slice_api)
            generation = publisher.generation

            assert slice_api.wipe(SliceSelector(driver=DRIVER, node_name=NODE)) == 2
            await eventually(lambda: len(slice_api.slices(SELECTOR)) == 2)
            await settled(registry, slice_api)

            slices = slice_api.slices(SELECTOR)
            assert generations(slices) == {publisher.generation}
            assert publisher.generation > generation
            assert device_names(slices) == [f"gpu-{index}" for index in range(130)]
            assert slice_api.writes["create"] == 4

    asyncio.run(scenario())


def test_watch_lists_again_after_410_gone_and_still_sees_wipes(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(3)))

    async def scenario() -> None:
        async with running(publisher):
            await eventually(lambda: len(slice_api.slices(SELECTOR)) == 1)
            await settled(registry, slice_api)
            watches = slice_api.calls["watch"]

            slice_api.compact()
            await eventually(lambda: slice_api.calls["watch"] > watches)
            slice_api.wipe(SELECTOR)

            await eventually(lambda: len(slice_api.slices(SELECTOR)) == 1)

    asyncio.run(scenario())


def test_failed_reconcile_is_retried_by_the_run_loop(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    slice_api.fail_next("node", errors.ApiError("connection refused"), times=2)
    publisher = publisher_for(slice_api, metrics, pool(gpus(1)))

    async def scenario() -> None:
        async with running(publisher):
            await eventually(lambda: len(slice_api.slices(SELECTOR)) == 1)

    asyncio.run(scenario())
    assert sample(registry, "gpu_dra_resourceslice_reconcile_errors_total", reason="api") == 2


def test_a_new_desired_pool_ends_a_retrys_back_off_at_once(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    """A taint set while the publisher backs off after a failure (the apiserver was down) is
    published when it is set, not when the back-off (here a minute) ends."""
    slow = PublisherSettings(backoff_initial_s=60, backoff_max_s=60, debounce_s=0.0)
    slice_api.fail_next("node", errors.ApiError("connection refused"), times=1)
    publisher = SlicePublisher(slice_api, driver=DRIVER, node_name=NODE, metrics=metrics,
                               settings=slow)  # fmt: skip
    publisher.set_desired(pool(gpus(1)))

    async def scenario() -> None:
        async with running(publisher):
            await eventually(lambda: slice_api.calls["node"] >= 1)  # the first sync failed
            await asyncio.sleep(0.05)
            assert slice_api.slices(SELECTOR) == []  # backing off
            publisher.set_desired(pool(gpus(2)))
            await eventually(lambda: device_names(slice_api.slices(SELECTOR)) == ["gpu-0", "gpu-1"])

    asyncio.run(scenario())


def test_watch_errors_are_retried(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    slice_api.fail_next("watch", errors.ApiError("connection reset"), times=2)
    publisher = publisher_for(slice_api, metrics, pool(gpus(1)))

    async def scenario() -> None:
        async with running(publisher):
            await eventually(lambda: slice_api.open_watches == 1)
            await settled(registry, slice_api)
            slice_api.wipe(SELECTOR)
            await eventually(lambda: len(slice_api.slices(SELECTOR)) == 1)

    asyncio.run(scenario())


def test_desired_state_set_while_running_is_published(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    publisher = publisher_for(slice_api, metrics)

    async def scenario() -> None:
        async with running(publisher):
            await asyncio.sleep(0.05)
            assert slice_api.slices(SELECTOR) == []  # nothing desired yet: nothing published

            publisher.set_desired(pool(gpus(4)))

            await eventually(lambda: len(device_names(slice_api.slices(SELECTOR))) == 4)

    asyncio.run(scenario())


def test_stop_closes_the_watch_and_returns(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    publisher = publisher_for(slice_api, metrics, pool(gpus(1)))

    async def scenario() -> None:
        async with running(publisher):
            await eventually(lambda: slice_api.open_watches == 1)
        assert slice_api.open_watches == 0

    asyncio.run(scenario())


def test_empty_pool_is_published_as_one_empty_slice(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    asyncio.run(publisher_for(slice_api, metrics, pool([])).sync())

    (published,) = slice_api.slices(SELECTOR)
    assert published["spec"]["devices"] == []
    assert published["spec"]["pool"]["resourceSliceCount"] == 1


def test_pool_for_another_node_is_refused(
    slice_api: InMemorySliceApi, metrics: SliceMetrics
) -> None:
    publisher = publisher_for(slice_api, metrics)
    other = build_pool(DRIVER, "node-b", "node-b", gpus(1), order=DeviceOrder.GIVEN)

    with pytest.raises(ValueError, match="node-b"):
        publisher.set_desired(other)


def test_watch_refused_with_410_at_start_lists_again(
    slice_api: InMemorySliceApi, metrics: SliceMetrics, registry: CollectorRegistry
) -> None:
    slice_api.fail_next("watch", errors.ResourceExpiredError("too old resource version"))
    publisher = publisher_for(slice_api, metrics, pool(gpus(1)))

    async def scenario() -> None:
        async with running(publisher):
            await eventually(lambda: slice_api.open_watches == 1)
            assert slice_api.calls["watch"] == 2
            await settled(registry, slice_api)
            slice_api.wipe(SELECTOR)
            await eventually(lambda: len(slice_api.slices(SELECTOR)) == 1)

    asyncio.run(scenario())
