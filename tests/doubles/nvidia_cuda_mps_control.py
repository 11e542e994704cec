#!/usr/bin/env python3
"""TEST DOUBLE of NVIDIA's ``nvidia-cuda-mps-control`` (not NVIDIA software, drives no GPU).

gpu-dra's MPS daemon manager (:mod:`gpu_dra.kubelet_plugin.mps`) runs the control binary it is
given; unit, integration and e2e tests give it this program instead of the real one, so the
manager's real code paths (daemonizing, environment, control commands on stdin, readiness,
``quit``, kill, fault detection) run without a GPU. Standard library only, so it runs as a
plain script (``tests/doubles/bin/nvidia-cuda-mps-control`` wraps it under the real name),
with ``python -m tests.doubles.nvidia_cuda_mps_control``, or copied into an image.

What it shares with the real program (``shared/reference/mps.md`` §1-3, §9):

* ``nvidia-cuda-mps-control -d [-M]`` starts a control daemon in the background (double fork,
  own session) and returns; ``-f`` runs it in the foreground. It takes
  ``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``), ``CUDA_MPS_LOG_DIRECTORY`` (default
  ``/var/log/nvidia-mps``) and ``CUDA_VISIBLE_DEVICES`` from its environment, writes
  ``nvidia-cuda-mps-control.pid`` and the ``control`` socket into the pipe directory and
  ``control.log`` (``Cmd:<command>`` per command) into the log directory. A second daemon on the
  same pipe directory is refused.
* Without arguments it is a client: one control command per stdin line, sent to the daemon of
  ``CUDA_MPS_PIPE_DIRECTORY``; answers go to stdout. Commands:
  ``set_default_active_thread_percentage <pct>``, ``get_default_active_thread_percentage``,
  ``set_default_device_pinned_mem_limit <dev> <N>M|<N>G``,
  ``get_default_device_pinned_mem_limit <dev>`` (``<dev>``: ordinal among
  ``CUDA_VISIBLE_DEVICES``, a UUID or a unique UUID prefix), ``start_server -uid <uid>``,
  ``get_server_list``, ``get_server_status <pid>``, ``quit``.
* ``set_default_*`` is accepted at any time, as by the real daemon, but only servers spawned
  afterwards inherit the values (each server records the defaults it was spawned with).
* ``quit`` stops the servers and the daemon and loses all settings.

What is its own (it is a double): daemon and client talk over the ``control`` unix socket with a
private line protocol (request: one command line; reply: ``OK`` or ``ERR`` line, then text); a
client error is a message on stderr and exit status 1. A "server" is a real idle child process
(``… --server``) carrying the daemon's environment, so leftovers of a killed daemon are visible
as processes, as with the real ``nvidia-cuda-mps-server``. The daemon keeps its settings in
``<pipe>/mps-double-state.json`` for tests to read (:func:`read_state`).

Fault injection for tests:

* file ``<pipe>/mps-double-fault``: the servers report ``FAULT`` (one is spawned first if none
  runs, since only a server can fault); removing it returns them to ``ACTIVE``.
* file ``<pipe>/mps-double-hang``: the daemon accepts connections but does not answer.
* env ``GPU_DRA_MPS_DOUBLE_FAIL_START=<message>``: ``-d`` fails before daemonizing.
* env ``GPU_DRA_MPS_DOUBLE_NEVER_READY=1``: the daemon writes its pid file but never opens its
  socket.
* env ``GPU_DRA_MPS_DOUBLE_STARTUP_DELAY=<seconds>``: the daemon opens its socket that late.
* env ``GPU_DRA_MPS_DOUBLE_FAIL_COMMAND=<command name>``: that command is answered with an error.
* env ``GPU_DRA_MPS_DOUBLE_IGNORE_SIGTERM=1``: the daemon survives SIGTERM (only SIGKILL stops it).

Unix socket paths are limited to 107 bytes; the double binds and connects relative to the pipe
directory, so long test paths work (the real daemon may not accept them).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
STATE_FILE = "mps-double-state.json"
FAULT_FILE = "mps-double-fault"
HANG_FILE = "mps-double-hang"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
DEFAULT_LOG_DIRECTORY = "/var/log/nvidia-mps"
SERVER_FLAG = "--server"
_LIMIT = re.compile(r"([0-9]+)([MG])")


def read_state(pipe_dir: Path) -> dict[str, Any]:
    """The daemon's settings and servers as it last wrote them (for tests)."""
    result: dict[str, Any] = json.loads((Path(pipe_dir) / STATE_FILE).read_text())
    return result


def inject_fault(pipe_dir: Path, *, on: bool = True) -> None:
    """Make the daemon's servers report FAULT (``on``) or ACTIVE again."""
    _flag(Path(pipe_dir) / FAULT_FILE, on)


