"""Whether the MPS daemons of MPS shares run: `SharedDaemonLiveness` for the health monitor.

The daemons a GPU's shares use are the shared daemons (`mps.shared_daemons`) that the checkpoint's
prepared claims record. Each is checked with the daemon manager's status (its pod or process,
its control pipe); one found DEAD in two checks in a row (the same daemon, by id and PID) is
reported, so that the moment between the last share's unprepare stopping its daemon and
dropping its checkpoint entry is not taken for a crash. Read-only: nothing is restarted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, CheckpointError, ClaimPhase
from gpu_dra.kubelet_plugin.mps import (
    DaemonHandle,
    DaemonState,
    DaemonStatus,
    MpsError,
    handles_from_state,
)
from gpu_dra.kubelet_plugin.mps.ids import is_shared_daemon

log = logging.getLogger(__name__)


class SharedDaemonLiveness:
    """`monitor.MpsLiveness` over the checkpoint (`entries`, e.g. ``Checkpoint.all``) and a
    daemon status check (``MpsDaemonManager.status``)."""

    def __init__(
        self,
        entries: Callable[[], Mapping[str, CheckpointEntry]],
        status: Callable[[DaemonHandle], DaemonStatus],
    ) -> None:
        self._entries = entries
        self._status = status
        self._dead_before: set[tuple[str, int]] = set()

    def dead_shared_daemons(self) -> dict[str, str]:
        try:
            entries = self._entries()
        except (OSError, CheckpointError) as error:
            raise RuntimeError(f"cannot read the checkpoint: {error}") from error
        handles: dict[tuple[str, int], DaemonHandle] = {}
        for uid, entry in sorted(entries.items()):
            if entry.phase is not ClaimPhase.PREPARE_COMPLETED:
                continue
            try:
                recorded = handles_from_state(entry.state)
            except MpsError as error:
                log.warning("health: MPS state of claim_uid=%s unusable: %s", uid, error)
                continue
            for handle in recorded:
                if is_shared_daemon(handle.daemon_id):
                    handles.setdefault((handle.daemon_id, handle.pid), handle)
        dead_now: dict[tuple[str, int], str] = {}
        for key, handle in handles.items():
            status = self._status(handle)
            if status.state is DaemonState.DEAD:
                dead_now[key] = status.detail or f"daemon {handle.daemon_id} is gone"
        reported = {}
        for key, detail in dead_now.items():
            if key in self._dead_before:
                for uuid in handles[key].devices:
                    reported[uuid] = f"{handles[key].daemon_id}: {detail}"
        self._dead_before = set(dead_now)
        return reported
