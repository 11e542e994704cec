"""Keep one node's pool of ResourceSlices published: reconcile on change, republish after a wipe.

`SlicePublisher.run()` reconciles on every trigger (new desired state, `republish()`, a watch event
someone else caused, a failed attempt): it lists the pool's slices and makes the writes
`plan.plan_pool` asks for, retrying conflicts and backing off on errors. A `Reflector` lists and
watches the node's slices in a thread; echoes of the publisher's own writes trigger nothing. In
steady state a trigger costs one list and no writes. See docs/architecture.md#slice-publishing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from gpu_dra.driver.slices import DesiredPool
from gpu_dra.kube import errors
from gpu_dra.kube.reflector import Reflector, ReflectorSettings
from gpu_dra.kubelet_plugin.slices.kubeapi import (
    ResourceSlice,
    SliceApi,
    SliceEvent,
    SliceList,
    SliceSelector,
)
from gpu_dra.kubelet_plugin.slices.metrics import SliceMetrics, WriteVerb
from gpu_dra.kubelet_plugin.slices.plan import SlicePlan, node_owner, plan_pool

log = logging.getLogger(__name__)

# Remembered versions of our own writes, to ignore their watch echoes; cleared when this large.
_MAX_REMEMBERED_WRITES = 1024


@dataclass(frozen=True)
class PublisherSettings:
    """Timing of the publisher's retries and watches."""

    conflict_attempts: int = 5
    """Attempts per sync when a write meets a conflict (409) before the sync fails."""

    backoff_initial_s: float = 0.2
    """First delay after a failed attempt; doubled after each further failure."""

    backoff_max_s: float = 5.0
    """Upper bound of the retry delay (of the reconciles and of the watch): a change waiting
    through an apiserver outage (a device's new taint) is published at most this long, plus a
    debounce and the request, after the apiserver answers again; a new desired pool ends the
    wait at once."""

    debounce_s: float = 0.2
    """Wait after a trigger so that a burst of events (a wipe) costs one reconcile."""

    watch_timeout_s: int = 300
    """Server-side timeout of one watch request; the watch then resumes where it stopped."""

    def __post_init__(self) -> None:
        if self.conflict_attempts < 1:
            raise ValueError(f"conflict_attempts must be at least 1, got {self.conflict_attempts}")


class _PoolLog(logging.LoggerAdapter[logging.Logger]):
    """Appends the publisher's driver and node to every message as key=value pairs."""

    def process(self, msg: object, kwargs: MutableMapping[str, Any]) -> tuple[object, Any]:
        context = " ".join(f"{key}={value}" for key, value in (self.extra or {}).items())
        return f"{msg} {context}", kwargs


@dataclass(frozen=True)
class SyncResult:
    generation: int
    created: int = 0
    updated: int = 0
    deleted: int = 0

    @property
    def writes(self) -> int:
        return self.created + self.updated + self.deleted


