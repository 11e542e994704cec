"""Test-only fault injection for the outage e2e tests: a simulated reboot and a slow prepare.

`GPU_DRA_TEST_BOOT_ID` replaces the kernel's boot ID (`checkpoint.read_boot_id`), so a plugin
started with a new value takes its checkpoint for one of an earlier boot, as after a reboot.
`GPU_DRA_TEST_PREPARE_DELAY_S` holds every new prepare that long (in its worker thread) right after
`PrepareStarted` is recorded (or where it would be, for a claim that gets none), so a test can
restart the kubelet while a prepare is under way.
`GPU_DRA_TEST_NVML_FAULTS` (``<call>@<GPU index>=<NVML error>``, comma-separated) makes those
simulated NVML calls fail from the end of discovery on (`nvml_faults_from_env`). All are honoured
on simulated nodes only (`--simulate`; logged and ignored otherwise), like
``GPU_DRA_TEST_CRASH_AT`` (`mig.crash_points`). See docs/architecture.md, "Outages".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Final

from gpu_dra.driver.nvml.interface import return_code_by_name
from gpu_dra.kubelet_plugin.checkpoint import read_boot_id

log = logging.getLogger(__name__)

TEST_BOOT_ID_ENV: Final = "GPU_DRA_TEST_BOOT_ID"
"""Environment variable with the boot ID a simulated node's plugin uses instead of the kernel's.
Tests only."""

TEST_PREPARE_DELAY_ENV: Final = "GPU_DRA_TEST_PREPARE_DELAY_S"
"""Environment variable with the seconds (0 to 300) a simulated node's plugin holds each new
prepare after recording `PrepareStarted`. Tests only."""

MAX_PREPARE_DELAY_S: Final = 300.0


def boot_id_from_env(env: Mapping[str, str], *, simulated: bool) -> Callable[[], str]:
    """What the checkpoint takes for the node's boot ID: the kernel's, or on a simulated node
    the value of `TEST_BOOT_ID_ENV` when set (on real GPUs the setting is logged and ignored:
    a test setting never makes a production plugin forget its claims)."""
    wanted = env.get(TEST_BOOT_ID_ENV, "").strip()
    if not wanted:
        return read_boot_id
    if not simulated:
        log.warning(
            "%s=%s ignored: fault injection works on simulated nodes only", TEST_BOOT_ID_ENV, wanted
        )
        return read_boot_id
    log.warning("TEST FAULT INJECTION %s=%s: used instead of the kernel's boot ID",
                TEST_BOOT_ID_ENV, wanted)  # fmt: skip
    return lambda: wanted


def prepare_delay_from_env(env: Mapping[str, str], *, simulated: bool) -> float:
    """Seconds to hold each new prepare after `PrepareStarted`: 0 unless `TEST_PREPARE_DELAY_ENV`
    is set on a simulated node (logged and ignored on real GPUs). A value that is no number of
    seconds from 0 to `MAX_PREPARE_DELAY_S` is a `ValueError` (the plugin does not start)."""
    raw = env.get(TEST_PREPARE_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    if not simulated:
        log.warning(
            "%s=%s ignored: fault injection works on simulated nodes only",
            TEST_PREPARE_DELAY_ENV,
            raw,
        )
        return 0.0
    try:
        delay = float(raw)
    except ValueError:
        delay = math.nan
    if not 0.0 <= delay <= MAX_PREPARE_DELAY_S:  # NaN and infinities fail too
        raise ValueError(
            f"{TEST_PREPARE_DELAY_ENV}={raw!r} is not a number of seconds from 0 to "
            f"{MAX_PREPARE_DELAY_S:g}"
        )
    log.warning("TEST FAULT INJECTION %s=%s: each new prepare waits %g s after PrepareStarted",
                TEST_PREPARE_DELAY_ENV, raw, delay)  # fmt: skip
    return delay


TEST_NVML_FAULTS_ENV: Final = "GPU_DRA_TEST_NVML_FAULTS"
"""Environment variable naming simulated NVML calls that fail after discovery, e.g.
``device_get_gpu_instance_profile_info@5=NVML_ERROR_UNKNOWN``. Tests only."""


def nvml_faults_from_env(env: Mapping[str, str], *, simulated: bool) -> list[tuple[str, int, int]]:
    """(call, GPU index, NVML return code) of each fault `TEST_NVML_FAULTS_ENV` names, for a
    simulated node (logged and ignored on real GPUs); `ValueError` for an unreadable entry."""
    raw = env.get(TEST_NVML_FAULTS_ENV, "").strip()
    if not raw:
        return []
    if not simulated:
        log.warning(
            "%s=%s ignored: fault injection works on simulated nodes only",
            TEST_NVML_FAULTS_ENV,
            raw,
        )
        return []
    faults = []
    for entry in raw.split(","):
        call, _, rest = entry.strip().partition("@")
        index, _, code = rest.partition("=")
        try:
            faults.append((call, int(index), return_code_by_name(code)))
        except (ValueError, KeyError) as error:
            raise ValueError(
                f"{TEST_NVML_FAULTS_ENV}: {entry!r} is not <call>@<GPU index>=<NVML error>"
            ) from error
    log.warning("TEST FAULT INJECTION %s=%s: these simulated NVML calls fail after discovery",
                TEST_NVML_FAULTS_ENV, raw)  # fmt: skip
    return faults
