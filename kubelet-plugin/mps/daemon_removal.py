"""Removing an MPS daemon, for `MpsDaemonManager` (stop, leftovers, a failed start or restart in
place): the runner's object, every process still serving its pipe directory (scanned again after
each kill), the compute mode of its GPUs, its shm and its directories. See docs/mps.md#lifecycle.
"""

from __future__ import annotations

import logging
import shutil

from gpu_dra.kubelet_plugin.mps.daemon_compute_mode import DaemonComputeMode
from gpu_dra.kubelet_plugin.mps.daemon_model import DaemonPaths, MpsError, MpsStopError
from gpu_dra.kubelet_plugin.mps.process import (
    DaemonRunner,
    ProcessIdentity,
    is_alive,
    kill,
    processes_using_pipe,
)
from gpu_dra.kubelet_plugin.mps.shm import ShmMounter

# The manager's logger: these are its steps.
log = logging.getLogger("gpu_dra.kubelet_plugin.mps.daemon")

_KILL_ROUNDS = 10
"""How often `_remove` scans for and kills a daemon's processes before it gives up."""


class DaemonRemoval(DaemonComputeMode):
    """The removal steps of `MpsDaemonManager`, which sets these attributes."""

    runner: DaemonRunner
    _runners: dict[str, DaemonRunner]
    shm: ShmMounter
    stop_timeout_s: float
    remove_timeout_s: float

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

    def _kill_launched(
        self, daemon_id: str, paths: DaemonPaths, identity: ProcessIdentity | None, ref: str | None
    ) -> None:
        """After a failed restart in place: remove the runner's object and kill the processes,
        leaving the directories (running workloads have them mounted)."""
        try:
            if ref is not None:
                self.runner.remove(daemon_id, ref, self.remove_timeout_s)
            survivors = [identity] if identity is not None and is_alive(identity) else []
            for process in [*survivors, *processes_using_pipe(paths.pipe)]:
                kill(process, grace_s=min(1.0, self.stop_timeout_s))
        except MpsError as error:
            log.error("mps cleanup after failed restart incomplete daemon_id=%s: %s",
                      daemon_id, error)  # fmt: skip
