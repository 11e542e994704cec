"""The health monitor: NVML events and MPS daemon checks -> the node's device health.

`HealthMonitor.run` initialises NVML, registers every GPU for XID critical errors and
double-bit ECC errors (as far as each supports them) in one event set and waits on it in a
worker thread (``wait_timeout_ms`` at a time); it reads the GPUs' ECC counters too
(`ecc.EccWatch`). Each event is classified by
`gpu_dra.driver.health.classify_event`; a wait or lookup answering GPU_IS_LOST probes the GPUs
and marks the ones that answer so as lost. A GPU that cannot be registered is "unmonitored"
(health Unknown, no taint); repeated wait failures make every GPU so until a wait works again.
With MPS shares, every ``mps_interval_s`` and at once on `mps_changed`, the `MpsLiveness`
verdicts (the MPS daemon supervisor's, read by `mps_watch.MpsWatch`) mark the share device of a
GPU whose shared daemon is down. Listeners (`add_listener`) get every new per-device snapshot:
`__main__` republishes the slices with taints, the DRA health service streams it. With a
`HealthRecord`, NVML's problems are kept on disk: the monitor starts from the recorded ones (a
restarted plugin keeps a GPU's taints), writes every change of them, and applies the operator's
clear requests (`record.request_clear`). See docs/architecture.md, "Health monitor".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Final

from gpu_dra.driver.health import (
    KEY_UNMONITORED,
    RECOVERY,
    DeviceHealth,
    DeviceScope,
    HealthPolicy,
    HealthState,
    Problem,
    Recovery,
    Severity,
    Target,
    classify_event,
    device_health,
    gpu_lost,
    persisted,
    rfc3339,
    unmonitored,
)
from gpu_dra.driver.model import Gpu
from gpu_dra.driver.nvml.interface import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_TIMEOUT,
    NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
    NVML_NO_INSTANCE_ID,
    EventData,
    EventSetHandle,
    NVMLError,
    NvmlLibrary,
    return_code,
    return_code_name,
)
from gpu_dra.kubelet_plugin.device_health.ecc import EccWatch
from gpu_dra.kubelet_plugin.device_health.monitor_inputs import MonitorTiming, MpsLiveness
from gpu_dra.kubelet_plugin.device_health.mps_watch import MpsWatch
from gpu_dra.kubelet_plugin.device_health.record import HealthRecord, split_by_gpu

log = logging.getLogger(__name__)

WATCHED_EVENTS: Final = NVML_EVENT_TYPE_XID_CRITICAL_ERROR | NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR
"""What the monitor registers each GPU for (ANDed with what the GPU supports)."""
WAIT_FAILURES_BEFORE_UNMONITORED: Final = 3
"""Consecutive failed waits (not timeouts) after which every GPU's health is Unknown."""

Snapshot = Mapping[str, DeviceHealth]
"""Device name -> its health, for every published device."""
Listener = Callable[[Snapshot], None]
EventObserver = Callable[[str | None, int, int, Problem | Recovery | None], None]
"""Gets every NVML event the monitor handles: the GPU's UUID (None: unreadable), the event
type and data, and what `classify_event` made of it (`metrics.HealthEventMetrics.observe`)."""


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _nvml_reason(call: str, error: Exception) -> str:
    code = return_code(error)
    name = return_code_name(code) if code is not None else type(error).__name__
    return f"{call}: {name}"


