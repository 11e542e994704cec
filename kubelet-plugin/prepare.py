"""Prepare and unprepare claims on this node: read, resolve, plan, check, commit, undo.

Per claim (the claims of one call run concurrently): a claim recorded `PrepareCompleted` returns
its devices, one left `PrepareStarted` is rolled back first. Otherwise the claim is read, its
opaque configs resolved, and each `Tier` plans its part; under the claim's device locks the
plans are checked against the other claims' records, `PrepareStarted` is recorded with the
tiers' intents, the tiers apply, the CDI spec is written and `PrepareCompleted` recorded. A
failure rolls back at once, a crash at the next prepare or in `recover()`. Unprepare works from
the record alone. Records change only through `ClaimRecords.update`. See docs/architecture.md,
"Prepare and unprepare".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gpu_dra.driver.config import AllocatedDevice, ConfigError, DeviceType, resolve_configs
from gpu_dra.driver.config.errors import DomainError
from gpu_dra.driver.model import MigDevice, MigPartition
from gpu_dra.driver.naming import InvalidNameError, validate_claim_uid
from gpu_dra.kubelet_plugin.cdi import (
    CdiDevice,
    ClaimSpecStore,
    ContainerEdits,
    qualified_device_id,
)
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint, CheckpointEntry, ClaimPhase, JsonValue
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords, completed, removed
from gpu_dra.kubelet_plugin.kubeapi import (
    ClaimNotFoundError,
    ClaimReader,
    ClaimReadError,
    ResourceClaim,
)
from gpu_dra.kubelet_plugin.mig import DynamicMig, MigError
from gpu_dra.kubelet_plugin.mig.tier import DynamicMigTier
from gpu_dra.kubelet_plugin.mps import MpsControl, MpsError
from gpu_dra.kubelet_plugin.mps.claim_tier import ClaimMpsTier
from gpu_dra.kubelet_plugin.mps.memory_limits import ShareMemory
from gpu_dra.kubelet_plugin.mps.share_tier import MpsShareTier
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice, PrepareResult
from gpu_dra.kubelet_plugin.tier import (
    AllocatedResult,
    ClaimRequest,
    Planned,
    PrepareError,
    PrepareRun,
    Tier,
    TierPlan,
)
from gpu_dra.kubelet_plugin.timeslicing import TimeSlicer, TimeSlicingError
from gpu_dra.kubelet_plugin.timeslicing_tier import TimeSlicingTier
from gpu_dra.kubelet_plugin.whole_gpu_tier import WholeGpuTier

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_TIER_ERRORS = (MpsError, TimeSlicingError, MigError)
"""What the tiers' executors raise; each error says whether a retry can succeed."""


