"""TEST DOUBLE: the control daemon of the ``nvidia-cuda-mps-control`` double.

The program, its interface and its knobs are described in :mod:`nvidia_cuda_mps_control` (the
entry point); this module is only imported in daemon mode, which keeps the client - started
once per control command - quick to start.
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
ENTRY_SCRIPT = Path(__file__).resolve().with_name("nvidia_cuda_mps_control.py")
_LIMIT = re.compile(r"([0-9]+)([MG])")


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
        self.closed = False

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
            [sys.executable, "-S", str(ENTRY_SCRIPT), SERVER_FLAG],
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
        if line == "quit":
            self.shutdown()  # servers stopped, socket and pid file gone before quit returns
        with contextlib.suppress(OSError):
            connection.sendall(reply.encode())
        return line == "quit"

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stop_servers()
        self.active_thread_percentage = 100.0
        self.pinned_limits.clear()
        for name in (SOCKET, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pipe / name)
        self.save()
        self.log("Exit")


def daemon_main(argv: list[str]) -> int:
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
