"""MpsDaemonManager against the nvidia-cuda-mps-control test double: real processes, real files.

Every daemon lives under a per-test scratch root; the fixtures stop what a test started, kill
and report anything left, and the module ends by checking that no daemon or server of any of
its tests still runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin.mps import (
    DaemonHandle,
    DaemonPaths,
    DaemonState,
    MpsDaemonGoneError,
    MpsDaemonManager,
    MpsError,
    MpsSettings,
    MpsStartError,
    MpsStateError,
    PlainDirectoryShm,
    TmpfsShmMounter,
    claim_daemon_id,
)
from gpu_dra.kubelet_plugin.mps.control import ControlClient
from gpu_dra.kubelet_plugin.mps.daemon import INSTANCE_RECORD
from gpu_dra.kubelet_plugin.mps.process import ProcessIdentity, is_alive, start_time, wait_gone
from gpu_dra.kubelet_plugin.mps.shm import is_mount_point
from tests.doubles import nvidia_cuda_mps_control as double
from tests.doubles.mps_helpers import (
    DOUBLE_BINARY,
    double_env,
    kill_processes_under,
    processes_under,
    scratch_root,
)

CLAIM = "0f6c2c6e-8a3c-4d0e-9a63-8e2b5e0c1d11"
GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
SETTINGS = MpsSettings(active_thread_percentage=25, pinned_limits={GPU_B: "2048M", GPU_A: "10240M"})

_MODULE_ROOTS: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def no_process_outlives_the_module() -> Iterator[None]:
    yield
    leftovers = {str(root): processes_under(root) for root in _MODULE_ROOTS}
    for root in _MODULE_ROOTS:
        kill_processes_under(root)
    assert not any(leftovers.values()), f"MPS processes left running: {leftovers}"


@pytest.fixture
def root() -> Iterator[Path]:
    """A short scratch data dir; anything still running under it afterwards fails the test."""
    path = scratch_root()
    _MODULE_ROOTS.append(path)
    yield path
    leftovers = kill_processes_under(path)
    subprocess.run(["rm", "-rf", str(path)], check=False)
    assert not leftovers, f"test left MPS processes running: {leftovers}"


class RecordingShm:
    """A ShmMounter double: records calls, pretends to mount."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Path]] = []

    def mount(self, path: Path) -> bool:
        self.calls.append(("mount", path))
        return True

    def unmount(self, path: Path) -> None:
        self.calls.append(("unmount", path))


ManagerFactory = Callable[..., MpsDaemonManager]


@pytest.fixture
def make_manager(root: Path) -> Iterator[ManagerFactory]:
    """Managers on ``root`` running the double; daemons they started are stopped at the end."""
    managers: list[MpsDaemonManager] = []
    started: list[DaemonHandle] = []

    def make(**knobs: str) -> MpsDaemonManager:
        options = {k: knobs.pop(k) for k in list(knobs) if not k.isupper()}
        manager = MpsDaemonManager(
            root,
            binary=DOUBLE_BINARY,
            base_env=double_env(**{k.lower(): v for k, v in knobs.items()}),
            shm=options.pop("shm", PlainDirectoryShm()),  # type: ignore[arg-type]
            start_timeout_s=float(options.pop("start_timeout_s", 10.0)),
            stop_timeout_s=float(options.pop("stop_timeout_s", 5.0)),
            status_timeout_s=float(options.pop("status_timeout_s", 2.0)),
        )
        original_start = manager.start

        def start(*args: object, **kwargs: object) -> DaemonHandle:
            handle = original_start(*args, **kwargs)  # type: ignore[arg-type]
            started.append(handle)
            return handle

        manager.start = start  # type: ignore[method-assign]
        managers.append(manager)
        return manager

    yield make
    for handle in started:
        managers[0].stop(handle)


@pytest.fixture
def manager(make_manager: ManagerFactory) -> MpsDaemonManager:
    return make_manager()


def control_log(handle: DaemonHandle) -> list[str]:
    lines = (handle.paths.log / "control.log").read_text().splitlines()
    return [line.split("] ", 1)[1] for line in lines]