class NodeClaimPreparer:
    """`ClaimPreparer` of this node's devices: whole GPUs, MIG devices (static and made at
    prepare), per-claim MPS, MPS shares and time-slicing, one `Tier` each."""

    def __init__(
        self,
        *,
        driver_name: str,
        node_name: str,
        inventory: NodeInventory,
        claims: ClaimReader,
        checkpoint: Checkpoint,
        cdi: ClaimSpecStore,
        claims_dir: Path,
        uncached_claims: ClaimReader | None = None,
        mps: MpsControl | None = None,
        time_slicer: TimeSlicer | None = None,
        dynamic_mig: DynamicMig | None = None,
        mps_share_max_percent: int = 100,
        common_edits: Callable[[], ContainerEdits] | None = None,
        mps_share_memory: ShareMemory | None = None,
    ) -> None:
        """`uncached_claims` reads the API server directly; give it when `claims` is a cache, which
        may not have seen a claim replaced under the same name yet: a claim whose UID does not
        match is read once more from there before it is reported replaced.

        `mps` starts and stops MPS control daemons; without it, claims asking for MPS fail.
        `time_slicer` sets time-slice intervals; without it, claims asking for TimeSlicing on
        full GPUs fail. `dynamic_mig` makes the MIG devices of partition devices; without it,
        claims with partition devices fail. `mps_share_max_percent` is the largest MPS share
        (`mps.share_tier`). `common_edits` gives the edits every container of a claim gets (the
        driver's userspace on real nodes, `driver_userspace.CommonEdits.current`; None on
        simulated ones), asked once per prepare before anything changes. `mps_share_memory`
        says which GPUs' MPS shares the driver caps per container (`mps.memory_limits`)."""
        self._driver = driver_name
        self._pool = node_name
        self._inventory = inventory
        self._claims = claims
        self._uncached_claims = uncached_claims
        self._records = ClaimRecords(checkpoint)
        self._cdi = cdi
        self._claims_dir = claims_dir
        self._common_edits = common_edits
        records, node = self._records, node_name
        shares = MpsShareTier(
            mps,
            records,
            inventory,
            node_name=node,
            max_percent=mps_share_max_percent,
            memory=mps_share_memory,
        )
        claim_mps = ClaimMpsTier(mps, inventory, node_name=node)
        time_slicing = TimeSlicingTier(time_slicer, records, inventory, node_name=node)
        mig = DynamicMigTier(dynamic_mig, records, inventory)
        whole = WholeGpuTier()
        # The order the tiers act in on a claim: checks, then changes (time slices, MPS
        # daemons, shares, MIG devices; docs/architecture.md); undo runs in reverse.
        self._tiers: tuple[Tier, ...] = (whole, time_slicing, claim_mps, shares, mig)
        # The order they plan in: a tier may read the plans made before its own.
        self._planning: tuple[Tier, ...] = (shares, claim_mps, time_slicing, mig, whole)
        # Locks live while someone holds them: no growth with the number of claims ever seen.
        self._device_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )
        self._claim_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    # ---- ClaimPreparer -------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        results = await asyncio.gather(*(self._prepare_one(claim) for claim in claims))
        return {claim.uid: result for claim, result in zip(claims, results, strict=True)}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        results = await asyncio.gather(*(self._unprepare_one(claim) for claim in claims))
        return {claim.uid: result for claim, result in zip(claims, results, strict=True)}

    # ---- start-up --------------------------------------------------------------------------------
    async def recover(self) -> None:
        """Roll back half-done prepares, let the tiers adopt what prepared claims hold (MPS
        daemons) and sweep what no record owns (MPS daemons, MIG instances), and remove CDI
        specs and claim files nobody owns.

        Run it before serving: what a prepare running beside it has made but not recorded yet
        would be taken for a leftover."""
        entries = await asyncio.to_thread(self._records.all)
        for uid, entry in entries.items():
            if entry.phase is ClaimPhase.PREPARE_STARTED:
                log.info("rolling back interrupted prepare claim_uid=%s", uid)
                try:
                    await _in_thread_to_completion(self._undo, uid)
                except (*_TIER_ERRORS, OSError) as error:
                    # Kept in the checkpoint: the next prepare or unprepare retries.
                    log.error("rollback of claim_uid=%s incomplete: %s", uid, error)
            else:
                await _in_thread_to_completion(self._adopt, entry)
        remaining = await asyncio.to_thread(self._records.all)  # what the rollbacks left
        await _in_thread_to_completion(self._sweep, remaining)
        owned = {uid for uid, e in entries.items() if e.phase is ClaimPhase.PREPARE_COMPLETED}
        for uid in await asyncio.to_thread(self._cdi.claim_uids):
            if uid not in owned:
                log.info("removing orphaned CDI spec claim_uid=%s", uid)
                await asyncio.to_thread(self._cdi.remove, uid)
        if self._claims_dir.exists():
            for directory in self._claims_dir.iterdir():
                if directory.name not in owned:
                    log.info("removing orphaned claim files claim_uid=%s", directory.name)
                    await asyncio.to_thread(shutil.rmtree, directory, True)

    def _adopt(self, entry: CheckpointEntry) -> None:
        for tier in self._tiers:
            tier.adopt(entry)

    def _sweep(self, entries: Mapping[str, CheckpointEntry]) -> None:
        for tier in self._tiers:
            tier.sweep(entries)

    # ---- prepare ---------------------------------------------------------------------------------
    async def _prepare_one(self, claim: ClaimRef) -> PrepareResult:
        where = f"claim {claim.namespace}/{claim.name} ({claim.uid})"
        try:
            validate_claim_uid(claim.uid)
            async with self._claim_lock(claim.uid):
                devices = await self._prepare_locked(claim)
        except (PrepareError, ConfigError, InvalidNameError) as error:
            log.warning("prepare failed claim_uid=%s error=%s", claim.uid, error)
            # ConfigError messages start with the claim already: name it once, with its UID.
            detail = str(error).removeprefix(f"resource claim {claim.namespace}/{claim.name}: ")
            return PrepareResult.failure(f"{where}: {detail}")
        except (DomainError, OSError, ClaimReadError) as error:
            log.exception("prepare failed claim_uid=%s", claim.uid)
            return PrepareResult.failure(f"{where}: {error} (will retry)")
        except _TIER_ERRORS as error:
            log.exception("prepare failed claim_uid=%s", claim.uid)
            retry = " (will retry)" if error.retryable else ""
            return PrepareResult.failure(f"{where}: {error}{retry}")
        log.info("prepared claim_uid=%s devices=%s", claim.uid, [d.device_name for d in devices])
        return PrepareResult.success(devices)

    async def _prepare_locked(self, claim: ClaimRef) -> tuple[PreparedDevice, ...]:
        # One thread hop for the checkpoint lookup and, for a new claim, the claim read.
        existing, resource_claim = await asyncio.to_thread(self._lookup, claim)
        if existing is not None:
            if existing.phase is ClaimPhase.PREPARE_COMPLETED:
                return existing.devices
            log.info("rolling back an interrupted prepare claim_uid=%s", claim.uid)
            await _in_thread_to_completion(self._undo, claim.uid)
            resource_claim = await asyncio.to_thread(self._read_claim, claim)
        assert resource_claim is not None
        request = self._request(claim, resource_claim)
        plans = self._plan(request)
        async with self._locked_devices(sorted({r.device for r in request.results})):
            return await _in_thread_to_completion(self._check_and_commit, request, plans)

    def _request(self, claim: ClaimRef, resource_claim: ResourceClaim) -> ClaimRequest:
        """This driver's results on this node and their opaque configs (class < claim, later
        wins); config errors name the claim, the config entry and the field."""
        results = self._our_results(resource_claim)
        if not results:
            raise PrepareError(
                f"the allocation has no device of driver {self._driver} in pool {self._pool}"
            )
        allocation = resource_claim["status"]["allocation"]["devices"]
        configs = resolve_configs(
            allocation.get("config", []),
            [
                AllocatedDevice(
                    request=r.request, device=r.device, type=self._device_type(r.device)
                )
                for r in results
            ],
            driver=self._driver,
            claim=f"{claim.namespace}/{claim.name}",
            spec_configs=resource_claim.get("spec", {}).get("devices", {}).get("config"),
        )
        return ClaimRequest(claim, tuple(results), tuple(configs.groups))

    def _plan(self, request: ClaimRequest) -> list[TierPlan]:
        """Each tier's part of the claim (pure), in the order the tiers act."""
        planned = Planned()
        for tier in self._planning:
            planned.add(tier, tier.plan(request, planned))
        return [planned.of_tier(tier) for tier in self._tiers]

    def _check_and_commit(
        self, request: ClaimRequest, plans: Sequence[TierPlan]
    ) -> tuple[PreparedDevice, ...]:
        """Every plan checked against one read of the other claims' records, then `_commit`:
        one thread hop, under the caller's device locks."""
        others = self._records.others(request.claim.uid)
        for plan in plans:
            plan.check(others)
        return self._commit(request, plans)

    def _commit(
        self, request: ClaimRequest, plans: Sequence[TierPlan]
    ) -> tuple[PreparedDevice, ...]:
        claim = request.claim
        # Before any change: a driver that cannot be found fails the claim with nothing to undo.
        common = None if self._common_edits is None else self._common_edits()
        intents: dict[str, JsonValue] = {}
        for plan in plans:
            intents.update(plan.intents())
        run = PrepareRun(claim, self._records, self._inventory, intents)
        # On disk before any tier changes anything: a crash from here on is rolled back from it.
        run.record()
        try:
            for plan in plans:
                plan.apply(run)
            for plan in plans:
                plan.apply_to_made(run)
            devices = self._write_spec(request, run, common)
            self._records.update(claim.uid, completed(claim, devices, run.completed))
        except BaseException:
            self._undo(claim.uid, run.state)
            raise
        return devices

    def _write_spec(
        self, request: ClaimRequest, run: PrepareRun, common: ContainerEdits | None
    ) -> tuple[PreparedDevice, ...]:
        """The claim's CDI spec (a CDI device per allocated device: its own edits, then those
        the tiers added) and claim files; the devices as the kubelet gets them."""
        claim = request.claim
        claim_dir = self._claims_dir / claim.uid
        claim_dir.mkdir(parents=True, exist_ok=True)
        claim_dir.chmod(0o755)
        by_device: dict[str, list[AllocatedResult]] = {}
        for result in request.results:
            by_device.setdefault(result.device, []).append(result)
        cdi_devices = []
        prepared = []
        for device_name, device_results in sorted(by_device.items()):
            edits = self._inventory.container_edits(run.device(device_name), claim_dir)
            if device_name in run.edits:
                edits = merged_edits(edits, run.edits[device_name])
            cdi_devices.append(CdiDevice(device_name, edits))
            prepared.append(
                PreparedDevice(
                    request_names=tuple(sorted({r.base_request for r in device_results})),
                    pool_name=self._pool,
                    device_name=device_name,
                    cdi_device_ids=(qualified_device_id(claim.uid, device_name, self._driver),),
                    share_id=device_results[0].share_id,
                )
            )
        self._cdi.write(claim.uid, cdi_devices, common_edits=common)
        return tuple(prepared)

    # ---- unprepare -------------------------------------------------------------------------------
    async def _unprepare_one(self, claim: ClaimRef) -> str | None:
        try:
            validate_claim_uid(claim.uid)
            async with self._claim_lock(claim.uid):
                entry = await asyncio.to_thread(self._records.get, claim.uid)
                if entry is None:
                    return None
                async with self._locked_devices(sorted(d.device_name for d in entry.devices)):
                    await _in_thread_to_completion(self._undo, claim.uid)
        except (InvalidNameError, OSError, DomainError, *_TIER_ERRORS) as error:
            log.exception("unprepare failed claim_uid=%s", claim.uid)
            return f"claim {claim.namespace}/{claim.name} ({claim.uid}): {error}"
        log.info("unprepared claim_uid=%s", claim.uid)
        return None

    def _undo(self, claim_uid: str, pending: Mapping[str, JsonValue] | None = None) -> None:
        """Remove everything a prepare of this claim may have left; the record last.

        The tiers undo in reverse order from the record and ``pending`` (the state of the
        prepare being rolled back, which may hold what is not recorded yet), then the CDI spec
        and claim files go, then the devices tiers made. A tier that cannot undo raises, and the
        record stays for the next try."""
        entry = self._records.get(claim_uid)
        for tier in reversed(self._tiers):
            tier.undo(claim_uid, entry, pending or {})
        self._cdi.remove(claim_uid)
        shutil.rmtree(self._claims_dir / claim_uid, ignore_errors=True)
        for tier in reversed(self._tiers):
            tier.undo_devices(claim_uid, entry)
        self._records.update(claim_uid, removed)

    # ---- the claim -------------------------------------------------------------------------------
    def _lookup(self, claim: ClaimRef) -> tuple[CheckpointEntry | None, ResourceClaim | None]:
        """The claim's checkpoint entry; without one, the claim as read from the API."""
        existing = self._records.get(claim.uid)
        if existing is not None:
            return existing, None
        return None, self._read_claim(claim)

    def _read_claim(self, claim: ClaimRef) -> ResourceClaim:
        resource_claim = _get_claim(self._claims, claim)
        uid = resource_claim.get("metadata", {}).get("uid")
        if uid != claim.uid and self._uncached_claims is not None:
            log.info(
                "cached claim has UID %s; reading it from the API server claim_uid=%s",
                uid,
                claim.uid,
            )
            resource_claim = _get_claim(self._uncached_claims, claim)
            uid = resource_claim.get("metadata", {}).get("uid")
        if uid != claim.uid:
            raise PrepareError(
                f"the claim was replaced: the API server has UID {uid}, the kubelet asked for "
                f"{claim.uid}"
            )
        if not resource_claim.get("status", {}).get("allocation"):
            raise PrepareError("the claim is not allocated")
        return resource_claim

    def _device_type(self, device_name: str) -> DeviceType:
        """`mig` for MIG devices, else `gpu`: decides which config kinds apply (GpuConfig or
        MigDeviceConfig) and which are a mismatch error."""
        device = self._inventory.by_name(device_name)
        return "mig" if isinstance(device, MigDevice | MigPartition) else "gpu"

    def _our_results(self, resource_claim: ResourceClaim) -> list[AllocatedResult]:
        raw: list[dict[str, Any]] = resource_claim["status"]["allocation"]["devices"].get(
            "results", []
        )
        results = []
        for item in raw:
            if item.get("driver") != self._driver or item.get("pool") != self._pool:
                continue
            device = self._inventory.by_name(item["device"])
            if device is None:
                raise PrepareError(
                    f"allocated device {item['device']} does not exist on node {self._pool}; "
                    "the ResourceSlice it came from is stale"
                )
            results.append(
                AllocatedResult(
                    request=item["request"],
                    device=item["device"],
                    admin_access=bool(item.get("adminAccess")),
                    share_id=item.get("shareID"),
                    consumed=item.get("consumedCapacity"),
                )
            )
        return results

    # ---- locks -----------------------------------------------------------------------------------
    def _claim_lock(self, uid: str) -> asyncio.Lock:
        lock = self._claim_locks.get(uid)
        if lock is None:
            lock = self._claim_locks[uid] = asyncio.Lock()
        return lock

    @contextlib.asynccontextmanager
    async def _locked_devices(self, names: Sequence[str]) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            held = []  # strong references while held
            for name in sorted(names):
                lock = self._device_locks.get(name)
                if lock is None:
                    lock = self._device_locks[name] = asyncio.Lock()
                held.append(lock)
                await stack.enter_async_context(lock)
            yield


def merged_edits(first: ContainerEdits, second: ContainerEdits) -> ContainerEdits:
    """``first`` then ``second``: environments combined (``second`` wins a name), the rest
    concatenated."""
    return ContainerEdits(
        env={**first.env, **second.env},
        device_nodes=first.device_nodes + second.device_nodes,
        mounts=first.mounts + second.mounts,
        hooks=first.hooks + second.hooks,
    )


def _get_claim(reader: ClaimReader, claim: ClaimRef) -> ResourceClaim:
    try:
        return reader.get_claim(claim.namespace, claim.name)
    except ClaimNotFoundError as error:
        raise PrepareError(f"{error}; it was deleted before the pod started") from error


async def _in_thread_to_completion(func: Callable[..., _T], /, *args: object) -> _T:
    """`asyncio.to_thread`, except that cancellation waits for the thread to finish.

    The thread cannot be stopped: returning early would release the caller's claim and device
    locks while it still writes, letting an unprepare (or another claim's prepare) of the same
    devices run beside a half-done prepare and leak its CDI spec and checkpoint entry.
    """
    task = asyncio.ensure_future(asyncio.to_thread(func, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # the caller is gone; the work rolled itself back if it failed
        raise
