"""The peaks of each claim device since the plugin first sampled it, kept in the plugin's memory
for right-sizing (`gpu-dra rightsize`, docs/metrics.md#right-sizing): the most device memory
used, the highest GPU utilization and the most compute processes in any sample, and when the
first sample was (the claim's prepare or the plugin's start, whichever came later: a restart
starts over). A value never read in any sample stays None (MIG devices without GPM have no
utilization);
a device no longer sampled is forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from gpu_dra.kubelet_plugin.utilization.monitor import ClaimReading

_N = TypeVar("_N", int, float)


@dataclass(frozen=True)
class Peak:
    """One claim device's peaks over the samples since `since`."""

    since: float
    """Wall-clock time of the device's first sample (seconds since the epoch)."""
    samples: int
    memory_used_bytes: int | None = None
    gpu_percent: float | None = None
    processes: int | None = None


class PeakTracker:
    """Peaks per claim device key (claim UID, device name), fed with every sample's readings."""

    def __init__(self) -> None:
        self._peaks: dict[tuple[str, str], Peak] = {}

    def observe(self, at: float, readings: Iterable[tuple[tuple[str, str], ClaimReading]]) -> None:
        """One sample taken at `at`: each device's key and reading; keys not in it are dropped."""
        peaks = {}
        for key, reading in readings:
            kept = self._peaks.get(key) or Peak(since=at, samples=0)
            peaks[key] = Peak(
                since=kept.since,
                samples=kept.samples + 1,
                memory_used_bytes=_most(kept.memory_used_bytes, reading.memory_used_bytes),
                gpu_percent=_most(kept.gpu_percent, reading.gpu_percent),
                processes=_most(kept.processes, reading.processes),
            )
        self._peaks = peaks

    def peak(self, key: tuple[str, str]) -> Peak | None:
        """The device's peaks; None: never sampled (or no longer held)."""
        return self._peaks.get(key)


def _most(kept: _N | None, new: _N | None) -> _N | None:
    if new is None:
        return kept
    return new if kept is None else max(kept, new)
