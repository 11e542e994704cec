"""The `Tier` protocol of the prepare path: one handler per way of handing out devices.

A `Tier` (`.whole_gpu`, `.dynamic_mig`, `.claim_mps`, `.mps_shares`, `.capped_shares`,
`.timeslicing`) plans its part of a claim (a `TierPlan`; pure, before any lock), which is
checked against the other claims' records (under the device locks) and applied: each side effect
recorded in the claim's `PrepareStarted` entry (`PrepareRun.record`, keys in `.state`) before the
next. It undoes its part from the record alone, says what of a prepared claim is gone, adopts
what prepared claims hold at start-up, and sweeps what no record owns. A tier reads the plans of
the tiers planned before it only through `TierPlan`'s facts (`shared_devices`, `mps_daemons`),
never their types. `NodeClaimPreparer` (prepare.py) runs the tiers `.assembly` builds. See
docs/architecture.md, "Prepare and unprepare".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpu_dra.driver.config import ConfigGroup
from gpu_dra.driver.model import Gpu, MigDevice
from gpu_dra.kubelet_plugin.cdi import ContainerEdits
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords, started
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice


class PrepareError(Exception):
    """A claim cannot be prepared; the message is what the pod event shows."""


@dataclass(frozen=True)
class AllocatedResult:
    """One allocation result of this driver on this node."""

    request: str
    device: str
    admin_access: bool
    share_id: str | None
    consumed: Mapping[str, str] | None = None
    """``consumedCapacity`` (devices that allow multiple allocations)."""

    @property
    def base_request(self) -> str:
        return self.request.split("/", 1)[0]


def config_group_of(result: AllocatedResult, groups: Sequence[ConfigGroup]) -> ConfigGroup | None:
    """The config group ``result`` (its request and device) resolved to, if any."""
    return next(
        (
            group
            for group in groups
            if any(d.request == result.request and d.device == result.device for d in group.devices)
        ),
        None,
    )


@dataclass(frozen=True)
class ClaimRequest:
    """What a claim asks of this node: its results here and their resolved config groups."""

    claim: ClaimRef
    results: tuple[AllocatedResult, ...]
    groups: tuple[ConfigGroup, ...]

    @property
    def label(self) -> str:
        """``namespace/name``, as config errors name the claim."""
        return f"{self.claim.namespace}/{self.claim.name}"


@dataclass
class PrepareRun:
    """One prepare under way, after its first `PrepareStarted` record: what the tiers recorded
    and made so far. Tiers add to it in `TierPlan.apply`; a rollback undoes from ``state``."""

    claim: ClaimRef
    records: ClaimRecords
    inventory: NodeInventory
    state: dict[str, JsonValue]
    """The claim's `PrepareStarted` state: the tiers' intents, then what they made (on disk
    after `record`; may be ahead of the disk when a record failed)."""
    devices: tuple[PreparedDevice, ...] = ()
    """The devices being prepared, as the kubelet gets them; in every `PrepareStarted` record."""
    completed: dict[str, JsonValue] = field(default_factory=dict)
    """The state `PrepareCompleted` records beside the devices."""
    edits: dict[str, ContainerEdits] = field(default_factory=dict)
    """Container edits by device name, added after the device's own (an MPS daemon's pipe)."""
    made: dict[str, MigDevice] = field(default_factory=dict)
    """Devices made for the claim (dynamic MIG), by name; they stand in for the published
    partition device."""
    others: Mapping[str, CheckpointEntry] = field(default_factory=dict)
    """The other claims' records as `TierPlan.check` got them: read once, under the claim's
    device locks, which the run still holds (a shared MIG device is joined from them)."""

    recorded: bool = True
    """Whether this prepare records `PrepareStarted` (some plan `changes_node`); a run without
    it must not `record`, so a plan that changes the node cannot pass for one that does not."""

    def record(self) -> None:
        """Write ``state`` as the claim's `PrepareStarted` entry; returns once it is on disk."""
        if not self.recorded:
            raise AssertionError(
                f"claim {self.claim.uid}: a plan records its changes but no plan of the claim "
                "says it changes the node (TierPlan.changes_node)"
            )
        self.records.update(self.claim.uid, started(self.claim, self.state, self.devices))

    def append(self, key: str, value: JsonValue) -> None:
        """Add ``value`` to the list under ``key`` in ``state`` and ``completed``, and
        `record` at once: what was just made is on disk before anything else happens."""
        earlier = self.state.get(key)
        values = [*(earlier if isinstance(earlier, list) else []), value]
        self.state[key] = values
        self.completed[key] = list(values)
        self.record()

    def device(self, name: str) -> Gpu | MigDevice:
        """The device a container gets for ``name``: one made for the claim, or the published
        one."""
        device = self.made.get(name) or self.inventory.by_name(name)
        assert isinstance(device, Gpu | MigDevice)  # partitions are in `made` once applied
        return device


class RecordedShare(Protocol):
    """A share of a GPU a claim records under its tier's state key (MPS and capped shares)."""

    @property
    def device_name(self) -> str: ...

    def to_state(self) -> dict[str, JsonValue]: ...


