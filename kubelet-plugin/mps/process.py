"""How a control daemon runs: the `DaemonRunner` seam and the host-process runner.

`ProcessRunner` runs ``<binary> -d`` on the host. ``-d`` daemonizes: the program forks a daemon
that leaves the caller's session and returns, so the daemon does not die with the plugin (nor
with the plugin's process group or session); it writes its PID to
``<pipe>/nvidia-cuda-mps-control.pid``. The plugin reads that file once, at start, and takes
the PID only if that process's environment names the pipe directory (`serves_pipe`); from then
on it knows the daemon by PID plus start time (a PID reused after the daemon's death is never
mistaken for it) and never trusts the pid file again: workloads see the pipe directory.

In production the daemon runs as a pod on the node instead (:mod:`.pod`, ``PodRunner``): it
then outlives plugin upgrades and is visible to operators. The pod shares the host's PID
namespace, so the daemon's PID file holds a host PID and the same process checks apply.

Linux only: process checks read ``/proc``. A zombie counts as gone (the daemon is not the
plugin's child; whoever adopted it reaps it, possibly late).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from gpu_dra.kubelet_plugin.mps.daemon_model import DaemonPaths, MpsStartError

PID_FILE: Final = "nvidia-cuda-mps-control.pid"
LAUNCH_LOG: Final = "launch.log"
"""Output of ``<binary> -d`` itself, in the log directory."""
PROC: Final = Path("/proc")


@dataclass(frozen=True)
class ProcessIdentity:
    """A process by PID and start time (``/proc/<pid>/stat`` field 22)."""

    pid: int
    start_time: int


def start_time(pid: int) -> int | None:
    """Start time of a live (non-zombie) process ``pid``; None when there is none."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_alive(identity: ProcessIdentity) -> bool:
    return start_time(identity.pid) == identity.start_time


def serves_pipe(pid: int, pipe_dir: Path) -> bool | None:
    """Whether process ``pid`` has ``CUDA_MPS_PIPE_DIRECTORY=<pipe_dir>`` in its environment
    (the daemon and its servers do); None when its environment cannot be read."""
    needle = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    try:
        environ = (PROC / str(pid) / "environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return None
    return needle in environ.split(b"\0")


def read_pid_file(pipe_dir: Path) -> int | None:
    try:
        text = (pipe_dir / PID_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return int(text) if text.isdigit() else None


def processes_using_pipe(pipe_dir: Path) -> Iterator[ProcessIdentity]:
    """Live processes whose environment names ``pipe_dir`` as ``CUDA_MPS_PIPE_DIRECTORY``.

    That is the daemon and its servers (they inherit its environment); workloads see the pipe
    dir under another path (``/tmp/nvidia-mps``) and are not matched. Needs root for other
    users' processes.
    """
    needle = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            started = start_time(int(entry.name))
            if started is not None:
                yield ProcessIdentity(int(entry.name), started)


def kill(identity: ProcessIdentity, *, grace_s: float) -> bool:
    """SIGTERM, then SIGKILL after ``grace_s``; True once the process is gone."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        if not is_alive(identity):
            return True
        with contextlib.suppress(ProcessLookupError):
            os.kill(identity.pid, sig)
        if wait_gone(identity, wait_s):
            return True
    return not is_alive(identity)


def wait_gone(identity: ProcessIdentity, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while is_alive(identity):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return True


def wait_for_daemon_pid(
    paths: DaemonPaths,
    deadline: float,
    timeout_s: float,
    failed: Callable[[], str | None] = lambda: None,
) -> ProcessIdentity:
    """The daemon's identity once its PID file names a live process that serves the pipe
    directory (`serves_pipe`; a PID file naming any other process is not believed);
    `MpsStartError` when the named process is gone, when ``failed()`` says why the start
    failed, or at the deadline."""
    delay = 0.005
    foreign: int | None = None
    while True:
        pid = read_pid_file(paths.pipe)
        started = start_time(pid) if pid is not None else None
        if pid is not None and started is not None:
            if serves_pipe(pid, paths.pipe) is not False:
                return ProcessIdentity(pid, started)
            foreign = pid
        elif pid is not None:
            raise MpsStartError(f"the MPS control daemon (pid {pid}) exited right after start")
        why = failed()
        if why is not None:
            raise MpsStartError(why)
        if time.monotonic() >= deadline:
            other = (
                f" (it names pid {foreign}, which does not serve {paths.pipe})"
                if foreign is not None
                else ""
            )
            raise MpsStartError(
                f"the MPS control daemon wrote no live PID to {paths.pipe / PID_FILE} "
                f"within {timeout_s}s{other}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


@dataclass(frozen=True)
class LaunchedDaemon:
    """What `DaemonRunner.launch` started."""

    identity: ProcessIdentity
    """The control daemon process (host PID namespace)."""
    ref: str = ""
    """The runner's own reference, kept in the handle: the pod's UID; empty for a host process."""


class DaemonRunner(Protocol):
    """Runs the control daemon for a set of directories; the manager does the rest (readiness
    through the control pipe, settings, process checks, directories)."""

    name: str
    """Recorded in the handle; a handle is only stopped or adopted by its own runner kind."""

    def launch(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        paths: DaemonPaths,
        timeout_s: float,
    ) -> LaunchedDaemon:
        """Start the daemon (``command`` is ``[binary, "-d", ...]``; the daemon id is
        ``paths.root.name``) and return it once its PID is known; raise `MpsStartError` if it
        does not start (what the runner created for it is removed again)."""
        ...

    def missing(self, daemon_id: str, ref: str) -> str | None:
        """None while what the runner made for the daemon (its pod ``ref``) still runs it;
        otherwise why not (the daemon then counts as dead)."""
        ...

    def remove(self, daemon_id: str, ref: str | None, timeout_s: float) -> None:
        """Remove what the runner made for the daemon and wait until it is gone; ``ref`` None:
        whatever it made for that id. Idempotent; `MpsStopError` when it stays."""
        ...

    def daemon_ids(self) -> list[str]:
        """Ids of the daemons the runner has something for on this node (pods), sorted."""
        ...


class ProcessRunner:
    """The daemon as a host process, started with ``-d`` (see the module doc)."""

    name = "process"

    def launch(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        paths: DaemonPaths,
        timeout_s: float,
    ) -> LaunchedDaemon:
        deadline = time.monotonic() + timeout_s
        # Output to a file, not a pipe: a daemonized child that kept a pipe open would block
        # the wait for the launching process.
        output_path = paths.log / LAUNCH_LOG
        try:
            with output_path.open("w+") as output:
                done = subprocess.run(
                    list(command),
                    env=dict(env),
                    cwd=paths.root,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                    check=False,
                    start_new_session=True,  # never in the plugin's session, even before -d
                )
                output.seek(0)
                text = output.read(500).strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            raise MpsStartError(f"cannot run {command[0]}: {error}") from error
        if done.returncode != 0:
            raise MpsStartError(f"{' '.join(command)} exited with {done.returncode}: {text}")
        return LaunchedDaemon(wait_for_daemon_pid(paths, deadline, timeout_s))

    def missing(self, daemon_id: str, ref: str) -> str | None:
        return None  # nothing besides the process, which the manager checks

    def remove(self, daemon_id: str, ref: str | None, timeout_s: float) -> None:
        return None  # the manager kills the processes and removes the directories

    def daemon_ids(self) -> list[str]:
        return []  # the manager finds leftovers by their directories
