"""What the health monitor takes besides NVML: its timing, and the MPS liveness it reads.

`MonitorTiming` sets the waits and back-offs of `monitor.HealthMonitor`; `MpsLiveness` is the
seam through which it reads the MPS daemon supervisor's verdicts (`mps.supervisor`). See
docs/architecture.md, "Health monitor".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class MpsLiveness(Protocol):
    """Which GPUs offered as MPS shares have a shared daemon that prepared claims record but
    that is not running (`mps.supervisor.DaemonSupervisor`, which probes the daemons; this only
    reads its verdicts). Blocking (called in a worker thread)."""

    def dead_shared_daemons(self) -> dict[str, str]:
        """GPU UUID -> why its shared daemon is judged dead."""
        ...


@dataclass(frozen=True)
class MonitorTiming:
    wait_timeout_ms: int = 1000
    """One ``event_set_wait``; also how long `HealthMonitor.stop` may take."""
    mps_interval_s: float = 10.0
    """Between two MPS daemon checks."""
    backoff_initial_s: float = 1.0
    """After a failed wait; doubled per further failure."""
    ecc_interval_s: float = 60.0
    """Between two reads of the GPUs' ECC error counters."""
    backoff_max_s: float = 30.0
    clear_poll_s: float = 2.0
    """Between two looks for the operator's clear request (with a health record)."""
