"""Prepare and unprepare whole-GPU claims: checkpoint first, CDI spec, idempotent, leak-free.

Prepare, per claim (claims of one call run concurrently):

1. a claim already `PrepareCompleted` in the checkpoint returns its stored devices;
2. read the claim (a cache may answer; a UID that does not match is asked of the API server
   again); it must have this UID and an allocation; keep only results for this driver and this
   node's pool;
3. resolve the opaque configs (class < claim, later wins) - errors name claim, config, field;
4. lock the claim's devices (per-device locks, in name order) and refuse a device already
   prepared for another claim; admin-access results neither are refused nor block others (the
   scheduler does not count them as allocated);
5. record `PrepareStarted`, write the CDI spec (one CDI device per allocated device, named
   `<claimUID>-<device>`), record `PrepareCompleted` with the devices, return them. Each record
   is on disk before the next step; the records of claims being prepared at the same time (in
   one call or in concurrent calls) share checkpoint writes (the checkpoint's group commit).

A prepare that fails after step 5 began is rolled back at once; one that died with the process
is rolled back by the next prepare of that claim or by `recover()` at start-up. A cancelled call
keeps its locks until its file work in the worker thread is done (a thread cannot be stopped).

Unprepare works from the checkpoint alone (the claim may be gone): remove the CDI spec and the
claim's files, then the checkpoint entry. Unknown claims succeed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from gpu_dra.driver.config import AllocatedDevice, ConfigError, resolve_configs
from gpu_dra.driver.config.errors import DomainError
from gpu_dra.driver.naming import InvalidNameError, validate_claim_uid
from gpu_dra.kubelet_plugin.cdi import CdiDevice, ClaimSpecStore, qualified_device_id
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint, CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.inventory import NodeInventory
from gpu_dra.kubelet_plugin.kubeapi import (
    ClaimNotFoundError,
    ClaimReader,
    ClaimReadError,
    ResourceClaim,
)
from gpu_dra.kubelet_plugin.preparer import ClaimRef, PreparedDevice, PrepareResult

log = logging.getLogger(__name__)

_T = TypeVar("_T")

ADMIN_ACCESS_STATE: Final = "adminAccessDevices"
"""Checkpoint `state` key: devices the claim holds with adminAccess (they block no one)."""


class PrepareError(Exception):
    """A claim cannot be prepared; the message is what the pod event shows."""


@dataclass(frozen=True)
class _Result:
    """One allocation result of this driver on this node."""

    request: str
    device: str
    admin_access: bool
    share_id: str | None

    @property
    def base_request(self) -> str:
        return self.request.split("/", 1)[0]


class WholeGpuPreparer:
    """`ClaimPreparer` for whole GPUs on one node."""

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
    ) -> None:
        """`uncached_claims` reads the API server directly; give it when `claims` is a cache, which
        may not have seen a claim replaced under the same name yet: a claim whose UID does not
        match is read once more from there before it is reported replaced."""
        self._driver = driver_name
        self._pool = node_name
        self._inventory = inventory
        self._claims = claims
        self._uncached_claims = uncached_claims
        self._checkpoint = checkpoint
        self._cdi = cdi
        self._claims_dir = claims_dir
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
        """Roll back half-done prepares and remove CDI specs/claim files nobody owns."""
        entries = await asyncio.to_thread(self._checkpoint.all)
        for uid, entry in entries.items():
            if entry.phase is ClaimPhase.PREPARE_STARTED:
                log.info("rolling back interrupted prepare claim_uid=%s", uid)
                await _in_thread_to_completion(self._undo, uid)
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
        results = self._our_results(resource_claim)
        if not results:
            raise PrepareError(
                f"the allocation has no device of driver {self._driver} in pool {self._pool}"
            )
        allocation = resource_claim["status"]["allocation"]["devices"]
        configs = resolve_configs(
            allocation.get("config", []),
            [AllocatedDevice(request=r.request, device=r.device, type="gpu") for r in results],
            driver=self._driver,
            claim=f"{claim.namespace}/{claim.name}",
            spec_configs=resource_claim.get("spec", {}).get("devices", {}).get("config"),
        )
        for group in configs.groups:
            sharing = getattr(group.config, "sharing", None)
            if sharing is not None:
                raise PrepareError(
                    f"{group.origin.label}: sharing strategy {sharing.strategy} is not supported "
                    "for whole-GPU claims by this gpu-dra version; remove `sharing` from the "
                    "config to get the GPU exclusively"
                )

        device_names = sorted({r.device for r in results})
        async with self._locked_devices(device_names):
            return await _in_thread_to_completion(self._check_and_commit, claim, results)

    def _lookup(self, claim: ClaimRef) -> tuple[CheckpointEntry | None, ResourceClaim | None]:
        """The claim's checkpoint entry; without one, the claim as read from the API."""
        existing = self._checkpoint.get(claim.uid)
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

    def _our_results(self, resource_claim: ResourceClaim) -> list[_Result]:
        raw: list[dict[str, Any]] = resource_claim["status"]["allocation"]["devices"].get(
            "results", []
        )
        results = []
        for item in raw:
            if item.get("driver") != self._driver or item.get("pool") != self._pool:
                continue
            if self._inventory.by_name(item["device"]) is None:
                raise PrepareError(
                    f"allocated device {item['device']} does not exist on node {self._pool}; "
                    "the ResourceSlice it came from is stale"
                )
            results.append(
                _Result(
                    request=item["request"],
                    device=item["device"],
                    admin_access=bool(item.get("adminAccess")),
                    share_id=item.get("shareID"),
                )
            )
        return results

    def _check_not_taken(self, claim: ClaimRef, results: Sequence[_Result]) -> None:
        exclusive = {r.device for r in results if not r.admin_access}
        for uid, entry in self._checkpoint.all().items():
            if uid == claim.uid:
                continue
            taken = exclusive & _exclusive_devices(entry)
            if taken:
                other = entry.claim
                raise PrepareError(
                    f"device {', '.join(sorted(taken))} is already prepared for claim "
                    f"{other.namespace}/{other.name} ({other.uid}); refusing to hand one GPU to "
                    "two claims (unprepare that claim or delete its pod first)"
                )

    def _check_and_commit(
        self, claim: ClaimRef, results: Sequence[_Result]
    ) -> tuple[PreparedDevice, ...]:
        """`_check_not_taken`, then `_commit`: one thread hop, under the caller's device locks."""
        self._check_not_taken(claim, results)
        return self._commit(claim, results)

    def _commit(self, claim: ClaimRef, results: Sequence[_Result]) -> tuple[PreparedDevice, ...]:
        self._checkpoint.put(CheckpointEntry(claim=claim, phase=ClaimPhase.PREPARE_STARTED))
        try:
            claim_dir = self._claims_dir / claim.uid
            claim_dir.mkdir(parents=True, exist_ok=True)
            claim_dir.chmod(0o755)
            by_device: dict[str, list[_Result]] = {}
            for result in results:
                by_device.setdefault(result.device, []).append(result)
            cdi_devices = []
            prepared = []
            for device_name, device_results in sorted(by_device.items()):
                gpu = self._inventory.by_name(device_name)
                assert gpu is not None  # checked in _our_results
                cdi_devices.append(
                    CdiDevice(device_name, self._inventory.container_edits(gpu, claim_dir))
                )
                prepared.append(
                    PreparedDevice(
                        request_names=tuple(sorted({r.base_request for r in device_results})),
                        pool_name=self._pool,
                        device_name=device_name,
                        cdi_device_ids=(qualified_device_id(claim.uid, device_name, self._driver),),
                        share_id=device_results[0].share_id,
                    )
                )
            self._cdi.write(claim.uid, cdi_devices)
            devices = tuple(prepared)
            admin = sorted({r.device for r in results if r.admin_access})
            self._checkpoint.put(
                CheckpointEntry(
                    claim=claim,
                    phase=ClaimPhase.PREPARE_COMPLETED,
                    devices=devices,
                    state={ADMIN_ACCESS_STATE: list(admin)} if admin else {},
                )
            )
        except BaseException:
            self._undo(claim.uid)
            raise
        return devices

    # ---- unprepare -------------------------------------------------------------------------------
    async def _unprepare_one(self, claim: ClaimRef) -> str | None:
        try:
            validate_claim_uid(claim.uid)
            async with self._claim_lock(claim.uid):
                entry = await asyncio.to_thread(self._checkpoint.get, claim.uid)
                if entry is None:
                    return None
                async with self._locked_devices(sorted(d.device_name for d in entry.devices)):
                    await _in_thread_to_completion(self._undo, claim.uid)
        except (InvalidNameError, OSError, DomainError) as error:
            log.exception("unprepare failed claim_uid=%s", claim.uid)
            return f"claim {claim.namespace}/{claim.name} ({claim.uid}): {error}"
        log.info("unprepared claim_uid=%s", claim.uid)
        return None

    def _undo(self, claim_uid: str) -> None:
        """Remove everything a prepare of this claim may have left; the checkpoint entry last."""
        self._cdi.remove(claim_uid)
        shutil.rmtree(self._claims_dir / claim_uid, ignore_errors=True)
        self._checkpoint.remove(claim_uid)

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


def _get_claim(reader: ClaimReader, claim: ClaimRef) -> ResourceClaim:
    try:
        return reader.get_claim(claim.namespace, claim.name)
    except ClaimNotFoundError as error:
        raise PrepareError(f"{error}; it was deleted before the pod started") from error


def _exclusive_devices(entry: CheckpointEntry) -> set[str]:
    """Devices `entry` holds for itself: all but those it was given with adminAccess."""
    admin = entry.state.get(ADMIN_ACCESS_STATE)
    shared = {name for name in admin if isinstance(name, str)} if isinstance(admin, list) else set()
    return {d.device_name for d in entry.devices} - shared


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
