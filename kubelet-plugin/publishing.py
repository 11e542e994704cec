"""Which plugin instance publishes the node's ResourceSlices: the newest ready one.

During a rolling update two instances run on a node; two `SlicePublisher`s of different
versions would each see the other's writes as foreign and write their own content back, without
end. `PublisherTurn` runs a publisher only while its instance is the live, ready instance that
started last (`plugin_instances.PluginInstance.newest_ready`, checked every `interval_s`): a new
instance takes over once its start-up recovery is done, the old one stops writing (its slices
stay: the new one adopts them by content), and the old one takes over again if the new one goes
away. `set_desired` (the health monitor's taints) goes to the running publisher and to every
later one. See docs/architecture.md, "Two instances on one node".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from gpu_dra.driver.resourceapi import DeviceTaint
from gpu_dra.driver.slices import DesiredPool
from gpu_dra.kubelet_plugin.slices.publisher import SlicePublisher

log = logging.getLogger(__name__)


class PublisherTurn:
    """Runs a fresh `SlicePublisher` (``make_publisher``) while ``is_turn()`` says so."""

    def __init__(
        self,
        make_publisher: Callable[[], SlicePublisher],
        is_turn: Callable[[], bool],
        *,
        interval_s: float = 2.0,
    ) -> None:
        """``is_turn`` blocks (file I/O): it runs in a worker thread."""
        self._make = make_publisher
        self._is_turn = is_turn
        self._interval_s = interval_s
        self._publisher: SlicePublisher | None = None
        self._desired: DesiredPool | None = None
        self._desired_lock = threading.Lock()  # set_desired may come from any thread
        self._stopping = asyncio.Event()

    @property
    def publishing(self) -> bool:
        return self._publisher is not None

    def republish(self) -> None:
        """Reconcile soon, if this instance publishes (e.g. after a kubelet registration)."""
        if self._publisher is not None:
            self._publisher.republish()

    def set_desired(self, pool: DesiredPool) -> None:
        """Publish ``pool`` from now on: the running publisher gets it, and so does every
        publisher made later (instead of the pool ``make_publisher`` set). Any thread."""
        with self._desired_lock:
            self._desired = pool
            if self._publisher is not None:
                self._publisher.set_desired(pool)

    def _new_publisher(self) -> SlicePublisher:
        publisher = self._make()
        with self._desired_lock:
            if self._desired is not None:
                publisher.set_desired(self._desired)
            self._publisher = publisher
        return publisher

    def stop(self) -> None:
        """Make `run` return (after stopping the publisher). Call in the event loop."""
        self._stopping.set()

    async def run(self) -> None:
        """Check the turn now and every `interval_s` until `stop`; a publisher that ends on its
        own (a bug) raises here."""
        task: asyncio.Task[None] | None = None
        try:
            while not self._stopping.is_set():
                try:
                    turn = await asyncio.to_thread(self._is_turn)
                except OSError as error:
                    log.warning("cannot tell whether this instance publishes, unchanged: %s", error)
                    turn = task is not None
                if turn and task is None:
                    log.info("publishing this node's ResourceSlices (newest plugin instance)")
                    task = asyncio.create_task(self._new_publisher().run(), name="publisher")
                elif not turn and task is not None:
                    log.info("a newer plugin instance publishes the ResourceSlices; stopping")
                    await self._stop_publisher(task)
                    task = None
                if task is not None and task.done():
                    task.result()  # the publisher only ends on a bug: surface it
                    raise RuntimeError("the slice publisher stopped on its own")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self._interval_s)
        finally:
            if task is not None:
                await self._stop_publisher(task)

    async def _stop_publisher(self, task: asyncio.Task[None]) -> None:
        with self._desired_lock:
            publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.stop()
        await asyncio.gather(task, return_exceptions=True)


class NodeTaints:
    """The published devices' taints from several sources (the health monitor, GPUs with MIG
    leftovers), merged per device; every change of a source republishes through `publish_with`'s
    callback. Event loop only."""

    def __init__(self, sources: Mapping[str, Mapping[str, Sequence[DeviceTaint]]]) -> None:
        self._sources = {name: dict(taints) for name, taints in sources.items()}
        self._publish: Callable[[Mapping[str, Sequence[DeviceTaint]]], None] | None = None

    def merged(self) -> dict[str, list[DeviceTaint]]:
        """Every source's taints of each device, sources in name order."""
        merged: dict[str, list[DeviceTaint]] = {}
        for name in sorted(self._sources):
            for device, taints in self._sources[name].items():
                merged.setdefault(device, []).extend(taints)
        return merged

    def publish_with(self, publish: Callable[[Mapping[str, Sequence[DeviceTaint]]], None]) -> None:
        self._publish = publish

    def set(self, source: str, taints: Mapping[str, Sequence[DeviceTaint]]) -> None:
        """``source``'s taints from now on; republished when they changed."""
        if self._sources.get(source) == dict(taints):
            return
        self._sources[source] = dict(taints)
        if self._publish is not None:
            self._publish(self.merged())