def commands(handle: DaemonHandle) -> list[str]:
    return [line.removeprefix("Cmd:") for line in control_log(handle) if line.startswith("Cmd:")]


def client_command(handle: DaemonHandle, command: str) -> str:
    return ControlClient(DOUBLE_BINARY, base_env=double_env()).run(handle.paths.pipe, command)


def alive(pid: int) -> bool:
    return start_time(pid) is not None


def server_identity(pid: int) -> ProcessIdentity:
    """The double's server `pid` by PID and start time, once it runs the server code (its
    command line ends in ``--server``)."""
    # Read until it shows: while the process execs, /proc/<pid>/cmdline is briefly empty.
    deadline = time.monotonic() + 5.0
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    while double.SERVER_FLAG.encode() not in cmdline and time.monotonic() < deadline:
        time.sleep(0.02)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert double.SERVER_FLAG.encode() in cmdline, cmdline
    started = start_time(pid)
    assert started is not None
    return ProcessIdentity(pid, started)


# -- start -------------------------------------------------------------------------------------


def test_start_applies_settings_in_order_before_any_server_spawns(
    manager: MpsDaemonManager,
) -> None:
    handle = manager.start(claim_daemon_id(CLAIM, [GPU_B, GPU_A]), [GPU_B, GPU_A], SETTINGS)

    assert commands(handle) == [
        "get_default_active_thread_percentage",  # readiness probe
        "set_default_active_thread_percentage 25",
        f"set_default_device_pinned_mem_limit {GPU_A} 10240M",
        f"set_default_device_pinned_mem_limit {GPU_B} 2048M",
        "get_default_active_thread_percentage",  # read back
        f"get_default_device_pinned_mem_limit {GPU_A}",
        f"get_default_device_pinned_mem_limit {GPU_B}",
    ]
    assert not [line for line in control_log(handle) if "server" in line.lower()]
    # The first client's server inherits the defaults.
    server_pid = int(client_command(handle, "start_server -uid 1000"))
    state = double.read_state(handle.paths.pipe)
    assert state["visibleDevices"] == [GPU_A, GPU_B]
    assert state["multiUser"] is False
    assert state["servers"] == [
        {
            "pid": server_pid,
            "uid": 1000,
            "status": "ACTIVE",
            "activeThreadPercentage": 25.0,
            "pinnedMemLimits": {GPU_A: "10240M", GPU_B: "2048M"},
        }
    ]


def test_start_returns_a_handle_of_a_running_daemon_with_its_directories(
    manager: MpsDaemonManager, root: Path
) -> None:
    daemon_id = claim_daemon_id(CLAIM, [GPU_A])
    handle = manager.start(daemon_id, [GPU_A], MpsSettings())

    assert handle.root == root / "mps" / daemon_id
    assert handle.devices == (GPU_A,)
    assert handle.runner == "process"
    assert handle.shm_mounted is False
    assert alive(handle.pid)
    assert start_time(handle.pid) == handle.pid_start_time
    assert handle.pid != os.getpid()
    assert os.getsid(handle.pid) != os.getsid(0)  # survives the plugin's session
    assert (handle.paths.pipe / "nvidia-cuda-mps-control.pid").read_text().strip() == str(
        handle.pid
    )
    for directory, mode in ((handle.paths.pipe, 0o755), (handle.paths.log, 0o755)):
        assert directory.stat().st_mode & 0o7777 == mode
    assert handle.paths.shm.stat().st_mode & 0o7777 == 0o1777
    assert manager.status(handle).state is DaemonState.READY
    # Without settings no set_default_* is issued and the daemon keeps its defaults.
    assert not [c for c in commands(handle) if c.startswith("set_")]


def test_handle_round_trips_through_checkpoint_json(manager: MpsDaemonManager) -> None:
    handle = manager.start(claim_daemon_id(CLAIM, [GPU_A, GPU_B]), [GPU_A, GPU_B], SETTINGS)
    assert DaemonHandle.from_state(json.loads(json.dumps(handle.to_state()))) == handle


def test_multi_user_starts_the_daemon_with_dash_m(manager: MpsDaemonManager) -> None:
    handle = manager.start("multi", [GPU_A], MpsSettings(multi_user=True))
    assert double.read_state(handle.paths.pipe)["multiUser"] is True


