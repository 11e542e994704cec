"""The compute mode of an MPS daemon's full GPUs, for `MpsDaemonManager`: ``EXCLUSIVE_PROCESS``
while the daemon runs (for the daemon ids its ``exclusive`` accepts), recorded in
``<root>/compute-mode`` before NVML sets it, set again where it was lost, and ``DEFAULT`` again
when the daemon goes. See docs/mps.md#compute-mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final

from gpu_dra.kubelet_plugin.mps.computemode import (
    DEFAULT,
    EXCLUSIVE_PROCESS,
    ComputeModeControl,
    ComputeModeError,
    is_full_gpu,
    mode_name,
)
from gpu_dra.kubelet_plugin.mps.daemon_model import DaemonPaths, MpsStopError

# The manager's logger: these are its steps.
log = logging.getLogger("gpu_dra.kubelet_plugin.mps.daemon")

COMPUTE_MODE_RECORD: Final = "compute-mode"
"""``<root>/compute-mode``: the full GPUs set to EXCLUSIVE_PROCESS for this daemon, one a line."""


class DaemonComputeMode:
    """The compute-mode steps of `MpsDaemonManager`, which sets these attributes."""

    compute_mode: ComputeModeControl | None
    exclusive: Callable[[str], bool]

    def _set_exclusive(self, paths: DaemonPaths, uuids: Sequence[str]) -> None:
        """EXCLUSIVE_PROCESS on the full GPUs of ``uuids``, each recorded before it is set (a
        GPU NVML refuses is unchanged and dropped from the record again)."""
        gpus = [uuid for uuid in uuids if is_full_gpu(uuid)]
        if self.compute_mode is None or not gpus or not self.exclusive(paths.root.name):
            return
        record = paths.root / COMPUTE_MODE_RECORD
        done: list[str] = []
        for uuid in gpus:
            record.write_text("".join(f"{u}\n" for u in [*done, uuid]))  # before NVML runs
            try:
                self.compute_mode.set_mode(uuid, EXCLUSIVE_PROCESS)
            except ComputeModeError:
                record.write_text("".join(f"{u}\n" for u in done))  # refused: unchanged
                raise
            done.append(uuid)
        log.info("mps compute mode EXCLUSIVE_PROCESS set daemon_id=%s gpus=%s",
                 paths.root.name, ",".join(gpus))  # fmt: skip

    @staticmethod
    def _exclusive_gpus(paths: DaemonPaths) -> list[str]:
        """The GPUs ``<root>/compute-mode`` records as set EXCLUSIVE_PROCESS for the daemon."""
        try:
            return (paths.root / COMPUTE_MODE_RECORD).read_text().split()
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _restore_exclusive(self, paths: DaemonPaths) -> list[str]:
        """EXCLUSIVE_PROCESS again on the GPUs ``<root>/compute-mode`` records that lost it (a
        GPU reset, an administrator, a process allowed to change it); what was found."""
        if self.compute_mode is None:
            return []
        try:
            recorded = (paths.root / COMPUTE_MODE_RECORD).read_text().split()
        except (FileNotFoundError, NotADirectoryError):
            return []
        changed = []
        for uuid in recorded:
            mode = self.compute_mode.get_mode(uuid)
            if mode != EXCLUSIVE_PROCESS:
                log.warning("mps compute mode of %s is %s, setting EXCLUSIVE_PROCESS again",
                            uuid, mode_name(mode))  # fmt: skip
                self.compute_mode.set_mode(uuid, EXCLUSIVE_PROCESS)
                changed.append(f"compute mode of {uuid} {mode_name(mode)}, not EXCLUSIVE_PROCESS")
        return changed

    def _reset_compute_mode(self, paths: DaemonPaths) -> None:
        """DEFAULT on the GPUs ``<root>/compute-mode`` records (every one is tried)."""
        try:
            recorded = (paths.root / COMPUTE_MODE_RECORD).read_text().split()
        except (FileNotFoundError, NotADirectoryError):
            return
        if self.compute_mode is None:
            raise MpsStopError(
                f"{paths.root} recorded EXCLUSIVE_PROCESS on {', '.join(recorded)} but this "
                "plugin has no compute-mode control to reset it (--mps-exclusive-compute-mode)"
            )
        failures: list[str] = []
        for uuid in recorded:
            try:
                self.compute_mode.set_mode(uuid, DEFAULT)
            except ComputeModeError as error:
                if error.not_supported:
                    log.info("compute mode reset of %s not supported: %s", uuid, error)
                    continue
                failures.append(str(error))
        if failures:
            raise MpsStopError("; ".join(failures))
        (paths.root / COMPUTE_MODE_RECORD).unlink()
