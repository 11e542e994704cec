"""What the MPS daemon manager takes and returns, its Protocol and its errors.

A daemon is started for a set of devices (full-GPU or MIG UUIDs) with `MpsSettings`; the
returned `DaemonHandle` is all that is needed to find, check and stop it later, also from a
restarted plugin: it goes into the checkpoint's per-claim ``state`` under
`tiers.state.MPS_STATE_KEY` (`tiers.state.handles_from_state`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Final, Protocol

from gpu_dra.driver.naming import InvalidNameError
from gpu_dra.kubelet_plugin.checkpoint import JsonObject, JsonValue
from gpu_dra.kubelet_plugin.mps.ids import checked_daemon_id, checked_device_uuid

STATE_VERSION: Final = 1
"""Version of one handle's serialized form; a reader refuses a newer one."""

PINNED_LIMIT: Final = re.compile(r"[1-9][0-9]*M")
"""A pinned-memory limit as the control commands take it: whole MiB (``render_pinned_limit``)."""


class MpsError(Exception):
    """An MPS daemon operation failed; the message names the daemon and what went wrong."""

    retryable: bool = True
    """Whether trying the same operation again later can succeed (the kubelet retries)."""


class MpsStartError(MpsError):
    """The daemon could not be started; everything started for it was removed again."""


class MpsStopError(MpsError):
    """The daemon or its directories could not be removed; stopping again may succeed."""


class MpsDaemonGoneError(MpsError):
    """The daemon recorded in a handle is not running (any more)."""

    retryable = False


class MpsStateError(MpsError):
    """A checkpoint entry does not hold a usable daemon handle."""

    retryable = False


class MpsCommandError(MpsError):
    """A control command failed, timed out or could not be run."""

    def __init__(self, command: str, pipe_dir: Path, reason: str) -> None:
        super().__init__(f"MPS control command {command!r} (pipe {pipe_dir}) failed: {reason}")
        self.command = command
        self.reason = reason


@dataclass(frozen=True)
class MpsSettings:
    """Daemon defaults, applied with ``set_default_*`` before any server spawns."""

    active_thread_percentage: int | None = None
    """``set_default_active_thread_percentage``; None leaves the daemon's 100."""
    pinned_limits: Mapping[str, str] = field(default_factory=dict)
    """``set_default_device_pinned_mem_limit`` per device UUID, ``"<N>M"`` (whole MiB)."""
    multi_user: bool = False
    """Start the daemon with ``-M``: one server for clients of every UID (no isolation between
    users; Volta+)."""

    def check(self, devices: Sequence[str]) -> None:
        """Raise `ValueError` naming the bad field; limits must be for ``devices``."""
        pct = self.active_thread_percentage
        if pct is not None and (isinstance(pct, bool) or not 0 <= pct <= 100):
            raise ValueError(f"active thread percentage must be 0..100, got {pct!r}")
        for uuid, limit in self.pinned_limits.items():
            if uuid not in devices:
                raise ValueError(f"pinned memory limit for {uuid}, which is not a daemon device")
            if not PINNED_LIMIT.fullmatch(limit):
                raise ValueError(f"pinned memory limit {limit!r} for {uuid} is not <MiB>M")

    def commands(self) -> list[str]:
        """The ``set_default_*`` commands, in the order they are issued."""
        result: list[str] = []
        if self.active_thread_percentage is not None:
            result.append(f"set_default_active_thread_percentage {self.active_thread_percentage}")
        result.extend(
            f"set_default_device_pinned_mem_limit {uuid} {limit}"
            for uuid, limit in sorted(self.pinned_limits.items())
        )
        return result

    def to_json(self) -> JsonObject:
        return {
            "activeThreadPercentage": self.active_thread_percentage,
            "pinnedLimits": dict(sorted(self.pinned_limits.items())),
            "multiUser": self.multi_user,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, JsonValue]) -> MpsSettings:
        pct = data.get("activeThreadPercentage")
        limits = data.get("pinnedLimits") or {}
        if (pct is not None and not isinstance(pct, int)) or not isinstance(limits, dict):
            raise TypeError("activeThreadPercentage or pinnedLimits has the wrong type")
        return cls(
            active_thread_percentage=pct,
            pinned_limits={str(k): str(v) for k, v in limits.items()},
            multi_user=bool(data.get("multiUser", False)),
        )


