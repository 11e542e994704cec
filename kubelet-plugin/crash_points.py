"""Test-only fault injection: the named points at which a plugin can be made to die (SIGKILL).

Prepare, unprepare, recovery and instance registration call `reached(name)` at each step of every
tier (the names are `POINTS`); it does nothing unless a test armed a point. The composition root
arms the point named by ``GPU_DRA_TEST_CRASH_AT`` (`arm_from_env`), on simulated nodes only: the
process kills itself with SIGKILL when it first gets there. The crash harness
(`tests/crash_harness/`) drives every point. See docs/architecture.md, "Crash safety" and
docs/development.md.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import Final

log = logging.getLogger(__name__)

CrashPoint = Callable[[str], None]
"""Called with the name of each fault injection point reached; may end the process."""

TEST_CRASH_ENV: Final = "GPU_DRA_TEST_CRASH_AT"
"""Environment variable naming the fault injection point at which the plugin kills itself
(SIGKILL); honoured only on simulated nodes. Tests only."""

# prepare (prepare.py): the records and files around the tiers' work
PREPARE_AFTER_STARTED: Final = "prepare-after-started"
PREPARE_AFTER_CLAIM_FILES: Final = "prepare-after-claim-files"
CDI_BEFORE_RENAME: Final = "cdi-before-rename"
PREPARE_AFTER_CDI_SPEC: Final = "prepare-after-cdi-spec"
PREPARE_AFTER_COMPLETED: Final = "prepare-after-completed"
CHECKPOINT_BEFORE_RENAME: Final = "checkpoint-before-rename"
# time-slicing
TIMESLICE_AFTER_SET: Final = "timeslice-after-set"
TIMESLICE_AFTER_RESET: Final = "timeslice-after-reset"
# per-claim MPS (whole GPUs and MIG devices) and MPS shares
MPS_AFTER_LAUNCH: Final = "mps-after-launch"
MPS_AFTER_DAEMON_START: Final = "mps-after-daemon-start"
MPS_MIG_AFTER_DAEMON_START: Final = "mps-mig-after-daemon-start"
MPS_AFTER_DAEMON_STOP: Final = "mps-after-daemon-stop"
MPS_SHARE_AFTER_JOIN: Final = "mps-share-after-join"
MPS_SHARE_AFTER_LEAVE: Final = "mps-share-after-leave"
MPS_RECORD_BEFORE_RENAME: Final = "mps-record-before-rename"
# dynamic MIG
MIG_AFTER_MODE_ON: Final = "mig-after-mode-on"
CRASH_AFTER_GPU_INSTANCE: Final = "mig-after-gpu-instance"
MIG_AFTER_COMPUTE_INSTANCE: Final = "mig-after-compute-instance"
MIG_AFTER_RECORD: Final = "mig-after-record"
MIG_AFTER_COMPUTE_INSTANCE_DESTROYED: Final = "mig-after-compute-instance-destroyed"
MIG_AFTER_GPU_INSTANCE_DESTROYED: Final = "mig-after-gpu-instance-destroyed"
# unprepare (prepare.py `_undo`)
UNPREPARE_AFTER_STARTED: Final = "unprepare-after-started"
UNPREPARE_AFTER_CDI_REMOVED: Final = "unprepare-after-cdi-removed"
UNPREPARE_AFTER_CLAIM_FILES_REMOVED: Final = "unprepare-after-claim-files-removed"
UNPREPARE_BEFORE_RECORD_REMOVED: Final = "unprepare-before-record-removed"
# start-up recovery
RECOVERY_AFTER_UNDO: Final = "recovery-after-undo"
# plugin instance registration (plugin_instances.py), at every start
INSTANCE_BEFORE_LOCK_RENAME: Final = "instance-before-lock-rename"
INSTANCE_INFO_BEFORE_RENAME: Final = "instance-info-before-rename"
# the health record (device_health/record.py)
HEALTH_RECORD_BEFORE_RENAME: Final = "health-record-before-rename"

POINTS: Final = frozenset(
    {
        PREPARE_AFTER_STARTED,
        PREPARE_AFTER_CLAIM_FILES,
        CDI_BEFORE_RENAME,
        PREPARE_AFTER_CDI_SPEC,
        PREPARE_AFTER_COMPLETED,
        CHECKPOINT_BEFORE_RENAME,
        TIMESLICE_AFTER_SET,
        TIMESLICE_AFTER_RESET,
        MPS_AFTER_LAUNCH,
        MPS_AFTER_DAEMON_START,
        MPS_MIG_AFTER_DAEMON_START,
        MPS_AFTER_DAEMON_STOP,
        MPS_SHARE_AFTER_JOIN,
        MPS_SHARE_AFTER_LEAVE,
        MPS_RECORD_BEFORE_RENAME,
        MIG_AFTER_MODE_ON,
        CRASH_AFTER_GPU_INSTANCE,
        MIG_AFTER_COMPUTE_INSTANCE,
        MIG_AFTER_RECORD,
        MIG_AFTER_COMPUTE_INSTANCE_DESTROYED,
        MIG_AFTER_GPU_INSTANCE_DESTROYED,
        UNPREPARE_AFTER_STARTED,
        UNPREPARE_AFTER_CDI_REMOVED,
        UNPREPARE_AFTER_CLAIM_FILES_REMOVED,
        UNPREPARE_BEFORE_RECORD_REMOVED,
        RECOVERY_AFTER_UNDO,
        INSTANCE_BEFORE_LOCK_RENAME,
        INSTANCE_INFO_BEFORE_RENAME,
        HEALTH_RECORD_BEFORE_RENAME,
    }
)
"""Every fault injection point the plugin's code reaches."""

_armed: list[CrashPoint] = []
"""The armed `CrashPoint` of this process, if any."""


def reached(point: str) -> None:
    """The hook: the plugin got to ``point`` (one of `POINTS`). Does nothing unless armed."""
    for crash in _armed:
        crash(point)


def arm(crash: CrashPoint | None) -> None:
    """Make `reached` call ``crash`` (None: nothing) in this process from now on."""
    _armed[:] = [] if crash is None else [crash]


def arm_from_env(env: Mapping[str, str], *, simulated: bool) -> None:
    """Arm the point `TEST_CRASH_ENV` names, if any (`crash_point_from_env`)."""
    arm(crash_point_from_env(env, simulated=simulated))


def kill_self(point: str) -> None:
    """SIGKILL this process at ``point``, its log flushed first."""
    log.critical("TEST FAULT INJECTION %s=%s: killing the plugin now", TEST_CRASH_ENV, point)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def crash_point_from_env(env: Mapping[str, str], *, simulated: bool) -> CrashPoint | None:
    """The `CrashPoint` that `TEST_CRASH_ENV` asks for: SIGKILL of this process when that point
    is reached. None when unset, or on real GPUs (logged: a test setting never crashes a
    production plugin); `ValueError` for a name that is not in `POINTS`."""
    wanted = env.get(TEST_CRASH_ENV, "")
    if not wanted:
        return None
    if not simulated:
        log.warning(
            "%s=%s ignored: fault injection works on simulated nodes only", TEST_CRASH_ENV, wanted
        )
        return None
    if wanted not in POINTS:
        raise ValueError(
            f"{TEST_CRASH_ENV}={wanted!r} names no fault injection point (known: "
            f"{', '.join(sorted(POINTS))})"
        )
    log.warning("TEST FAULT INJECTION: the plugin kills itself at %s", wanted)

    def crash(point: str) -> None:
        if point == wanted:
            kill_self(point)

    return crash