def inject_hang(pipe_dir: Path, *, on: bool = True) -> None:
    """Make the daemon stop answering (``on``) or answer again."""
    _flag(Path(pipe_dir) / HANG_FILE, on)


def _flag(path: Path, on: bool) -> None:
    if on:
        path.write_text("1\n")
    else:
        path.unlink(missing_ok=True)


class CommandError(Exception):
    """A control command the daemon refuses; the message goes to the client's stderr."""


class Daemon:
    def __init__(self, env: dict[str, str], multi_user: bool) -> None:
        self.pipe = Path(env.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIRECTORY))
        self.log_dir = Path(env.get("CUDA_MPS_LOG_DIRECTORY", DEFAULT_LOG_DIRECTORY))
        visible = env.get("CUDA_VISIBLE_DEVICES", "")
        self.devices = [d.strip() for d in visible.split(",") if d.strip()]
        self.multi_user = multi_user
        self.fail_command = env.get("GPU_DRA_MPS_DOUBLE_FAIL_COMMAND", "")
        self.active_thread_percentage = 100.0
        self.pinned_limits: dict[str, str] = {}
        self.servers: dict[int, dict[str, Any]] = {}
        self.children: dict[int, subprocess.Popen[bytes]] = {}
        self.commands: list[str] = []

    # -- logging and state -------------------------------------------------------------------

    def log(self, message: str, file: str = "control.log") -> None:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        with (self.log_dir / file).open("a") as handle:
            handle.write(f"[{stamp} Control {os.getpid()}] {message}\n")

    def save(self) -> None:
        state = {
            "pid": os.getpid(),
            "visibleDevices": self.devices,
            "multiUser": self.multi_user,
            "defaults": {
                "activeThreadPercentage": self.active_thread_percentage,
                "pinnedMemLimits": self.pinned_limits,
            },
            "servers": list(self.servers.values()),
            "commands": self.commands,
        }
        temporary = self.pipe / f".{STATE_FILE}.tmp"
        temporary.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(temporary, self.pipe / STATE_FILE)

    # -- commands ----------------------------------------------------------------------------

    def device(self, name: str) -> str:
        if not self.devices:
            return name
        if name.isdigit():
            if int(name) >= len(self.devices):
                raise CommandError(f"Invalid device {name}")
            return self.devices[int(name)]
        matches = [d for d in self.devices if d.startswith(name)]
        if len(matches) != 1:
            raise CommandError(f"Invalid device {name}")
        return matches[0]

    def spawn_server(self, uid: int) -> int:
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), SERVER_FLAG],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.children[child.pid] = child
        self.servers[child.pid] = {
            "pid": child.pid,
            "uid": uid,
            "status": "ACTIVE",
            "activeThreadPercentage": self.active_thread_percentage,
            "pinnedMemLimits": dict(self.pinned_limits),
        }
        self.log(f"Starting new server {child.pid} for user {uid}")
        self.log(f"NEW SERVER {child.pid}: Ready")
        return child.pid

    def stop_servers(self) -> None:
        for pid, child in list(self.children.items()):
            child.kill()
            child.wait()
            self.log(f"Server {pid} exited with status 0")
        self.children.clear()
        self.servers.clear()

    def apply_fault_file(self) -> None:
        faulted = (self.pipe / FAULT_FILE).exists()
        if faulted and not self.servers:
            self.spawn_server(0)
        for server in self.servers.values():
            status = "FAULT" if faulted else "ACTIVE"
            if server["status"] != status:
                server["status"] = status
                if faulted:
                    self.log("Volta MPS: Server is handling a fatal GPU error", "server.log")

    def execute(self, line: str) -> str:
        words = line.split()
        name, args = words[0], words[1:]
        self.commands.append(line)
        self.log(f"Cmd:{line}")
        self.apply_fault_file()
        if name == self.fail_command:
            raise CommandError(f"{name} failed (GPU_DRA_MPS_DOUBLE_FAIL_COMMAND)")
        if name == "quit":
            return ""
        if name == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                value = float(args[0])
            except ValueError:
                raise CommandError(f"Invalid percentage {args[0]}") from None
            if not 0 <= value <= 100:
                raise CommandError(f"Invalid percentage {args[0]}")
            self.active_thread_percentage = value
            return ""
        if name == "get_default_active_thread_percentage" and not args:
            return f"{self.active_thread_percentage:.1f}"
        if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
            device = self.device(args[0])
            match = _LIMIT.fullmatch(args[1])
            if match is None:
                raise CommandError(f"Invalid memory limit {args[1]}: expected <N>M or <N>G")
            mib = int(match[1]) * (1024 if match[2] == "G" else 1)
            self.pinned_limits[device] = f"{mib}M"
            return ""
        if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.pinned_limits.get(self.device(args[0]), "0M")
        if name == "start_server" and len(args) == 2 and args[0] == "-uid" and args[1].isdigit():
            return str(self.spawn_server(int(args[1])))
        if name == "get_server_list" and not args:
            return "\n".join(str(pid) for pid in self.servers)
        if name == "get_server_status" and len(args) == 1 and args[0].isdigit():
            server = self.servers.get(int(args[0]))
            if server is None:
                raise CommandError(f"Server {args[0]} not found")
            return str(server["status"])
        raise CommandError(f"Unrecognized command or arguments: {line}")

    # -- serving -----------------------------------------------------------------------------

    def serve(self, never_ready: bool, startup_delay: float) -> None:
        os.chdir(self.pipe)  # bind relative to the pipe dir: no 107-byte socket path limit
        Path(PID_FILE).write_text(f"{os.getpid()}\n")
        self.log(f"Starting control daemon using socket {self.pipe / SOCKET}")
        self.save()
        if never_ready:
            while True:
                time.sleep(3600)
        time.sleep(startup_delay)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET)
        listener.bind(SOCKET)
        listener.listen(16)
        self.log(
            "To connect CUDA applications to this daemon, set env "
            f"CUDA_MPS_PIPE_DIRECTORY={self.pipe}"
        )
        while True:
            connection, _ = listener.accept()
            with connection:
                if self.handle(connection):
                    return

    def handle(self, connection: socket.socket) -> bool:
        """Answer one request; True when the daemon should exit."""
        data = b""
        while not data.endswith(b"\n"):
            chunk = connection.recv(4096)
            if not chunk:
                return False
            data += chunk
        while (self.pipe / HANG_FILE).exists():
            time.sleep(0.02)
        line = data.decode().strip()
        try:
            output = self.execute(line)
            reply = f"OK\n{output}"
        except CommandError as error:
            self.log(f"Error: {error}")
            reply = f"ERR\n{error}"
        self.save()
        with contextlib.suppress(OSError):
            connection.sendall(reply.encode())
        return line == "quit"

    def shutdown(self) -> None:
        self.stop_servers()
        self.active_thread_percentage = 100.0
        self.pinned_limits.clear()
        for name in (SOCKET, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pipe / name)
        self.save()
        self.log("Exit")


