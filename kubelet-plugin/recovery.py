"""Start-up recovery of this node's claims, run before the plugin serves.

Unfinished records of dead owners are undone (a `PrepareStarted` rolled back, an
`UnprepareStarted` finished), those of live instances left to them; the tiers adopt what
prepared claims hold and sweep what no record owns; temporaries of interrupted writes, CDI
specs and claim files nobody owns are removed. The caller holds the node lock exclusive.
`missing_parts` tells what a prepared claim lost (prepare then prepares it again). See
docs/architecture.md, "Claim states" and "Two instances on one node".
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.atomic_file import remove_temporaries
from gpu_dra.kubelet_plugin.blocking import in_thread_to_completion
from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore
from gpu_dra.kubelet_plugin.checkpoint import (
    BOOT_MARKER_FILE,
    CHECKPOINT_FILE,
    CheckpointEntry,
    ClaimPhase,
)
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.mig import MigError
from gpu_dra.kubelet_plugin.mps import MpsError
from gpu_dra.kubelet_plugin.tiers.protocol import Tier
from gpu_dra.kubelet_plugin.time_slicer import TimeSlicingError

log = logging.getLogger(__name__)

TIER_ERRORS = (MpsError, TimeSlicingError, MigError)
"""What the tiers' executors raise; each error says whether a retry can succeed."""

UNDOING = {
    ClaimPhase.PREPARE_STARTED: "rolling back an interrupted prepare",
    ClaimPhase.UNPREPARE_STARTED: "finishing an interrupted unprepare",
}
_UNFINISHED = {
    ClaimPhase.PREPARE_STARTED: "unfinished prepare",
    ClaimPhase.UNPREPARE_STARTED: "unfinished unprepare",
}


async def recover_claims(
    *,
    records: ClaimRecords,
    tiers: Sequence[Tier],
    cdi: ClaimSpecStore,
    data_dir: Path,
    claims_dir: Path,
    shared_dirs: Sequence[Path],
    owner_alive: Callable[[str | None], bool],
    undo: Callable[[str], None],
) -> None:
    """Undo, adopt, sweep and remove as the module says; ``shared_dirs`` hold files claims
    share (simulated fact files), ``undo`` removes one claim's everything
    (`NodeClaimPreparer._undo`), ``owner_alive`` tells whether a record's owner still runs."""
    entries = await asyncio.to_thread(records.all)
    for uid, entry in entries.items():
        if entry.phase is ClaimPhase.PREPARE_COMPLETED:
            await in_thread_to_completion(_adopt, tiers, entry)
        elif owner_alive(entry.owner):
            # Another instance runs: it finishes this at the claim's next call (which any
            # instance may get), not recovery behind its back.
            log.info(
                "%s left to its running instance claim_uid=%s owner=%s",
                _UNFINISHED[entry.phase],
                uid,
                entry.owner,
            )
        else:
            log.info("%s claim_uid=%s", UNDOING[entry.phase], uid)
            try:
                await in_thread_to_completion(undo, uid)
                crash_points.reached(crash_points.RECOVERY_AFTER_UNDO)
            except (*TIER_ERRORS, OSError) as error:
                # Kept in the checkpoint: the next prepare or unprepare retries.
                log.error("undo of claim_uid=%s incomplete: %s", uid, error)
    remaining = await asyncio.to_thread(records.all)  # what the rollbacks left
    await in_thread_to_completion(_sweep, tiers, remaining)
    await asyncio.to_thread(cdi.remove_temporaries)
    # The data dir's other files (simulated MIG state, time slices, shared fact files) are
    # written by any instance: their temporaries are removed only here, while none works.
    await asyncio.to_thread(remove_temporaries, data_dir, _not_the_checkpoint)
    for directory in shared_dirs:
        await asyncio.to_thread(remove_temporaries, directory)
    owned = {
        uid
        for uid, e in remaining.items()
        if e.phase is ClaimPhase.PREPARE_COMPLETED or owner_alive(e.owner)
    }
    await _remove_orphans(cdi, claims_dir, owned)


async def _remove_orphans(cdi: ClaimSpecStore, claims_dir: Path, owned: set[str]) -> None:
    """The CDI specs and claim files of claims not in ``owned``."""
    for uid in await asyncio.to_thread(cdi.claim_uids):
        if uid not in owned:
            log.info("removing orphaned CDI spec claim_uid=%s", uid)
            await asyncio.to_thread(cdi.remove, uid)
    for directory in await asyncio.to_thread(_claim_dirs, claims_dir):
        if directory.name not in owned:
            log.info("removing orphaned claim files claim_uid=%s", directory.name)
            await asyncio.to_thread(shutil.rmtree, directory, True)


def _claim_dirs(claims_dir: Path) -> list[Path]:
    return list(claims_dir.iterdir()) if claims_dir.exists() else []


def _adopt(tiers: Sequence[Tier], entry: CheckpointEntry) -> None:
    for tier in tiers:
        tier.adopt(entry)


def _sweep(tiers: Sequence[Tier], entries: Mapping[str, CheckpointEntry]) -> None:
    for tier in tiers:
        tier.sweep(entries)


def _not_the_checkpoint(target: str) -> bool:
    """Whether temporary files of writes of ``target`` are recovery's to remove (those of the
    checkpoint and its boot marker are `Checkpoint.load`'s, under the checkpoint lock)."""
    return target not in (CHECKPOINT_FILE, BOOT_MARKER_FILE)


def missing_parts(
    entry: CheckpointEntry,
    cdi: ClaimSpecStore,
    file_dirs: Sequence[Path],
    tiers: Sequence[Tier],
) -> list[str]:
    """What of the prepared claim ``entry`` is gone: its CDI spec, a file the plugin made
    that the spec mounts (one under ``file_dirs``: claim files, shared fact files), what the
    tiers made (daemons, MIG devices). Raises when a tier cannot tell."""
    missing = []
    if not cdi.path_for(entry.uid).exists():
        missing.append("its CDI spec is gone")
    for host_path in cdi.mounted_host_paths(entry.uid):
        path = Path(host_path)
        if any(path.is_relative_to(d) for d in file_dirs) and not path.exists():
            missing.append(f"its file {host_path} is gone")
    for tier in tiers:
        missing += tier.missing(entry)
    return missing
