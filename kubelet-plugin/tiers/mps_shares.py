"""The MPS share tier: claims holding scheduler-accounted parts of one GPU or MIG device, served
by its one shared MPS daemon (`shared_daemons`).

A result on a device offered as shares (``--mps-shares``, ``--mps-shares-on-mig``,
``--mps-shares-on-dynamic-mig``) is a **share**: offered devices are share-only, so one that
consumed all of the device under a share's config is a share of all of it. Only a result that
consumed all of it under a config that is no share's (no MPS, or ``mpsConfig`` fields: allocated
through a whole-device class before those stopped selecting offered devices) is prepared as any
whole device. A share needs a
config with ``sharing.strategy: MPS`` and no ``mpsConfig`` fields, at most the largest share
allowed, one per device and claim. Its CDI devices get the daemon's pipe (read-only: the daemon
serves other tenants) and shm and the share's caps as client environment, plus - where the
driver enforces it (`memory_limits`; never on MIG devices) - its memory as
``NVIDIA_GPU_MEMORY_LIMIT``/``_REQUEST`` and the ``apply-cuda-memory-limits`` hook, which caps
each container's cgroup; its record keeps the daemon's handle and the share
(`state.SHARES_STATE_KEY`). A share of a dynamic MIG partition joins its daemon once the dynamic-MIG
tier has made (or found) the MIG device (`SharePlan.apply_to_made`). See docs/mps.md, "MPS
shares".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpu_dra.driver.config import ConfigGroup, MpsConfig, mps_config
from gpu_dra.driver.model import MigDevice, MigPartition
from gpu_dra.driver.shares import OfferedDevice, ShareError, ceiling, consumed_share, is_partial
from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore, ContainerEdits
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.memory_limits import Enforcement, MemoryLimitSupport, ShareMemory
from gpu_dra.kubelet_plugin.mps.daemon_model import MpsControl, MpsError
from gpu_dra.kubelet_plugin.mps.edits import workload_edits
from gpu_dra.kubelet_plugin.mps.ids import shared_daemon_id
from gpu_dra.kubelet_plugin.mps.recorded_daemons import (
    adopt_daemons,
    claim_handles,
    dead_daemons,
    dead_phrase,
    remove_unrecorded,
)
from gpu_dra.kubelet_plugin.mps.shared_daemons import PlannedShare, SharedDaemons
from gpu_dra.kubelet_plugin.mps.warm_policy import OFF, WarmPolicy
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.node_locks import NodeLocks
from gpu_dra.kubelet_plugin.tiers.protocol import (
    AllocatedResult,
    ClaimRequest,
    Planned,
    PrepareError,
    PrepareRun,
    Tier,
    TierPlan,
    config_group_of,
    share_intents,
)
from gpu_dra.kubelet_plugin.tiers.state import (
    MEMORY_ENFORCEMENT_KEY,
    MPS_STATE_KEY,
    SHARES_STATE_KEY,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharePlan(TierPlan):
    """The MPS shares of one claim, by device name."""

    shares: tuple[PlannedShare, ...]
    shared: SharedDaemons | None
    memory: ShareMemory | None = None

    @property
    def shared_devices(self) -> frozenset[str]:
        return frozenset(share.device_name for share in self.shares)

    @property
    def changes_node(self) -> bool:
        """Whether it joins (or starts) shared daemons (the undo leaves them)."""
        return bool(self.shares)

    def intents(self) -> Mapping[str, JsonValue]:
        return share_intents(SHARES_STATE_KEY, self.shares)

    def apply(self, run: PrepareRun) -> None:
        """Join each share's daemon; its handle is recorded before others could stop it. The
        shares of dynamic MIG partitions wait for their MIG devices (`apply_to_made`)."""
        self._join(run, [share for share in self.shares if not share.pending])

    def apply_to_made(self, run: PrepareRun) -> None:
        """Join the daemons of the MIG devices made (or found made by an earlier share) for the
        claim's partition shares, keyed by their UUIDs."""
        made = []
        for share in self.shares:
            if share.pending:
                device = run.made.get(share.device_name)
                if device is None:  # the dynamic-MIG tier makes every partition it is given
                    raise PrepareError(f"no MIG device was made for {share.device_name}")
                made.append(share.on(device))
        self._join(run, made)

    def _join(self, run: PrepareRun, shares: Sequence[PlannedShare]) -> None:
        if not shares:
            return
        support = self.memory.support if self.memory is not None else MemoryLimitSupport()
        watchdog = self.memory.watchdog if self.memory is not None else ""
        recorded = run.completed.get(SHARES_STATE_KEY)
        states: dict[str, JsonValue] = dict(recorded) if isinstance(recorded, dict) else {}
        for share in shares:
            assert self.shared is not None  # checked in plan
            handle = self.shared.join(
                run.claim.uid, share, lambda joined: run.append(MPS_STATE_KEY, joined.to_state())
            )
            mps = workload_edits(handle.paths, share.caps(), pipe_read_only=True)
            uuid, mib = share.device.uuid, share.size.memory_mib
            limit = support.edits(uuid, mib)
            run.edits[share.device_name] = ContainerEdits(
                env={**mps.env, **limit.env}, mounts=mps.mounts, hooks=limit.hooks
            )
            enforcement = support.enforcement(uuid)
            states[share.device_name] = {
                **share.to_state(),
                MEMORY_ENFORCEMENT_KEY: enforcement.value,
            }
            message = (
                f"MPS share of {uuid} ({mib} MiB, {share.size.compute_percent} % compute): "
                f"memory capped per container by the driver ({support.why(uuid)}), and per "
                "CUDA process by MPS"
                if enforcement is Enforcement.DRIVER
                else f"MPS share of {uuid} ({mib} MiB, {share.size.compute_percent} % "
                f"compute): memory capped per CUDA process by MPS only, which a process can "
                f"escape; not by the driver: {support.why(uuid)}"
                + (f"; {watchdog}" if watchdog else "")
            )
            log.info("mps share claim_uid=%s device=%s memory_enforcement=%s: %s",
                     run.claim.uid, share.device_name, enforcement.value, message)  # fmt: skip
            if self.memory is not None and self.memory.report is not None:
                self.memory.report(run.claim, message)
        run.completed[SHARES_STATE_KEY] = states