def test_start_waits_for_a_slow_daemon(make_manager: ManagerFactory) -> None:
    manager = make_manager(STARTUP_DELAY="0.3")
    began = time.monotonic()
    handle = manager.start("slow", [GPU_A], SETTINGS.__class__(active_thread_percentage=50))
    assert time.monotonic() - began >= 0.3
    assert manager.status(handle).state is DaemonState.READY


def test_start_replaces_a_leftover_daemon_of_the_same_id(make_manager: ManagerFactory) -> None:
    crashed = make_manager().start("again", [GPU_A], MpsSettings(active_thread_percentage=10))
    server = int(client_command(crashed, "start_server -uid 0"))

    handle = make_manager().start("again", [GPU_A], MpsSettings(active_thread_percentage=20))

    assert not alive(crashed.pid)
    assert not alive(server)
    assert handle.pid != crashed.pid
    assert alive(handle.pid)
    assert double.read_state(handle.paths.pipe)["defaults"]["activeThreadPercentage"] == 20.0
    # Every handle of an id names its current instance: stopping the stale one stops it.
    assert make_manager().adopt(crashed) == handle
    make_manager().stop(crashed)
    assert not alive(handle.pid)
    assert not handle.root.exists()


def test_removing_a_leftover_kills_a_daemon_forked_while_its_launcher_is_killed(
    make_manager: ManagerFactory, root: Path
) -> None:
    # A plugin killed while ``nvidia-cuda-mps-control -d`` was forking its daemon: start-up
    # removes the unrecorded daemon's leftovers while the launcher forks the daemon (here:
    # when it is stopped), so the daemon appears after the first scan of the processes.
    manager = make_manager()
    paths = DaemonPaths.of(root, "launching")
    paths.pipe.mkdir(parents=True)
    launcher = textwrap.dedent(
        """
        import os, signal, sys, time
        def fork_daemon(*_):
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.setsid()
                time.sleep(60)
            os._exit(0)
        signal.signal(signal.SIGTERM, fork_daemon)
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(paths.pipe)}
    with subprocess.Popen(
        [sys.executable, "-c", launcher], env=env, stdout=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"

        manager.remove_leftover("launching")

        assert process.wait(timeout=10) == 0
    assert processes_under(root) == []
    assert not paths.root.exists()


# -- start failures leave nothing behind ---------------------------------------------------------


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        pytest.param({"FAIL_START": "no GPU"}, "exited with 1: .*no GPU", id="launch-fails"),
        pytest.param(
            {"NEVER_READY": "1", "start_timeout_s": "0.5"},
            "did not answer within 0.5s",
            id="never-ready",
        ),
        pytest.param(
            {"FAIL_COMMAND": "set_default_device_pinned_mem_limit"},
            "set_default_device_pinned_mem_limit GPU-.* failed",
            id="setting-refused",
        ),
        pytest.param(
            {"FAIL_COMMAND": "get_default_device_pinned_mem_limit"},
            "get_default_device_pinned_mem_limit GPU-.* failed",
            id="read-back-fails",
        ),
    ],
)
def test_failed_start_leaves_no_process_and_no_directory(
    make_manager: ManagerFactory, root: Path, knobs: dict[str, str], message: str
) -> None:
    manager = make_manager(**knobs)
    with pytest.raises(MpsStartError, match=message) as caught:
        manager.start(claim_daemon_id(CLAIM, [GPU_A, GPU_B]), [GPU_A, GPU_B], SETTINGS)
    assert CLAIM in str(caught.value)
    assert processes_under(root) == []
    assert list((root / "mps").iterdir()) == []


def test_daemon_dying_during_start_up_is_reported_with_its_log(
    make_manager: ManagerFactory, root: Path
) -> None:
    manager = make_manager(STARTUP_DELAY="5")
    pid_file = root / "mps" / "dies" / "pipe" / "nvidia-cuda-mps-control.pid"

    def kill_when_started() -> None:
        deadline = time.monotonic() + 5
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_started)
    killer.start()
    try:
        with pytest.raises(MpsStartError, match=r"exited"):
            manager.start("dies", [GPU_A], MpsSettings())
    finally:
        killer.join()
    assert processes_under(root) == []
    assert not (root / "mps" / "dies").exists()


def test_missing_binary_fails_start_cleanly(root: Path) -> None:
    manager = MpsDaemonManager(root, binary=root / "nope", shm=PlainDirectoryShm())
    with pytest.raises(MpsStartError, match="cannot run"):
        manager.start("nobin", [GPU_A], MpsSettings())
    assert list((root / "mps").iterdir()) == []


def test_settings_for_devices_the_daemon_does_not_have_are_refused(
    manager: MpsDaemonManager, root: Path
) -> None:
    with pytest.raises(ValueError, match="not a daemon device"):
        manager.start("bad", [GPU_A], MpsSettings(pinned_limits={GPU_B: "1M"}))
    assert not (root / "mps").exists()


def test_a_data_dir_too_long_for_socket_paths_is_refused() -> None:
    with pytest.raises(ValueError, match="exceed 107 bytes"):
        MpsDaemonManager(Path("/" + "d" * 60), shm=PlainDirectoryShm())


# -- stop ----------------------------------------------------------------------------------------


def test_stop_quits_the_daemon_and_removes_everything(
    manager: MpsDaemonManager, root: Path
) -> None:
    handle = manager.start("stopme", [GPU_A], SETTINGS.__class__(active_thread_percentage=30))
    server = int(client_command(handle, "start_server -uid 0"))

    manager.stop(handle)

    assert not alive(handle.pid)
    assert not alive(server)
    assert processes_under(root) == []
    assert not handle.root.exists()
    manager.stop(handle)  # idempotent


def test_stop_kills_a_daemon_that_does_not_answer(make_manager: ManagerFactory, root: Path) -> None:
    manager = make_manager(stop_timeout_s="0.3")
    handle = manager.start("hung", [GPU_A], MpsSettings())
    double.inject_hang(handle.paths.pipe)

    manager.stop(handle)

    assert not alive(handle.pid)
    assert processes_under(root) == []
    assert not handle.root.exists()


def test_stop_sigkills_a_daemon_that_ignores_sigterm(
    make_manager: ManagerFactory, root: Path
) -> None:
    manager = make_manager(IGNORE_SIGTERM="1", stop_timeout_s="0.2")
    handle = manager.start("stubborn", [GPU_A], MpsSettings())
    double.inject_hang(handle.paths.pipe)
    began = time.monotonic()

    manager.stop(handle)

    assert time.monotonic() - began < 4
    assert not alive(handle.pid)
    assert not handle.root.exists()


def test_stop_after_the_daemon_died_kills_orphaned_servers(
    manager: MpsDaemonManager, root: Path
) -> None:
    handle = manager.start("orphans", [GPU_A], MpsSettings())
    server = server_identity(int(client_command(handle, "start_server -uid 0")))
    daemon = ProcessIdentity(handle.pid, handle.pid_start_time)
    os.kill(handle.pid, signal.SIGKILL)
    # SIGKILL is delivered asynchronously: wait until the daemon is really gone, so that stop()
    # meets a dead daemon (not one still answering, or dying under its feet).
    assert wait_gone(daemon, 10.0)
    assert is_alive(server)  # orphaned: it outlives its daemon
    assert server.pid in processes_under(root)

    manager.stop(handle)

    assert not is_alive(server)  # by PID and start time: a reused PID is not the server
    assert processes_under(root) == []
    assert not handle.root.exists()


def test_stop_unmounts_shm_before_removing_the_directories(
    make_manager: ManagerFactory,
) -> None:
    shm = RecordingShm()
    manager = make_manager(shm=shm)  # type: ignore[arg-type]
    handle = manager.start("shm", [GPU_A], MpsSettings())
    assert handle.shm_mounted is True
    manager.stop(handle)
    assert shm.calls == [("mount", handle.paths.shm), ("unmount", handle.paths.shm)]


def test_failed_start_unmounts_shm(make_manager: ManagerFactory) -> None:
    shm = RecordingShm()
    manager = make_manager(shm=shm, FAIL_COMMAND="set_default_active_thread_percentage")  # type: ignore[arg-type]
    with pytest.raises(MpsStartError):
        manager.start("shmfail", [GPU_A], MpsSettings(active_thread_percentage=5))
    assert [call for call, _ in shm.calls] == ["mount", "unmount"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting tmpfs needs root")
def test_tmpfs_shm_is_mounted_for_the_daemon_and_unmounted_on_stop(
    make_manager: ManagerFactory,
) -> None:
    manager = make_manager(shm=TmpfsShmMounter(size="1m"))  # type: ignore[arg-type]
    try:
        handle = manager.start("tmpfs", [GPU_A], MpsSettings())
    except MpsStartError as error:
        if "mount" in str(error):
            pytest.skip(f"tmpfs cannot be mounted here: {error}")
        raise
    assert is_mount_point(handle.paths.shm)
    assert handle.paths.shm.stat().st_mode & 0o7777 == 0o1777
    manager.stop(handle)
    assert not is_mount_point(handle.paths.shm)
    assert not handle.root.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting tmpfs needs root")
def test_tmpfs_shm_under_a_linked_data_dir_is_unmounted_on_stop(
    make_manager: ManagerFactory, tmp_path: Path
) -> None:
    """The kernel lists the resolved mount point; a data dir reached through a symlink (a
    linked /var/lib/kubelet) must still be unmounted, or the daemon's directory stays busy."""
    manager = make_manager(shm=TmpfsShmMounter(size="1m"))  # type: ignore[arg-type]
    handle = manager.start("linked", [GPU_A], MpsSettings())
    link = tmp_path / "linked-shm"
    link.symlink_to(handle.paths.shm)
    assert is_mount_point(link)
    manager.stop(handle)
    assert not is_mount_point(link)


def test_is_mount_point_reads_the_resolved_path(tmp_path: Path) -> None:
    real = tmp_path / "real dir"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    mountinfo = tmp_path / "mountinfo"
    escaped = str(real).replace(" ", "\\040")
    mountinfo.write_text(f"36 35 0:40 / {escaped} rw,nosuid - tmpfs tmpfs rw\n")

    assert is_mount_point(link, mountinfo)
    assert is_mount_point(real, mountinfo)
    assert not is_mount_point(tmp_path, mountinfo)


# -- status --------------------------------------------------------------------------------------


def test_status_reports_a_dead_daemon(manager: MpsDaemonManager) -> None:
    handle = manager.start("dead", [GPU_A], MpsSettings())
    os.kill(handle.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive(handle.pid) and time.monotonic() < deadline:
        time.sleep(0.01)

    status = manager.status(handle)

    assert status.state is DaemonState.DEAD
    assert not status.healthy
    assert str(handle.pid) in status.detail


def test_status_reports_fault_and_recovery(manager: MpsDaemonManager) -> None:
    handle = manager.start("fault", [GPU_A], MpsSettings())
    assert manager.status(handle).healthy

    double.inject_fault(handle.paths.pipe)
    status = manager.status(handle)
    assert status.state is DaemonState.FAULT
    assert len(status.faulted_servers) == 1
    assert "FAULT" in status.detail

    double.inject_fault(handle.paths.pipe, on=False)
    assert manager.status(handle).state is DaemonState.READY


def test_status_reports_an_unresponsive_daemon(make_manager: ManagerFactory) -> None:
    manager = make_manager(status_timeout_s="0.3", stop_timeout_s="0.2")
    handle = manager.start("mute", [GPU_A], MpsSettings())
    double.inject_hang(handle.paths.pipe)
    status = manager.status(handle)
    assert status.state is DaemonState.UNRESPONSIVE
    assert "no answer" in status.detail


def test_status_does_not_mistake_a_reused_pid_for_the_daemon(manager: MpsDaemonManager) -> None:
    handle = manager.start("reuse", [GPU_A], MpsSettings())
    impostor = replace(handle, pid=os.getpid(), pid_start_time=start_time(os.getpid()) or 0)
    impostor = replace(impostor, pid_start_time=impostor.pid_start_time + 1)
    # The plugin's instance record names the daemon: any handle of the id resolves to it.
    assert manager.status(impostor).state is DaemonState.READY
    (handle.root / INSTANCE_RECORD).unlink()
    assert manager.status(impostor).state is DaemonState.DEAD


# -- adopt after a plugin restart ----------------------------------------------------------------

_PLUGIN = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from gpu_dra.kubelet_plugin.mps import MpsDaemonManager, MpsSettings, PlainDirectoryShm
    root, binary, gpu = sys.argv[1:4]
    manager = MpsDaemonManager(Path(root), binary=binary, shm=PlainDirectoryShm())
    handle = manager.start("adopted", [gpu], MpsSettings(active_thread_percentage=40))
    print(json.dumps(handle.to_state()), flush=True)
    time.sleep(60)
    """
)


def test_a_restarted_plugin_adopts_the_running_daemon_and_can_stop_it(
    root: Path, make_manager: ManagerFactory
) -> None:
    plugin = subprocess.Popen(
        [sys.executable, "-c", _PLUGIN, str(root), str(DOUBLE_BINARY), GPU_A],
        env=double_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert plugin.stdout is not None
        state = json.loads(plugin.stdout.readline())
    finally:
        os.killpg(plugin.pid, signal.SIGKILL)  # the plugin crashes with its whole group
        plugin.wait()
        if plugin.stdout is not None:
            plugin.stdout.close()

    restarted = make_manager()  # a new manager object, as in the restarted plugin
    handle = restarted.adopt(DaemonHandle.from_state(state))

    assert alive(handle.pid)
    assert restarted.status(handle).state is DaemonState.READY
    restarted.stop(handle)
    assert not alive(handle.pid)
    assert processes_under(root) == []
    assert not handle.root.exists()


def test_adopt_verifies_the_daemon_still_holds_its_settings(manager: MpsDaemonManager) -> None:
    handle = manager.start("drift", [GPU_A], MpsSettings(active_thread_percentage=40))
    client_command(handle, "set_default_active_thread_percentage 90")
    with pytest.raises(MpsError, match="active thread percentage 90, not 40"):
        manager.adopt(handle)


def test_adopt_of_a_dead_daemon_raises_gone_and_stop_cleans_up(
    manager: MpsDaemonManager, root: Path
) -> None:
    handle = manager.start("gone", [GPU_A], MpsSettings())
    client_command(handle, "quit")
    deadline = time.monotonic() + 5
    while alive(handle.pid) and time.monotonic() < deadline:
        time.sleep(0.01)

    with pytest.raises(MpsDaemonGoneError, match=r"control daemon pid \d+ is gone"):
        manager.adopt(handle)
    manager.stop(handle)
    assert not handle.root.exists()


def test_a_record_write_that_died_before_its_rename_leaves_nothing_after_adopt_or_a_restart(
    manager: MpsDaemonManager,
) -> None:
    """A plugin killed in a daemon record's write (crash point ``mps-record-before-rename``)
    leaves ``.daemon.json.<random>.tmp``; the adoption at start-up and the next record write
    (a restart in place) remove it."""
    handle = manager.start("record", [GPU_A], MpsSettings())
    left = handle.root / f".{INSTANCE_RECORD}.k1l1ed.tmp"
    left.write_text('{"half": ')

    assert manager.adopt(handle) == handle
    assert not left.exists()

    left.write_text('{"half": ')
    client_command(handle, "quit")
    deadline = time.monotonic() + 5
    while alive(handle.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    repair = manager.ensure(handle)  # restarted in place: the record is written anew
    assert repair.restarted is not None
    assert not left.exists()
    assert sorted(p.name for p in handle.root.iterdir() if p.name.startswith(".")) == []
    manager.stop(repair.handle)


def test_handles_of_another_runner_are_refused(manager: MpsDaemonManager, root: Path) -> None:
    handle = DaemonHandle(
        daemon_id="pod",
        devices=(GPU_A,),
        root=DaemonPaths.of(root, "pod").root,
        pid=1,
        pid_start_time=1,
        settings=MpsSettings(),
        runner="pod",
        shm_mounted=False,
    )
    for call in (manager.stop, manager.status, manager.adopt):
        with pytest.raises(MpsStateError, match="runner 'pod'"):
            call(handle)  # type: ignore[operator]
