"""Leader election on a `coordination.k8s.io/v1` Lease, with client-go's rules and defaults.

Candidates read the Lease every retry period; one whose holder has not renewed for the lease's
duration (timed on this candidate's clock, from when it last saw the record change) or that is
released takes it with a write guarded by its resourceVersion. The leader renews every retry
period; when no renewal succeeded for the renew deadline it stops its duties at once and becomes
a candidate again (the process keeps running: health and everything not leader-only go on). On
stop the leader releases the Lease (holder ""), so a successor need not wait. The `kubernetes`
client's own `leaderelection` uses the process-wide default client, blocking threads and no
release, hence this module. See docs/deployment.md, "Leader election".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol, cast

from kubernetes import client as k8s

from gpu_dra.controller import errors
from gpu_dra.controller.kubeapi import translated_errors

log = logging.getLogger(__name__)

LEASE_GROUP = "coordination.k8s.io"
LEASE_VERSION = "v1"
LEASES = "leases"
JITTER_FACTOR = 1.2
"""client-go's: each retry waits retry period times a factor in [1, 1.2)."""


@dataclass(frozen=True)
class LeaseRecord:
    """The election fields of a Lease's spec, and its resourceVersion (the write guard)."""

    holder: str
    """`holderIdentity`; "" when released."""
    lease_duration_s: int
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0
    resource_version: str = ""


class LeaseApi(Protocol):
    """One Lease, read and written whole (blocking calls; errors are `errors.ApiError`)."""

    def get(self) -> LeaseRecord | None:
        """The Lease, or None when it does not exist."""
        ...

    def create(self, record: LeaseRecord) -> LeaseRecord:
        """Create it (`errors.AlreadyExistsError` when another candidate was first)."""
        ...

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        """Write it over `record.resource_version` (`errors.ConflictError` when stale)."""
        ...


@dataclass(frozen=True)
class ElectionConfig:
    lease_name: str
    namespace: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("leader election needs an identity")
        if self.lease_duration_s < 1:
            raise ValueError("the lease duration must be at least 1 second")
        if not self.lease_duration_s > self.renew_deadline_s:
            raise ValueError(
                f"the lease duration ({self.lease_duration_s:g}s) must be longer than the renew "
                f"deadline ({self.renew_deadline_s:g}s)"
            )
        if not self.renew_deadline_s > JITTER_FACTOR * self.retry_period_s:
            raise ValueError(
                f"the renew deadline ({self.renew_deadline_s:g}s) must be longer than "
                f"{JITTER_FACTOR:g} times the retry period ({self.retry_period_s:g}s)"
            )


ApiReport = Callable[[bool, str], None]
"""Told after each Lease call whether the apiserver answered (and what failed if not)."""
LeaderReport = Callable[[bool], None]
"""Told when this candidate starts and stops leading."""
Duty = Callable[[], Coroutine[Any, Any, int]]
"""The leader-only work; it runs until cancelled, or returns an exit status."""


