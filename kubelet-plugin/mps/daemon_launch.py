"""Launching an MPS control daemon, for `MpsDaemonManager` (start and restart in place): the
control binary's command line, the daemon's environment, and the wait until it answers on its
socket (`MpsStartError`, with the tail of its control log, when it exits first or the deadline
passes). See docs/mps.md#the-daemon.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

from gpu_dra.kubelet_plugin.mps.control import ControlClient
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonPaths,
    MpsCommandError,
    MpsSettings,
    MpsStartError,
)
from gpu_dra.kubelet_plugin.mps.process import ProcessIdentity, is_alive

SOCKET: Final = "control"
_LOG_TAIL: Final = 600


class DaemonLaunch:
    """The launch steps of `MpsDaemonManager`, which sets these attributes."""

    binary: str
    base_env: dict[str, str]
    client: ControlClient
    start_timeout_s: float

    def _command(self, settings: MpsSettings) -> list[str]:
        return [self.binary, "-d", *(["-M"] if settings.multi_user else [])]

    def _daemon_env(self, paths: DaemonPaths, uuids: Sequence[str]) -> dict[str, str]:
        return {
            **self.base_env,
            "CUDA_VISIBLE_DEVICES": ",".join(uuids),
            "CUDA_MPS_PIPE_DIRECTORY": str(paths.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(paths.log),
        }

    def _wait_ready(self, paths: DaemonPaths, identity: ProcessIdentity, deadline: float) -> None:
        """Until the daemon answers on its socket; it dying or the deadline is an error."""
        delay = 0.005
        last: MpsCommandError | None = None
        while True:
            if not is_alive(identity):
                raise MpsStartError(
                    f"the daemon (pid {identity.pid}) exited during start-up{self._log_tail(paths)}"
                )
            if (paths.pipe / SOCKET).exists():
                remaining = max(deadline - time.monotonic(), 0.1)
                try:
                    self.client.active_thread_percentage(paths.pipe, timeout_s=remaining)
                    return
                except MpsCommandError as error:
                    last = error
            if time.monotonic() >= deadline:
                why = f" (last probe: {last.reason})" if last else f" (no socket {SOCKET})"
                raise MpsStartError(
                    f"the daemon (pid {identity.pid}) did not answer within "
                    f"{self.start_timeout_s}s{why}{self._log_tail(paths)}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    @staticmethod
    def _log_tail(paths: DaemonPaths) -> str:
        try:
            text = (paths.log / "control.log").read_text(errors="replace").strip()
        except OSError:
            return ""
        return f"; control.log: {text[-_LOG_TAIL:]}" if text else ""
