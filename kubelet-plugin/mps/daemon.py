"""`MpsDaemonManager`: the real `MpsControl`, running the control binary it is given.

Start removes a leftover of the same id, creates and mounts the daemon's directories, optionally
sets the full GPUs to ``EXCLUSIVE_PROCESS`` (`ComputeModeControl`), launches the daemon through
its `DaemonRunner`, waits until it answers, applies the settings before any server can spawn and
reads them back; any failure removes whatever was made and raises `MpsStartError`. Stop and
status undo and check all of it. The manager's calls block; run them in a worker thread.
See docs/mps.md#the-daemon, docs/mps.md#compute-mode and docs/mps.md#lifecycle.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from gpu_dra.driver.naming import InvalidNameError
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.mps.computemode import (
    DEFAULT,
    EXCLUSIVE_PROCESS,
    ComputeModeControl,
    ComputeModeError,
    is_full_gpu,
)
from gpu_dra.kubelet_plugin.mps.control import ControlClient
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonHandle,
    DaemonPaths,
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
from gpu_dra.kubelet_plugin.mps.ids import checked_daemon_id, checked_device_uuid
from gpu_dra.kubelet_plugin.mps.process import (
    DaemonRunner,
    ProcessIdentity,
    ProcessRunner,
    is_alive,
    kill,
    processes_using_pipe,
    read_pid_file,
    wait_gone,
)
from gpu_dra.kubelet_plugin.mps.shm import ShmMounter, TmpfsShmMounter

log = logging.getLogger(__name__)

_KILL_ROUNDS = 10
"""How often `_remove` scans for and kills a daemon's processes before it gives up."""

DEFAULT_BINARY: Final = "nvidia-cuda-mps-control"
SOCKET: Final = "control"
MAX_SOCKET_PATH: Final = 107
"""``sun_path`` holds 108 bytes including the terminating NUL."""
_LONGEST_ID: Final = "x" * 44
_LOG_TAIL: Final = 600
_LOCK_STRIPES: Final = 64
DIR_MODE: Final = 0o755
SHM_MODE: Final = 0o1777
COMPUTE_MODE_RECORD: Final = "compute-mode"
"""``<root>/compute-mode``: the full GPUs set to EXCLUSIVE_PROCESS for this daemon, one a line."""


