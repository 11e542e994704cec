"""Prepared claims as the checkpoint records them; `ClaimRecords.update` is the one way to change
a claim's record.

Prepare, rollback, unprepare and recovery change records only through `update` (the phase
changes are the mutations below: `started`, `completed`, `unprepare_started`, `removed`); the
tiers and the rest of the plugin only read. An update returns once it is on disk, and updates of
claims prepared at the same time share writes. The caller holds the claim's lock, so updates of
one claim never race. Every entry written names this plugin instance (`owner`), whatever its
phase: recovery leaves the `PrepareStarted` and `UnprepareStarted` entries of instances that
still run to them. See docs/architecture.md, "Prepare and unprepare".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from gpu_dra.kubelet_plugin.checkpoint import (
    Checkpoint,
    CheckpointEntry,
    ClaimPhase,
    JsonValue,
    Mutation,
)
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice


class ClaimRecords:
    """The checkpoint's claim entries: reads, and `update`. Blocking (file I/O, fsync, the
    checkpoint's lock): call it from a worker thread."""

    def __init__(self, checkpoint: Checkpoint, *, owner: str | None = None) -> None:
        """``owner``: the token of this plugin instance (`plugin_instances.PluginInstance`), written
        into every entry; None writes none."""
        self._checkpoint = checkpoint
        self.owner = owner

    @property
    def data_dir(self) -> Path:
        """The checkpoint's directory."""
        return self._checkpoint.data_dir

    def get(self, claim_uid: str) -> CheckpointEntry | None:
        return self._checkpoint.get(claim_uid)

    def all(self) -> dict[str, CheckpointEntry]:
        return self._checkpoint.all()

    def others(self, claim_uid: str) -> dict[str, CheckpointEntry]:
        """Every entry but that of ``claim_uid``."""
        return {uid: e for uid, e in self._checkpoint.all().items() if uid != claim_uid}

    def update(self, claim_uid: str, mutate: Mutation) -> CheckpointEntry | None:
        """The only change of a claim's record: ``mutate`` gets its entry (None: none) and
        returns the one to keep (None: remove it); returns that once it is on disk. ``mutate``
        runs under the checkpoint's lock: quick, and no checkpoint calls. The entry kept names
        this instance as its owner."""
        owner = self.owner
        if owner is None:
            return self._checkpoint.update(claim_uid, mutate)

        def owned(entry: CheckpointEntry | None) -> CheckpointEntry | None:
            kept = mutate(entry)
            return None if kept is None else replace(kept, owner=owner)

        return self._checkpoint.update(claim_uid, owned)


def started(
    claim: ClaimRef, state: Mapping[str, JsonValue], devices: Sequence[PreparedDevice] = ()
) -> Mutation:
    """The claim's entry becomes `PrepareStarted` with ``state``: what the prepare under way
    has recorded so far (intents and what it made), enough to undo it after a crash, and the
    ``devices`` it prepares, so that other claims' checks see them while it is under way."""
    entry = CheckpointEntry(
        claim=claim, phase=ClaimPhase.PREPARE_STARTED, devices=tuple(devices), state=dict(state)
    )
    return lambda _: entry


def completed(
    claim: ClaimRef, devices: Sequence[PreparedDevice], state: Mapping[str, JsonValue]
) -> Mutation:
    """The claim's entry becomes `PrepareCompleted` with its prepared devices and ``state``."""
    entry = CheckpointEntry(
        claim=claim, phase=ClaimPhase.PREPARE_COMPLETED, devices=tuple(devices), state=dict(state)
    )
    return lambda _: entry


def unprepare_started(entry: CheckpointEntry | None) -> CheckpointEntry | None:
    """The claim's entry becomes `UnprepareStarted` (devices and state kept), before anything
    is torn down: from here on it is never taken for prepared, and a crash is finished by the
    next prepare or unprepare of the claim or at start-up."""
    if entry is None or entry.phase is not ClaimPhase.PREPARE_COMPLETED:
        return entry
    return replace(entry, phase=ClaimPhase.UNPREPARE_STARTED)


def removed(_: CheckpointEntry | None) -> None:
    """The claim's entry goes (the last step of an unprepare or a rollback)."""
    return None