class SlicePublisher:
    """Publishes one node-local pool of one driver and keeps it published.

    Usage (inside the kubelet plugin's event loop)::

        publisher = SlicePublisher(api, driver="gpu.nvidia.com", node_name=node)
        publisher.set_desired(build_pool(...))
        task = asyncio.create_task(publisher.run())
        ...                       # after each plugin registration:
        publisher.republish()
        ...
        publisher.stop()
        await task

    The publisher owns every slice under its selector (`spec.driver`, `spec.nodeName`): slices of
    other pools there are deleted. Run one publisher per driver and node.
    """

    def __init__(
        self,
        api: SliceApi,
        *,
        driver: str,
        node_name: str,
        metrics: SliceMetrics | None = None,
        settings: PublisherSettings | None = None,
    ) -> None:
        self._api = api
        self._selector = SliceSelector(driver=driver, node_name=node_name)
        self._metrics = metrics or SliceMetrics(CollectorRegistry())
        self._settings = settings or PublisherSettings()
        self._log = _PoolLog(log, {"driver": driver, "node": node_name})
        self._desired: DesiredPool | None = None
        self._generation = 0
        self._dirty = asyncio.Event()
        self._new_desired = asyncio.Event()
        """Set by `set_desired`: ends a retry's back-off early (the apiserver may be back)."""
        self._stopping = asyncio.Event()
        self._sync_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._own_versions: set[str] = set()
        self._own_deletes: set[str] = set()
        selector = self._selector
        self._reflector = Reflector[SliceList, SliceEvent](
            "ResourceSlices",
            lambda: api.list_slices(selector),
            lambda version, timeout: api.watch_slices(
                selector, resource_version=version, timeout_seconds=timeout
            ),
            lambda _listing: self._trigger(),  # changes before this list were seen by no watch
            self._on_event,
            settings=ReflectorSettings(
                backoff_initial_s=self._settings.backoff_initial_s,
                backoff_max_s=self._settings.backoff_max_s,
                watch_timeout_s=self._settings.watch_timeout_s,
            ),
        )

    @property
    def generation(self) -> int:
        """The pool generation last published (0 before the first publish)."""
        return self._generation

    def set_desired(self, pool: DesiredPool) -> None:
        """Publish `pool` from now on (a reconcile follows). Callable from any thread."""
        if (pool.driver, pool.node_name) != (self._selector.driver, self._selector.node_name):
            raise ValueError(
                f"pool {pool.name!r} is for driver {pool.driver!r} on node {pool.node_name!r}; "
                f"this publisher publishes for {self._selector.driver!r} on "
                f"{self._selector.node_name!r}"
            )
        self._desired = pool
        self._call_in_loop(self._new_desired.set)
        self._trigger()

    def republish(self) -> None:
        """Reconcile soon, e.g. after the kubelet (re)registered the plugin. Any thread."""
        self._trigger()

    def stop(self) -> None:
        """Make `run()` return; closes the watch. Any thread; idempotent; final."""
        self._call_in_loop(self._stopping.set)
        self._reflector.stop()

    async def run(self) -> None:
        """Reconcile and watch until `stop()` (or cancellation)."""
        self._loop = asyncio.get_running_loop()
        self._reflector.start("slice-watch")
        reconciler = asyncio.create_task(self._reconcile_forever(), name="slices-reconcile")
        stopper = asyncio.create_task(self._stopping.wait(), name="slices-stop")
        try:
            done, _ = await asyncio.wait({stopper, reconciler}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stopper, reconciler):
                task.cancel()
            self._reflector.stop()
            await asyncio.gather(stopper, reconciler, return_exceptions=True)
            await asyncio.to_thread(self._reflector.close)
        if reconciler in done:
            reconciler.result()  # the reconcile loop only ends on a bug: raise it

    async def sync(self) -> SyncResult:
        """Reconcile the pool once now, retrying conflicts; raises the last error on failure."""
        settings = self._settings
        async with self._sync_lock:
            delay = settings.backoff_initial_s
            for attempt in range(1, settings.conflict_attempts + 1):
                desired = self._desired
                if desired is None:
                    raise RuntimeError("SlicePublisher.sync() before set_desired()")
                try:
                    return await self._reconcile(desired)
                except (errors.ConflictError, errors.AlreadyExistsError) as error:
                    self._metrics.count_error("conflict")
                    if attempt == settings.conflict_attempts:
                        raise
                    self._log.info(
                        "conflict writing slices, retrying: attempt=%d delay_s=%.2f error=%s",
                        attempt,
                        delay,
                        error,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, settings.backoff_max_s)
                except errors.ApiError:
                    self._metrics.count_error("api")
                    raise
        raise AssertionError("unreachable: conflict_attempts must be >= 1")

    async def _reconcile(self, desired: DesiredPool) -> SyncResult:
        listing = await asyncio.to_thread(self._api.list_slices, self._selector)
        plan = plan_pool(desired, listing.items, last_generation=self._generation)
        if plan.is_empty:
            self._generation = max(self._generation, plan.generation)
            self._metrics.reconciles.inc()
            return SyncResult(generation=plan.generation)

        node_name = desired.node_name
        node_uid = await asyncio.to_thread(self._api.node_uid, node_name)
        result = await self._write(plan.owned_by(node_owner(node_name, node_uid)))
        self._generation = plan.generation
        self._metrics.reconciles.inc()
        self._log.info(
            "published pool: pool=%s generation=%d slices=%d devices=%d "
            "created=%d updated=%d deleted=%d",
            desired.name,
            plan.generation,
            len(desired.slices),
            desired.device_count,
            result.created,
            result.updated,
            result.deleted,
        )
        return result

    async def _write(self, plan: SlicePlan) -> SyncResult:
        deleted = 0
        for live in plan.deletes:
            metadata = live["metadata"]
            name = metadata.get("name", "")
            self._remember(self._own_deletes, name)
            try:
                await asyncio.to_thread(
                    self._api.delete_slice,
                    name,
                    uid=metadata.get("uid", ""),
                    resource_version=metadata.get("resourceVersion", ""),
                )
            except errors.NotFoundError:
                continue  # already gone: that is what we wanted
            deleted += 1
            self._metrics.count_write("delete")
        for body in plan.updates:
            try:
                stored = await asyncio.to_thread(self._api.replace_slice, body)
            except errors.NotFoundError as error:
                raise errors.ConflictError(
                    f"ResourceSlice {body['metadata'].get('name')} vanished while updating it",
                    status=404,
                ) from error
            self._stored(stored, "update")
        for body in plan.creates:
            self._stored(await asyncio.to_thread(self._api.create_slice, body), "create")
        return SyncResult(
            generation=plan.generation,
            created=len(plan.creates),
            updated=len(plan.updates),
            deleted=deleted,
        )

    def _stored(self, stored: ResourceSlice, verb: WriteVerb) -> None:
        self._remember(self._own_versions, stored["metadata"].get("resourceVersion", ""))
        self._metrics.count_write(verb)

    async def _reconcile_forever(self) -> None:
        settings = self._settings
        delay = settings.backoff_initial_s
        while True:
            await self._dirty.wait()
            if settings.debounce_s > 0:
                await asyncio.sleep(settings.debounce_s)
            self._dirty.clear()
            if self._desired is None:
                continue
            try:
                await self.sync()
            except errors.ApiError as error:
                self._log.warning(
                    "publishing slices failed: retry_in_s=%.2f error=%s", delay, error
                )
            except Exception:
                self._metrics.count_error("internal")
                self._log.exception("publishing slices failed: retry_in_s=%.2f", delay)
            else:
                delay = settings.backoff_initial_s
                continue
            self._new_desired.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new_desired.wait(), delay)
            delay = min(delay * 2, settings.backoff_max_s)
            self._dirty.set()

    def _on_event(self, event: SliceEvent) -> None:
        """A watch event, in the reflector's thread: judged in the event loop."""
        self._call_in_loop(functools.partial(self._on_event_in_loop, event))

    def _on_event_in_loop(self, event: SliceEvent) -> None:
        if self._caused_by_others(event):
            self._log.debug("slice event: type=%s name=%s", event.type, event.name)
            self._dirty.set()

    def _caused_by_others(self, event: SliceEvent) -> bool:
        if event.type == "BOOKMARK":
            return False
        if event.type == "DELETED":
            own = event.name in self._own_deletes
            self._own_deletes.discard(event.name)
            return not own
        own = event.resource_version in self._own_versions
        self._own_versions.discard(event.resource_version)
        return not own

    def _trigger(self) -> None:
        self._call_in_loop(self._dirty.set)

    def _call_in_loop(self, callback: Callable[[], object]) -> None:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is not loop:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(callback)
        else:
            callback()

    @staticmethod
    def _remember(remembered: set[str], value: str) -> None:
        if len(remembered) >= _MAX_REMEMBERED_WRITES:
            remembered.clear()
        remembered.add(value)
