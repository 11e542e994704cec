"""`MpsDaemonManager`: the real `MpsControl`, running the control binary it is given.

Start removes a leftover of the same id, creates and mounts the daemon's directories, optionally
sets the full GPUs to ``EXCLUSIVE_PROCESS`` (`ComputeModeControl`), launches the daemon through
its `DaemonRunner`, waits until it answers, applies the settings before any server can spawn and
reads them back; any failure removes whatever was made and raises `MpsStartError`. `ensure`
restarts a dead daemon **in place** (same id, directories, shm and settings) and records the new
instance in ``<root>/daemon.json`` (`current_handle`); liveness is the runner's object and the
process (PID + start time, its environment), never the pid file workloads see. Stop and status
undo and check all of it. The manager's calls block; run them in a worker thread. Three groups
of its steps are base classes in modules of their own: launching (`daemon_launch`), the compute
mode of its GPUs (`daemon_compute_mode`) and removal (`daemon_removal`). See
docs/mps.md#the-daemon, docs/mps.md#compute-mode and docs/mps.md#lifecycle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Final

from gpu_dra.driver.naming import InvalidNameError
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.atomic_file import remove_temporaries, write_atomically
from gpu_dra.kubelet_plugin.mps.computemode import ComputeModeControl, ComputeModeError, is_full_gpu
from gpu_dra.kubelet_plugin.mps.control import ControlClient
from gpu_dra.kubelet_plugin.mps.daemon_launch import SOCKET, DaemonLaunch
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonHandle,
    DaemonObserver,
    DaemonPaths,
    DaemonRepair,
    DaemonState,
    DaemonStatus,
    MpsCommandError,
    MpsDaemonGoneError,
    MpsError,
    MpsSettings,
    MpsStartError,
    MpsStateError,
    MpsStopError,
)
from gpu_dra.kubelet_plugin.mps.daemon_removal import DaemonRemoval
from gpu_dra.kubelet_plugin.mps.ids import checked_daemon_id, checked_device_uuid
from gpu_dra.kubelet_plugin.mps.process import (
    PID_FILE,
    DaemonRunner,
    ProcessIdentity,
    ProcessRunner,
    is_alive,
    kill,
    processes_using_pipe,
    serves_pipe,
    wait_gone,
)
from gpu_dra.kubelet_plugin.mps.shm import ShmMounter, TmpfsShmMounter, is_mount_point

log = logging.getLogger(__name__)

DEFAULT_BINARY: Final = "nvidia-cuda-mps-control"
MAX_SOCKET_PATH: Final = 107
"""``sun_path`` holds 108 bytes including the terminating NUL."""
_LONGEST_ID: Final = "x" * 44
_LOCK_STRIPES: Final = 64
DIR_MODE: Final = 0o755
SHM_MODE: Final = 0o1777
INSTANCE_RECORD: Final = "daemon.json"
"""``<root>/daemon.json``: the handle of the daemon's current instance (`current_handle`)."""


def current_handle(handle: DaemonHandle) -> DaemonHandle:
    """The current instance of ``handle``'s daemon: the handle ``<root>/daemon.json`` holds
    when it names the same id and root (a restart in place wrote it), else ``handle``."""
    try:
        data = json.loads((handle.root / INSTANCE_RECORD).read_text())
        current = DaemonHandle.from_state(data)
    except (FileNotFoundError, NotADirectoryError):
        return handle
    except (OSError, ValueError, MpsStateError) as error:
        log.warning("mps instance record of %s unusable: %s", handle.daemon_id, error)
        return handle
    if current.daemon_id != handle.daemon_id or current.root != handle.root:
        return handle
    return current


