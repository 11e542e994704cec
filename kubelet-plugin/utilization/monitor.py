"""The sampling loop: every ``--utilization-interval`` seconds one `Sample` of the claims'
devices, in a thread of its own; the newest sample and each claim device's last activity are
kept for the metrics (`utilization.metrics`), and each claim device's peaks
(`utilization.peaks`, for right-sizing).

Cost is bounded: one sample at a time, never two overlapping; a sample that takes longer than
the interval delays the next. A claim device is active in a sample when its SM activity (GPU
utilization; an MPS share's processes' SM utilization; a MIG device's GPM SM utilization) is at
least the idle threshold (``--utilization-idle-threshold``), or its memory used changed by more
than `MEMORY_CHANGE_BYTES` or its set of processes changed since the previous sample. Without
SM activity (MIG devices of pre-Hopper GPUs, a failed call) a device with a process on it
counts as active, and a device of which nothing could be read too: unknown is not idle. Errors
are logged when they start (and when they change), counted in every sample. See
docs/metrics.md#idle-claims.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice
from gpu_dra.kubelet_plugin.utilization.peaks import Peak, PeakTracker
from gpu_dra.kubelet_plugin.utilization.sampler import (
    DeviceReading,
    ProcessReading,
    Sample,
    SampleError,
    UtilizationSampler,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimReading:
    """What one claim's device did in a sample; None: not known (not reported, or failed)."""

    gpu_percent: float | None
    memory_percent: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    processes: int | None
    pids: frozenset[int] | None = None
    """The processes' ids (for an MPS share, those of its pods)."""


def claim_reading(device: ClaimDevice, reading: DeviceReading | None) -> ClaimReading:
    """The claim's part of its device's reading: the whole device, or for an MPS share the
    processes of the claim's pods (memory they use, the sum of their SM utilization)."""
    if reading is None:
        return ClaimReading(None, None, None, None, None)
    if device.tier != "mps-share":
        processes = None if reading.processes is None else len(reading.processes)
        pids = None if reading.processes is None else frozenset(p.pid for p in reading.processes)
        gpu_percent = reading.gpu_percent if reading.gpu_percent is not None else reading.sm_percent
        return ClaimReading(
            None if gpu_percent is None else float(gpu_percent),
            None if reading.memory_percent is None else float(reading.memory_percent),
            reading.memory_used_bytes,
            reading.memory_total_bytes,
            processes,
            pids,
        )
    if reading.processes is None or not device.pods:
        return ClaimReading(None, None, None, device.share_memory_bytes, None)
    pod_uids = {pod.uid for pod in device.pods}
    mine = [p for p in reading.processes if p.pod_uid in pod_uids]
    return ClaimReading(
        _sum([p.sm_percent for p in mine]),
        None,
        _sum_int([p.used_memory_bytes for p in mine]),
        device.share_memory_bytes,
        len(mine),
        frozenset(p.pid for p in mine),
    )


def _claim_readings(sample: Sample) -> list[tuple[tuple[str, str], ClaimReading]]:
    return [(d.key, claim_reading(d, sample.readings.get(d.uuid or ""))) for d in sample.devices]


def _sum(values: Sequence[float | None]) -> float | None:
    if any(value is None for value in values):
        return None
    return float(sum(value for value in values if value is not None))


def _sum_int(values: Sequence[int | None]) -> int | None:
    if any(value is None for value in values):
        return None
    return sum(value for value in values if value is not None)


MEMORY_CHANGE_BYTES: Final = 32 * 2**20
"""A change of a device's memory used by more than this between two samples is activity: an
idle process holding a context keeps its memory; a job loading data or growing does not."""


