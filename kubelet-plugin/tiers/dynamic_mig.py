"""The dynamic-MIG tier: partition devices become MIG devices at prepare, and go at unprepare.

The claim's intents (parent, GI profile, placement) are in its first `PrepareStarted` record,
before any NVML call; the instances are made after the other tiers' changes, their ids recorded
at once, and the new devices stand in for the partitions in the CDI spec (`PrepareRun.made`).
Undo destroys them once the CDI spec is gone; start-up destroys every MIG instance of a
dynamic-MIG GPU that no prepared claim, nor a prepare of another running plugin instance,
records. The claims of a partition offered as MPS shares share its MIG device (made by the
first, destroyed after the last). A whole GPU another claim has MIG devices on,
and the reverse, are refused. The work is `DynamicMig`'s (`mig.claims`); see docs/mig.md, "Dynamic
MIG: lifecycle".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpu_dra.driver.model import Gpu, MigPartition
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.mig.claims import DynamicMig
from gpu_dra.kubelet_plugin.mig.instances import MigError
from gpu_dra.kubelet_plugin.mig.intents import MigIntent
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.tiers.protocol import (
    ClaimRequest,
    Planned,
    PrepareError,
    PrepareRun,
    Tier,
    TierPlan,
)
from gpu_dra.kubelet_plugin.tiers.state import (
    DYNAMIC_MIG_STATE_KEY,
    intents_from_state,
    intents_to_state,
)


@dataclass(frozen=True)
class MigPlan(TierPlan):
    """The MIG devices one claim makes, and the whole GPUs it holds (which exclude them)."""

    claim_uid: str
    to_make: tuple[MigIntent, ...]
    whole: tuple[Gpu, ...]
    dynamic_mig: DynamicMig | None

    @property
    def changes_node(self) -> bool:
        """Whether it makes or joins MIG devices (the undo destroys or leaves them)."""
        return bool(self.to_make)

    def check(self, others: Mapping[str, CheckpointEntry]) -> None:
        """Refuse a whole GPU another claim has MIG devices on, and a MIG device on a GPU
        another claim holds whole (the scheduler's counters prevent both; this guards races)."""
        if self.dynamic_mig is None or (not self.whole and not self.to_make):
            return
        conflict = self.dynamic_mig.conflict(self.claim_uid, self.to_make, self.whole, others)
        if conflict is not None:
            raise PrepareError(conflict)

    def intents(self) -> Mapping[str, JsonValue]:
        """Where each MIG device goes: on disk before any NVML call."""
        return {DYNAMIC_MIG_STATE_KEY: intents_to_state(self.to_make)} if self.to_make else {}

    def apply(self, run: PrepareRun) -> None:
        """Make the MIG devices and record their ids (the intents are on disk already)."""
        if not self.to_make:
            return
        assert self.dynamic_mig is not None  # checked in plan
        created, made = self.dynamic_mig.create(self.to_make, run.others)
        run.state[DYNAMIC_MIG_STATE_KEY] = intents_to_state(created)
        run.completed[DYNAMIC_MIG_STATE_KEY] = intents_to_state(created)
        run.made.update(made)
        run.record()
        crash_points.reached(crash_points.MIG_AFTER_RECORD)


class DynamicMigTier(Tier):
    """`Tier` of MIG devices made at prepare. Without `DynamicMig` (the plugin runs without
    dynamic MIG), claims with partition devices fail, and so does undoing a claim that
    recorded MIG devices."""

    def __init__(
        self,
        dynamic_mig: DynamicMig | None,
        records: ClaimRecords,
        inventory: NodeInventory,
        *,
        owner_alive: Callable[[str | None], bool] = lambda _: False,
    ) -> None:
        """``owner_alive`` tells whether the plugin instance that wrote a record still runs: the
        start-up sweep keeps the MIG devices of its `PrepareStarted` and `UnprepareStarted`
        claims too."""
        self._dynamic_mig = dynamic_mig
        self._records = records
        self._inventory = inventory
        self._owner_alive = owner_alive

    def plan(self, request: ClaimRequest, planned: Planned) -> MigPlan:
        """One intent per partition device; nothing is made yet."""
        partitions: dict[str, MigPartition] = {}
        whole: list[Gpu] = []
        for result in request.results:
            device = self._inventory.by_name(result.device)
            if isinstance(device, MigPartition):
                partitions[result.device] = device
            elif isinstance(device, Gpu) and not result.admin_access:
                whole.append(device)
        intents: Sequence[MigIntent] = ()
        if partitions:
            if self._dynamic_mig is None:
                raise PrepareError(
                    f"allocated device {min(partitions)} is a dynamic MIG partition, but this "
                    "plugin does not make MIG devices (it runs without dynamic MIG); the "
                    "ResourceSlice it came from is stale"
                )
            shared = {name for name in partitions if self._inventory.shared_gpu(name) is not None}
            intents = self._dynamic_mig.plan(partitions, shared)
        return MigPlan(request.claim.uid, tuple(intents), tuple(whole), self._dynamic_mig)

    def undo_devices(self, claim_uid: str, entry: CheckpointEntry | None) -> None:
        """Destroy the claim's MIG devices; raises, keeping the record for the next try, when
        one cannot be destroyed."""
        intents = [] if entry is None else intents_from_state(entry.state)
        if not intents:
            return
        if self._dynamic_mig is None:
            raise MigError(
                f"claim {claim_uid} has MIG devices ({', '.join(i.device for i in intents)}) but "
                "this plugin runs without dynamic MIG and cannot destroy them; restart it with "
                "dynamic MIG on"
            )
        self._dynamic_mig.release(claim_uid, intents, self._records.all())

    def missing(self, entry: CheckpointEntry) -> list[str]:
        """The claim's MIG devices that are gone; raises `MigError` when they cannot be listed
        (or this plugin runs without dynamic MIG)."""
        intents = intents_from_state(entry.state)
        if not intents:
            return []
        if self._dynamic_mig is None:
            raise MigError(
                f"claim {entry.uid} has MIG devices ({', '.join(i.device for i in intents)}) but "
                "this plugin runs without dynamic MIG and cannot check them; restart it with "
                "dynamic MIG on"
            )
        return self._dynamic_mig.missing(intents)

    def sweep(self, entries: Mapping[str, CheckpointEntry]) -> None:
        if self._dynamic_mig is not None:
            self._dynamic_mig.remove_unowned(entries, owner_alive=self._owner_alive)

    def unswept(self) -> dict[str, str]:
        """The GPUs (UUID -> why) whose sweep failed: not to be handed out whole until
        `sweep_again` succeeds."""
        return {} if self._dynamic_mig is None else self._dynamic_mig.unswept

    def sweep_again(self, gpu_uuid: str) -> str | None:
        """Sweep an unswept GPU again, keeping what the records name (under its lock)."""
        if self._dynamic_mig is None:
            return None
        return self._dynamic_mig.sweep_again(gpu_uuid, self._records.all())