class HealthMonitor:
    """Watches the GPUs in `gpus` and keeps the health of the devices in `scopes` (see the
    module doc). `shared_gpus`: UUIDs of the GPUs offered as MPS shares, `shared_migs` the
    static MIG devices offered as shares (MIG UUID -> target), `partition_daemons` the MIG
    devices made from partitions offered as shares as they are now (MIG UUID -> the partition's
    target; read at every MPS pass), all checked with `mps`."""

    def __init__(
        self,
        nvml: NvmlLibrary,
        gpus: Sequence[Gpu],
        scopes: Sequence[DeviceScope],
        *,
        policy: HealthPolicy,
        shared_gpus: Sequence[str] = (),
        shared_migs: Mapping[str, Target] | None = None,
        partition_daemons: Callable[[], Mapping[str, Target]] | None = None,
        mps: MpsLiveness | None = None,
        timing: MonitorTiming | None = None,
        clock: Callable[[], datetime] = _utc_now,
        record: HealthRecord | None = None,
        recorded: HealthState | None = None,
        report_unwatched: Callable[[Mapping[str, str]], None] | None = None,
        observe_event: EventObserver | None = None,
    ) -> None:
        """``record``: where NVML's problems are kept (None: in memory only); ``recorded``:
        what it held at start (`HealthRecord.load`), the monitor's first state. Problems of GPUs
        not in ``gpus`` (one that fell off the bus and was not discovered) are kept in the
        record, not applied. ``report_unwatched`` gets the GPUs NVML cannot watch, with why,
        once registration is done (in a worker thread: a Kubernetes Event, say);
        ``observe_event`` every NVML event handled (metrics)."""
        self._nvml = nvml
        self._gpus = {gpu.uuid: gpu for gpu in gpus}
        self._ecc = EccWatch(nvml, list(self._gpus))
        self._scopes = tuple(scopes)
        self._policy = policy
        self._mps = (
            None if mps is None else MpsWatch(mps, shared_gpus, shared_migs, partition_daemons)
        )
        self._timing = timing or MonitorTiming()
        self._clock = clock
        self._record = record
        present, absent = split_by_gpu(recorded or HealthState(), set(self._gpus))
        self._absent = absent
        """Recorded problems of GPUs this node does not have now: written back unchanged."""
        self._state = present
        for target, problems in present.problems.items():
            for problem in problems.values():
                log.warning("health: GPU %s: %s (recorded %s; kept until cleared)",
                            target.gpu_uuid, problem.message, rfc3339(problem.since))  # fmt: skip
        self._snapshot: Snapshot = device_health(self._state, self._scopes)
        self._version = 0
        self._changed = asyncio.Event()
        self._listeners: list[Listener] = []
        self._stopping = asyncio.Event()
        self._started = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._registration_problems: set[str] = set()
        self._report_unwatched = report_unwatched
        self._observe_event = observe_event
        self._unwatched: dict[str, str] = {}
        """GPU UUID -> why NVML cannot watch it (registration), for `report_unwatched`."""
        self._wait_failures = 0
        self._beats: dict[str, float] = {}
        """Worker -> when it last completed a check (the NVML waiter, the MPS checker)."""

    # ---- what others read ---------------------------------------------------------------------
    @property
    def policy(self) -> HealthPolicy:
        return self._policy

    @property
    def version(self) -> int:
        """Bumped on every change of `snapshot`."""
        return self._version

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def add_listener(self, listener: Listener) -> None:
        """`listener` gets every new snapshot (in the event loop; it must not block)."""
        self._listeners.append(listener)

    async def wait_changed(self, version: int, timeout_s: float) -> None:
        """Return once `version` is outdated, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._version == version:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._changed.clear()
            if self._version != version:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def started(self) -> None:
        """Return once `run` has registered the GPUs (or found it cannot) and applied that."""
        await self._started.wait()

    def alive_within(self, seconds: float) -> bool:
        """Whether every running check (NVML waits, MPS checks) completed in the last
        `seconds`: only then is the monitor's health worth repeating to the kubelet."""
        now = time.monotonic()
        return all(now - beat <= seconds for beat in self._beats.values())

    # ---- lifecycle ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Make `run` return (within one wait timeout). Call in the event loop."""
        self._stopping.set()

    def mps_changed(self) -> None:
        """Read the MPS liveness now, not at the next interval (a daemon went down or came
        back). Any thread; before `run` it does nothing."""
        loop = self._loop
        if loop is not None and self._mps is not None:
            loop.call_soon_threadsafe(self._mps.poke)

    async def run(self) -> None:
        """Watch until `stop`; NVML is initialised for the monitor's lifetime."""
        self._loop = asyncio.get_running_loop()
        event_set, problems = await asyncio.to_thread(self._start_nvml)
        state = self._state
        for target, problem in problems:
            state = state.with_problem(target, problem)
        version = self._version
        self._set_state(state)
        if self._version == version and self._state.problems:
            self._notify()  # the recorded problems: the listeners have not had them yet
        workers = []
        if event_set is not None:
            self._beat("nvml")
            workers.append(asyncio.create_task(self._watch_events(event_set), name="health-nvml"))
        if self._mps is not None and self._mps.watches_any:
            self._beat("mps")
            workers.append(asyncio.create_task(self._watch_mps(self._mps), name="health-mps"))
        if event_set is not None:
            workers.append(asyncio.create_task(self._watch_ecc(), name="health-ecc"))
        if self._unwatched and self._report_unwatched is not None:
            try:
                await asyncio.to_thread(self._report_unwatched, dict(self._unwatched))
            except Exception:
                log.exception("health: reporting the GPUs NVML cannot watch failed")
        if self._record is not None:
            await self._apply_clear()
            workers.append(asyncio.create_task(self._watch_clears(), name="health-clears"))
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            self._stopping.set()
            # The NVML worker returns after its current wait; only then is the set freed.
            await asyncio.gather(*workers, return_exceptions=True)
            await asyncio.to_thread(self._stop_nvml, event_set)

    # ---- NVML ---------------------------------------------------------------------------------
    def _start_nvml(self) -> tuple[EventSetHandle | None, list[tuple[Target, Problem]]]:
        """Init NVML and register every GPU: the event set (None when there is none) and the
        problems found on the way."""
        now = self._clock()
        try:
            self._nvml.init()
        except NVMLError as error:
            return None, self._all_unmonitored(_nvml_reason("nvmlInit", error), now)
        try:
            event_set = self._nvml.event_set_create()
        except NVMLError as error:
            self._nvml.shutdown()
            return None, self._all_unmonitored(_nvml_reason("nvmlEventSetCreate", error), now)
        problems = []
        for uuid in self._gpus:
            problem = self._register(uuid, event_set, now)
            if problem is not None:
                problems.append((Target(uuid), problem))
        return event_set, problems

    def _register(self, uuid: str, event_set: EventSetHandle, now: datetime) -> Problem | None:
        """Register one GPU; the problem that keeps it from being watched, if any."""
        call = "nvmlDeviceGetHandleByUUID"
        try:
            handle = self._nvml.device_get_handle_by_uuid(uuid)
            call = "nvmlDeviceGetSupportedEventTypes"
            types = self._nvml.device_get_supported_event_types(handle) & WATCHED_EVENTS
            if not types:
                log.warning("health: GPU %s reports no XID or ECC events: not watched", uuid)
                self._registration_problems.add(uuid)
                self._unwatched[uuid] = "the GPU reports no XID or ECC events"
                return unmonitored(self._unwatched[uuid], now)
            call = "nvmlDeviceRegisterEvents"
            self._nvml.device_register_events(handle, types, event_set)
        except NVMLError as error:
            log.error("health: GPU %s not watched: %s", uuid, _nvml_reason(call, error))
            if return_code(error) == NVML_ERROR_GPU_IS_LOST:
                return gpu_lost(f"{call} answered GPU_IS_LOST", now)
            self._registration_problems.add(uuid)
            self._unwatched[uuid] = _nvml_reason(call, error)
            return unmonitored(self._unwatched[uuid], now)
        log.info("health: watching GPU %s for NVML events 0x%x", uuid, types)
        return None

    def _all_unmonitored(self, reason: str, now: datetime) -> list[tuple[Target, Problem]]:
        log.error("health: NVML events unavailable, device health is unknown: %s", reason)
        self._registration_problems.update(self._gpus)
        self._unwatched.update(dict.fromkeys(self._gpus, reason))
        return [(Target(uuid), unmonitored(reason, now)) for uuid in self._gpus]

    def _stop_nvml(self, event_set: EventSetHandle | None) -> None:
        if event_set is None:
            return
        try:
            self._nvml.event_set_free(event_set)
            self._nvml.shutdown()
        except NVMLError as error:
            log.warning("health: NVML shutdown: %s", _nvml_reason("nvmlEventSetFree", error))

    async def _watch_events(self, event_set: EventSetHandle) -> None:
        delay = self._timing.backoff_initial_s
        while not self._stopping.is_set():
            try:
                event, uuid = await asyncio.to_thread(self._wait, event_set)
            except NVMLError as error:
                code = return_code(error)
                if code == NVML_ERROR_TIMEOUT:
                    self._wait_worked()
                    delay = self._timing.backoff_initial_s
                    continue
                if code == NVML_ERROR_GPU_IS_LOST:
                    await self._find_lost("nvmlEventSetWait answered GPU_IS_LOST")
                else:
                    self._wait_failed(_nvml_reason("nvmlEventSetWait", error))
                await self._pause(delay)
                delay = min(delay * 2, self._timing.backoff_max_s)
                continue
            except Exception as error:  # a bug: keep watching, but say so
                log.exception("health: waiting for NVML events failed")
                self._wait_failed(f"nvmlEventSetWait: {type(error).__name__}")
                await self._pause(delay)
                delay = min(delay * 2, self._timing.backoff_max_s)
                continue
            self._wait_worked()
            delay = self._timing.backoff_initial_s
            await self._on_event(event, uuid)

    def _wait(self, event_set: EventSetHandle) -> tuple[EventData, str | Exception]:
        """One wait, and the UUID of the event's GPU (or why it could not be read)."""
        event = self._nvml.event_set_wait(event_set, self._timing.wait_timeout_ms)
        try:
            return event, self._nvml.device_get_uuid(event.device)
        except NVMLError as error:
            return event, error

    async def _on_event(self, event: EventData, uuid: str | Exception) -> None:
        now = self._clock()
        found = classify_event(event.eventType, event.eventData, self._policy, now)
        if self._observe_event is not None:
            gpu = None if isinstance(uuid, Exception) else uuid
            self._observe_event(gpu, event.eventType, event.eventData, found)
        what = f"event type 0x{event.eventType:x} data {event.eventData}"
        if found is None:
            log.info("health: ignored NVML %s (gpu=%s)", what, uuid)
            return
        if isinstance(uuid, Exception):
            log.error(
                "health: NVML %s for a GPU whose UUID cannot be read (%s); probing the GPUs",
                what,
                _nvml_reason("nvmlDeviceGetUUID", uuid),
            )
            await self._find_lost(f"its UUID could not be read after NVML {what}")
            return
        if uuid not in self._gpus:
            log.warning("health: NVML %s for GPU %s, which is not published", what, uuid)
            return
        if found is RECOVERY:
            log.info("health: GPU %s recovered", uuid)
            self._set_state(self._state.recovered(uuid))
            return
        assert not isinstance(found, Recovery)
        mig = (event.gpuInstanceId, event.computeInstanceId)
        target = Target(uuid)
        if NVML_NO_INSTANCE_ID not in mig and found.severity is not Severity.LOST:
            target = Target(uuid, mig)
        log.warning(
            "health: GPU %s%s: %s",
            uuid,
            "" if target.mig is None else f" GPU instance {mig[0]} compute instance {mig[1]}",
            found.message,
        )
        self._set_state(self._state.with_problem(target, found))

    async def _find_lost(self, why: str) -> None:
        """Probe every watched GPU; those answering GPU_IS_LOST are lost."""
        lost = await asyncio.to_thread(self._probe_lost)
        if not lost:
            log.error("health: %s, but every GPU still answers", why)
            return
        now = self._clock()
        state = self._state
        for uuid, call in lost.items():
            log.error("health: GPU %s is lost (%s answered GPU_IS_LOST)", uuid, call)
            state = state.with_problem(Target(uuid), gpu_lost(f"{call} answered GPU_IS_LOST", now))
        self._set_state(state)

    def _probe_lost(self) -> dict[str, str]:
        lost = {}
        for uuid in self._gpus:
            call = "nvmlDeviceGetHandleByUUID"
            try:
                handle = self._nvml.device_get_handle_by_uuid(uuid)
                call = "nvmlDeviceGetMemoryInfo"
                self._nvml.device_get_memory_info(handle)
            except NVMLError as error:
                if return_code(error) == NVML_ERROR_GPU_IS_LOST:
                    lost[uuid] = call
        return lost

    def _wait_worked(self) -> None:
        self._beat("nvml")
        if self._wait_failures >= WAIT_FAILURES_BEFORE_UNMONITORED:
            log.info("health: NVML event waits work again")
            state = self._state
            for uuid in self._gpus:
                if uuid not in self._registration_problems:
                    state = state.without(uuid, {KEY_UNMONITORED}, mig=False)
            self._set_state(state)
        self._wait_failures = 0

    def _wait_failed(self, reason: str) -> None:
        self._wait_failures += 1
        log.error("health: waiting for NVML events failed (%d in a row): %s",
                  self._wait_failures, reason)  # fmt: skip
        if self._wait_failures == WAIT_FAILURES_BEFORE_UNMONITORED:
            now = self._clock()
            state = self._state
            for uuid in self._gpus:
                if uuid not in self._registration_problems:  # keep the reason they have
                    state = state.with_problem(Target(uuid), unmonitored(reason, now))
            self._set_state(state)

    # ---- MPS ----------------------------------------------------------------------------------
    async def _watch_mps(self, mps: MpsWatch) -> None:
        """Take the share daemons' verdicts at once, then after every `MpsWatch.pause`."""
        while not self._stopping.is_set():
            if await mps.check():
                self._beat("mps")
                self._set_state(mps.applied_to(self._state, self._clock()))
            await mps.pause(self._stopping, self._timing.mps_interval_s)

    async def _watch_ecc(self) -> None:
        """Read the ECC counters at once and every ``ecc_interval_s`` (`ecc.EccWatch`)."""
        while not self._stopping.is_set():
            try:
                found = await asyncio.to_thread(self._ecc.poll, self._clock())
            except Exception:
                log.exception("health: reading the ECC counters failed")
            else:
                state = self._state
                for target, problem in found:
                    state = state.with_problem(target, problem)
                self._set_state(state)
            await self._pause(self._timing.ecc_interval_s)

    # ---- the record ---------------------------------------------------------------------------
    async def _watch_clears(self) -> None:
        while not self._stopping.is_set():
            await self._pause(self._timing.clear_poll_s)
            try:
                await self._apply_clear()
            except Exception:
                log.exception("health: applying a clear request failed")

    async def _apply_clear(self) -> None:
        """Apply the operator's clear request, if one waits: the GPUs' recorded problems go
        (the record is written), then the request."""
        assert self._record is not None
        request = await asyncio.to_thread(self._record.pending_clear)
        if request is None:
            return
        state = self._state
        for uuid in sorted(self._gpus):
            if request.covers(uuid) and persisted(state.recovered(uuid)) != persisted(state):
                log.warning("health: GPU %s recorded problems cleared by the operator", uuid)
                state = state.recovered(uuid)
        absent = self._absent
        for uuid in sorted({t.gpu_uuid for t in absent.problems}):
            if request.covers(uuid):
                log.warning("health: GPU %s (not on the node) recorded problems cleared", uuid)
                absent = absent.recovered(uuid)
        self._absent = absent
        self._set_state(state, force_save=True)
        await asyncio.to_thread(self._record.done_clearing)

    def _save(self, state: HealthState) -> None:
        """Write the record when NVML's problems changed (in the event loop: a small file, and
        the order of changes is kept). A failed write is logged; the next change retries."""
        if self._record is None:
            return
        try:
            self._record.save(state, also=self._absent)
        except OSError as error:
            log.error("health: the record %s could not be written: %s (a restarted plugin "
                      "would not know the latest problems)", self._record.path, error)  # fmt: skip

    # ---- state --------------------------------------------------------------------------------
    def _beat(self, worker: str) -> None:
        self._beats[worker] = time.monotonic()

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def _set_state(self, state: HealthState, *, force_save: bool = False) -> None:
        if state is self._state and not force_save:
            return
        self._state = state
        self._save(state)
        snapshot = device_health(state, self._scopes)
        if snapshot == self._snapshot:
            return
        self._snapshot = snapshot
        self._notify()

    def _notify(self) -> None:
        self._version += 1
        self._changed.set()
        for listener in self._listeners:
            try:
                listener(self._snapshot)
            except Exception:
                log.exception("health: a listener failed")