class LeaderElector:
    """Runs `Duty` only while this candidate holds the Lease."""

    def __init__(
        self,
        api: LeaseApi,
        config: ElectionConfig,
        *,
        on_api: ApiReport | None = None,
        on_leading: LeaderReport | None = None,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._api = api
        self.config = config
        self._on_api = on_api or (lambda ok, detail: None)
        self._on_leading = on_leading or (lambda leading: None)
        self._clock = clock
        self._now = now
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._last_holder: str | None = None
        self.leading = False

    async def run(self, duty: Duty, stop: asyncio.Event) -> int | None:
        """Elect and lead until `stop`; the duty's exit status if it ended on its own (the
        Lease is released first), None when stopped."""
        while not stop.is_set():
            if not await self._acquire(stop):
                return None
            status = await self._lead(duty, stop)
            if status is not None or stop.is_set():
                return status
        return None

    async def _acquire(self, stop: asyncio.Event) -> bool:
        log.info(
            "leader election: candidate identity=%s lease=%s/%s",
            self.config.identity,
            self.config.namespace,
            self.config.lease_name,
        )
        while not stop.is_set():
            if await self._try(self.config.retry_period_s * JITTER_FACTOR):
                return True
            await _sleep_or_stop(stop, self._jittered())
        return False

    async def _lead(self, duty: Duty, stop: asyncio.Event) -> int | None:
        log.info("leader election: became the leader identity=%s", self.config.identity)
        self._set_leading(True)
        task: asyncio.Task[int] = asyncio.create_task(duty(), name="leader-duty")
        last_renewal = self._clock()
        lost = False
        try:
            while True:
                stopped = asyncio.create_task(stop.wait())
                await asyncio.wait(
                    {task, stopped},
                    timeout=self.config.retry_period_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                stopped.cancel()
                if task.done():
                    status = task.result()  # a duty that raised ends the process
                    log.warning("leader election: the leader's duty ended (status %d)", status)
                    return status
                if stop.is_set():
                    return None
                left = last_renewal + self.config.renew_deadline_s - self._clock()
                if left > 0 and await self._try(left):
                    last_renewal = self._clock()
                    continue
                holder = self._observed.holder if self._observed else ""
                if self._clock() - last_renewal >= self.config.renew_deadline_s or (
                    holder != self.config.identity
                ):
                    log.error(
                        "leader election: lost the lease (last renewal %.1fs ago, holder %r); "
                        "stopping the leader's duties",
                        self._clock() - last_renewal,
                        holder,
                    )
                    lost = True
                    return None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self._set_leading(False)
            if not lost:
                await self._release()

    async def _try(self, timeout_s: float) -> bool:
        """One read and, when allowed, one write of the Lease: whether this candidate now holds
        it. API failures count as not holding it."""
        try:
            held = await asyncio.wait_for(
                asyncio.to_thread(self._try_acquire_or_renew), max(timeout_s, 0.01)
            )
        except TimeoutError:
            self._on_api(False, f"Lease {self._lease}: no answer in {timeout_s:.1f}s")
            return False
        except (errors.ConflictError, errors.AlreadyExistsError) as error:
            log.debug("leader election: another candidate wrote first: %s", error)
            held = False
        except errors.ApiError as error:
            log.warning("leader election: %s", error)
            self._on_api(False, str(error))
            return False
        self._on_api(True, "")
        return held

    def _try_acquire_or_renew(self) -> bool:
        me = self.config.identity
        now = self._now()
        record = self._api.get()
        if record is None:
            self._observe(self._api.create(self._record(None, now)))
            return True
        self._observe(record)
        if record.holder and record.holder != me and not self._expired(record):
            return False
        self._observe(self._api.replace(self._record(record, now)))
        return True

    def _record(self, old: LeaseRecord | None, now: datetime) -> LeaseRecord:
        me = self.config.identity
        duration = max(1, round(self.config.lease_duration_s))
        if old is None:
            return LeaseRecord(me, duration, now, now, 0)
        if old.holder == me:
            return replace(old, lease_duration_s=duration, renew_time=now)
        return replace(
            old,
            holder=me,
            lease_duration_s=duration,
            acquire_time=now,
            renew_time=now,
            transitions=old.transitions + 1,
        )

    def _observe(self, record: LeaseRecord) -> None:
        key = (record.holder, record.renew_time, record.transitions)
        seen = self._observed
        if seen is None or key != (seen.holder, seen.renew_time, seen.transitions):
            self._observed_at = self._clock()
        self._observed = record
        if record.holder != self._last_holder:
            self._last_holder = record.holder
            log.info("leader election: leader is now %r", record.holder or "(released)")

    def _expired(self, record: LeaseRecord) -> bool:
        """Whether `record`'s holder has not renewed for its lease duration, on this clock."""
        duration = record.lease_duration_s or self.config.lease_duration_s
        return self._clock() >= self._observed_at + duration

    async def _release(self) -> None:
        """Clear the holder so another candidate takes over at once (best effort)."""

        def release() -> None:
            record = self._api.get()
            if record is None or record.holder != self.config.identity:
                return
            now = self._now()
            self._api.replace(
                replace(record, holder="", lease_duration_s=1, acquire_time=now, renew_time=now)
            )

        try:
            await asyncio.wait_for(asyncio.to_thread(release), self.config.renew_deadline_s)
        except (TimeoutError, errors.ApiError) as error:
            log.warning("leader election: could not release the lease: %s", error)
        else:
            log.info("leader election: released the lease identity=%s", self.config.identity)

    def _set_leading(self, leading: bool) -> None:
        self.leading = leading
        self._on_leading(leading)

    def _jittered(self) -> float:
        return self.config.retry_period_s * random.uniform(1.0, JITTER_FACTOR)  # noqa: S311

    @property
    def _lease(self) -> str:
        return f"{self.config.namespace}/{self.config.lease_name}"


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


class KubernetesLeaseApi:
    """`LeaseApi` on the `kubernetes` client (raw dictionaries, `CustomObjectsApi`)."""

    def __init__(
        self, api_client: k8s.ApiClient, *, namespace: str, name: str, request_timeout_s: float
    ) -> None:
        self._objects = k8s.CustomObjectsApi(api_client)
        self._namespace = namespace
        self._name = name
        self._timeout = request_timeout_s

    def get(self) -> LeaseRecord | None:
        try:
            with translated_errors(f"read Lease {self._namespace}/{self._name}"):
                lease = self._objects.get_namespaced_custom_object(
                    LEASE_GROUP,
                    LEASE_VERSION,
                    self._namespace,
                    LEASES,
                    self._name,
                    _request_timeout=self._timeout,
                )
        except errors.NotFoundError:
            return None
        return lease_record(cast("dict[str, Any]", lease))

    def create(self, record: LeaseRecord) -> LeaseRecord:
        with translated_errors(f"create Lease {self._namespace}/{self._name}"):
            lease = self._objects.create_namespaced_custom_object(
                LEASE_GROUP,
                LEASE_VERSION,
                self._namespace,
                LEASES,
                lease_object(record, self._namespace, self._name),
                _request_timeout=self._timeout,
            )
        return lease_record(cast("dict[str, Any]", lease))

    def replace(self, record: LeaseRecord) -> LeaseRecord:
        with translated_errors(f"update Lease {self._namespace}/{self._name}"):
            lease = self._objects.replace_namespaced_custom_object(
                LEASE_GROUP,
                LEASE_VERSION,
                self._namespace,
                LEASES,
                self._name,
                lease_object(record, self._namespace, self._name),
                _request_timeout=self._timeout,
            )
        return lease_record(cast("dict[str, Any]", lease))


def lease_object(record: LeaseRecord, namespace: str, name: str) -> dict[str, Any]:
    """The Lease manifest of `record` (with its resourceVersion, when it has one)."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if record.resource_version:
        metadata["resourceVersion"] = record.resource_version
    spec: dict[str, Any] = {
        "holderIdentity": record.holder,
        "leaseDurationSeconds": record.lease_duration_s,
        "leaseTransitions": record.transitions,
    }
    if record.acquire_time is not None:
        spec["acquireTime"] = micro_time(record.acquire_time)
    if record.renew_time is not None:
        spec["renewTime"] = micro_time(record.renew_time)
    return {
        "apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}",
        "kind": "Lease",
        "metadata": metadata,
        "spec": spec,
    }


def lease_record(lease: dict[str, Any]) -> LeaseRecord:
    """The election fields of a Lease as the apiserver returns it."""
    spec = lease.get("spec") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        lease_duration_s=int(spec.get("leaseDurationSeconds") or 0),
        acquire_time=_parse_time(spec.get("acquireTime")),
        renew_time=_parse_time(spec.get("renewTime")),
        transitions=int(spec.get("leaseTransitions") or 0),
        resource_version=str((lease.get("metadata") or {}).get("resourceVersion") or ""),
    )


def micro_time(moment: datetime) -> str:
    """Kubernetes `MicroTime`: RFC 3339 in UTC with microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: object) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None