class MpsShareTier(Tier):
    """`Tier` of MPS shares. Without an MPS control daemon manager, claims with shares fail."""

    def __init__(
        self,
        mps: MpsControl | None,
        records: ClaimRecords,
        inventory: NodeInventory,
        *,
        node_name: str,
        max_percent: int,
        locks: NodeLocks | None = None,
        memory: ShareMemory | None = None,
        cdi: ClaimSpecStore | None = None,
        warm: WarmPolicy = OFF,
    ) -> None:
        """``locks``: the node's locks, when other plugin instances may share the daemons.
        ``memory``: which GPUs' shares the driver caps per container (the hook), and where
        each share's enforcement is reported; None: no GPU. ``cdi``: the claims' specs, whose
        pipe mounts an older plugin wrote read-write are made read-only (`adopt`, `missing`).
        ``warm``: whether the offered GPUs' daemons are kept warm (`mps.warm_daemons`): then
        the start-up sweep keeps those no claim records."""
        self._cdi = cdi
        self._warm = warm
        self._mps = mps
        self._memory = memory
        self._inventory = inventory
        self._node = node_name
        self._max_percent = max_percent
        self._shared = None
        if mps is not None:
            self._shared = SharedDaemons(mps, records, max_percent=max_percent, locks=locks)

    @property
    def shared(self) -> SharedDaemons | None:
        """The shared daemons (None without an MPS manager)."""
        return self._shared

    def warm_daemon_ids(self) -> frozenset[str]:
        """The ids of the daemons kept warm: those of the offered GPUs and static MIG devices,
        unless warm is off."""
        if not self._warm.warm:
            return frozenset()
        return frozenset(shared_daemon_id(d.uuid) for d in self._inventory.shared_devices)

    def plan(self, request: ClaimRequest, planned: Planned) -> SharePlan:
        try:
            shares = plan_shares(
                request.results,
                request.groups,
                self._inventory.shared_gpu,
                max_percent=self._max_percent,
            )
        except ShareError as error:
            raise PrepareError(str(error)) from error
        if shares and self._shared is None:
            raise PrepareError(
                f"device {shares[0].device_name} is an MPS share, but MPS is not available on "
                f"node {self._node}: the plugin has no MPS control daemon manager (see its "
                "start-up log)"
            )
        return SharePlan(tuple(shares), self._shared, self._memory)

    def undo(
        self, claim_uid: str, entry: CheckpointEntry | None, pending: Mapping[str, JsonValue]
    ) -> None:
        """Leave the shared daemons of the claim; the last claim recording one stops it."""
        handles = claim_handles(entry, pending, shared=True)
        if handles and self._shared is None:
            raise MpsError(
                f"claim {claim_uid} has MPS daemons ({', '.join(h.daemon_id for h in handles)})"
                " but this plugin has no MPS control daemon manager to stop them"
            )
        for handle in handles:
            assert self._shared is not None
            self._shared.release(claim_uid, handle)

    def missing(self, entry: CheckpointEntry) -> list[str]:
        """A dead shared daemon is restarted in place (`SharedDaemons.ensure`: the other
        shares have its directories mounted); missing only when that fails. A pipe mount an
        older plugin wrote read-write is made read-only first (`read_only_pipes`)."""
        self.read_only_pipes(entry)
        lost = []
        for handle, why in dead_daemons(self._mps, entry, shared=True):
            assert self._shared is not None  # dead_daemons judged it with the manager
            try:
                self._shared.ensure(handle)
            except MpsError as error:
                lost.append(f"{dead_phrase(handle, why)} and was not restarted: {error}")
        return lost

    def adopt(self, entry: CheckpointEntry) -> None:
        self.read_only_pipes(entry)
        if self._shared is None:
            adopt_daemons(self._mps, entry, shared=True)
        else:
            adopt_daemons(self._mps, entry, shared=True, lock=self._shared.lock)

    def read_only_pipes(self, entry: CheckpointEntry) -> list[str]:
        """Make the shared daemons' pipe directories read-only in the claim's CDI spec (a
        plugin before containment mounted them read-write): the containers created from now
        on cannot remove, replace or create files in them. What was changed."""
        if self._cdi is None:
            return []
        try:
            pipes = {str(h.paths.pipe) for h in claim_handles(entry, {}, shared=True)}
        except MpsError as error:
            log.error("mps state of claim_uid=%s unusable: %s", entry.uid, error)
            return []
        if not pipes:
            return []
        changed = self._cdi.make_mounts_read_only(entry.uid, pipes)
        if changed:
            log.warning(
                "mps share pipe mounted read-write by an older plugin, now read-only for new "
                "containers claim_uid=%s: %s",
                entry.uid,
                ", ".join(changed),
            )
        return changed

    def sweep(self, entries: Mapping[str, CheckpointEntry]) -> None:
        if self._mps is not None:
            remove_unrecorded(self._mps, entries, shared=True, keep=self.warm_daemon_ids())