class ActivityTracker:
    """When each claim device was last active (or first sampled, while never active)."""

    def __init__(self, idle_threshold_percent: float) -> None:
        self.threshold = idle_threshold_percent
        self._first: dict[tuple[str, str], float] = {}
        self._active: dict[tuple[str, str], float] = {}
        self._previous: dict[tuple[str, str], ClaimReading] = {}

    def observe(self, sample: Sample) -> None:
        keys = set()
        for device in sample.devices:
            keys.add(device.key)
            self._first.setdefault(device.key, sample.at)
            reading = claim_reading(device, sample.readings.get(device.uuid or ""))
            if self.is_active(reading, self._previous.get(device.key)):
                self._active[device.key] = sample.at
            self._previous[device.key] = reading
        for gone in set(self._first) - keys:
            self._first.pop(gone, None)
            self._active.pop(gone, None)
            self._previous.pop(gone, None)

    def is_active(self, reading: ClaimReading, previous: ClaimReading | None = None) -> bool:
        """SM activity at the threshold, or memory or processes changed since `previous`;
        without SM activity, any process; nothing known: active (unknown is not idle)."""
        if _changed(reading, previous):
            return True
        if reading.gpu_percent is not None:
            return reading.gpu_percent >= self.threshold
        if reading.processes is None and reading.memory_used_bytes is None:
            return True
        return reading.processes is None or reading.processes > 0

    def last_active(self, key: tuple[str, str]) -> float | None:
        """The last sample the device was active in, else its first sample; None: unsampled."""
        return self._active.get(key, self._first.get(key))


def _changed(reading: ClaimReading, previous: ClaimReading | None) -> bool:
    if previous is None:
        return False
    now, before = reading.memory_used_bytes, previous.memory_used_bytes
    if now is not None and before is not None and abs(now - before) > MEMORY_CHANGE_BYTES:
        return True
    return reading.pids is not None and previous.pids is not None and reading.pids != previous.pids


class UtilizationMonitor:
    """Samples in a thread every `interval_s`; `latest` is the newest sample."""

    def __init__(
        self,
        sampler: UtilizationSampler,
        devices: Callable[[], list[ClaimDevice]],
        *,
        interval_s: float,
        idle_threshold_percent: float,
        before_sample: Callable[[], None] | None = None,
        on_sample: Callable[[Sample], None] | None = None,
    ) -> None:
        """`devices`: the claim devices now; `before_sample`: runs first in every round (the
        simulated node's utilization file); `on_sample` gets every sample (the metrics)."""
        self._sampler = sampler
        self._devices = devices
        self.interval_s = interval_s
        self.activity = ActivityTracker(idle_threshold_percent)
        self.peaks = PeakTracker()
        self._before = before_sample
        self._on_sample = on_sample
        self._lock = threading.Lock()
        self._latest: Sample | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported: set[tuple[str, str, str]] = set()

    @property
    def latest(self) -> Sample | None:
        with self._lock:
            return self._latest

    def last_active(self, key: tuple[str, str]) -> float | None:
        with self._lock:
            return self.activity.last_active(key)

    def peak(self, key: tuple[str, str]) -> Peak | None:
        with self._lock:
            return self.peaks.peak(key)

    def sample_once(self) -> Sample:
        """One round: the hook, a sample, activity, logs; blocking."""
        if self._before is not None:
            self._before()
        sample = self._sampler.sample(self._devices())
        with self._lock:
            self._latest = sample
            self.activity.observe(sample)
            self.peaks.observe(sample.at, _claim_readings(sample))
        self._log_errors(sample.errors)
        if self._on_sample is not None:
            self._on_sample(sample)
        return sample

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="utilization", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop sampling and release NVML (after the thread ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return  # a sample hangs in NVML: leave it to the process's exit
        self._sampler.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # a bug must not end sampling for good
                log.exception("utilization sample failed")
            self._stop.wait(self.interval_s)

    def _log_errors(self, errors: Sequence[SampleError]) -> None:
        now = {(e.device, e.call, e.reason) for e in errors}
        for error in errors:
            if (error.device, error.call, error.reason) not in self._reported:
                log.warning(
                    "utilization of %s: %s failed: %s %s",
                    error.device, error.call, error.reason, error.detail,
                )  # fmt: skip
        for device, call, reason in self._reported - now:
            log.info("utilization of %s: %s works again (was %s)", device, call, reason)
        self._reported = now


__all__ = ["ClaimReading", "ProcessReading", "UtilizationMonitor", "claim_reading"]
