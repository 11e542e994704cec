"""The time-slicing tier: the time-slice interval of full GPUs of a ``TimeSlicing`` config group.

NVIDIA-compatible (``nvidia-compat.md`` §8): each full GPU of the group gets its interval through
the `TimeSlicer` seam; ``MigDeviceConfig`` TimeSlicing on MIG devices is accepted and changes
nothing. The intervals are recorded before they are set (`state.TIME_SLICE_STATE_KEY`); "Not
Supported" fails the claim, except for interval Default, which needs no change. Undo resets them
to Default unless another claim still records the GPU. MPS and TimeSlicing on one GPU, or two
claims asking one GPU (adminAccess) for different intervals, are refused here. See
docs/config.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from gpu_dra.driver.config import ConfigGroup
from gpu_dra.driver.model import Gpu, MigDevice, MigPartition
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.mps import MpsError
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.tiers.protocol import (
    ClaimRequest,
    Planned,
    PlannedDaemon,
    PrepareError,
    PrepareRun,
    Tier,
    TierPlan,
)
from gpu_dra.kubelet_plugin.tiers.state import (
    TIME_SLICE_STATE_KEY,
    handles_from_state,
    time_slices_from_state,
    time_slices_to_state,
)
from gpu_dra.kubelet_plugin.time_slicer import (
    TimeSlicer,
    TimeSlicingError,
    TimeSlicingNotSupportedError,
    interval_name,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimeSlice:
    """One full GPU whose time-slice interval a claim sets."""

    device_name: str
    uuid: str
    product: str
    interval: int
    label: str
    """The config entry asking for it, as messages name it."""


@dataclass(frozen=True)
class TimeSlicePlan(TierPlan):
    """The intervals one claim sets, one per GPU, and its MPS daemons (which exclude them)."""

    slices: tuple[TimeSlice, ...]
    daemons: tuple[PlannedDaemon, ...]
    """The claim's per-claim MPS daemons (`PlannedDaemon`), planned before."""
    slicer: TimeSlicer | None

    @property
    def changes_node(self) -> bool:
        """Whether it sets an interval (the undo resets it)."""
        return bool(self.slices)

    def check(self, others: Mapping[str, CheckpointEntry]) -> None:
        """Refuse what other prepared claims make impossible on the same GPUs: a different
        interval, or MPS beside TimeSlicing (possible where adminAccess lets two claims hold one
        GPU), in either direction."""
        if not self.slices and not self.daemons:
            return
        mine = {ts.uuid: ts for ts in self.slices}
        mps_uuids = {uuid: daemon for daemon in self.daemons for uuid in daemon.uuids}
        for entry in others.values():
            other = entry.claim
            owner = f"claim {other.namespace}/{other.name} ({other.uid})"
            try:
                theirs = time_slices_from_state(entry.state)
                their_mps = {u for h in handles_from_state(entry.state) for u in h.devices}
            except (TimeSlicingError, MpsError) as error:
                raise PrepareError(
                    f"the sharing state of {owner} is unusable ({error}); cannot tell whether it "
                    "conflicts"
                ) from error
            for uuid, ts in mine.items():
                if uuid in their_mps:
                    raise PrepareError(
                        f"{ts.label}: device {ts.device_name} ({uuid}) runs an MPS daemon of "
                        f"{owner}; MPS and TimeSlicing cannot both be active on one GPU"
                    )
                if uuid in theirs and theirs[uuid] != ts.interval:
                    raise PrepareError(
                        f"{ts.label}: device {ts.device_name} ({uuid}) is already time-sliced "
                        f"with interval {interval_name(theirs[uuid])} by {owner}; this claim "
                        f"asks for {interval_name(ts.interval)}"
                    )
            for uuid, daemon in mps_uuids.items():
                if uuid in theirs:
                    raise PrepareError(
                        f"{daemon.daemon_id}: GPU {uuid} is time-sliced by {owner}; MPS and "
                        "TimeSlicing cannot both be active on one GPU"
                    )

    def intents(self) -> Mapping[str, JsonValue]:
        """The intervals about to be set: a crash before they are all set is rolled back."""
        if not self.slices:
            return {}
        intervals = {ts.uuid: ts.interval for ts in self.slices}
        return {TIME_SLICE_STATE_KEY: time_slices_to_state(intervals)}

    def apply(self, run: PrepareRun) -> None:
        """Set each GPU's interval; "Not Supported" fails the claim, except for Default: such a
        GPU has no other interval, nothing to change. The record keeps those set."""
        applied: dict[str, int] = {}
        for ts in self.slices:
            assert self.slicer is not None  # checked in plan
            try:
                self.slicer.set_interval(ts.uuid, ts.interval)
                crash_points.reached(crash_points.TIMESLICE_AFTER_SET)
            except TimeSlicingNotSupportedError as error:
                if ts.interval == 0:
                    log.warning(
                        "GPU %s (%s, %s) does not support time-slice intervals; interval "
                        "Default needs no change",
                        ts.device_name,
                        ts.uuid,
                        ts.product,
                    )
                    continue
                raise PrepareError(f"{ts.label}: {error.for_product(ts.product)}") from error
            applied[ts.uuid] = ts.interval
        if applied:
            run.completed[TIME_SLICE_STATE_KEY] = time_slices_to_state(applied)


