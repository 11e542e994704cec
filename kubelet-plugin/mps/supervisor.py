"""Daemon supervision: every MPS daemon a prepared claim uses is checked periodically.

`DaemonSupervisor.check` runs `MpsControl.ensure` once for each daemon id the
``PrepareCompleted`` claims of the checkpoint record: a daemon that died or was quit is
restarted in place, settings a client changed are set back; the manager's observer
(`mps.events.MpsEvents`) tells the affected claims and pods. `run` repeats it every
``interval_s`` (``--mps-daemon-check-interval``): a change is found within that interval plus
one check. A daemon being stopped meanwhile is skipped (its directory is gone). See
docs/mps.md, "Daemon supervision".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonHandle,
    DaemonRepair,
    MpsControl,
    MpsDaemonGoneError,
    MpsError,
    handles_from_state,
)

log = logging.getLogger(__name__)

Entries = Callable[[], Mapping[str, CheckpointEntry]]


class DaemonSupervisor:
    """Checks and repairs the daemons of prepared claims (see the module doc)."""

    def __init__(self, mps: MpsControl, entries: Entries, *, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"check interval must be positive, got {interval_s}")
        self._mps = mps
        self._entries = entries
        self.interval_s = interval_s

    def daemons(self) -> dict[str, DaemonHandle]:
        """One recorded handle per daemon id of the ``PrepareCompleted`` claims (any handle:
        `MpsControl.ensure` resolves the current instance)."""
        found: dict[str, DaemonHandle] = {}
        for uid, entry in sorted(self._entries().items()):
            if entry.phase is not ClaimPhase.PREPARE_COMPLETED:
                continue  # a prepare or rollback under way owns its daemons
            try:
                handles = handles_from_state(entry.state)
            except MpsError as error:
                log.error("mps state of claim_uid=%s unusable, not supervised: %s", uid, error)
                continue
            for handle in handles:
                found.setdefault(handle.daemon_id, handle)
        return found

    def check(self) -> list[DaemonRepair]:
        """One pass: `MpsControl.ensure` for every supervised daemon; the repairs made.
        Blocking: call it from a worker thread."""
        repairs = []
        for daemon_id, handle in sorted(self.daemons().items()):
            started = time.monotonic()
            try:
                repair = self._mps.ensure(handle)
            except MpsDaemonGoneError:
                log.debug("mps daemon stopped meanwhile daemon_id=%s", daemon_id)
                continue
            except MpsError as error:
                log.error("mps daemon not repaired daemon_id=%s: %s", daemon_id, error)
                continue
            if repair.changed:
                log.warning(
                    "mps daemon repaired daemon_id=%s restarted=%s restored=%s in %.3fs",
                    daemon_id,
                    repair.restarted,
                    list(repair.restored),
                    time.monotonic() - started,
                )
                repairs.append(repair)
        return repairs

    async def run(self) -> None:
        """`check` every ``interval_s`` until cancelled."""
        log.info("mps daemon supervision every %gs", self.interval_s)
        while True:
            try:
                await asyncio.to_thread(self.check)
            except Exception:
                log.exception("mps daemon supervision pass failed")
            await asyncio.sleep(self.interval_s)