class MpsDaemonManager:
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
        other_runners: Sequence[DaemonRunner] = (),
    ) -> None:
        """``base_env``: the daemon's and the control client's environment besides the MPS
        variables (``PATH``, ``LD_LIBRARY_PATH`` for the driver's libraries); default this
        process's. ``shm`` defaults to a tmpfs per daemon (needs CAP_SYS_ADMIN).
        ``remove_timeout_s`` bounds the wait for the runner's object (pod) to go.
        ``compute_mode``: set EXCLUSIVE_PROCESS on the full GPUs while their daemon runs;
        None leaves compute modes alone. ``runner`` starts new daemons; ``other_runners`` only
        check, adopt and remove the daemons they started (a plugin whose
        ``--mps-daemon-runner`` changed still stops the daemons of claims prepared before)."""
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
        # Striped: calls for one daemon id serialize, memory stays bounded.
        self._locks = tuple(threading.Lock() for _ in range(_LOCK_STRIPES))

    @property
    def runners(self) -> dict[str, DaemonRunner]:
        """Every runner by name: `runner` for new daemons, the others for the daemons they
        started."""
        return dict(self._runners)

    # -- MpsControl ------------------------------------------------------------------------

    def start(self, daemon_id: str, devices: Sequence[str], settings: MpsSettings) -> DaemonHandle:
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
            except BaseException as error:
                self._remove_quietly(paths, identity, mounted, ref)
                if isinstance(error, MpsError | OSError):
                    raise MpsStartError(
                        f"MPS control daemon {daemon_id} for {', '.join(uuids)}: {error}"
                    ) from error
                raise
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
        log.info(
            "mps daemon started daemon_id=%s pid=%d devices=%s settings=%s",
            daemon_id, identity.pid, ",".join(uuids), settings.commands(),
        )  # fmt: skip
        return handle

    def stop(self, handle: DaemonHandle) -> None:
        runner = self._runner_of(handle)
        identity = ProcessIdentity(handle.pid, handle.pid_start_time)
        with self._lock(handle.daemon_id):
            recorded = read_pid_file(handle.paths.pipe)
            if (
                not is_alive(identity)
                and recorded not in (None, handle.pid)
                and any(p.pid == recorded for p in processes_using_pipe(handle.paths.pipe))
            ):
                # A newer daemon of the same id replaced this one (a restarted start): its
                # processes and directories are not this handle's to remove.
                log.warning("mps stop of a replaced daemon skipped daemon_id=%s pid=%d",
                            handle.daemon_id, handle.pid)  # fmt: skip
                return
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
        runner = self._runner_of(handle)
        identity = ProcessIdentity(handle.pid, handle.pid_start_time)
        missing = runner.missing(handle.daemon_id, handle.runner_ref)
        if missing is not None:
            return DaemonStatus(DaemonState.DEAD, missing)
        if not is_alive(identity):
            return DaemonStatus(DaemonState.DEAD, f"control daemon pid {handle.pid} is gone")
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
        runner = self._runner_of(handle)
        identity = ProcessIdentity(handle.pid, handle.pid_start_time)
        pipe = handle.paths.pipe
        missing = runner.missing(handle.daemon_id, handle.runner_ref)
        if missing is not None:
            raise MpsDaemonGoneError(f"MPS control daemon {handle.daemon_id}: {missing}")
        if not is_alive(identity):
            raise MpsDaemonGoneError(
                f"MPS control daemon {handle.daemon_id} (pid {handle.pid}) is not running"
            )
        recorded = read_pid_file(pipe)
        if recorded != handle.pid:
            raise MpsDaemonGoneError(
                f"MPS control daemon {handle.daemon_id}: {pipe} names pid {recorded}, "
                f"not {handle.pid}"
            )
        try:
            self._verify(handle.paths, handle.settings)
        except MpsCommandError as error:
            raise MpsError(
                f"MPS control daemon {handle.daemon_id} does not answer: {error}"
            ) from error
        log.info("mps daemon adopted daemon_id=%s pid=%d", handle.daemon_id, handle.pid)
        return handle

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

    def _command(self, settings: MpsSettings) -> list[str]:
        return [self.binary, "-d", *(["-M"] if settings.multi_user else [])]

    def _daemon_env(self, paths: DaemonPaths, uuids: Sequence[str]) -> dict[str, str]:
        return {
            **self.base_env,
            "CUDA_VISIBLE_DEVICES": ",".join(uuids),
            "CUDA_MPS_PIPE_DIRECTORY": str(paths.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(paths.log),
        }

    def _wait_ready(self, paths: DaemonPaths, identity: ProcessIdentity, deadline: float) -> None:
        """Until the daemon answers on its socket; it dying or the deadline is an error."""
        delay = 0.005
        last: MpsCommandError | None = None
        while True:
            if not is_alive(identity):
                raise MpsStartError(
                    f"the daemon (pid {identity.pid}) exited during start-up{self._log_tail(paths)}"
                )
            if (paths.pipe / SOCKET).exists():
                remaining = max(deadline - time.monotonic(), 0.1)
                try:
                    self.client.active_thread_percentage(paths.pipe, timeout_s=remaining)
                    return
                except MpsCommandError as error:
                    last = error
            if time.monotonic() >= deadline:
                why = f" (last probe: {last.reason})" if last else f" (no socket {SOCKET})"
                raise MpsStartError(
                    f"the daemon (pid {identity.pid}) did not answer within "
                    f"{self.start_timeout_s}s{why}{self._log_tail(paths)}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _verify(self, paths: DaemonPaths, settings: MpsSettings) -> None:
        """Read the defaults back: `MpsError` when the daemon holds other values."""
        wrong: list[str] = []
        percentage = self.client.active_thread_percentage(paths.pipe)
        wanted = settings.active_thread_percentage
        if wanted is not None and percentage != float(wanted):
            wrong.append(f"active thread percentage {percentage:g}, not {wanted}")
        for uuid, limit in sorted(settings.pinned_limits.items()):
            mib = self.client.pinned_limit_mib(paths.pipe, uuid)
            if mib != int(limit.removesuffix("M")):
                wrong.append(f"pinned memory limit of {uuid} {mib}M, not {limit}")
        if wrong:
            raise MpsError(f"the daemon reports {'; '.join(wrong)}")

    def _set_exclusive(self, paths: DaemonPaths, uuids: Sequence[str]) -> None:
        """EXCLUSIVE_PROCESS on the full GPUs of ``uuids``, each recorded before it is set (a
        GPU NVML refuses is unchanged and dropped from the record again)."""
        gpus = [uuid for uuid in uuids if is_full_gpu(uuid)]
        if self.compute_mode is None or not gpus:
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

    def _remove(
        self,
        paths: DaemonPaths,
        identity: ProcessIdentity | None,
        mounted: bool,
        ref: str | None = None,
        runner: DaemonRunner | None = None,
    ) -> None:
        """Remove the runner's object (``ref``: the pod; None: any of this id; ``runner`` None:
        this manager's runner, then the other runners' best-effort), kill what still runs for
        ``paths``, reset the compute mode, unmount shm, remove the directories. When the
        runner's object does not go, the processes are still killed and the compute mode reset
        (a failed start recorded nowhere would leave them running); shm and the directories
        stay for a retry, and the runner's `MpsStopError` is raised."""
        runner_error: MpsStopError | None = None
        try:
            (runner or self.runner).remove(paths.root.name, ref, self.remove_timeout_s)
        except MpsStopError as error:
            runner_error = error
        if runner is None:
            for other in self._runners.values():
                if other is self.runner:
                    continue
                try:
                    other.remove(paths.root.name, ref, self.remove_timeout_s)
                except MpsStopError as error:
                    log.warning("mps %s runner left %s: %s", other.name, paths.root.name, error)
        survivors = [identity] if identity is not None and is_alive(identity) else []
        survivors += [p for p in processes_using_pipe(paths.pipe) if p not in survivors]
        grace_s = min(1.0, self.stop_timeout_s)
        # A daemon being launched (``-d`` forks it, the fork forks again) may fork while it is
        # killed: one more scan after any kill, until one finds nothing (a crashed plugin's
        # launch still under way at start-up left MPS daemons running nobody recorded).
        for _ in range(_KILL_ROUNDS):
            stuck = [p.pid for p in survivors if not kill(p, grace_s=grace_s)]
            if stuck:
                raise MpsStopError(
                    f"MPS daemon processes {stuck} of {paths.root} do not exit"
                ) from runner_error
            if not survivors:
                break
            survivors = list(processes_using_pipe(paths.pipe))
        else:
            raise MpsStopError(
                f"MPS daemon processes of {paths.root} keep appearing: {[p.pid for p in survivors]}"
            ) from runner_error
        self._reset_compute_mode(paths)
        if runner_error is not None:
            raise runner_error
        try:
            if mounted:
                self.shm.unmount(paths.shm)
            shutil.rmtree(paths.root, ignore_errors=False)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise MpsStopError(f"cannot remove MPS directory {paths.root}: {error}") from error

    def _remove_quietly(
        self,
        paths: DaemonPaths,
        identity: ProcessIdentity | None,
        mounted: bool,
        ref: str | None,
    ) -> None:
        try:
            self._remove(paths, identity, mounted, ref)
        except MpsError as error:
            log.error("mps cleanup after failed start incomplete root=%s: %s", paths.root, error)

    def _runner_of(self, handle: DaemonHandle) -> DaemonRunner:
        runner = self._runners.get(handle.runner)
        if runner is None:
            raise MpsStateError(
                f"MPS daemon {handle.daemon_id} was started by runner {handle.runner!r}; "
                f"this plugin uses {self.runner.name!r}"
            )
        return runner

    @staticmethod
    def _log_tail(paths: DaemonPaths) -> str:
        try:
            text = (paths.log / "control.log").read_text(errors="replace").strip()
        except OSError:
            return ""
        return f"; control.log: {text[-_LOG_TAIL:]}" if text else ""

    @contextmanager
    def _lock(self, daemon_id: str) -> Iterator[None]:
        index = int.from_bytes(hashlib.sha256(daemon_id.encode()).digest()[:4]) % _LOCK_STRIPES
        with self._locks[index]:
            yield
