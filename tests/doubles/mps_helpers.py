"""Helpers for tests that run the ``nvidia-cuda-mps-control`` test double.

Every daemon a test starts has its pipe directory under a scratch root; :func:`processes_under`
finds the processes (daemons, simulated servers) whose ``CUDA_MPS_PIPE_DIRECTORY`` lies under
such a root, so fixtures can check that a test left none behind and kill any that it did.
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
