"""Test-only fault injection of dynamic MIG: the points where a plugin can be made to die.

`CRASH_AFTER_GPU_INSTANCE` is reached after a GPU instance exists and before its compute instance
does. The composition root passes `crash_point_from_env` (``GPU_DRA_TEST_CRASH_AT``) to
`MigLifecycle`: SIGKILL of the plugin at that point, on simulated nodes only, so e2e tests can
prove the rollback from the checkpoint. See docs/mig.md, "Dynamic MIG: lifecycle".
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import Final

log = logging.getLogger(__name__)

CRASH_AFTER_GPU_INSTANCE: Final = "mig-after-gpu-instance"
"""Fault injection point (tests only): after the GPU instance exists, before its compute
instance does."""

CrashPoint = Callable[[str], None]
"""Called with the name of each fault injection point reached; may end the process."""

TEST_CRASH_ENV: Final = "GPU_DRA_TEST_CRASH_AT"
"""Environment variable naming the fault injection point at which the plugin kills itself
(SIGKILL); honoured only on simulated nodes. Tests only."""


def crash_point_from_env(env: Mapping[str, str], *, simulated: bool) -> CrashPoint | None:
    """The `CrashPoint` that `TEST_CRASH_ENV` asks for: SIGKILL of this process when that point
    is reached. None when unset, or on real GPUs (logged: a test setting never crashes a
    production plugin)."""
    wanted = env.get(TEST_CRASH_ENV, "")
    if not wanted:
        return None
    if not simulated:
        log.warning(
            "%s=%s ignored: fault injection works on simulated nodes only", TEST_CRASH_ENV, wanted
        )
        return None
    if wanted != CRASH_AFTER_GPU_INSTANCE:
        raise ValueError(
            f"{TEST_CRASH_ENV}={wanted!r} names no fault injection point (known: "
            f"{CRASH_AFTER_GPU_INSTANCE})"
        )
    log.warning("TEST FAULT INJECTION: the plugin kills itself at %s", wanted)

    def crash(point: str) -> None:
        if point != wanted:
            return
        log.critical("TEST FAULT INJECTION %s=%s: killing the plugin now", TEST_CRASH_ENV, point)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    return crash
