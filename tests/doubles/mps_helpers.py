"""Helpers for tests that run the ``nvidia-cuda-mps-control`` test double.

Every daemon a test starts has its pipe directory under a scratch root; :func:`processes_under`
finds the processes (daemons, simulated servers, control clients in flight) whose
``CUDA_MPS_PIPE_DIRECTORY`` lies under such a root, so fixtures can check that a test left none
behind and kill any that it did; :func:`daemon_processes_under` leaves out the control clients
(one control command each, run by the plugin: not a daemon, and gone within its timeout).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

DOUBLES = Path(__file__).resolve().parent
DOUBLE_SCRIPT = DOUBLES / "nvidia_cuda_mps_control.py"
DOUBLE_BINARY = DOUBLES / "bin" / "nvidia-cuda-mps-control"
"""The double under the real program's name (a shell wrapper running ``$PYTHON``)."""


def double_env(**knobs: str) -> dict[str, str]:
    """This process's environment, the double run by this interpreter, plus fault knobs
    (``fail_command="quit"`` -> ``GPU_DRA_MPS_DOUBLE_FAIL_COMMAND=quit``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_MPS_DOUBLE_")}
    env["PYTHON"] = sys.executable
    env.update({f"GPU_DRA_MPS_DOUBLE_{k.upper()}": v for k, v in knobs.items()})
    return env


def scratch_root(prefix: str = "gpu-dra-mps-") -> Path:
    """A short directory under /tmp: unix socket paths stay below 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def processes_under(root: Path) -> list[int]:
    """PIDs of live processes whose ``CUDA_MPS_PIPE_DIRECTORY`` is under ``root``."""
    needle = f"CUDA_MPS_PIPE_DIRECTORY={root}/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X") and any(v.startswith(needle) for v in environ.split(b"\0")):
            found.append(int(entry.name))
    return found


DAEMON_FLAGS = frozenset({"-d", "-f", "--server"})
"""Arguments of a control daemon (``-d``, ``-f``) or a (simulated) server; a control client has
none of them."""


def is_control_client(pid: int) -> bool:
    """Whether ``pid`` is a control client: ``nvidia-cuda-mps-control`` (the real program or
    the double) run without a daemon flag, one command on its stdin. An unreadable process is
    not taken for one."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    names = [Path(arg).name for arg in argv]
    if DAEMON_FLAGS.intersection(argv) or "nvidia-cuda-mps-server" in names:
        return False
    return any(name in ("nvidia-cuda-mps-control", "nvidia_cuda_mps_control.py") for name in names)


def daemon_processes_under(root: Path) -> list[int]:
    """`processes_under` but the control clients (`is_control_client`): the daemons and their
    servers. A warm daemon shows one process here even while the plugin sends it commands."""
    return [pid for pid in processes_under(root) if not is_control_client(pid)]


def kill_processes_under(root: Path, *, grace_s: float = 2.0) -> list[int]:
    """SIGKILL what :func:`processes_under` still finds after ``grace_s`` (a daemon that was
    told to ``quit`` exits just after answering); returns those PIDs."""
    deadline = time.monotonic() + grace_s
    while (pids := processes_under(root)) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