class TimeSlicingTier(Tier):
    """`Tier` of time-slice intervals; plan it after the per-claim MPS tier. Without a
    `TimeSlicer`, claims asking for TimeSlicing on full GPUs fail."""

    def __init__(
        self,
        slicer: TimeSlicer | None,
        records: ClaimRecords,
        inventory: NodeInventory,
        *,
        node_name: str,
    ) -> None:
        self._slicer = slicer
        self._records = records
        self._inventory = inventory
        self._node = node_name

    def plan(self, request: ClaimRequest, planned: Planned) -> TimeSlicePlan:
        """The full GPUs whose interval the claim sets, one per GPU, by device name. MIG devices
        of a TimeSlicing group are a no-op (logged); a GPU asked for two intervals, or for MPS
        and TimeSlicing, is an error."""
        daemons = planned.mps_daemons
        slices: dict[str, TimeSlice] = {}
        for group in request.groups:
            for wanted in self._group_slices(group):
                earlier = slices.get(wanted.device_name)
                if earlier is not None and earlier.interval != wanted.interval:
                    raise PrepareError(
                        f"{group.origin.label}: device {wanted.device_name} is also in config "
                        f"group {earlier.label} with time-slice interval "
                        f"{interval_name(earlier.interval)}; one GPU has one interval (this "
                        f"entry asks for {interval_name(wanted.interval)})"
                    )
                slices.setdefault(wanted.device_name, wanted)
        for daemon in daemons:
            for name in daemon.device_names:
                if name in slices:
                    raise PrepareError(
                        f"{slices[name].label}: device {name} is time-sliced and also served by "
                        f"MPS daemon {daemon.daemon_id}; MPS and TimeSlicing cannot both be "
                        "active on one GPU"
                    )
        if slices and self._slicer is None:
            first = next(iter(slices.values()))
            raise PrepareError(
                f"{first.label}: time-slicing is not available on node {self._node}: the plugin "
                "has no nvidia-smi to set intervals with (--nvidia-smi; see its start-up log)"
            )
        return TimeSlicePlan(tuple(slices[name] for name in sorted(slices)), daemons, self._slicer)

    def _group_slices(self, group: ConfigGroup) -> list[TimeSlice]:
        """The full GPUs of one config group with strategy TimeSlicing, with its interval."""
        sharing = getattr(group.config, "sharing", None)
        if sharing is None or sharing.strategy != "TimeSlicing":
            return []
        slicing = getattr(sharing, "time_slicing_config", None)
        interval = 0 if slicing is None else slicing.nvidia_smi_value
        wanted = []
        for name in sorted({d.device for d in group.devices}):
            device = self._inventory.by_name(name)
            if isinstance(device, MigDevice | MigPartition):
                log.info(
                    "time-slicing on MIG device %s accepted as a no-op (%s): MIG devices "
                    "have no time-slice interval of their own",
                    name,
                    group.origin.label,
                )
                continue
            assert isinstance(device, Gpu)  # checked when the results were read
            wanted.append(
                TimeSlice(name, device.uuid, device.product_name, interval, group.origin.label)
            )
        return wanted

    def undo(
        self, claim_uid: str, entry: CheckpointEntry | None, pending: Mapping[str, JsonValue]
    ) -> None:
        if entry is not None:
            self._reset(claim_uid, time_slices_from_state(entry.state))

    def _reset(self, claim_uid: str, slices: Mapping[str, int]) -> None:
        """Set the GPUs of ``slices`` back to Default, except those another claim in the
        checkpoint still records. Every GPU is tried; the first failure is raised after."""
        if not slices:
            return
        if self._slicer is None:
            raise TimeSlicingError(
                f"claim {claim_uid} set time-slice intervals on {', '.join(sorted(slices))} but "
                "this plugin has no nvidia-smi to reset them with"
            )
        kept: set[str] = set()
        for entry in self._records.others(claim_uid).values():
            with contextlib.suppress(TimeSlicingError):
                kept.update(time_slices_from_state(entry.state))
        failures: list[TimeSlicingError] = []
        for uuid in sorted(slices):
            if uuid in kept:
                log.info("time-slice of uuid=%s kept: another claim still uses it", uuid)
                continue
            try:
                self._slicer.reset(uuid)
                crash_points.reached(crash_points.TIMESLICE_AFTER_RESET)
            except TimeSlicingNotSupportedError:
                log.info("time-slice reset of uuid=%s: not supported, nothing to reset", uuid)
            except TimeSlicingError as error:
                log.error(
                    "time-slice reset of uuid=%s failed claim_uid=%s: %s", uuid, claim_uid, error
                )
                failures.append(error)
        if failures:
            raise failures[0]