def _daemon_main(argv: list[str]) -> int:
    env = dict(os.environ)
    multi_user = "-M" in argv
    foreground = "-f" in argv
    failure = env.get("GPU_DRA_MPS_DOUBLE_FAIL_START")
    if failure:
        print(f"nvidia-cuda-mps-control (test double): {failure}", file=sys.stderr)
        return 1
    daemon = Daemon(env, multi_user)
    for directory in (daemon.pipe, daemon.log_dir):
        if not directory.is_dir():
            print(f"Directory {directory} does not exist", file=sys.stderr)
            return 1
    running = _running_pid(daemon.pipe)
    if running is not None:
        print(f"An instance of this daemon is already running (pid {running})", file=sys.stderr)
        return 1
    if not foreground:
        if os.fork():
            return 0  # the caller's process: -d returns at once, as the real program does
        os.setsid()
        if os.fork():
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
    ignore_term = env.get("GPU_DRA_MPS_DOUBLE_IGNORE_SIGTERM") == "1"
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else _exit_on_signal)
    try:
        daemon.serve(
            never_ready=env.get("GPU_DRA_MPS_DOUBLE_NEVER_READY") == "1",
            startup_delay=float(env.get("GPU_DRA_MPS_DOUBLE_STARTUP_DELAY", "0")),
        )
    except SystemExit:
        pass  # SIGTERM
    finally:
        daemon.shutdown()
    return 0


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _running_pid(pipe: Path) -> int | None:
    try:
        pid = int((pipe / PID_FILE).read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def _client_main() -> int:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIRECTORY))
    for raw in sys.stdin:
        line = raw.strip()
        if not line:
            continue
        try:
            os.chdir(pipe)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.connect(SOCKET)
                connection.sendall(f"{line}\n".encode())
                connection.shutdown(socket.SHUT_WR)
                reply = b""
                while chunk := connection.recv(65536):
                    reply += chunk
        except OSError as error:
            print(f"Cannot find MPS control daemon process ({pipe}: {error})", file=sys.stderr)
            return 1
        status, _, text = reply.decode().partition("\n")
        if status != "OK":
            print(text or "no answer from the MPS control daemon", file=sys.stderr)
            return 1
        if text:
            print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == [SERVER_FLAG]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        while True:
            time.sleep(3600)
    if "-v" in args:
        print("nvidia-cuda-mps-control test double (gpu-dra)")
        return 0
    if "-d" in args or "-f" in args:
        return _daemon_main(args)
    if args:
        print(f"Unsupported arguments {args} (test double)", file=sys.stderr)
        return 1
    return _client_main()


if __name__ == "__main__":
    sys.exit(main())
