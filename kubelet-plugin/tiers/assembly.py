"""A node's tiers, built in one place, and the two orders they run in.

`node_tiers` builds the six tiers of one plugin instance from the parts start-up made (MPS
daemon manager, time slicer, dynamic MIG, memory-cap support); `NodeTiers` declares the
**planning** order (a tier may read the facts of the plans made before its own: the share
tiers first, so that per-claim MPS and the whole-GPU check know the shares; per-claim MPS before
time-slicing, which refuses MPS on a time-sliced GPU) and the **acting** order (checks, then
changes: time slices, MPS daemons, shares, MIG devices; undo runs in reverse, so MIG devices are
destroyed last, after their daemons). `NodeClaimPreparer` (prepare.py) runs them. See
docs/architecture.md, "Prepare and unprepare".
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.memory_limits import ShareMemory
from gpu_dra.kubelet_plugin.mig.claims import DynamicMig
from gpu_dra.kubelet_plugin.mps.daemon_model import MpsControl
from gpu_dra.kubelet_plugin.mps.shared_daemons import SharedDaemons
from gpu_dra.kubelet_plugin.mps.warm_policy import OFF, WarmPolicy
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_instances import PluginInstance
from gpu_dra.kubelet_plugin.tiers.capped_shares import CappedShareTier
from gpu_dra.kubelet_plugin.tiers.claim_mps import ClaimMpsTier
from gpu_dra.kubelet_plugin.tiers.dynamic_mig import DynamicMigTier
from gpu_dra.kubelet_plugin.tiers.mps_shares import MpsShareTier
from gpu_dra.kubelet_plugin.tiers.protocol import Tier
from gpu_dra.kubelet_plugin.tiers.timeslicing import TimeSlicingTier
from gpu_dra.kubelet_plugin.tiers.whole_gpu import WholeGpuTier
from gpu_dra.kubelet_plugin.time_slicer import TimeSlicer


@dataclass(frozen=True)
class NodeTiers:
    """The tiers of one plugin instance (see the module doc for the orders)."""

    whole_gpu: WholeGpuTier
    time_slicing: TimeSlicingTier
    claim_mps: ClaimMpsTier
    mps_shares: MpsShareTier
    capped_shares: CappedShareTier
    dynamic_mig: DynamicMigTier

    @property
    def planning(self) -> tuple[Tier, ...]:
        """The order the tiers plan a claim in."""
        return (
            self.mps_shares,
            self.capped_shares,
            self.claim_mps,
            self.time_slicing,
            self.dynamic_mig,
            self.whole_gpu,
        )

    @property
    def acting(self) -> tuple[Tier, ...]:
        """The order the tiers check and apply a claim in; undo runs in reverse."""
        return (
            self.whole_gpu,
            self.time_slicing,
            self.claim_mps,
            self.mps_shares,
            self.capped_shares,
            self.dynamic_mig,
        )

    @property
    def shared_daemons(self) -> SharedDaemons | None:
        """The shared MPS daemons of the share tier (None without MPS), for the warmer and
        the supervisor."""
        return self.mps_shares.shared


def node_tiers(
    records: ClaimRecords,
    inventory: NodeInventory,
    *,
    node_name: str,
    cdi: ClaimSpecStore,
    instance: PluginInstance | None = None,
    mps: MpsControl | None = None,
    time_slicer: TimeSlicer | None = None,
    dynamic_mig: DynamicMig | None = None,
    mps_share_max_percent: int = 100,
    mps_share_memory: ShareMemory | None = None,
    mps_share_warm: WarmPolicy = OFF,
    capped_share_memory: ShareMemory | None = None,
) -> NodeTiers:
    """The tiers of the plugin instance ``instance`` (None: the only one), recording through
    ``records`` (the same the preparer gets). What a part's absence means:

    `mps` starts and stops MPS control daemons; without it, claims asking for MPS fail.
    `time_slicer` sets time-slice intervals; without it, claims asking for TimeSlicing on full
    GPUs fail. `dynamic_mig` makes the MIG devices of partition devices; without it, claims with
    partition devices fail. `mps_share_max_percent` is the largest MPS share (`.mps_shares`).
    `mps_share_memory` says which GPUs' MPS shares the driver caps per container
    (`memory_limits`); `capped_share_memory` the same for capped shares (without it, claims
    with capped shares fail). `mps_share_warm`: whether the shared daemons of the offered GPUs
    are kept warm (`mps.warm_daemons`; the sweep then keeps those no claim records). `cdi`: the
    claims' specs (the preparer's), whose share pipe mounts an older plugin wrote read-write are
    made read-only.
    ``instance``'s node-wide locks are taken around daemon starts and stops, and the MIG sweep
    keeps what the records of its running peers name."""
    locks = None if instance is None else instance.locks

    def owner_alive(owner: str | None) -> bool:
        return instance is not None and instance.owner_alive(owner)

    return NodeTiers(
        whole_gpu=WholeGpuTier(),
        time_slicing=TimeSlicingTier(time_slicer, records, inventory, node_name=node_name),
        claim_mps=ClaimMpsTier(mps, inventory, node_name=node_name, locks=locks),
        mps_shares=MpsShareTier(
            mps,
            records,
            inventory,
            node_name=node_name,
            max_percent=mps_share_max_percent,
            locks=locks,
            memory=mps_share_memory,
            cdi=cdi,
            warm=mps_share_warm,
        ),
        capped_shares=CappedShareTier(
            inventory,
            None if capped_share_memory is None else capped_share_memory.support,
            report=None if capped_share_memory is None else capped_share_memory.report,
        ),
        dynamic_mig=DynamicMigTier(dynamic_mig, records, inventory, owner_alive=owner_alive),
    )
