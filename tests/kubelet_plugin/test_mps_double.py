"""The nvidia-cuda-mps-control test double behaves like the real program where the manager
relies on it, and ControlClient reads the real program's output formats."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin.mps import MpsCommandError
from gpu_dra.kubelet_plugin.mps.control import ControlClient
from gpu_dra.kubelet_plugin.mps.process import read_pid_file, start_time
from tests.doubles import nvidia_cuda_mps_control as double
from tests.doubles.mps_helpers import (
    DOUBLE_BINARY,
    DOUBLE_SCRIPT,
    daemon_processes_under,
    double_env,
    is_control_client,
    kill_processes_under,
    processes_under,
    scratch_root,
)

GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
_ROOTS: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def no_process_outlives_the_module() -> Iterator[None]:
    yield
    leftovers = {str(root): kill_processes_under(root) for root in _ROOTS}
    assert not any(leftovers.values()), f"MPS double processes left running: {leftovers}"


def settle(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Poll `condition` until it holds or `seconds` passed; the caller's assertions follow."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


class Daemon:
    """One double daemon in a scratch dir, driven through the double's own client."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pipe = root / "pipe"
        self.log = root / "log"
        self.pipe.mkdir()
        self.log.mkdir()

    def env(self, **knobs: str) -> dict[str, str]:
        return {
            **double_env(**knobs),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log),
            "CUDA_VISIBLE_DEVICES": f"{GPU_A},{GPU_B}",
        }

    def start(self, *flags: str, **knobs: str) -> subprocess.CompletedProcess[str]:
        done = self.run([str(DOUBLE_BINARY), "-d", *flags], "", **knobs)
        if done.returncode == 0:
            settle((self.pipe / double.SOCKET).exists)
        return done

    def send(self, *commands: str) -> subprocess.CompletedProcess[str]:
        return self.run([str(DOUBLE_BINARY)], "".join(f"{c}\n" for c in commands))

    def run(self, argv: list[str], stdin: str, **knobs: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            input=stdin,
            env=self.env(**knobs),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    root = scratch_root("gpu-dra-mps-double-")
    _ROOTS.append(root)
    yield Daemon(root)
    leftovers = kill_processes_under(root)
    subprocess.run(["rm", "-rf", str(root)], check=False)
    assert not leftovers, f"test left processes running: {leftovers}"


def log_lines(d: Daemon) -> list[str]:
    return [line.split("] ", 1)[1] for line in (d.log / "control.log").read_text().splitlines()]


def test_it_is_marked_as_a_test_double_and_executable() -> None:
    assert "TEST DOUBLE" in (double.__doc__ or "")
    assert "TEST DOUBLE" in DOUBLE_BINARY.read_text()
    for path in (DOUBLE_BINARY, DOUBLE_SCRIPT):
        assert path.stat().st_mode & stat.S_IXUSR
    version = subprocess.run(
        [sys.executable, "-m", "tests.doubles.nvidia_cuda_mps_control", "-v"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert "test double" in version.stdout


def test_daemon_mode_returns_at_once_and_leaves_a_daemon_in_its_own_session(
    daemon: Daemon,
) -> None:
    done = daemon.start()
    assert done.returncode == 0, done.stderr
    pid = read_pid_file(daemon.pipe)
    assert pid is not None
    assert start_time(pid) is not None
    assert os.getsid(pid) != os.getsid(0)
    # The double logs its second line just after listen(); the socket file exists from bind().
    settle(lambda: len(log_lines(daemon)) >= 2)
    assert log_lines(daemon)[:2] == [
        f"Starting control daemon using socket {daemon.pipe}/control",
        f"To connect CUDA applications to this daemon, set env "
        f"CUDA_MPS_PIPE_DIRECTORY={daemon.pipe}",
    ]
    assert daemon.send("quit").returncode == 0


def test_commands_answer_like_the_real_daemon(daemon: Daemon) -> None:
    daemon.start()
    done = daemon.send(
        "get_default_active_thread_percentage",
        "set_default_active_thread_percentage 25",
        "get_default_active_thread_percentage",
        f"set_default_device_pinned_mem_limit {GPU_A} 2G",
        "set_default_device_pinned_mem_limit 1 900M",
        f"get_default_device_pinned_mem_limit {GPU_A}",
        "get_default_device_pinned_mem_limit GPU-aaaa",  # unique prefix
        "get_server_list",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["100.0", "25.0", "2048M", "900M"]
    assert f"Cmd:set_default_device_pinned_mem_limit {GPU_A} 2G" in log_lines(daemon)
    daemon.send("quit")


@pytest.mark.parametrize(
    "command",
    [
        "set_default_active_thread_percentage 101",
        "set_default_device_pinned_mem_limit GPU-ffff 1M",
        "set_default_device_pinned_mem_limit 0 1Gi",
        "set_default_device_pinned_mem_limit 2 1M",
        "get_server_status 1",
        "frobnicate",
    ],
)
def test_refused_commands_exit_non_zero_with_a_message(daemon: Daemon, command: str) -> None:
    daemon.start()
    done = daemon.send(command)
    assert done.returncode == 1
    assert done.stderr.strip()
    assert f"Cmd:{command}" in log_lines(daemon)
    daemon.send("quit")


def test_defaults_set_after_a_server_spawned_only_reach_later_servers(daemon: Daemon) -> None:
    daemon.start()
    daemon.send("set_default_active_thread_percentage 50")
    first = int(daemon.send("start_server -uid 1000").stdout)
    assert daemon.send("set_default_active_thread_percentage 20").returncode == 0
    second = int(daemon.send("start_server -uid 0").stdout)

    servers = {s["pid"]: s for s in double.read_state(daemon.pipe)["servers"]}
    assert servers[first]["activeThreadPercentage"] == 50.0
    assert servers[second]["activeThreadPercentage"] == 20.0
    assert daemon.send("get_server_list").stdout.split() == [str(first), str(second)]
    assert processes_under(daemon.root)  # the servers are real processes
    daemon.send("quit")


def test_quit_stops_servers_removes_socket_and_pid_file_and_loses_settings(
    daemon: Daemon,
) -> None:
    daemon.start()
    daemon.send("set_default_active_thread_percentage 10", "start_server -uid 0")
    pid = read_pid_file(daemon.pipe)
    assert pid is not None

    assert daemon.send("quit").returncode == 0
    settle(lambda: not processes_under(daemon.root))

    assert processes_under(daemon.root) == []
    assert not (daemon.pipe / double.SOCKET).exists()
    assert read_pid_file(daemon.pipe) is None
    state = double.read_state(daemon.pipe)
    assert state["defaults"]["activeThreadPercentage"] == 100.0
    assert state["servers"] == []
    assert log_lines(daemon)[-1] == "Exit"


def test_a_second_daemon_on_the_same_pipe_directory_is_refused(daemon: Daemon) -> None:
    daemon.start()
    again = daemon.start()
    assert again.returncode == 1
    assert "already running" in again.stderr
    daemon.send("quit")


def test_the_client_fails_without_a_daemon(daemon: Daemon) -> None:
    done = daemon.send("get_server_list")
    assert done.returncode == 1
    assert "Cannot find MPS control daemon" in done.stderr


def test_multi_user_flag_and_fault_injection(daemon: Daemon) -> None:
    daemon.start("-M")
    assert double.read_state(daemon.pipe)["multiUser"] is True
    double.inject_fault(daemon.pipe)
    (server,) = daemon.send("get_server_list").stdout.split()
    assert daemon.send(f"get_server_status {server}").stdout.strip() == "FAULT"
    assert "fatal GPU error" in (daemon.log / "server.log").read_text()
    double.inject_fault(daemon.pipe, on=False)
    assert daemon.send(f"get_server_status {server}").stdout.strip() == "ACTIVE"
    daemon.send("quit")


def test_start_failure_knob(daemon: Daemon) -> None:
    done = daemon.start(FAIL_START="driver not loaded")
    assert done.returncode == 1
    assert "driver not loaded" in done.stderr
    assert read_pid_file(daemon.pipe) is None


# -- ControlClient against other output formats ----------------------------------------------------


def scripted_binary(tmp_path: Path, output: str, status: int = 0) -> Path:
    """A stand-in control binary that prints ``output`` and exits with ``status``."""
    path = tmp_path / "control"
    path.write_text(f"#!/bin/sh\ncat >/dev/null\nprintf '%s' '{output}'\nexit {status}\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize(("output", "value"), [("100.0\n", 100.0), ("25\n", 25.0)])
def test_percentage_is_read_from_either_format(tmp_path: Path, output: str, value: float) -> None:
    client = ControlClient(scripted_binary(tmp_path, output), base_env={})
    assert client.active_thread_percentage(tmp_path) == value


@pytest.mark.parametrize(
    ("output", "mib"), [("1024M\n", 1024), ("2G\n", 2048), ("0M\n", None), ("0\n", None)]
)
def test_pinned_limit_is_read_in_mib(tmp_path: Path, output: str, mib: int | None) -> None:
    client = ControlClient(scripted_binary(tmp_path, output), base_env={})
    if output == "0\n":
        with pytest.raises(MpsCommandError, match="no memory limit"):
            client.pinned_limit_mib(tmp_path, GPU_A)
    else:
        assert client.pinned_limit_mib(tmp_path, GPU_A) == mib


def test_client_errors_name_the_command_and_the_output(tmp_path: Path) -> None:
    client = ControlClient(scripted_binary(tmp_path, "boom", status=3), base_env={})
    with pytest.raises(MpsCommandError, match=r"'get_server_list' .* exit status 3: boom"):
        client.server_pids(tmp_path)
    with pytest.raises(ValueError, match="one control command"):
        client.run(tmp_path, "quit\nquit")


def client_execd(pid: int) -> bool:
    """Whether ``pid`` runs the double itself (its wrapper has exec'd it)."""
    try:
        return b"nvidia_cuda_mps_control.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_a_control_client_in_flight_is_no_daemon_process(daemon: Daemon) -> None:
    # The e2e leak check of 2026-11-26 saw two processes of a fresh warm daemon: the daemon and
    # a control command the plugin was sending it (`ControlClient`: its own process, with the
    # daemon's CUDA_MPS_PIPE_DIRECTORY in its environment). Here the client waits on a daemon
    # that does not answer, so both are there at once.
    assert daemon.start().returncode == 0
    pid = read_pid_file(daemon.pipe)
    assert pid is not None
    double.inject_hang(daemon.pipe)
    client = subprocess.Popen(
        [str(DOUBLE_BINARY)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=daemon.env(),
        text=True,
    )
    try:
        assert client.stdin is not None
        client.stdin.write("get_server_list\n")
        client.stdin.flush()
        # The client starts as the double's sh wrapper, whose path helpers (a subshell,
        # readlink, dirname) carry the same environment until it execs the double.
        settle(lambda: client_execd(client.pid))

        assert sorted(processes_under(daemon.root)) == sorted([pid, client.pid])
        assert is_control_client(client.pid)
        assert not is_control_client(pid)
        assert daemon_processes_under(daemon.root) == [pid]
    finally:
        client.kill()
        client.communicate()  # reaped, its stdin closed
    # A server is the daemon's, and counts.
    double.inject_hang(daemon.pipe, on=False)
    server = int(daemon.send("start_server -uid 0").stdout.split()[0])
    assert sorted(daemon_processes_under(daemon.root)) == sorted([pid, server])
    assert daemon.send("quit").returncode == 0