@dataclass(frozen=True)
class DaemonPaths:
    """``<data_dir>/mps/<id>/{pipe,log,shm}`` on the host."""

    root: Path

    @classmethod
    def of(cls, data_dir: Path, daemon_id: str) -> DaemonPaths:
        return cls(data_dir / "mps" / checked_daemon_id(daemon_id))

    @property
    def pipe(self) -> Path:
        """``CUDA_MPS_PIPE_DIRECTORY`` of the daemon; mounted at ``/tmp/nvidia-mps``."""
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        """``CUDA_MPS_LOG_DIRECTORY``: ``control.log``, ``server.log``."""
        return self.root / "log"

    @property
    def shm(self) -> Path:
        """The workloads' ``/dev/shm`` (a tmpfs in production)."""
        return self.root / "shm"


@dataclass(frozen=True)
class DaemonHandle:
    """A started daemon: what a restarted plugin needs to find, check and stop it."""

    daemon_id: str
    devices: tuple[str, ...]
    """UUIDs in ``CUDA_VISIBLE_DEVICES`` order (sorted)."""
    root: Path
    pid: int
    """The control daemon's PID in the plugin's PID namespace (the host's)."""
    pid_start_time: int
    """Start time of ``pid`` (clock ticks after boot): a reused PID is never taken for it."""
    settings: MpsSettings
    runner: str
    """Name of the `DaemonRunner` that started it (``process`` or ``pod``)."""
    shm_mounted: bool
    """Whether ``shm`` is a mount that stop must undo."""
    runner_ref: str = ""
    """The runner's reference to what it made: the daemon pod's UID; empty for ``process``."""

    @property
    def paths(self) -> DaemonPaths:
        return DaemonPaths(self.root)

    def to_state(self) -> JsonObject:
        """JSON for the checkpoint (see `tiers.state.handles_to_state`)."""
        return {
            "version": STATE_VERSION,
            "daemonId": self.daemon_id,
            "devices": list(self.devices),
            "root": str(self.root),
            "pid": self.pid,
            "pidStartTime": self.pid_start_time,
            "settings": self.settings.to_json(),
            "runner": self.runner,
            "shmMounted": self.shm_mounted,
            **({"runnerRef": self.runner_ref} if self.runner_ref else {}),
        }

    @classmethod
    def from_state(cls, data: JsonValue) -> DaemonHandle:
        """The handle `to_state` wrote; `MpsStateError` for anything else."""
        if not isinstance(data, dict):
            raise MpsStateError(f"MPS daemon state is not an object: {data!r:.200}")
        version = data.get("version")
        if not isinstance(version, int) or version > STATE_VERSION:
            raise MpsStateError(
                f"MPS daemon state version {version!r} is newer than this plugin's "
                f"{STATE_VERSION}: run a plugin version that wrote it"
            )
        try:
            devices, settings = data["devices"], data["settings"]
            pid, start = data["pid"], data["pidStartTime"]
            if not isinstance(devices, list) or not isinstance(settings, dict):
                raise TypeError("devices or settings has the wrong type")
            if not isinstance(pid, int) or not isinstance(start, int) or pid <= 0:
                raise TypeError("pid or pidStartTime is not a positive integer")
            root = data["root"]
            if not isinstance(root, str) or not root.startswith("/"):
                raise ValueError(f"root {root!r} is not an absolute path")
            return cls(
                daemon_id=checked_daemon_id(str(data["daemonId"])),
                devices=tuple(checked_device_uuid(str(d)) for d in devices),
                root=Path(root),
                pid=pid,
                pid_start_time=start,
                settings=MpsSettings.from_json(settings),
                runner=str(data["runner"]),
                shm_mounted=bool(data["shmMounted"]),
                runner_ref=str(data.get("runnerRef") or ""),
            )
        except (KeyError, TypeError, ValueError, InvalidNameError) as error:
            raise MpsStateError(f"MPS daemon state is incomplete or invalid: {error}") from error


@dataclass(frozen=True)
class DaemonRepair:
    """What `MpsControl.ensure` found and did to one daemon."""

    handle: DaemonHandle
    """The daemon's current instance (a new PID, start time and pod after a restart)."""
    restarted: str | None = None
    """Why the daemon was restarted in place (it was dead: quit, killed, its pod gone); None
    when it was running."""
    restored: tuple[str, ...] = ()
    """The settings the daemon reported other than recorded, each ``"<what> <found>, not
    <recorded>"``, set back with ``set_default_*``; empty when they held."""

    @property
    def changed(self) -> bool:
        return self.restarted is not None or bool(self.restored)


class DaemonObserver(Protocol):
    """Told what `MpsControl.ensure` repaired or could not repair (the Kubernetes Events of
    `mps.events`). Called in the manager's worker thread: return quickly."""

    def daemon_repaired(self, repair: DaemonRepair) -> None: ...

    def daemon_unrepaired(self, handle: DaemonHandle, reason: str) -> None: ...


