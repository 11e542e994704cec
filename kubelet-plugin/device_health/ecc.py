"""ECC error counters of the node's GPUs, read from NVML where it offers them.

NVML's events tell of a double-bit ECC error as it happens; its counters
(``nvmlDeviceGetTotalEccErrors``, volatile: since the driver loaded or the GPU was last reset)
also tell of what happened while no plugin watched, and of corrected single-bit errors, which
send no critical event. `EccWatch.poll` reads both counts of every GPU: an uncorrected count
above zero is a double-bit ECC problem (the GPU needs a reset), a growing corrected count is
logged (a rising single-bit rate precedes failures; NVIDIA reports a high rate as XID 92). A
GPU whose counters NVML does not offer (no ECC, ECC off, an older driver) is logged once and
not read again. Blocking: call it from a worker thread. See docs/architecture.md, "Health
monitor".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Final

from gpu_dra.driver.health import KEY_ECC, Problem, Severity, Target
from gpu_dra.driver.nvml.interface import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_MEMORY_ERROR_TYPE_CORRECTED,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_VOLATILE_ECC,
    NVMLError,
    NvmlLibrary,
    return_code,
    return_code_name,
)

log = logging.getLogger(__name__)

NOT_OFFERED: Final = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND})


class EccWatch:
    """The ECC counters of ``gpus`` (UUIDs), compared from one poll to the next."""

    def __init__(self, nvml: NvmlLibrary, gpus: Sequence[str]) -> None:
        self._nvml = nvml
        self._gpus = tuple(gpus)
        self._not_offered: set[str] = set()
        self._counts: dict[str, tuple[int, int]] = {}

    @property
    def counts(self) -> dict[str, tuple[int, int]]:
        """GPU UUID -> (corrected, uncorrected) volatile counts at the last poll."""
        return dict(self._counts)

    def poll(self, now: datetime) -> list[tuple[Target, Problem]]:
        """Read every GPU's counters; the problems they show (uncorrected errors counted)."""
        problems = []
        for uuid in self._gpus:
            if uuid in self._not_offered:
                continue
            counts = self._read(uuid)
            if counts is None:
                continue
            corrected, uncorrected = counts
            before = self._counts.get(uuid)
            self._counts[uuid] = counts
            if before is not None and corrected > before[0]:
                log.warning(
                    "health: GPU %s counted %d more corrected (single-bit) ECC errors, %d since "
                    "its last reset",
                    uuid,
                    corrected - before[0],
                    corrected,
                )
            if uncorrected > 0:
                message = (
                    f"{uncorrected} uncorrected (double-bit) ECC error(s) counted by NVML since "
                    "the GPU's last reset"
                )
                problem = Problem(KEY_ECC, "double-bit", Severity.DEGRADED, message, now)
                problems.append((Target(uuid), problem))
        return problems

    def _read(self, uuid: str) -> tuple[int, int] | None:
        call = "nvmlDeviceGetHandleByUUID"
        try:
            handle = self._nvml.device_get_handle_by_uuid(uuid)
            call = "nvmlDeviceGetTotalEccErrors"
            corrected = self._nvml.device_get_total_ecc_errors(
                handle, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC
            )
            uncorrected = self._nvml.device_get_total_ecc_errors(
                handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC
            )
        except NVMLError as error:
            code = return_code(error)
            name = return_code_name(code) if code is not None else type(error).__name__
            if code in NOT_OFFERED:
                self._not_offered.add(uuid)
                log.info("health: GPU %s ECC counters not watched: %s answered %s",
                         uuid, call, name)  # fmt: skip
            elif code != NVML_ERROR_GPU_IS_LOST:  # a lost GPU is the event watcher's
                log.error("health: GPU %s ECC counters not read: %s answered %s",
                          uuid, call, name)  # fmt: skip
            return None
        return corrected, uncorrected
