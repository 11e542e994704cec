"""The MPS daemons claims' records name: which to stop on undo, which are dead, adoption at
start-up, and the start-up sweep of daemons no record names.

Both MPS tiers record their daemons' handles in one list (checkpoint state `MPS_STATE_KEY`, in
the order they started); each tier handles its own kind: per-claim daemons
(`tiers.claim_mps`) or per-GPU shared ones (`tiers.mps_shares`, told apart by id). See
docs/mps.md, "Lifecycle".
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonHandle,
    MpsControl,
    MpsDaemonGoneError,
    MpsError,
)
from gpu_dra.kubelet_plugin.mps.ids import is_shared_daemon
from gpu_dra.kubelet_plugin.mps.process import ProcessIdentity, is_alive
from gpu_dra.kubelet_plugin.tiers.state import handles_from_state

log = logging.getLogger(__name__)


def claim_handles(
    entry: CheckpointEntry | None, pending: Mapping[str, JsonValue], *, shared: bool
) -> list[DaemonHandle]:
    """The claim's daemons of one kind (shared or per-claim): those ``pending`` (the state of a
    prepare being rolled back, which may hold daemons not recorded yet) names, then those its
    record names. Raises `MpsError` when either is unusable."""
    handles = handles_from_state(pending)
    if entry is not None:
        handles += [h for h in handles_from_state(entry.state) if h not in handles]
    return [h for h in handles if is_shared_daemon(h.daemon_id) == shared]


def dead_daemons(
    mps: MpsControl | None, entry: CheckpointEntry, *, shared: bool
) -> list[tuple[DaemonHandle, str]]:
    """The daemons of one kind ``entry`` records that are not running, with why: the current
    instance of each (a restart in place leaves the claim's record naming the instance it
    joined) as `MpsControl.dead` judges it; without a manager, by the recorded process alone.
    Raises `MpsError` when the record is unusable."""
    dead: list[tuple[DaemonHandle, str]] = []
    for handle in claim_handles(entry, {}, shared=shared):
        if mps is not None:
            why = mps.dead(handle)
        elif not is_alive(ProcessIdentity(handle.pid, handle.pid_start_time)):
            why = f"pid {handle.pid} is gone"
        else:
            why = None
        if why is not None:
            dead.append((handle, why))
    return dead


def dead_phrase(handle: DaemonHandle, why: str) -> str:
    return f"MPS control daemon {handle.daemon_id} is not running ({why})"


def adopt_daemons(
    mps: MpsControl | None,
    entry: CheckpointEntry,
    *,
    shared: bool,
    lock: Callable[[str], AbstractContextManager[None]] = lambda _: contextlib.nullcontext(),
) -> None:
    """Re-attach to the daemons of one kind of a prepared claim, each under ``lock(daemon
    id)`` (the daemon's node-wide lock, which its starts, stops and repairs hold); a dead or
    faulty one is logged (the claim stays prepared: its pods keep running, unprepare cleans
    up)."""
    try:
        handles = [
            h for h in handles_from_state(entry.state) if is_shared_daemon(h.daemon_id) == shared
        ]
    except MpsError as error:
        log.error("mps state of claim_uid=%s unusable: %s", entry.uid, error)
        return
    for handle in handles:
        if mps is None:
            log.error(
                "claim_uid=%s has MPS daemon %s but MPS is not available in this plugin",
                entry.uid,
                handle.daemon_id,
            )
            continue
        try:
            with lock(handle.daemon_id):
                mps.adopt(handle)
            status = mps.status(handle)
        except MpsDaemonGoneError as error:
            log.error(
                "mps daemon of prepared claim is gone claim_uid=%s: %s; CUDA processes that "
                "start now run without MPS; unprepare cleans up",
                entry.uid,
                error,
            )
            continue
        except MpsError as error:
            log.error("mps daemon not adopted claim_uid=%s: %s", entry.uid, error)
            continue
        if not status.healthy:
            log.warning(
                "mps daemon adopted in state %s claim_uid=%s daemon_id=%s: %s",
                status.state,
                entry.uid,
                handle.daemon_id,
                status.detail,
            )


def remove_unrecorded(
    mps: MpsControl,
    entries: Mapping[str, CheckpointEntry],
    *,
    shared: bool,
    keep: Collection[str] = (),
) -> None:
    """Remove the daemons of one kind no entry of ``entries`` records: started by a plugin that
    died before it could record them (between `MpsControl.start` and the checkpoint write).
    ``keep``: ids that are no leftovers even when no entry records them (warm daemons)."""
    recorded: set[str] = set()
    for uid, entry in entries.items():
        try:
            recorded.update(h.daemon_id for h in handles_from_state(entry.state))
        except MpsError as error:
            # Its daemons cannot be told apart from leftovers: remove none at all.
            log.error("mps state of claim_uid=%s unusable, leftovers kept: %s", uid, error)
            return
    for daemon_id in mps.leftovers():
        if daemon_id in recorded or is_shared_daemon(daemon_id) != shared:
            continue
        if daemon_id in keep:
            log.info("mps warm daemon kept daemon_id=%s (no claim records it)", daemon_id)
            continue
        log.info("removing MPS daemon no claim records daemon_id=%s", daemon_id)
        try:
            mps.remove_leftover(daemon_id)
        except MpsError as error:
            log.error("mps leftover daemon_id=%s not removed: %s", daemon_id, error)