def share_intents(key: str, shares: Sequence[RecordedShare]) -> Mapping[str, JsonValue]:
    """``{key: {device name: share}}`` for a claim's first `PrepareStarted` record, so that it
    does not hold the shares' GPUs whole; nothing without shares."""
    if not shares:
        return {}
    return {key: {share.device_name: share.to_state() for share in shares}}


class PlannedDaemon(Protocol):
    """A per-claim MPS daemon a plan starts: the devices it serves cannot be time-sliced."""

    @property
    def daemon_id(self) -> str: ...

    @property
    def device_names(self) -> tuple[str, ...]: ...

    @property
    def uuids(self) -> tuple[str, ...]: ...


class TierPlan(Protocol):
    """One tier's part of one claim. Subclass it to keep the defaults (nothing to do)."""

    @property
    def shared_devices(self) -> frozenset[str]:
        """Devices this plan hands out as shares (MPS or capped): the claim does not hold them
        whole, and other claims' shares of them do not exclude it."""
        return frozenset()

    @property
    def mps_daemons(self) -> Sequence[PlannedDaemon]:
        """The per-claim MPS daemons this plan starts."""
        return ()

    @property
    def changes_node(self) -> bool:
        """Whether `apply` or `apply_to_made` changes the node beyond the claim's CDI spec and
        claim files (a daemon, a MIG device, a setting), or holds what another claim's check
        must see while this prepare is under way: then the claim's `PrepareStarted` record is
        written before any tier applies. False only for a plan whose undo has nothing to do on
        the node (container edits and ``run.completed`` state at most); a claim whose plans all
        say so gets no `PrepareStarted` record (docs/architecture.md, "Claims without a
        PrepareStarted record"). True by default: a plan has to show it is safe to skip."""
        return True

    def check(self, others: Mapping[str, CheckpointEntry]) -> None:
        """Raise `PrepareError` when what other claims hold (their entries, read once under
        the claim's device locks) makes this part impossible."""
        return None

    def intents(self) -> Mapping[str, JsonValue]:
        """State for the claim's first `PrepareStarted` record, on disk before any tier
        applies: what a rollback after a crash must find (devices to destroy, settings to
        reset)."""
        return {}

    def apply(self, run: PrepareRun) -> None:
        """Make the changes (side effects), each recorded in ``run`` before the next; add
        ``run.completed`` state and container edits. Raising fails the claim; the tiers' `undo`
        then rolls back from ``run.state``."""
        return None

    def apply_to_made(self, run: PrepareRun) -> None:
        """Changes that need devices another tier made (``run.made``); after every `apply`."""
        return None


class Tier(Protocol):
    """One way of handing out devices: plans claims, undoes them, and cleans up at start-up.
    Subclass it to keep the defaults (nothing to undo, adopt or sweep). Blocking: every method
    but `plan` runs in a worker thread."""

    def plan(self, request: ClaimRequest, planned: Planned) -> TierPlan:
        """This tier's part of ``request`` (pure: no I/O). ``planned`` has the plans of the
        tiers planned before. Raises `PrepareError` (or a config error) naming what to fix."""
        ...

    def undo(
        self, claim_uid: str, entry: CheckpointEntry | None, pending: Mapping[str, JsonValue]
    ) -> None:
        """Undo what the claim's record (``entry``; None: none) and ``pending`` (the state of a
        prepare being rolled back, possibly ahead of the record) say this tier did, before the
        claim's CDI spec is removed. Idempotent; raising keeps the record for the next try."""
        return None

    def undo_devices(self, claim_uid: str, entry: CheckpointEntry | None) -> None:
        """Destroy the devices this tier made for the claim, once its CDI spec is gone."""
        return None

    def missing(self, entry: CheckpointEntry) -> list[str]:
        """What this tier made for the prepared claim ``entry`` that is gone now (a daemon that
        died, a MIG device destroyed), one phrase each; empty when all is there. Raises when it
        cannot tell (an NVML error is never "all there")."""
        return []

    def adopt(self, entry: CheckpointEntry) -> None:
        """At start-up: take over what a prepared claim holds (from an earlier process)."""
        return None

    def sweep(self, entries: Mapping[str, CheckpointEntry]) -> None:
        """At start-up, after interrupted prepares were rolled back: remove what this tier
        finds that no entry of ``entries`` records."""
        return None


class Planned:
    """The plans of one claim made so far, in planning order; a tier reads what the earlier
    ones planned through their facts."""

    def __init__(self) -> None:
        self._plans: dict[int, TierPlan] = {}

    def add(self, tier: Tier, plan: TierPlan) -> None:
        self._plans[id(tier)] = plan

    def of_tier(self, tier: Tier) -> TierPlan:
        return self._plans[id(tier)]

    @property
    def shared_devices(self) -> frozenset[str]:
        """The devices the plans so far hand out as shares."""
        return frozenset().union(*(plan.shared_devices for plan in self._plans.values()))

    @property
    def mps_daemons(self) -> tuple[PlannedDaemon, ...]:
        """The per-claim MPS daemons the plans so far start."""
        return tuple(d for plan in self._plans.values() for d in plan.mps_daemons)
