"""Control commands through the control binary: ``echo <cmd> | nvidia-cuda-mps-control``.

One command per invocation, so a failure names its command. The daemon is addressed by its
pipe directory (``CUDA_MPS_PIPE_DIRECTORY``). The binary is the real
``nvidia-cuda-mps-control`` in production and the test double in tests; the real client's
exit status and error text on a refused command are not documented, so callers read values
back (``get_*``) instead of trusting a zero exit status alone.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from gpu_dra.kubelet_plugin.mps.daemon_model import MpsCommandError

_NUMBER: Final = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_MEMORY: Final = re.compile(r"([0-9]+)\s*([MG])")
_OUTPUT_SHOWN: Final = 500


class ControlClient:
    """Runs control commands against the daemon of a pipe directory."""

    def __init__(
        self,
        binary: str | Path,
        *,
        base_env: Mapping[str, str] | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.binary = str(binary)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.timeout_s = timeout_s

    def env(self, pipe_dir: Path) -> dict[str, str]:
        return {**self.base_env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}

    def run(self, pipe_dir: Path, command: str, *, timeout_s: float | None = None) -> str:
        """The command's stdout; `MpsCommandError` on a non-zero exit, timeout or no binary."""
        if "\n" in command or not command.strip():
            raise ValueError(f"one control command per call, got {command!r}")
        try:
            done = subprocess.run(
                [self.binary],
                input=f"{command}\n",
                env=self.env(pipe_dir),
                capture_output=True,
                text=True,
                timeout=self.timeout_s if timeout_s is None else timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            raise MpsCommandError(command, pipe_dir, f"no answer in {error.timeout}s") from error
        except OSError as error:
            raise MpsCommandError(
                command, pipe_dir, f"cannot run {self.binary}: {error}"
            ) from error
        if done.returncode != 0:
            text = (done.stderr.strip() or done.stdout.strip())[:_OUTPUT_SHOWN]
            raise MpsCommandError(command, pipe_dir, f"exit status {done.returncode}: {text}")
        return done.stdout

    def active_thread_percentage(self, pipe_dir: Path, *, timeout_s: float | None = None) -> float:
        """``get_default_active_thread_percentage`` (the device plugin's health probe)."""
        command = "get_default_active_thread_percentage"
        output = self.run(pipe_dir, command, timeout_s=timeout_s)
        numbers = _NUMBER.findall(output)
        if not numbers:
            raise MpsCommandError(command, pipe_dir, f"no percentage in {output[:100]!r}")
        return float(numbers[-1])

    def pinned_limit_mib(self, pipe_dir: Path, uuid: str) -> int | None:
        """``get_default_device_pinned_mem_limit <uuid>`` in MiB; None when there is none."""
        command = f"get_default_device_pinned_mem_limit {uuid}"
        output = self.run(pipe_dir, command)
        match = _MEMORY.search(output)
        if match is None:
            raise MpsCommandError(command, pipe_dir, f"no memory limit in {output[:100]!r}")
        mib = int(match[1]) * (1024 if match[2] == "G" else 1)
        return mib or None

    def server_pids(self, pipe_dir: Path, *, timeout_s: float | None = None) -> list[int]:
        """``get_server_list``: PIDs of the daemon's servers."""
        output = self.run(pipe_dir, "get_server_list", timeout_s=timeout_s)
        return [int(word) for word in output.split() if word.isdigit()]

    def server_status(self, pipe_dir: Path, pid: int, *, timeout_s: float | None = None) -> str:
        """``get_server_status <pid>``: ``ACTIVE`` or ``FAULT``."""
        output = self.run(pipe_dir, f"get_server_status {pid}", timeout_s=timeout_s)
        return output.strip().split()[-1].upper() if output.strip() else ""

    def run_all(self, pipe_dir: Path, commands: Sequence[str]) -> None:
        for command in commands:
            self.run(pipe_dir, command)
