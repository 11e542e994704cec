"""Time to publish a node's 8-GPU pool with SlicePublisher, and the cost of a resync.

Against ``InMemorySliceApi`` (``tests/fakes/slice_api.py``: an in-memory API server with
resourceVersions, validation and watches), so the numbers are the publisher's own cost:

* ``discover_and_plan``: simulated NVML discovery of ``hgx-h100`` plus
  ``NodeInventory.desired_pool`` (what the plugin does before it starts the publisher);
* ``publish``: from starting ``SlicePublisher.run()`` (desired pool already set, as the plugin
  does) to the return of the last write of the pool; with the production debounce (0.2 s, the
  wait that lets a burst of events cost one reconcile) and with the debounce set to 0;
* ``resync``: ``SlicePublisher.sync()`` on an up-to-date pool: one list, a plan, and no writes;
* ``republish``: ``republish()`` (what every kubelet registration triggers) through the running
  loop, counted in writes: it must make none;
* ``after_wipe``: the kubelet deletes the node's slices (as at its start); time until the watch
  saw it and the pool is written again.

Optionally against a real API server: set ``GPU_DRA_BENCH_KUBECONFIG`` to a kubeconfig and
``GPU_DRA_BENCH_NODE`` to an existing Node. The slices are published under the driver name
``bench.gpu-dra.example.com`` (so that a running gpu-dra plugin's slices are never touched) and
deleted at the end.

    python -m bench.publish_time [--repeats 20] [--resyncs 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench.report import Reporter, Target
from gpu_dra.controller.kubeapi import (
    KubernetesSliceApi,
    ResourceSlice,
    SliceApi,
    SliceList,
    SliceSelector,
    SliceWatch,
    new_api_client,
)
from gpu_dra.controller.publisher import PublisherSettings, SlicePublisher
from gpu_dra.driver.discovery import discover_gpus
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.slices import DesiredPool
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from tests.fakes.slice_api import InMemorySliceApi

BENCH: Final = "publish_time"
MACHINE: Final = "hgx-h100"
DRIVER: Final = "gpu.nvidia.com"
REAL_API_DRIVER: Final = "bench.gpu-dra.example.com"
FAKE_NODE: Final = "bench-node"
FAKE_NODE_UID: Final = "6c0f9a8e-1d2b-4e3f-9a5b-7c8d9e0f1a2b"
REPUBLISHES: Final = 5
WIPES: Final = 5
POLL_S: Final = 0.0005
WAIT_LIMIT_S: Final = 30.0
ZERO_WRITES: Final = Target("==", 0)


class CountingSliceApi:
    """A `SliceApi` around another that counts calls and remembers when the last write ended."""

    def __init__(self, api: SliceApi) -> None:
        self.inner = api
        self.calls: collections.Counter[str] = collections.Counter()
        self.last_write_at = 0.0

    @property
    def writes(self) -> int:
        return self.calls["create"] + self.calls["update"] + self.calls["delete"]

    def list_slices(self, selector: SliceSelector) -> SliceList:
        self.calls["list"] += 1
        return self.inner.list_slices(selector)

    def create_slice(self, body: ResourceSlice) -> ResourceSlice:
        with self._write("create"):
            return self.inner.create_slice(body)

    def replace_slice(self, body: ResourceSlice) -> ResourceSlice:
        with self._write("update"):
            return self.inner.replace_slice(body)

    def delete_slice(self, name: str, *, uid: str, resource_version: str) -> None:
        with self._write("delete"):
            self.inner.delete_slice(name, uid=uid, resource_version=resource_version)

    def watch_slices(
        self, selector: SliceSelector, *, resource_version: str, timeout_seconds: int
    ) -> SliceWatch:
        self.calls["watch"] += 1
        return self.inner.watch_slices(
            selector, resource_version=resource_version, timeout_seconds=timeout_seconds
        )

    def node_uid(self, name: str) -> str:
        self.calls["node"] += 1
        return self.inner.node_uid(name)

    @contextlib.contextmanager
    def _write(self, verb: str) -> Iterator[None]:
        yield
        self.calls[verb] += 1
        self.last_write_at = time.perf_counter()


@dataclass(frozen=True)
class Backend:
    """Where slices are published: a fresh API per repeat, the node, and a cleanup."""

    name: str
    driver: str
    node: str
    new_api: Callable[[], SliceApi]
    cleanup: Callable[[SliceApi], None] = lambda api: None
    can_wipe: bool = False


def in_memory_backend() -> Backend:
    return Backend(
        name="in-memory",
        driver=DRIVER,
        node=FAKE_NODE,
        new_api=lambda: InMemorySliceApi(nodes={FAKE_NODE: FAKE_NODE_UID}),
        can_wipe=True,
    )


def real_backend(kubeconfig: Path, node: str) -> Backend:
    client = new_api_client(kubeconfig)

    def delete_all(api: SliceApi) -> None:
        for item in api.list_slices(SliceSelector(REAL_API_DRIVER, node)).items:
            metadata = item["metadata"]
            api.delete_slice(
                metadata["name"], uid=metadata["uid"], resource_version=metadata["resourceVersion"]
            )

    return Backend(
        name="apiserver",
        driver=REAL_API_DRIVER,
        node=node,
        new_api=lambda: KubernetesSliceApi(client),
        cleanup=delete_all,
    )


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.perf_counter() + WAIT_LIMIT_S
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what} did not happen within {WAIT_LIMIT_S:.0f}s")
        await asyncio.sleep(POLL_S)


async def _until_calls(api: CountingSliceApi, verb: str, count: int, what: str) -> None:
    await _until(lambda: api.calls[verb] >= count, what)


@contextlib.asynccontextmanager
async def running(publisher: SlicePublisher) -> AsyncIterator[float]:
    """Run the publisher; yields the time it was started."""
    started = time.perf_counter()
    task = asyncio.create_task(publisher.run())
    try:
        yield started
    finally:
        publisher.stop()
        await task


@dataclass
class Measurements:
    """What the repeats measured; times in milliseconds."""

    publish_ms: dict[str, list[float]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    resync_ms: list[float] = field(default_factory=list)
    resync_writes: int = 0
    republish_writes: int = 0
    republish_lists: int = 0
    wipe_ms: list[float] = field(default_factory=list)


async def one_repeat(
    backend: Backend,
    pool: DesiredPool,
    measurements: Measurements,
    *,
    debounce_s: float,
    resyncs: int,
) -> None:
    """Publish the pool on a fresh API; with ``resyncs``, then measure the steady state."""
    api = CountingSliceApi(backend.new_api())
    publisher = SlicePublisher(
        api,
        driver=backend.driver,
        node_name=backend.node,
        settings=PublisherSettings(debounce_s=debounce_s),
    )
    publisher.set_desired(pool)  # before run(), as the plugin does
    try:
        async with running(publisher) as started:
            await _until(lambda: publisher.generation > 0, "the first publish")
            label = "publish" if debounce_s else "publish_no_debounce"
            measurements.publish_ms[label].append((api.last_write_at - started) * 1000)
            if resyncs:
                await _steady_state(publisher, api, measurements, debounce_s, resyncs)
                if backend.can_wipe:
                    await _after_wipe(api, backend, pool, measurements)
    finally:
        backend.cleanup(api)


async def _steady_state(
    publisher: SlicePublisher,
    api: CountingSliceApi,
    measurements: Measurements,
    debounce_s: float,
    resyncs: int,
) -> None:
    await asyncio.sleep(debounce_s + 0.05)  # let the trigger of the watch's first list pass
    writes = api.writes
    for _ in range(resyncs):
        started = time.perf_counter()
        await publisher.sync()
        measurements.resync_ms.append((time.perf_counter() - started) * 1000)
    measurements.resync_writes += api.writes - writes

    writes, lists = api.writes, api.calls["list"]
    for _ in range(REPUBLISHES):
        lists_before = api.calls["list"]
        publisher.republish()
        await _until_calls(api, "list", lists_before + 1, "the reconcile after republish()")
    await asyncio.sleep(debounce_s + 0.05)
    measurements.republish_writes += api.writes - writes
    measurements.republish_lists += api.calls["list"] - lists


async def _after_wipe(
    api: CountingSliceApi, backend: Backend, pool: DesiredPool, measurements: Measurements
) -> None:
    fake = api.inner
    assert isinstance(fake, InMemorySliceApi)
    for _ in range(WIPES):
        creates_before = api.calls["create"]
        started = time.perf_counter()
        fake.wipe(SliceSelector(backend.driver, backend.node))  # the kubelet: not our write
        await _until_calls(
            api, "create", creates_before + len(pool.slices), "the publish after a wipe"
        )
        measurements.wipe_ms.append((api.last_write_at - started) * 1000)


def discover_and_plan(driver: str, node: str) -> DesiredPool:
    host = SimulatedHost.load(MACHINE, node)
    inventory = NodeInventory(tuple(discover_gpus(host.nvml, host.pci)), simulated=True)
    return inventory.desired_pool(driver, node)


async def run(args: argparse.Namespace, reporter: Reporter) -> None:
    kubeconfig = os.environ.get("GPU_DRA_BENCH_KUBECONFIG")
    node = os.environ.get("GPU_DRA_BENCH_NODE")
    if kubeconfig and not node:
        raise SystemExit("GPU_DRA_BENCH_KUBECONFIG needs GPU_DRA_BENCH_NODE (an existing Node)")
    backend = real_backend(Path(kubeconfig), node) if kubeconfig and node else in_memory_backend()

    plan_ms = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        pool = discover_and_plan(backend.driver, backend.node)
        plan_ms.append((time.perf_counter() - started) * 1000)
    reporter.run(
        api=backend.name,
        machine=MACHINE,
        devices=pool.device_count,
        slices=len(pool.slices),
        repeats=args.repeats,
        resyncs=args.resyncs,
    )

    measurements = Measurements()
    for number in range(args.repeats):
        for debounce_s in (PublisherSettings().debounce_s, 0.0):
            await one_repeat(
                backend,
                pool,
                measurements,
                debounce_s=debounce_s,
                resyncs=args.resyncs if number == 0 and debounce_s else 0,
            )

    reporter.distribution("discover_and_plan", plan_ms)
    reporter.distribution("publish", measurements.publish_ms["publish"])
    reporter.distribution(
        "publish_no_debounce", measurements.publish_ms["publish_no_debounce"], primary="p50"
    )
    reporter.distribution("resync", measurements.resync_ms)
    reporter.metric("resync_writes", measurements.resync_writes, "writes", target=ZERO_WRITES)
    reporter.metric("republish_writes", measurements.republish_writes, "writes", target=ZERO_WRITES)
    reporter.metric("republish_lists", measurements.republish_lists, "lists")
    if measurements.wipe_ms:
        reporter.distribution("after_wipe", measurements.wipe_ms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="publishes per debounce (20)")
    parser.add_argument("--resyncs", type=int, default=200, help="steady-state syncs (200)")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args(argv)
    asyncio.run(run(args, Reporter(BENCH, json_lines=args.json)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
