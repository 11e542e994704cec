"""Prepare and unprepare claims on this node: read, resolve, plan, check, commit, undo.

Per claim (concurrently): a recorded claim is returned, rolled back or unprepared first by its
state; otherwise it is read, its configs resolved, each `Tier` plans, the plans are checked under
the claim's GPU locks, `PrepareStarted` is recorded, the tiers apply, the CDI spec is written and
`PrepareCompleted` recorded. A failure rolls back at once, a crash at the next call or in
`recover()`. A new claim whose plans change nothing on the node (`TierPlan.changes_node`: whole
GPUs, static MIG devices) gets no `PrepareStarted` record: what a crash leaves of it (its CDI
spec and claim files) is removed by `recover()`, by its next prepare or by its unprepare.
Unprepare works from the record alone. Records change only through `ClaimRecords.update`; the
locks (claim, GPUs, node-wide) are `prepare_locks.PrepareLocks`. See docs/architecture.md:
"Prepare and unprepare", "Claims without a PrepareStarted record" and "Two instances on one node".
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpu_dra.driver.config import (
    AllocatedDevice,
    ConfigError,
    DeviceType,
    resolve_configs,
    shown_name,
)
from gpu_dra.driver.config.errors import DomainError
from gpu_dra.driver.model import MigDevice, MigPartition
from gpu_dra.driver.naming import InvalidNameError, gpu_device_name, validate_claim_uid
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.blocking import in_thread_to_completion
from gpu_dra.kubelet_plugin.cdi import (
    CdiDevice,
    ClaimSpecStore,
    ContainerEdits,
    merged_edits,
    qualified_device_id,
)
from gpu_dra.kubelet_plugin.checkpoint import (
    CheckpointEntry,
    CheckpointError,
    ClaimPhase,
    JsonValue,
)
from gpu_dra.kubelet_plugin.claim_allocation import (
    allocated_devices,
    allocated_result,
    allocation_of,
    claim_uid,
    get_claim,
    spec_configs,
)
from gpu_dra.kubelet_plugin.claim_records import (
    ClaimRecords,
    completed,
    removed,
    unprepare_started,
)
from gpu_dra.kubelet_plugin.kubeapi import ClaimReader, ClaimReadError, ResourceClaim
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_instances import PluginInstance
from gpu_dra.kubelet_plugin.prepare_locks import PrepareLocks, lock_names
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice, PrepareResult
from gpu_dra.kubelet_plugin.recovery import TIER_ERRORS, UNDOING, missing_parts, recover_claims
from gpu_dra.kubelet_plugin.tiers.assembly import NodeTiers
from gpu_dra.kubelet_plugin.tiers.protocol import (
    AllocatedResult,
    ClaimRequest,
    Planned,
    PrepareError,
    PrepareRun,
    TierPlan,
)

log = logging.getLogger(__name__)


class NodeClaimPreparer:
    """`ClaimPreparer` of this node's devices: whole GPUs, MIG devices (static and made at
    prepare), per-claim MPS, MPS shares, capped shares and time-slicing, one `Tier` each."""

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        inventory: NodeInventory,
        claims: ClaimReader,
        records: ClaimRecords,
        cdi: ClaimSpecStore,
        claims_dir: Path,
        tiers: NodeTiers,
        uncached_claims: ClaimReader | None = None,
        common_edits: Callable[[], ContainerEdits] | None = None,
        instance: PluginInstance | None = None,
        recovery_wait_s: float = 300.0,
        test_prepare_delay_s: float = 0.0,
    ) -> None:
        """``records`` and ``tiers`` (`tiers.assembly.node_tiers`, given the same records and
        ``cdi``) are this instance's: the records name ``instance`` as their owner.

        `uncached_claims` reads the API server directly; give it when `claims` is a cache, which
        may not have seen a claim replaced under the same name yet: a claim whose UID does not
        match is read once more from there before it is reported replaced. `common_edits` gives
        the edits every container of a claim gets (the driver's userspace on real nodes,
        `nvidia_userspace.CommonEdits.current`; None on simulated ones), asked once per prepare
        before anything changes. `instance` is this plugin instance on the node: its node-wide
        locks are taken beside the in-process ones, and `recover` waits up to `recovery_wait_s`
        for the other instances' calls under way; without it, every record is this process's.
        `test_prepare_delay_s` (tests only, `fault_injection`) holds each new prepare that long
        in its worker thread right after `PrepareStarted` is recorded (or where it would be, for
        a claim that gets none)."""
        assert records.owner == (None if instance is None else instance.token)
        self._driver = driver_name
        self._pool = node_name
        self._inventory = inventory
        self._claims = claims
        self._uncached_claims = uncached_claims
        self._instance = instance
        self._locks = PrepareLocks(instance, recovery_wait_s)
        self._records = records
        self._cdi = cdi
        self._data_dir = records.data_dir
        self._claims_dir = claims_dir
        fact_files = inventory.fact_files
        # Files claims share (simulated fact files), written by any instance.
        self._shared_dirs = () if fact_files is None else (fact_files.directory,)
        self._common_edits = common_edits
        self._test_prepare_delay_s = test_prepare_delay_s
        self._tiers = tiers.acting
        self._planning = tiers.planning
        self._dynamic_mig = tiers.dynamic_mig
        self.shared_daemons = tiers.shared_daemons
        """The shared MPS daemons of the share tier (None without MPS), for the warmer."""

    # ---- ClaimPreparer -------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        results = await asyncio.gather(*(self._prepare_one(claim) for claim in claims))
        return {claim.uid: result for claim, result in zip(claims, results, strict=True)}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        results = await asyncio.gather(*(self._unprepare_one(claim) for claim in claims))
        return {claim.uid: result for claim, result in zip(claims, results, strict=True)}

    # ---- start-up --------------------------------------------------------------------------------
    async def recover(self) -> None:
        """Roll back half-done prepares and finish half-done unprepares, let the tiers adopt
        what prepared claims hold (MPS daemons) and sweep what no record owns (MPS daemons, MIG
        instances), and remove CDI specs, temporary files of interrupted writes (CDI specs, the
        data dir's files, shared fact files) and claim files nobody owns.

        Run it before serving: what a prepare running beside it has made but not recorded yet
        would be taken for a leftover. Other instances' calls are waited for (the node lock,
        exclusive); their `PrepareStarted` and `UnprepareStarted` records, and what those name,
        are left to them while they run."""
        async with self._locks.exclusive():
            await recover_claims(
                records=self._records,
                tiers=self._tiers,
                cdi=self._cdi,
                data_dir=self._data_dir,
                claims_dir=self._claims_dir,
                shared_dirs=self._shared_dirs,
                owner_alive=self._owner_alive,
                undo=self._undo,
            )

    async def retry_mig_sweeps(self) -> dict[str, str]:
        """Sweep again, each under its GPU's locks, the GPUs whose start-up sweep failed; the
        GPUs still not swept (UUID -> why)."""
        names = {gpu.uuid: gpu_device_name(gpu.minor) for gpu in self._inventory.gpus}
        for uuid in sorted(self._dynamic_mig.unswept()):
            async with self._locks.operation(), self._locks.devices([names[uuid]]):
                why = await in_thread_to_completion(self._dynamic_mig.sweep_again, uuid)
            if why is not None:
                log.warning("mig sweep of gpu_uuid=%s failed again: %s", uuid, why)
        return self._dynamic_mig.unswept()

    def _owner_alive(self, owner: str | None) -> bool:
        """Whether the instance that wrote a record still runs (never, without an instance)."""
        return self._instance is not None and self._instance.owner_alive(owner)

    # ---- prepare ---------------------------------------------------------------------------------
    async def _prepare_one(self, claim: ClaimRef) -> PrepareResult:
        where = f"claim {claim.namespace}/{claim.name} ({claim.uid})"
        try:
            validate_claim_uid(claim.uid)
            async with self._locks.operation(), self._locks.claim(claim.uid):
                devices = await self._prepare_locked(claim)
        except (PrepareError, ConfigError, InvalidNameError) as error:
            log.warning("prepare failed claim_uid=%s error=%s", claim.uid, error)
            # ConfigError messages start with the claim already: name it once, with its UID.
            detail = str(error).removeprefix(f"resource claim {claim.namespace}/{claim.name}: ")
            return _failure(f"{where}: {detail}", error)
        except (DomainError, OSError, ClaimReadError) as error:
            log.exception("prepare failed claim_uid=%s", claim.uid)
            return _failure(f"{where}: {error} (will retry)", error)
        except TIER_ERRORS as error:
            log.exception("prepare failed claim_uid=%s", claim.uid)
            retry = " (will retry)" if error.retryable else ""
            return _failure(f"{where}: {error}{retry}", error)
        except CheckpointError as error:
            log.exception("prepare failed claim_uid=%s", claim.uid)
            return _failure(f"{where}: {error} (will retry)", error)
        except Exception as error:
            # A bug, or data no check foresaw: this claim fails, the others of the call do not.
            log.exception("prepare failed unexpectedly claim_uid=%s", claim.uid)
            return _failure(
                f"{where}: unexpected {type(error).__name__}: {error} (will retry)", error
            )
        log.info("prepared claim_uid=%s devices=%s", claim.uid, [d.device_name for d in devices])
        return PrepareResult.success(devices)

    async def _prepare_locked(self, claim: ClaimRef) -> tuple[PreparedDevice, ...]:
        # One thread hop for the checkpoint lookup and, for a new claim, the claim read.
        existing, resource_claim = await asyncio.to_thread(self._lookup, claim)
        if existing is not None:
            lost: list[str] = []
            if existing.phase is ClaimPhase.PREPARE_COMPLETED:
                lost = await asyncio.to_thread(
                    missing_parts,
                    existing,
                    self._cdi,
                    (self._claims_dir, *self._shared_dirs),
                    self._tiers,
                )
                if not lost:
                    return existing.devices
                log.warning(
                    "prepared claim lost %s; unpreparing and preparing it again claim_uid=%s",
                    "; ".join(lost),
                    claim.uid,
                )
            else:
                log.info("%s claim_uid=%s", UNDOING[existing.phase], claim.uid)
            try:
                async with self._locks.devices(lock_names(existing)):
                    await in_thread_to_completion(self._undo, claim.uid)
                resource_claim = await asyncio.to_thread(self._read_claim, claim)
                # The kubelet may still run containers with what the undone record handed out:
                # this prepare records PrepareStarted whatever its tiers, so the devices stay
                # held if it dies.
                return await self._prepare_new(claim, resource_claim, record=True)
            except Exception as error:
                if lost:
                    error.add_note(f"while preparing it again because {'; '.join(lost)}")
                raise
        assert resource_claim is not None
        return await self._prepare_new(claim, resource_claim)

    async def _prepare_new(
        self, claim: ClaimRef, resource_claim: ResourceClaim, *, record: bool = False
    ) -> tuple[PreparedDevice, ...]:
        """Plan, check and commit a claim that has no record; ``record``: write `PrepareStarted`
        even when no plan changes the node."""
        request = self._request(claim, resource_claim)
        plans = self._plan(request)
        record = record or any(plan.changes_node for plan in plans)
        async with self._locks.devices([r.device for r in request.results]):
            return await in_thread_to_completion(self._check_and_commit, request, plans, record)

    def _request(self, claim: ClaimRef, resource_claim: ResourceClaim) -> ClaimRequest:
        """This driver's results on this node and their opaque configs (class < claim, later
        wins); config errors name the claim, the config entry and the field."""
        allocation = allocated_devices(resource_claim)
        results = self._our_results(allocation["results"])
        if not results:
            raise PrepareError(
                f"the allocation has no device of driver {self._driver} in pool {self._pool}"
            )
        configs = resolve_configs(
            allocation["config"],
            [
                AllocatedDevice(
                    request=r.request, device=r.device, type=self._device_type(r.device)
                )
                for r in results
            ],
            driver=self._driver,
            claim=f"{claim.namespace}/{claim.name}",
            spec_configs=spec_configs(resource_claim),
        )
        return ClaimRequest(claim, tuple(results), tuple(configs.groups))

    def _plan(self, request: ClaimRequest) -> list[TierPlan]:
        """Each tier's part of the claim (pure), in the order the tiers act."""
        planned = Planned()
        for tier in self._planning:
            planned.add(tier, tier.plan(request, planned))
        return [planned.of_tier(tier) for tier in self._tiers]

    def _check_and_commit(
        self, request: ClaimRequest, plans: Sequence[TierPlan], record: bool
    ) -> tuple[PreparedDevice, ...]:
        """Every plan checked against one read of the other claims' records, then `_commit`:
        one thread hop, under the caller's device locks."""
        others = self._records.others(request.claim.uid)
        for plan in plans:
            plan.check(others)
        return self._commit(request, plans, others, record)

    def _commit(
        self,
        request: ClaimRequest,
        plans: Sequence[TierPlan],
        others: Mapping[str, CheckpointEntry],
        record: bool,
    ) -> tuple[PreparedDevice, ...]:
        """Apply the plans, write the CDI spec and record `PrepareCompleted`; with ``record``,
        `PrepareStarted` first. Without it nothing but the CDI spec and the claim files is made
        before `PrepareCompleted`, and the caller holds the device locks until that is on
        disk: no other claim's check can run in between, and a crash leaves only files that
        `recover()`, the claim's next prepare or its unprepare removes."""
        claim = request.claim
        # Before any change: a driver that cannot be found fails the claim with nothing to undo.
        common = None if self._common_edits is None else self._common_edits()
        intents: dict[str, JsonValue] = {}
        for plan in plans:
            intents.update(plan.intents())
        run = PrepareRun(
            claim,
            self._records,
            self._inventory,
            intents,
            self._devices(request),
            others=others,
            recorded=record,
        )
        if record:
            # On disk before any tier changes anything: a crash from here on is rolled back.
            run.record()
            crash_points.reached(crash_points.PREPARE_AFTER_STARTED)
        try:
            if self._test_prepare_delay_s > 0:
                log.warning("TEST FAULT INJECTION: holding the prepare %g s after PrepareStarted "
                            "claim_uid=%s", self._test_prepare_delay_s, claim.uid)  # fmt: skip
                time.sleep(self._test_prepare_delay_s)
            for plan in plans:
                plan.apply(run)
            for plan in plans:
                plan.apply_to_made(run)
            self._write_spec(request, run, common)
            crash_points.reached(crash_points.PREPARE_AFTER_CDI_SPEC)
            self._records.update(claim.uid, completed(claim, run.devices, run.completed))
        except BaseException:
            self._undo(claim.uid, run.state)
            raise
        crash_points.reached(crash_points.PREPARE_AFTER_COMPLETED)
        return run.devices

    def _devices(self, request: ClaimRequest) -> tuple[PreparedDevice, ...]:
        """The claim's devices as the kubelet gets them, one per allocated device."""
        by_device: dict[str, list[AllocatedResult]] = {}
        for result in request.results:
            by_device.setdefault(result.device, []).append(result)
        return tuple(
            PreparedDevice(
                request_names=tuple(sorted({r.base_request for r in device_results})),
                pool_name=self._pool,
                device_name=device_name,
                cdi_device_ids=(qualified_device_id(request.claim.uid, device_name, self._driver),),
                share_id=device_results[0].share_id,
            )
            for device_name, device_results in sorted(by_device.items())
        )

    def _write_spec(
        self, request: ClaimRequest, run: PrepareRun, common: ContainerEdits | None
    ) -> None:
        """The claim's CDI spec (a CDI device per allocated device: its own edits, then those
        the tiers added) and claim files (only a simulated MIG device made for the claim has
        any: the claim directory is made for them).

        A recorded prepare (its tiers change the node) gets its claim directory in any case:
        plugins of the previous version, during a rolling update or after a downgrade, take a
        prepared claim without one for a claim that lost its files and prepare it again,
        which would stop the MPS daemon or destroy the MIG device its running pods use."""
        claim_dir = self._claims_dir / request.claim.uid
        if run.recorded:
            claim_dir.mkdir(parents=True, exist_ok=True)
            claim_dir.chmod(0o755)
        cdi_devices = []
        for device in run.devices:
            name = device.device_name
            edits = self._inventory.container_edits(run.device(name), claim_dir)
            if name in run.edits:
                edits = merged_edits(edits, run.edits[name])
            cdi_devices.append(CdiDevice(name, edits))
        crash_points.reached(crash_points.PREPARE_AFTER_CLAIM_FILES)
        self._cdi.write(request.claim.uid, cdi_devices, common_edits=common)

    # ---- unprepare -------------------------------------------------------------------------------
    async def _unprepare_one(self, claim: ClaimRef) -> str | None:
        try:
            validate_claim_uid(claim.uid)
            async with self._locks.operation(), self._locks.claim(claim.uid):
                entry = await asyncio.to_thread(self._entry_or_leftovers, claim.uid)
                if entry is None:
                    return None
                async with self._locks.devices(lock_names(entry)):
                    await in_thread_to_completion(self._undo, claim.uid)
        except (InvalidNameError, OSError, DomainError, CheckpointError, *TIER_ERRORS) as error:
            log.exception("unprepare failed claim_uid=%s", claim.uid)
            return f"claim {claim.namespace}/{claim.name} ({claim.uid}): {error}"
        except Exception as error:
            log.exception("unprepare failed unexpectedly claim_uid=%s", claim.uid)
            return (
                f"claim {claim.namespace}/{claim.name} ({claim.uid}): unexpected "
                f"{type(error).__name__}: {error}"
            )
        log.info("unprepared claim_uid=%s", claim.uid)
        return None

    def _entry_or_leftovers(self, claim_uid: str) -> CheckpointEntry | None:
        """The claim's entry; without one, what a prepare of it that died without a record
        left (its CDI spec, its claim files) is removed first. The caller holds the claim's
        lock, so no prepare of it runs beside (in any instance)."""
        entry = self._records.get(claim_uid)
        if entry is None:
            self._cdi.remove(claim_uid)  # logged when there was one
            claim_dir = self._claims_dir / claim_uid
            if claim_dir.exists():
                log.info("removing claim files of an interrupted prepare claim_uid=%s", claim_uid)
                shutil.rmtree(claim_dir, ignore_errors=True)
        return entry

    def _undo(self, claim_uid: str, pending: Mapping[str, JsonValue] | None = None) -> None:
        """Remove everything a prepare of this claim may have left; the record last.

        A `PrepareCompleted` record becomes `UnprepareStarted` first, so that a crash or an
        error part-way is finished later instead of being taken for a prepared claim. The tiers
        undo in reverse order from the record and ``pending`` (the state of the prepare being
        rolled back, which may hold what is not recorded yet), then the CDI spec and claim files
        go, then the devices tiers made. A tier that cannot undo raises, and the record stays
        for the next try."""
        entry = self._records.get(claim_uid)
        if entry is not None and entry.phase is ClaimPhase.PREPARE_COMPLETED:
            entry = self._records.update(claim_uid, unprepare_started)
            crash_points.reached(crash_points.UNPREPARE_AFTER_STARTED)
        for tier in reversed(self._tiers):
            tier.undo(claim_uid, entry, pending or {})
        self._cdi.remove(claim_uid)
        crash_points.reached(crash_points.UNPREPARE_AFTER_CDI_REMOVED)
        shutil.rmtree(self._claims_dir / claim_uid, ignore_errors=True)
        crash_points.reached(crash_points.UNPREPARE_AFTER_CLAIM_FILES_REMOVED)
        for tier in reversed(self._tiers):
            tier.undo_devices(claim_uid, entry)
        crash_points.reached(crash_points.UNPREPARE_BEFORE_RECORD_REMOVED)
        self._records.update(claim_uid, removed)

    # ---- the claim -------------------------------------------------------------------------------
    def _lookup(self, claim: ClaimRef) -> tuple[CheckpointEntry | None, ResourceClaim | None]:
        """The claim's checkpoint entry; without one, the claim as read from the API (and the
        leftovers of a prepare of it that died without a record are gone)."""
        existing = self._entry_or_leftovers(claim.uid)
        if existing is not None:
            return existing, None
        return None, self._read_claim(claim)

    def _read_claim(self, claim: ClaimRef) -> ResourceClaim:
        resource_claim = get_claim(self._claims, claim)
        uid = claim_uid(resource_claim)
        if uid != claim.uid and self._uncached_claims is not None:
            log.info(
                "cached claim has UID %s; reading it from the API server claim_uid=%s",
                uid,
                claim.uid,
            )
            resource_claim = get_claim(self._uncached_claims, claim)
            uid = claim_uid(resource_claim)
        if uid != claim.uid:
            raise PrepareError(
                f"the claim was replaced: the API server has UID {uid}, the kubelet asked for "
                f"{claim.uid}"
            )
        if allocation_of(resource_claim) is None:
            raise PrepareError("the claim is not allocated")
        return resource_claim

    def _device_type(self, device_name: str) -> DeviceType:
        """`mig` for MIG devices, else `gpu`: decides which config kinds apply (GpuConfig or
        MigDeviceConfig) and which are a mismatch error."""
        device = self._inventory.by_name(device_name)
        return "mig" if isinstance(device, MigDevice | MigPartition) else "gpu"

    def _our_results(self, raw: Sequence[Mapping[str, Any]]) -> list[AllocatedResult]:
        """The results of this driver in this node's pool; `PrepareError` for one that is
        malformed or names a device this node does not have."""
        results = []
        for index, item in enumerate(raw):
            if item.get("driver") != self._driver or item.get("pool") != self._pool:
                continue
            result = allocated_result(index, item)
            if self._inventory.by_name(result.device) is None:
                raise PrepareError(
                    f"allocated device {shown_name(result.device)} does not exist on node "
                    f"{self._pool}; "
                    "the ResourceSlice it came from is stale"
                )
            results.append(result)
        return results


def _failure(message: str, error: BaseException) -> PrepareResult:
    """The failed result with ``message``, and the context notes ``error`` carries."""
    notes = getattr(error, "__notes__", [])
    return PrepareResult.failure("".join([message, *(f" [{note}]" for note in notes)]))