class DaemonState(StrEnum):
    READY = "Ready"
    """Running and answering; no server in FAULT."""
    FAULT = "Fault"
    """A server reports FAULT: a fatal GPU error; new clients of its devices are refused until
    the affected clients exit (MPS recovers by itself then)."""
    UNRESPONSIVE = "Unresponsive"
    """The process runs but control commands fail or time out."""
    DEAD = "Dead"
    """The daemon process is gone."""


@dataclass(frozen=True)
class DaemonStatus:
    state: DaemonState
    detail: str = ""
    faulted_servers: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.state is DaemonState.READY


class MpsControl(Protocol):
    """Starts and stops MPS control daemons; blocking calls (use ``asyncio.to_thread``)."""

    def start(
        self,
        daemon_id: str,
        devices: Sequence[str],
        settings: MpsSettings,
        *,
        exclusive: bool = True,
    ) -> DaemonHandle:
        """Start a daemon for ``devices`` with ``settings`` applied and wait until it answers.

        A leftover daemon or directory of the same id (a start that died with the plugin) is
        removed first. On failure nothing is left behind and `MpsStartError` is raised.
        ``exclusive`` False leaves the compute mode alone (a warm daemon that no share uses
        yet: `set_exclusive` when the first one joins).
        """
        ...

    def recorded(self, daemon_id: str) -> DaemonHandle | None:
        """The handle of the current instance of daemon ``daemon_id`` as its own directory
        records it (``daemon.json``), running or not; None when there is none (never started,
        or stopped). Only reads."""
        ...

    def reset_exclusive(self, handle: DaemonHandle) -> None:
        """DEFAULT again on the GPUs `set_exclusive` (or `start`) set for the daemon, which
        keeps running; idempotent. `MpsStopError` when NVML refuses."""
        ...

    def set_exclusive(self, handle: DaemonHandle) -> None:
        """EXCLUSIVE_PROCESS on the daemon's full GPUs where the manager's policy asks for it
        (as `start` does), recorded so that stop resets it; idempotent. `MpsError` when NVML
        refuses."""
        ...

    def stop(self, handle: DaemonHandle) -> None:
        """``quit`` the daemon (kill it if it does not go), unmount shm, remove its directories.

        Stops the current instance of the handle's id (after restarts in place the handle may
        name an older one). Idempotent: a handle of a daemon that is already gone only cleans
        up."""
        ...

    def status(self, handle: DaemonHandle) -> DaemonStatus:
        """Whether the daemon runs, answers, and has no server in FAULT."""
        ...

    def adopt(self, handle: DaemonHandle) -> DaemonHandle:
        """Re-attach to a daemon started by an earlier plugin process: its current instance
        (see `ensure`), checked, settings read back; only queries reach the daemon.

        Raises `MpsDaemonGoneError` when it is not running; `stop` then cleans up."""
        ...

    def dead(self, handle: DaemonHandle) -> str | None:
        """Why the current instance of ``handle``'s daemon is not running, or None while it
        runs: its runner's object (pod UID), its process (PID + start time) and its environment
        naming the pipe directory, never the pid file. The one judgement of death: supervision,
        the health monitor and prepare's check of a prepared claim all use it. Only reads."""
        ...

    def ensure(
        self, handle: DaemonHandle, *, on_dead: Callable[[DaemonHandle, str], None] | None = None
    ) -> DaemonRepair:
        """Keep the daemon of ``handle``'s id serving with its recorded settings: a dead one is
        restarted **in place** (same id, directories, shm and settings; the directories that
        running workloads have mounted are never removed or re-created), settings that differ
        are set again. ``handle`` may be an older instance of the id: the current one is used.
        ``on_dead(current, why)`` is called before a restart (the daemon is down until it
        returns). Callers serialize it with start and stop of the id across plugin instances
        (the node-wide ``mps-<daemon id>`` lock).

        `MpsDaemonGoneError` when the daemon's directory is gone (it was stopped);
        `MpsStartError` when a restart failed (the directories stay for the next try);
        `MpsError` when it runs but does not answer or keeps other settings."""
        ...

    def leftovers(self) -> list[str]:
        """Ids of the daemons that have directories (running or not), sorted.

        At start-up, those no checkpoint entry records are leftovers of a plugin that died
        between starting a daemon and recording it: `remove_leftover` removes them."""
        ...

    def remove_leftover(self, daemon_id: str) -> None:
        """Kill what runs for daemon ``daemon_id``, unmount its shm, remove its directories,
        without a handle. Idempotent; `MpsStopError` when something cannot be removed."""
        ...