def _set_fields(mps: MpsConfig) -> list[str]:
    """The ``mpsConfig`` fields a config sets (a share's caps come from its capacity)."""
    return sorted(name for name, value in mps.model_dump(by_alias=True).items() if value)


def plan_shares(
    results: Sequence[AllocatedResult],
    groups: Sequence[ConfigGroup],
    shared_gpu: Callable[[str], OfferedDevice | None],
    *,
    max_percent: int,
) -> list[PlannedShare]:
    """The results of ``results`` that are MPS shares, checked, by device name; `PrepareError`
    (or `gpu_dra.driver.shares.ShareError` for an unreadable consumedCapacity) naming the device
    and what to change. ``shared_gpu`` maps a device name to its GPU (or static MIG device) when
    that device is offered as MPS shares."""
    planned: dict[str, PlannedShare] = {}
    for result in results:
        gpu = shared_gpu(result.device)
        if gpu is None or result.admin_access:
            continue
        size = consumed_share(result.consumed, gpu)
        group = config_group_of(result, groups)
        mps = None if group is None else mps_config(group.config)
        fields = [] if mps is None else _set_fields(mps)
        if not is_partial(size, gpu) and (mps is None or fields):
            # All of the device under a config that is no share's: allocated through a
            # whole-device class before those stopped selecting offered devices (docs/mps.md),
            # so no share is beside it; prepared as the whole device, as then.
            continue
        where = f"device {result.device} (request {result.request}, {size})"
        if group is None or mps is None:
            mig = isinstance(gpu, MigDevice | MigPartition)
            raise PrepareError(
                f"{where} is an MPS share of the {'MIG device' if mig else 'GPU'}, but its config "
                "has no sharing.strategy MPS, so its caps could not be applied; use DeviceClass "
                f"{'mps.mig.nvidia.com' if mig else 'mps.gpu.nvidia.com'}, or add a "
                f"{'MigDeviceConfig' if mig else 'GpuConfig'} with sharing.strategy MPS"
            )
        if fields:
            raise PrepareError(
                f"{where}: {group.origin.label} sets mpsConfig {', '.join(fields)}, but an MPS "
                "share's caps come from its capacity request (memory, compute) and its GPU's "
                "daemon is shared; remove mpsConfig"
            )
        largest = ceiling(gpu, max_percent)
        if size.memory_bytes > largest.memory_bytes or size.compute_percent > max_percent:
            raise PrepareError(
                f"{where} is larger than the largest MPS share this node allows ({largest}; "
                f"--mps-share-max-percent={max_percent}); ask for at most that"
            )
        if result.device in planned:
            raise PrepareError(
                f"{where}: the claim holds two MPS shares of this device; ask for one share of the "
                "combined size in one request"
            )
        planned[result.device] = PlannedShare(result.device, gpu, size, result.share_id)
    return [planned[name] for name in sorted(planned)]