class MpsDaemonManager(DaemonLaunch, DaemonRemoval):
    """Starts, checks, adopts and stops MPS control daemons under ``<data_dir>/mps``."""

    def __init__(
        self,
        data_dir: Path,
        *,
        binary: str | Path = DEFAULT_BINARY,
        base_env: Mapping[str, str] | None = None,
        runner: DaemonRunner | None = None,
        shm: ShmMounter | None = None,
        start_timeout_s: float = 10.0,
        command_timeout_s: float = 5.0,
        stop_timeout_s: float = 5.0,
        status_timeout_s: float = 2.0,
        remove_timeout_s: float = 30.0,
        compute_mode: ComputeModeControl | None = None,
        exclusive: Callable[[str], bool] | None = None,
        other_runners: Sequence[DaemonRunner] = (),
        observer: DaemonObserver | None = None,
    ) -> None:
        """``base_env``: the daemon's and the control client's environment besides the MPS
        variables (``PATH``, ``LD_LIBRARY_PATH`` for the driver's libraries); default this
        process's. ``shm`` defaults to a tmpfs per daemon (needs CAP_SYS_ADMIN).
        ``remove_timeout_s`` bounds the wait for the runner's object (pod) to go.
        ``compute_mode``: set EXCLUSIVE_PROCESS on the full GPUs while their daemon runs, for
        the daemon ids ``exclusive`` accepts (None: every daemon), and reset them; None leaves
        compute modes alone. ``runner`` starts new daemons; ``other_runners`` only check, adopt
        and remove the daemons they started (a plugin whose ``--mps-daemon-runner`` changed
        still stops the daemons of claims prepared before). ``observer`` is told what `ensure`
        repaired (restarts, restored settings) or could not repair."""
        self.data_dir = data_dir
        socket_path = DaemonPaths.of(data_dir, _LONGEST_ID).pipe / SOCKET
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"MPS socket paths under {data_dir} would exceed {MAX_SOCKET_PATH} bytes "
                f"({socket_path}): use a shorter data directory"
            )
        self.binary = str(binary)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.runner: DaemonRunner = runner or ProcessRunner()
        self._runners = {r.name: r for r in [*other_runners, self.runner]}
        self.shm: ShmMounter = shm or TmpfsShmMounter()
        self.client = ControlClient(binary, base_env=self.base_env, timeout_s=command_timeout_s)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.status_timeout_s = status_timeout_s
        self.remove_timeout_s = remove_timeout_s
        self.compute_mode = compute_mode
        self.exclusive: Callable[[str], bool] = exclusive or (lambda _daemon_id: True)
        self.observer = observer
        # Striped: calls for one daemon id serialize, memory stays bounded.
        self._locks = tuple(threading.Lock() for _ in range(_LOCK_STRIPES))

    @property
    def runners(self) -> dict[str, DaemonRunner]:
        """Every runner by name: `runner` for new daemons, the others for the daemons they
        started."""
        return dict(self._runners)

    # -- MpsControl ------------------------------------------------------------------------

    def start(
        self,
        daemon_id: str,
        devices: Sequence[str],
        settings: MpsSettings,
        *,
        exclusive: bool = True,
    ) -> DaemonHandle:
        paths = DaemonPaths.of(self.data_dir, daemon_id)
        uuids = tuple(sorted({checked_device_uuid(d) for d in devices}))
        if not uuids:
            raise ValueError(f"MPS daemon {daemon_id}: no devices")
        settings.check(uuids)
        with self._lock(daemon_id):
            if paths.root.exists():
                log.warning("mps leftover removed daemon_id=%s root=%s", daemon_id, paths.root)
                try:
                    self._remove(paths, None, mounted=True)
                except MpsStopError as error:
                    raise MpsStartError(f"MPS control daemon {daemon_id}: {error}") from error
            try:
                self.runner.remove(daemon_id, None, self.remove_timeout_s)  # a leftover pod
            except MpsStopError as error:
                raise MpsStartError(f"MPS control daemon {daemon_id}: {error}") from error
            identity: ProcessIdentity | None = None
            ref: str | None = None
            mounted = False
            try:
                for directory in (paths.root, paths.pipe, paths.log, paths.shm):
                    directory.mkdir(mode=DIR_MODE, parents=True)
                    directory.chmod(DIR_MODE)  # not narrowed by the umask
                mounted = self.shm.mount(paths.shm)
                paths.shm.chmod(SHM_MODE)
                if exclusive:
                    self._set_exclusive(paths, uuids)
                deadline = time.monotonic() + self.start_timeout_s
                launched = self.runner.launch(
                    self._command(settings), self._daemon_env(paths, uuids), paths,
                    self.start_timeout_s,
                )  # fmt: skip
                identity, ref = launched.identity, launched.ref
                crash_points.reached(crash_points.MPS_AFTER_LAUNCH)
                self._wait_ready(paths, identity, deadline)
                self.client.run_all(paths.pipe, settings.commands())
                self._verify(paths, settings)
                handle = DaemonHandle(
                    daemon_id=daemon_id,
                    devices=uuids,
                    root=paths.root,
                    pid=identity.pid,
                    pid_start_time=identity.start_time,
                    settings=settings,
                    runner=self.runner.name,
                    shm_mounted=mounted,
                    runner_ref=ref or "",
                )
                self._record_instance(handle)
            except BaseException as error:
                self._remove_quietly(paths, identity, mounted, ref)
                if isinstance(error, MpsError | OSError):
                    raise MpsStartError(
                        f"MPS control daemon {daemon_id} for {', '.join(uuids)}: {error}"
                    ) from error
                raise
        log.info(
            "mps daemon started daemon_id=%s pid=%d devices=%s settings=%s",
            daemon_id, identity.pid, ",".join(uuids), settings.commands(),
        )  # fmt: skip
        return handle

    def recorded(self, daemon_id: str) -> DaemonHandle | None:
        paths = DaemonPaths.of(self.data_dir, daemon_id)
        try:
            data = json.loads((paths.root / INSTANCE_RECORD).read_text())
            handle = DaemonHandle.from_state(data)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError, MpsStateError) as error:
            log.warning("mps instance record of %s unusable: %s", daemon_id, error)
            return None
        if handle.daemon_id != daemon_id or handle.root != paths.root:
            log.warning("mps instance record of %s names %s at %s", daemon_id,
                        handle.daemon_id, handle.root)  # fmt: skip
            return None
        return handle

    def set_exclusive(self, handle: DaemonHandle) -> None:
        with self._lock(handle.daemon_id):
            gpus = [u for u in handle.devices if is_full_gpu(u)]
            if gpus and self._exclusive_gpus(handle.paths) == gpus:
                return  # set already
            try:
                self._set_exclusive(handle.paths, handle.devices)
            except ComputeModeError as error:
                raise MpsError(
                    f"MPS control daemon {handle.daemon_id}: compute mode not set: {error}"
                ) from error

    def reset_exclusive(self, handle: DaemonHandle) -> None:
        with self._lock(handle.daemon_id):
            self._reset_compute_mode(handle.paths)

    def stop(self, handle: DaemonHandle) -> None:
        with self._lock(handle.daemon_id):
            handle = current_handle(handle)  # the id's instance now, after restarts in place
            runner = self._runner_of(handle)
            identity = ProcessIdentity(handle.pid, handle.pid_start_time)
            if is_alive(identity):
                try:
                    self.client.run(handle.paths.pipe, "quit", timeout_s=self.stop_timeout_s)
                except MpsCommandError as error:
                    log.warning("mps quit failed daemon_id=%s: %s", handle.daemon_id, error)
                if not wait_gone(identity, self.stop_timeout_s):
                    log.warning("mps daemon killed daemon_id=%s pid=%d", handle.daemon_id,
                                handle.pid)  # fmt: skip
            self._remove(
                handle.paths,
                identity,
                mounted=handle.shm_mounted,
                ref=handle.runner_ref or None,
                runner=runner,
            )
        log.info("mps daemon stopped daemon_id=%s", handle.daemon_id)

    def status(self, handle: DaemonHandle) -> DaemonStatus:
        handle = current_handle(handle)
        dead = self._dead(handle)
        if dead is not None:
            return DaemonStatus(DaemonState.DEAD, dead)
        identity = ProcessIdentity(handle.pid, handle.pid_start_time)
        pipe = handle.paths.pipe
        try:
            servers = self.client.server_pids(pipe, timeout_s=self.status_timeout_s)
            faulted = tuple(
                pid
                for pid in servers
                if self.client.server_status(pipe, pid, timeout_s=self.status_timeout_s) == "FAULT"
            )
        except MpsCommandError as error:
            if not is_alive(identity):
                return DaemonStatus(DaemonState.DEAD, f"control daemon pid {handle.pid} is gone")
            return DaemonStatus(DaemonState.UNRESPONSIVE, str(error))
        if faulted:
            detail = (
                f"MPS server(s) {', '.join(map(str, faulted))} in FAULT after a fatal GPU error; "
                "new clients are refused until the affected clients exit"
            )
            return DaemonStatus(DaemonState.FAULT, detail, faulted)
        return DaemonStatus(DaemonState.READY, f"{len(servers)} server(s)")

    def adopt(self, handle: DaemonHandle) -> DaemonHandle:
        """As `MpsControl.adopt`; also removes what a record write that died before its rename
        left in the daemon's directory (call it under the daemon's node-wide lock)."""
        remove_temporaries(handle.root, lambda target: target == INSTANCE_RECORD)
        handle = current_handle(handle)
        dead = self._dead(handle)
        if dead is not None:
            raise MpsDaemonGoneError(f"MPS control daemon {handle.daemon_id}: {dead}")
        try:
            self._verify(handle.paths, handle.settings)
        except MpsCommandError as error:
            raise MpsError(
                f"MPS control daemon {handle.daemon_id} does not answer: {error}"
            ) from error
        log.info("mps daemon adopted daemon_id=%s pid=%d", handle.daemon_id, handle.pid)
        return handle

    def dead(self, handle: DaemonHandle) -> str | None:
        return self._dead(current_handle(handle))

    def ensure(
        self, handle: DaemonHandle, *, on_dead: Callable[[DaemonHandle, str], None] | None = None
    ) -> DaemonRepair:
        try:
            repair = self._ensure(handle, on_dead)
        except MpsDaemonGoneError:
            raise
        except MpsError as error:
            if self.observer is not None:
                self.observer.daemon_unrepaired(handle, str(error))
            raise
        if repair.changed and self.observer is not None:
            self.observer.daemon_repaired(repair)
        return repair

    def _ensure(
        self, handle: DaemonHandle, on_dead: Callable[[DaemonHandle, str], None] | None
    ) -> DaemonRepair:
        with self._lock(handle.daemon_id):
            if not handle.paths.pipe.is_dir():
                raise MpsDaemonGoneError(
                    f"MPS control daemon {handle.daemon_id}: {handle.paths.pipe} is gone (stopped)"
                )
            current = current_handle(handle)
            restarted = self._dead(current)
            if restarted is not None:
                if on_dead is not None:
                    on_dead(current, restarted)  # reported while it is down
                current = self._restart_in_place(current, restarted)
            try:
                wrong = self._differences(current.paths, current.settings)
                if wrong:
                    log.warning("mps daemon settings changed, restoring daemon_id=%s: %s",
                                current.daemon_id, "; ".join(wrong))  # fmt: skip
                    self.client.run_all(current.paths.pipe, current.settings.commands())
                    self._verify(current.paths, current.settings)
            except MpsCommandError as error:
                raise MpsError(
                    f"MPS control daemon {current.daemon_id} does not answer: {error}"
                ) from error
            wrong += self._restore_exclusive(current.paths)
        return DaemonRepair(current, restarted, tuple(wrong))

    def leftovers(self) -> list[str]:
        try:
            names = [entry.name for entry in (self.data_dir / "mps").iterdir() if entry.is_dir()]
        except FileNotFoundError:
            names = []
        ids = {i for runner in self._runners.values() for i in runner.daemon_ids()}
        for name in names:
            try:
                ids.add(checked_daemon_id(name))
            except InvalidNameError:
                continue  # not a daemon directory of this manager
        return sorted(ids)

    def remove_leftover(self, daemon_id: str) -> None:
        paths = DaemonPaths.of(self.data_dir, daemon_id)
        with self._lock(daemon_id):
            self._remove(paths, None, mounted=True)
        log.info("mps leftover removed daemon_id=%s", daemon_id)

    # -- steps -----------------------------------------------------------------------------

    def _dead(self, handle: DaemonHandle) -> str | None:
        """Why the daemon of ``handle`` is not running, or None while it runs: the runner's
        object (the pod, by UID), the process (PID + start time) and its environment naming the
        pipe directory. The pid file in the pipe directory is not consulted (workloads see it)."""
        missing = self._runner_of(handle).missing(handle.daemon_id, handle.runner_ref)
        if missing is not None:
            return missing
        if not is_alive(ProcessIdentity(handle.pid, handle.pid_start_time)):
            return f"control daemon pid {handle.pid} is gone"
        if serves_pipe(handle.pid, handle.paths.pipe) is False:
            return f"pid {handle.pid} does not serve {handle.paths.pipe}"
        return None

    def _restart_in_place(self, old: DaemonHandle, why: str) -> DaemonHandle:
        """Start the dead daemon of ``old`` again in its own directories, with its settings,
        and record the new instance. Nothing workloads have mounted is removed or re-created:
        only the old runner object, leftover processes, the stale socket and pid file go; a
        directory that is missing is made, the shm is mounted again only if it is not. A failed
        restart removes what it launched and keeps the directories (`MpsStartError`)."""
        paths = old.paths
        log.warning("mps daemon restarting in place daemon_id=%s: %s", old.daemon_id, why)
        where = f"MPS control daemon {old.daemon_id} (restart in place after: {why})"
        identity: ProcessIdentity | None = None
        ref: str | None = None
        try:
            for runner in {self._runner_of(old), self.runner}:
                runner.remove(old.daemon_id, None, self.remove_timeout_s)
            survivors = list(processes_using_pipe(paths.pipe))
            stuck = [p.pid for p in survivors if not kill(p, grace_s=min(1.0, self.stop_timeout_s))]
            if stuck:
                raise MpsStartError(f"processes {stuck} of the dead daemon do not exit")
            for name in (PID_FILE, SOCKET):
                with contextlib.suppress(FileNotFoundError):
                    (paths.pipe / name).unlink()
            for directory in (paths.root, paths.pipe, paths.log, paths.shm):
                directory.mkdir(mode=DIR_MODE, exist_ok=True)
            mounted = old.shm_mounted
            if mounted and not is_mount_point(paths.shm):
                mounted = self.shm.mount(paths.shm)
            paths.shm.chmod(SHM_MODE)
            # The GPUs it held exclusive before (none for a warm daemon no share joined yet).
            self._set_exclusive(paths, self._exclusive_gpus(paths))
            deadline = time.monotonic() + self.start_timeout_s
            launched = self.runner.launch(
                self._command(old.settings), self._daemon_env(paths, old.devices), paths,
                self.start_timeout_s,
            )  # fmt: skip
            identity, ref = launched.identity, launched.ref
            self._wait_ready(paths, identity, deadline)
            self.client.run_all(paths.pipe, old.settings.commands())
            self._verify(paths, old.settings)
            new = replace(
                old,
                pid=identity.pid,
                pid_start_time=identity.start_time,
                runner=self.runner.name,
                runner_ref=ref or "",
                shm_mounted=mounted,
            )
            self._record_instance(new)
        except (MpsError, OSError) as error:
            self._kill_launched(old.daemon_id, paths, identity, ref)
            raise MpsStartError(f"{where}: {error}") from error
        log.warning("mps daemon restarted in place daemon_id=%s pid=%d (was %d)",
                    new.daemon_id, new.pid, old.pid)  # fmt: skip
        return new

    def _record_instance(self, handle: DaemonHandle) -> None:
        """``<root>/daemon.json`` := ``handle`` (`current_handle`), atomically; first the
        temporaries of earlier writes that died before their rename are removed (the callers
        hold the daemon's lock, node-wide too, so no other write of it is under way)."""
        remove_temporaries(handle.root, lambda target: target == INSTANCE_RECORD)
        data = json.dumps(handle.to_state(), sort_keys=True).encode()
        write_atomically(
            handle.root / INSTANCE_RECORD,
            data,
            mode=0o644,
            crash_point=crash_points.MPS_RECORD_BEFORE_RENAME,
        )

    def _verify(self, paths: DaemonPaths, settings: MpsSettings) -> None:
        """Read the defaults back: `MpsError` when the daemon holds other values."""
        wrong = self._differences(paths, settings)
        if wrong:
            raise MpsError(f"the daemon reports {'; '.join(wrong)}")

    def _differences(self, paths: DaemonPaths, settings: MpsSettings) -> list[str]:
        """The defaults the daemon reports other than ``settings``, each ``"<what> <found>,
        not <wanted>"``; `MpsCommandError` when it does not answer."""
        wrong: list[str] = []
        percentage = self.client.active_thread_percentage(paths.pipe)
        wanted = settings.active_thread_percentage
        if wanted is not None and percentage != float(wanted):
            wrong.append(f"active thread percentage {percentage:g}, not {wanted}")
        for uuid, limit in sorted(settings.pinned_limits.items()):
            mib = self.client.pinned_limit_mib(paths.pipe, uuid)
            if mib != int(limit.removesuffix("M")):
                wrong.append(f"pinned memory limit of {uuid} {mib}M, not {limit}")
        return wrong

    def _runner_of(self, handle: DaemonHandle) -> DaemonRunner:
        runner = self._runners.get(handle.runner)
        if runner is None:
            raise MpsStateError(
                f"MPS daemon {handle.daemon_id} was started by runner {handle.runner!r}; "
                f"this plugin uses {self.runner.name!r}"
            )
        return runner

    @contextmanager
    def _lock(self, daemon_id: str) -> Iterator[None]:
        index = int.from_bytes(hashlib.sha256(daemon_id.encode()).digest()[:4]) % _LOCK_STRIPES
        with self._locks[index]:
            yield
