#!/usr/bin/env python3
"""TEST DOUBLE of NVIDIA's ``nvidia-cuda-mps-control`` (not NVIDIA software, drives no GPU).

gpu-dra's MPS daemon manager (:mod:`gpu_dra.kubelet_plugin.mps`) runs the control binary it is
given; unit, integration and e2e tests give it this program instead of the real one, so the
manager's real code paths (daemonizing, environment, control commands on stdin, readiness,
``quit``, kill, fault detection) run without a GPU. Standard library only, so it runs as a
plain script (``tests/doubles/bin/nvidia-cuda-mps-control`` wraps it under the real name),
with ``python -m tests.doubles.nvidia_cuda_mps_control``, or copied into an image together
with ``mps_double_daemon.py`` (the daemon, imported only in daemon mode so that the client,
started once per command, starts quickly).

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

import importlib
import os
import signal
import socket
import sys
from types import ModuleType

# Kept in step with mps_double_daemon (which the client does not import, to start quickly).
PID_FILE = "nvidia-cuda-mps-control.pid"
SOCKET = "control"
STATE_FILE = "mps-double-state.json"
FAULT_FILE = "mps-double-fault"
HANG_FILE = "mps-double-hang"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
SERVER_FLAG = "--server"


def read_state(pipe_dir: os.PathLike[str] | str) -> dict[str, object]:
    """The daemon's settings and servers as it last wrote them (for tests)."""
    import json  # noqa: PLC0415 - only tests call this; the client starts without json

    with open(os.path.join(pipe_dir, STATE_FILE)) as handle:
        result: dict[str, object] = json.load(handle)
    return result


def inject_fault(pipe_dir: os.PathLike[str] | str, *, on: bool = True) -> None:
    """Make the daemon's servers report FAULT (``on``) or ACTIVE again."""
    _flag(os.path.join(pipe_dir, FAULT_FILE), on)


def inject_hang(pipe_dir: os.PathLike[str] | str, *, on: bool = True) -> None:
    """Make the daemon stop answering (``on``) or answer again."""
    _flag(os.path.join(pipe_dir, HANG_FILE), on)


def _flag(path: str, on: bool) -> None:
    if on:
        with open(path, "w") as handle:
            handle.write("1\n")
    elif os.path.exists(path):
        os.unlink(path)


def _daemon_module() -> ModuleType:
    if __package__:
        return importlib.import_module(f"{__package__}.mps_double_daemon")
    return importlib.import_module("mps_double_daemon")  # run as a script: its directory


def _client_main() -> int:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIRECTORY)
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
    if args == [SERVER_FLAG]:  # a simulated MPS server: idles until killed
        while True:
            signal.pause()
    if "-v" in args:
        print("nvidia-cuda-mps-control test double (gpu-dra)")
        return 0
    if "-d" in args or "-f" in args:
        result: int = _daemon_module().daemon_main(args)
        return result
    if args:
        print(f"Unsupported arguments {args} (test double)", file=sys.stderr)
        return 1
    return _client_main()


if __name__ == "__main__":
    sys.exit(main())
