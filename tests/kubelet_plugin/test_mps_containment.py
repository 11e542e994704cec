"""Containment of an MPS daemon against its clients (issue 16, item 2), with the real
`MpsDaemonManager` running the ``nvidia-cuda-mps-control`` test double: a daemon that a client
quit or killed is restarted in place (its directories, which workloads have mounted, are never
removed or re-created), settings a client changed are restored, the pid file a client could
write is never believed, and a read-only mount of the pipe directory still reaches the daemon
while no file in it can be removed or created. Every test fails if a daemon is left running.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin.mps import (
    DaemonHandle,
    DaemonPaths,
    DaemonRepair,
    DaemonState,
    MpsDaemonGoneError,
    MpsDaemonManager,
    MpsSettings,
    MpsStartError,
)
from gpu_dra.kubelet_plugin.mps.control import ControlClient
from gpu_dra.kubelet_plugin.mps.daemon import current_handle
from gpu_dra.kubelet_plugin.mps.process import PID_FILE, start_time, wait_for_daemon_pid
from tests.doubles import nvidia_cuda_mps_control as double
from tests.doubles.mps_helpers import DOUBLE_BINARY, double_env
from tests.kubelet_plugin.nodes import double_daemon_manager, wait_dead

GPU = "GPU-11111111-2222-3333-4444-555555555555"
SETTINGS = MpsSettings(active_thread_percentage=50, pinned_limits={GPU: "40779M"})


class RecordingObserver:
    """A `DaemonObserver` that keeps what it was told."""

    def __init__(self) -> None:
        self.repaired: list[DaemonRepair] = []
        self.unrepaired: list[tuple[str, str]] = []

    def daemon_repaired(self, repair: DaemonRepair) -> None:
        self.repaired.append(repair)

    def daemon_unrepaired(self, handle: DaemonHandle, reason: str) -> None:
        self.unrepaired.append((handle.daemon_id, reason))


@pytest.fixture
def observer() -> RecordingObserver:
    return RecordingObserver()


@pytest.fixture
def manager(mps_root: Path, observer: RecordingObserver) -> Iterator[MpsDaemonManager]:
    manager = double_daemon_manager(mps_root)
    manager.observer = observer
    yield manager
    for entry in (mps_root / "mps").glob("*"):
        manager.remove_leftover(entry.name)


def tenant(handle: DaemonHandle, command: str) -> str:
    """A client of the daemon sends ``command`` through the pipe directory."""
    return ControlClient(DOUBLE_BINARY, base_env=double_env()).run(handle.paths.pipe, command)


def inode(path: Path) -> tuple[int, int]:
    st = path.stat()
    return (st.st_dev, st.st_ino)


def directories(handle: DaemonHandle) -> dict[str, tuple[int, int]]:
    paths = handle.paths
    return {p.name: inode(p) for p in (paths.root, paths.pipe, paths.log, paths.shm)}


# ---- restart in place ------------------------------------------------------------------------


def test_a_daemon_a_client_quit_is_restarted_in_place_with_its_settings(
    manager: MpsDaemonManager, observer: RecordingObserver
) -> None:
    handle = manager.start("shared-0123456789abcdef", [GPU], SETTINGS)
    before = directories(handle)
    (handle.paths.shm / "client-buffer").write_text("a tenant's shared memory")

    tenant(handle, "quit")
    assert wait_dead(handle.pid)
    assert manager.status(handle).state is DaemonState.DEAD
    repair = manager.ensure(handle)

    new = repair.handle
    assert repair.restarted == f"control daemon pid {handle.pid} is gone"
    assert repair.restored == ()
    assert new.pid != handle.pid
    assert start_time(new.pid) == new.pid_start_time
    # Nothing a workload has mounted was removed or re-created.
    assert directories(new) == before
    assert (new.paths.shm / "client-buffer").read_text() == "a tenant's shared memory"
    assert double.read_state(new.paths.pipe)["defaults"] == {
        "activeThreadPercentage": 50.0,
        "pinnedMemLimits": {GPU: "40779M"},
    }
    # The plugin's own record names the new instance; the old handle resolves to it.
    assert current_handle(handle) == new
    assert manager.status(handle).state is DaemonState.READY
    assert observer.repaired == [repair]
    # Running: nothing to do, nothing reported.
    assert manager.ensure(handle) == DaemonRepair(new)
    assert len(observer.repaired) == 1
    manager.stop(handle)  # the stale handle stops the current instance
    assert wait_dead(new.pid)
    assert not handle.root.exists()


def test_a_killed_daemon_leaves_a_stale_socket_and_pid_file_and_is_restarted(
    manager: MpsDaemonManager,
) -> None:
    handle = manager.start("killed", [GPU], SETTINGS)
    server = int(tenant(handle, "start_server -uid 0"))
    os.kill(handle.pid, signal.SIGKILL)
    assert wait_dead(handle.pid)
    assert (handle.paths.pipe / double.SOCKET).exists()
    assert (handle.paths.pipe / PID_FILE).read_text().strip() == str(handle.pid)

    new = manager.ensure(handle).handle

    assert wait_dead(server)  # the dead daemon's server went with the restart
    assert (handle.paths.pipe / PID_FILE).read_text().strip() == str(new.pid)
    assert tenant(new, "get_default_active_thread_percentage").strip() == "50.0"
    manager.stop(new)


def test_settings_a_client_changed_are_restored_and_reported(
    manager: MpsDaemonManager, observer: RecordingObserver
) -> None:
    handle = manager.start("tampered", [GPU], SETTINGS)
    tenant(handle, "set_default_active_thread_percentage 100")
    tenant(handle, f"set_default_device_pinned_mem_limit {GPU} 81559M")

    repair = manager.ensure(handle)

    assert repair.restarted is None
    assert repair.handle == handle
    assert repair.restored == (
        "active thread percentage 100, not 50",
        f"pinned memory limit of {GPU} 81559M, not 40779M",
    )
    assert double.read_state(handle.paths.pipe)["defaults"] == {
        "activeThreadPercentage": 50.0,
        "pinnedMemLimits": {GPU: "40779M"},
    }
    assert observer.repaired == [repair]
    manager.stop(handle)


def test_a_restart_that_fails_keeps_the_directories_and_is_reported(
    manager: MpsDaemonManager, observer: RecordingObserver
) -> None:
    handle = manager.start("fails", [GPU], SETTINGS)
    before = directories(handle)
    tenant(handle, "quit")
    assert wait_dead(handle.pid)
    manager.base_env["GPU_DRA_MPS_DOUBLE_FAIL_START"] = "no GPU"

    with pytest.raises(MpsStartError, match="restart in place after: control daemon pid"):
        manager.ensure(handle)

    assert directories(handle) == before
    assert [daemon for daemon, _ in observer.unrepaired] == ["fails"]
    assert "no GPU" in observer.unrepaired[0][1]
    del manager.base_env["GPU_DRA_MPS_DOUBLE_FAIL_START"]
    new = manager.ensure(handle).handle  # the next check succeeds
    assert directories(new) == before
    manager.stop(new)


def test_ensure_of_a_stopped_daemon_is_gone_and_restarts_nothing(
    manager: MpsDaemonManager,
) -> None:
    handle = manager.start("stopped", [GPU], SETTINGS)
    manager.stop(handle)

    with pytest.raises(MpsDaemonGoneError, match="is gone"):
        manager.ensure(handle)
    assert not handle.root.exists()


# ---- the pid file is not trusted ---------------------------------------------------------------


def test_a_forged_pid_file_does_not_make_a_running_daemon_dead(
    manager: MpsDaemonManager,
) -> None:
    handle = manager.start("forged", [GPU], SETTINGS)
    (handle.paths.pipe / PID_FILE).write_text(f"{os.getpid()}\n")

    assert manager.adopt(handle) == handle
    assert manager.ensure(handle).restarted is None
    assert manager.status(handle).state is DaemonState.READY
    manager.stop(handle)
    assert wait_dead(handle.pid)


def test_a_pid_file_naming_a_process_that_does_not_serve_the_pipe_is_not_believed(
    tmp_path: Path,
) -> None:
    paths = DaemonPaths(tmp_path / "daemon")
    paths.pipe.mkdir(parents=True)
    (paths.pipe / PID_FILE).write_text(f"{os.getpid()}\n")  # alive, but not a daemon of it

    with pytest.raises(MpsStartError, match=rf"names pid {os.getpid()}, which does not serve"):
        wait_for_daemon_pid(paths, time.monotonic() + 0.3, 0.3)

    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(paths.pipe)}
    with subprocess.Popen(["sleep", "30"], env=env) as daemon:
        try:
            (paths.pipe / PID_FILE).write_text(f"{daemon.pid}\n")
            identity = wait_for_daemon_pid(paths, time.monotonic() + 5, 5)
            assert identity.pid == daemon.pid
        finally:
            daemon.kill()


# ---- a read-only mount of the pipe directory ----------------------------------------------------

_TENANT = textwrap.dedent(
    """
    import os, subprocess, sys
    pipe, binary = sys.argv[1:3]
    for name, action in (
        ("remove", lambda: os.unlink(os.path.join(pipe, "control"))),
        ("rename", lambda: os.rename(os.path.join(pipe, "control"), os.path.join(pipe, "x"))),
        ("create", lambda: open(os.path.join(pipe, "evil"), "w").close()),
        ("pidfile", lambda: open(os.path.join(pipe, "nvidia-cuda-mps-control.pid"), "w")),
        ("rmdir", lambda: os.rmdir(pipe)),
    ):
        try:
            action()
            print(name, "ok")
        except OSError as error:
            print(name, error.errno)
    done = subprocess.run([binary], input="get_default_active_thread_percentage\\n",
                          capture_output=True, text=True,
                          env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe})
    print("query", done.returncode, done.stdout.strip())
    """
)


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
    return done.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unprivileged user and mount namespaces")
def test_through_a_read_only_mount_the_daemon_answers_and_no_file_can_change(
    manager: MpsDaemonManager, tmp_path: Path
) -> None:
    handle = manager.start("readonly", [GPU], SETTINGS)
    mounted = tmp_path / "nvidia-mps"
    mounted.mkdir()
    script = (
        f"mount --bind {handle.paths.pipe} {mounted} && "
        f"mount -o remount,bind,ro {mounted} && "
        f'exec "$0" -c "$1" {mounted} {DOUBLE_BINARY}'
    )
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, _TENANT],
        env=double_env(),
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )

    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines == {
        "remove": str(errno.EROFS),
        "rename": str(errno.EROFS),
        "create": str(errno.EROFS),
        "pidfile": str(errno.EROFS),
        "rmdir": str(errno.EBUSY),  # the mount point itself
        "query": "0 50.0",
    }
    assert {p.name for p in handle.paths.pipe.iterdir()} >= {double.SOCKET, PID_FILE}
    manager.stop(handle)
