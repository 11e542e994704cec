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
5. record `PrepareStarted` (with the time-slice intervals about to be applied); set the
   interval of every full GPU of a config group with `sharing.strategy: TimeSlicing`; start one
   MPS control daemon per config group with `sharing.strategy: MPS` and record its handle in a
   `PrepareStarted` update at once; write the
   CDI spec (one CDI device per allocated device, named `<claimUID>-<device>`; devices of an MPS
   group also get the daemon's pipe directory and shm; on real nodes the spec's common edits are
   the driver's userspace, `driver_userspace.CommonEdits`, asked before step 5 changes anything,
   so a driver that cannot be found fails the claim with nothing to undo), record
   `PrepareCompleted` with the
   devices and the daemon handles, return the devices. Each record is on disk before the next
   step; the records of claims being prepared at the same time (in one call or in concurrent
   calls) share checkpoint writes (the checkpoint's group commit).

A prepare that fails after step 5 began is rolled back at once; one that died with the process
is rolled back by the next prepare of that claim or by `recover()` at start-up. A cancelled call
keeps its locks until its file work in the worker thread is done (a thread cannot be stopped).

Unprepare works from the checkpoint alone (the claim may be gone): stop the claim's MPS daemons
(handles in the entry's `state`), reset the time-slice intervals it recorded to Default (unless
another prepared claim still records the same GPU), remove the CDI spec and the claim's files,
then the checkpoint entry. Unknown claims succeed. `recover()` at start-up adopts the daemons of
prepared claims (a dead one is logged; the claim stays prepared) and rolls back interrupted
prepares, daemons and time slices included.

MPS (NVIDIA-compatible, `nvidia-compat.md` §7): one daemon per (claim, config group) for the
group's full GPUs and one per MIG device of the group (``MigDeviceConfig``; CUDA_VISIBLE_DEVICES
and pinned limits keyed by the MIG UUID), id `claim_daemon_id(claimUID, UUIDs)`, defaults from
`mpsConfig`. The manager sets EXCLUSIVE_PROCESS on the full GPUs when configured.

MPS shares (`mps.shares`): a result on a GPU offered as shares that consumed less than the whole
GPU joins the GPU's one shared daemon (started by the first share, stopped with the last, counted
through the checkpoint) and gets its consumed capacity as client caps in its CDI devices. Shares
of one GPU do not exclude each other; a share and a whole-GPU hold of one GPU do.

Dynamic MIG (`mig/`, `docs/mig.md`): a claim's partition devices (`MigPartition`) become MIG
devices during prepare. Their intents (parent, GI profile ID, placement) are in the first
`PrepareStarted` record, before any NVML call; the GPU and compute instances are made after the
time slices and the MPS daemons of published devices, their ids recorded in a second
`PrepareStarted` record; then the MPS daemons of config groups with new MIG devices start (one
per MIG device, keyed by the UUID it was made with; each recorded at once), and the CDI spec
gets the new MIG devices' edits. Unprepare and rollback destroy them after the CDI
spec is gone; `recover()` also destroys every MIG instance of a dynamic-MIG GPU that no
prepared claim records.

Time-slicing (`nvidia-compat.md` §8, `timeslicing.py`): full GPUs of a TimeSlicing group get
their interval through the `TimeSlicer` seam; `MigDeviceConfig` TimeSlicing on MIG devices is
accepted and changes nothing (as NVIDIA's driver). "Not Supported" fails the claim with a
message, except for interval Default, which then needs no change. MPS and TimeSlicing on one
physical GPU at once, or two claims time-slicing one GPU (adminAccess) with different intervals,
are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from gpu_dra.driver.config import (
    AllocatedDevice,
    ConfigError,
    ConfigGroup,
    DeviceType,
    mps_config,
    pinned_memory_limits,
    resolve_configs,
)
from gpu_dra.driver.config.errors import DomainError
from gpu_dra.driver.model import Gpu, MigDevice, MigPartition
from gpu_dra.driver.naming import InvalidNameError, validate_claim_uid
from gpu_dra.driver.shares import ShareError
from gpu_dra.kubelet_plugin.cdi import (
    CdiDevice,
    ClaimSpecStore,
    ContainerEdits,
    qualified_device_id,
)
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint, CheckpointEntry, ClaimPhase, JsonValue
from gpu_dra.kubelet_plugin.kubeapi import (
    ClaimNotFoundError,
    ClaimReader,
    ClaimReadError,
    ResourceClaim,
)
from gpu_dra.kubelet_plugin.mig import (
    DYNAMIC_MIG_STATE_KEY,
    DynamicMig,
    MigError,
    MigIntent,
    intents_from_state,
    intents_to_state,
)
from gpu_dra.kubelet_plugin.mps import (
    MPS_STATE_KEY,
    DaemonHandle,
    MpsControl,
    MpsDaemonGoneError,
    MpsError,
    MpsSettings,
    claim_daemon_id,
    handles_from_state,
    handles_to_state,
    workload_edits,
)
from gpu_dra.kubelet_plugin.mps.shared_daemons import (
    SHARES_STATE_KEY,
    PlannedShare,
    SharedDaemons,
    ShareRefusedError,
    is_shared_daemon,
    plan_shares,
    share_devices,
)
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice, PrepareResult
from gpu_dra.kubelet_plugin.timeslicing import (
    TIME_SLICE_STATE_KEY,
    TimeSlicer,
    TimeSlicingError,
    TimeSlicingNotSupportedError,
    interval_name,
    time_slices_from_state,
    time_slices_to_state,
)

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
    consumed: Mapping[str, str] | None = None
    """``consumedCapacity`` (devices that allow multiple allocations)."""

    @property
    def base_request(self) -> str:
        return self.request.split("/", 1)[0]


@dataclass(frozen=True)
class _MpsGroup:
    """One MPS daemon to start for a claim: its config group's devices and settings."""

    daemon_id: str
    device_names: tuple[str, ...]
    uuids: tuple[str, ...]
    settings: MpsSettings
    deferred: ConfigGroup | None = None
    """A config group with dynamic MIG devices: its daemons are planned and started once the MIG
    devices exist (their UUIDs are known only then); ``daemon_id`` and ``uuids`` are empty."""


@dataclass(frozen=True)
class _TimeSlice:
    """One full GPU whose time-slice interval a claim sets."""

    device_name: str
    uuid: str
    product: str
    interval: int
    label: str
    """The config entry asking for it, as messages name it."""


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
        mps: MpsControl | None = None,
        time_slicer: TimeSlicer | None = None,
        dynamic_mig: DynamicMig | None = None,
        mps_share_max_percent: int = 100,
        common_edits: Callable[[], ContainerEdits] | None = None,
    ) -> None:
        """`uncached_claims` reads the API server directly; give it when `claims` is a cache, which
        may not have seen a claim replaced under the same name yet: a claim whose UID does not
        match is read once more from there before it is reported replaced.

        `mps` starts and stops MPS control daemons; without it, claims asking for MPS fail.
        `time_slicer` sets time-slice intervals; without it, claims asking for TimeSlicing on
        full GPUs fail. `dynamic_mig` makes the MIG devices of partition devices; without it,
        claims with partition devices fail. `mps_share_max_percent` is the largest MPS share
        (`mps.shares`). `common_edits` gives the edits every container of a claim gets (the
        driver's userspace on real nodes, `driver_userspace.CommonEdits.current`; None on
        simulated ones), asked once per prepare before anything changes."""
        self._driver = driver_name
        self._pool = node_name
        self._inventory = inventory
        self._claims = claims
        self._uncached_claims = uncached_claims
        self._checkpoint = checkpoint
        self._cdi = cdi
        self._claims_dir = claims_dir
        self._mps = mps
        self._time_slicer = time_slicer
        self._dynamic_mig = dynamic_mig
        self._max_share = mps_share_max_percent
        self._common_edits = common_edits
        self._shared = None
        if mps is not None:
            self._shared = SharedDaemons(mps, checkpoint, max_percent=mps_share_max_percent)
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
        """Roll back half-done prepares (stopping their MPS daemons), adopt the MPS daemons of
        prepared claims, and remove MPS daemons, CDI specs and claim files nobody owns.

        Run it before serving: a daemon that a prepare running beside it has started but not
        recorded yet would be taken for a leftover."""
        entries = await asyncio.to_thread(self._checkpoint.all)
        for uid, entry in entries.items():
            if entry.phase is ClaimPhase.PREPARE_STARTED:
                log.info("rolling back interrupted prepare claim_uid=%s", uid)
                try:
                    await _in_thread_to_completion(self._undo, uid)
                except (MpsError, TimeSlicingError, MigError, OSError) as error:
                    # Kept in the checkpoint: the next prepare or unprepare retries.
                    log.error("rollback of claim_uid=%s incomplete: %s", uid, error)
            else:
                await _in_thread_to_completion(self._adopt_daemons, entry)
        if self._mps is not None or self._dynamic_mig is not None:
            # What the rollbacks left: one read for both sweeps.
            remaining = await asyncio.to_thread(self._checkpoint.all)
            if self._mps is not None:
                await _in_thread_to_completion(self._remove_unrecorded_daemons, remaining)
            if self._dynamic_mig is not None:
                await _in_thread_to_completion(self._dynamic_mig.remove_unowned, remaining)
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
        except (MpsError, TimeSlicingError, MigError) as error:
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
        shares = self._plan_shares(results, configs.groups)
        mps_groups = self._mps_groups(
            claim, configs.groups, results, skip={s.device_name for s in shares}
        )
        time_slices = self._time_slices(configs.groups, mps_groups)
        mig_intents = self._mig_intents(results)

        device_names = sorted({r.device for r in results})
        async with self._locked_devices(device_names):
            commit = functools.partial(self._check_and_commit, shares=shares)
            return await _in_thread_to_completion(
                commit, claim, results, mps_groups, time_slices, mig_intents
            )

    def _plan_shares(
        self, results: Sequence[_Result], groups: Sequence[ConfigGroup]
    ) -> list[PlannedShare]:
        """The MPS shares among the results (`mps.shares`); errors become `PrepareError`s."""
        try:
            shares = plan_shares(
                results, groups, self._inventory.shared_gpu, max_percent=self._max_share
            )
        except (ShareRefusedError, ShareError) as error:
            raise PrepareError(str(error)) from error
        if shares and self._shared is None:
            raise PrepareError(
                f"device {shares[0].device_name} is an MPS share, but MPS is not available on "
                f"node {self._pool}: the plugin has no MPS control daemon manager (see its "
                "start-up log)"
            )
        return shares

    def _mig_intents(self, results: Sequence[_Result]) -> list[MigIntent]:
        """The MIG devices the claim makes: one per partition device (dynamic MIG)."""
        partitions = {
            r.device: device
            for r in results
            if isinstance(device := self._inventory.by_name(r.device), MigPartition)
        }
        if not partitions:
            return []
        if self._dynamic_mig is None:
            raise PrepareError(
                f"allocated device {min(partitions)} is a dynamic MIG partition, but this plugin "
                "does not make MIG devices (it runs without dynamic MIG); the ResourceSlice it "
                "came from is stale"
            )
        return self._dynamic_mig.plan(partitions)

    def _mps_groups(
        self,
        claim: ClaimRef,
        groups: Sequence[ConfigGroup],
        results: Sequence[_Result],
        skip: Collection[str] = (),
    ) -> list[_MpsGroup]:
        """The MPS daemons the claim needs, one per config group with strategy MPS, leaving out
        the devices in ``skip`` (MPS shares, served by their GPU's shared daemon). Config
        errors that need the group's UUIDs are raised here, before anything is started."""
        admin = {r.device for r in results if r.admin_access}
        planned: list[_MpsGroup] = []
        taken: dict[str, str] = {}
        for group in groups:
            sharing = getattr(group.config, "sharing", None)
            if sharing is None:
                continue
            mps = mps_config(group.config)
            if mps is None:
                continue  # TimeSlicing: `_time_slices`
            names = tuple(sorted({d.device for d in group.devices}.difference(skip)))
            if not names:
                continue
            shared = sorted(admin.intersection(names))
            if shared:
                raise PrepareError(
                    f"{group.origin.label}: MPS cannot be used on devices allocated with "
                    f"adminAccess ({', '.join(shared)}): they may belong to another claim"
                )
            for name in names:
                if name in taken:
                    raise PrepareError(
                        f"{group.origin.label}: device {name} is also in config group "
                        f"{taken[name]}; one device can be served by one MPS daemon only"
                    )
                taken[name] = group.origin.label
            if any(isinstance(self._inventory.by_name(n), MigPartition) for n in names):
                planned.append(_MpsGroup("", names, (), MpsSettings(), deferred=group))
                continue  # planned in `_commit` once the MIG devices exist
            planned += self._group_daemons(claim, group, names, self._uuid)
        if planned and self._mps is None:
            raise PrepareError(
                f"{planned[0].daemon_id or ', '.join(planned[0].device_names)}: MPS is not "
                f"available on node {self._pool}: the plugin has no MPS control daemon manager "
                "(see its start-up log)"
            )
        return planned

    def _group_daemons(
        self,
        claim: ClaimRef,
        group: ConfigGroup,
        names: Sequence[str],
        uuid_of: Callable[[str], str],
    ) -> list[_MpsGroup]:
        """The daemons for ``names`` of one MPS config group: its full GPUs share one (NVIDIA's
        model); each MIG device gets one of its own (MPS on MIG needs one per MIG device,
        mps.md §8)."""
        mps = mps_config(group.config)
        assert mps is not None  # only groups with strategy MPS get here
        uuids = tuple(sorted(uuid_of(name) for name in names))
        limits = pinned_memory_limits(group, uuids, claim=f"{claim.namespace}/{claim.name}")
        gpus = tuple(n for n in names if isinstance(self._inventory.by_name(n), Gpu))
        daemons = [gpus] if gpus else []
        daemons += [(n,) for n in names if n not in gpus]
        planned = []
        for daemon_names in daemons:
            daemon_uuids = tuple(sorted(uuid_of(name) for name in daemon_names))
            settings = MpsSettings(
                active_thread_percentage=mps.default_active_thread_percentage,
                pinned_limits={u: v for u, v in limits.items() if u in daemon_uuids},
                multi_user=bool(mps.multi_user),
            )
            settings.check(daemon_uuids)
            daemon_id = claim_daemon_id(claim.uid, daemon_uuids)
            planned.append(_MpsGroup(daemon_id, daemon_names, daemon_uuids, settings))
        return planned

    def _time_slices(
        self, groups: Sequence[ConfigGroup], mps_groups: Sequence[_MpsGroup]
    ) -> list[_TimeSlice]:
        """The full GPUs whose interval the claim sets, one per GPU, by device name. MIG
        devices of a TimeSlicing group are a no-op (logged); a GPU asked for two intervals, or
        for MPS and TimeSlicing, is an error."""
        planned: dict[str, _TimeSlice] = {}
        for group in groups:
            sharing = getattr(group.config, "sharing", None)
            if sharing is None or sharing.strategy != "TimeSlicing":
                continue
            slicing = getattr(sharing, "time_slicing_config", None)
            interval = 0 if slicing is None else slicing.nvidia_smi_value
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
                assert isinstance(device, Gpu)  # checked in _our_results
                wanted = _TimeSlice(
                    name, device.uuid, device.product_name, interval, group.origin.label
                )
                earlier = planned.get(name)
                if earlier is not None and earlier.interval != interval:
                    raise PrepareError(
                        f"{group.origin.label}: device {name} is also in config group "
                        f"{earlier.label} with time-slice interval "
                        f"{interval_name(earlier.interval)}; one GPU has one interval (this "
                        f"entry asks for {interval_name(interval)})"
                    )
                planned.setdefault(name, wanted)
        for mps_group in mps_groups:
            for name in mps_group.device_names:
                if name in planned:
                    raise PrepareError(
                        f"{planned[name].label}: device {name} is time-sliced and also served by "
                        f"MPS daemon {mps_group.daemon_id}; MPS and TimeSlicing cannot both be "
                        "active on one GPU"
                    )
        if planned and self._time_slicer is None:
            first = next(iter(planned.values()))
            raise PrepareError(
                f"{first.label}: time-slicing is not available on node {self._pool}: the plugin "
                "has no nvidia-smi to set intervals with (--nvidia-smi; see its start-up log)"
            )
        return [planned[name] for name in sorted(planned)]

    def _check_sharing_conflicts(
        self,
        mps_groups: Sequence[_MpsGroup],
        time_slices: Sequence[_TimeSlice],
        others: Mapping[str, CheckpointEntry],
    ) -> None:
        """Refuse what other prepared claims make impossible on the same GPUs: a different
        time-slice interval, or MPS beside TimeSlicing (possible where adminAccess lets two
        claims hold one GPU)."""
        if not time_slices and not mps_groups:
            return
        mine = {ts.uuid: ts for ts in time_slices}
        mps_uuids = {uuid: group for group in mps_groups for uuid in group.uuids}
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
            for uuid, group in mps_uuids.items():
                if uuid in theirs:
                    raise PrepareError(
                        f"{group.daemon_id}: GPU {uuid} is time-sliced by {owner}; MPS and "
                        "TimeSlicing cannot both be active on one GPU"
                    )

    def _uuid(self, device_name: str) -> str:
        gpu = self._inventory.by_name(device_name)
        assert isinstance(gpu, Gpu | MigDevice)  # checked in _our_results
        return gpu.uuid

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

    def _device_type(self, device_name: str) -> DeviceType:
        """`mig` for MIG devices, else `gpu`: decides which config kinds apply (GpuConfig or
        MigDeviceConfig) and which are a mismatch error."""
        device = self._inventory.by_name(device_name)
        return "mig" if isinstance(device, MigDevice | MigPartition) else "gpu"

    def _our_results(self, resource_claim: ResourceClaim) -> list[_Result]:
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
                _Result(
                    request=item["request"],
                    device=item["device"],
                    admin_access=bool(item.get("adminAccess")),
                    share_id=item.get("shareID"),
                    consumed=item.get("consumedCapacity"),
                )
            )
        return results

    def _check_not_taken(
        self,
        results: Sequence[_Result],
        shares: Sequence[PlannedShare],
        others: Mapping[str, CheckpointEntry],
    ) -> None:
        """Refuse a device another prepared claim holds for itself; MPS shares of one GPU do
        not exclude each other, but a share and a whole-GPU hold do."""
        held = {r.device for r in results if not r.admin_access}
        whole = held - {share.device_name for share in shares}
        for entry in others.values():
            taken = (held & _exclusive_devices(entry)) | (whole & share_devices(entry.state))
            if taken:
                other = entry.claim
                raise PrepareError(
                    f"device {', '.join(sorted(taken))} is already prepared for claim "
                    f"{other.namespace}/{other.name} ({other.uid}); refusing to hand one GPU to "
                    "two claims (unprepare that claim or delete its pod first)"
                )

    def _check_and_commit(
        self,
        claim: ClaimRef,
        results: Sequence[_Result],
        mps_groups: Sequence[_MpsGroup],
        time_slices: Sequence[_TimeSlice],
        mig_intents: Sequence[MigIntent] = (),
        *,
        shares: Sequence[PlannedShare] = (),
    ) -> tuple[PreparedDevice, ...]:
        """`_check_not_taken`, `_check_sharing_conflicts` and `_check_mig_conflicts` on one
        read of the other claims' entries, then `_commit`: one thread hop, under the caller's
        device locks."""
        others = {uid: e for uid, e in self._checkpoint.all().items() if uid != claim.uid}
        self._check_not_taken(results, shares, others)
        self._check_sharing_conflicts(mps_groups, time_slices, others)
        self._check_mig_conflicts(claim, results, mig_intents, others)
        return self._commit(claim, results, mps_groups, time_slices, mig_intents, shares=shares)

    def _check_mig_conflicts(
        self,
        claim: ClaimRef,
        results: Sequence[_Result],
        mig_intents: Sequence[MigIntent],
        others: Mapping[str, CheckpointEntry],
    ) -> None:
        """Refuse a whole GPU another claim has MIG devices on, and a MIG device on a GPU
        another claim holds whole (the scheduler's counters prevent both; this guards races)."""
        if self._dynamic_mig is None:
            return
        whole = [
            device
            for r in results
            if not r.admin_access and isinstance(device := self._inventory.by_name(r.device), Gpu)
        ]
        if not whole and not mig_intents:
            return
        conflict = self._dynamic_mig.conflict(claim.uid, mig_intents, whole, others)
        if conflict is not None:
            raise PrepareError(conflict)

    def _commit(
        self,
        claim: ClaimRef,
        results: Sequence[_Result],
        mps_groups: Sequence[_MpsGroup],
        time_slices: Sequence[_TimeSlice] = (),
        mig_intents: Sequence[MigIntent] = (),
        *,
        shares: Sequence[PlannedShare] = (),
    ) -> tuple[PreparedDevice, ...]:
        # Before any change: a driver that cannot be found fails the claim with nothing to undo.
        common = None if self._common_edits is None else self._common_edits()
        started: dict[str, JsonValue] = {}
        if mig_intents:
            # Recorded before any NVML call: a crash from here on is rolled back from it.
            started[DYNAMIC_MIG_STATE_KEY] = intents_to_state(mig_intents)
        if time_slices:
            # Recorded before nvidia-smi runs: a crash in between is rolled back from it.
            started[TIME_SLICE_STATE_KEY] = time_slices_to_state(
                {ts.uuid: ts.interval for ts in time_slices}
            )
        self._checkpoint.put(
            CheckpointEntry(claim=claim, phase=ClaimPhase.PREPARE_STARTED, state=started)
        )
        handles: list[DaemonHandle] = []
        try:
            applied = self._apply_time_slices(time_slices)
            mps_edits: dict[str, ContainerEdits] = {}
            for group in mps_groups:
                if group.deferred is None:
                    self._start_daemon(claim, group, started, handles, mps_edits)
            mps_edits.update(self._join_shares(claim, shares, started, handles))
            made = self._make_mig_devices(claim, mig_intents, started, handles)
            # MPS on dynamic MIG: the daemons of groups with new MIG devices, keyed by the UUIDs
            # those devices got; their handles are recorded with the devices' ids.
            for pending in (g for g in mps_groups if g.deferred is not None):
                assert pending.deferred is not None
                for group in self._group_daemons(
                    claim,
                    pending.deferred,
                    pending.device_names,
                    lambda n: self._made_or_published(made, n).uuid,
                ):
                    self._start_daemon(claim, group, started, handles, mps_edits)
            claim_dir = self._claims_dir / claim.uid
            claim_dir.mkdir(parents=True, exist_ok=True)
            claim_dir.chmod(0o755)
            by_device: dict[str, list[_Result]] = {}
            for result in results:
                by_device.setdefault(result.device, []).append(result)
            cdi_devices = []
            prepared = []
            for device_name, device_results in sorted(by_device.items()):
                gpu = self._made_or_published(made, device_name)
                edits = self._inventory.container_edits(gpu, claim_dir)
                if device_name in mps_edits:
                    edits = merged_edits(edits, mps_edits[device_name])
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
            devices = tuple(prepared)
            admin = sorted({r.device for r in results if r.admin_access})
            state: dict[str, JsonValue] = {}
            if admin:
                state[ADMIN_ACCESS_STATE] = list(admin)
            if handles:
                state[MPS_STATE_KEY] = handles_to_state(handles)
            if shares:
                state[SHARES_STATE_KEY] = {s.device_name: s.to_state() for s in shares}
            if applied:
                state[TIME_SLICE_STATE_KEY] = time_slices_to_state(applied)
            if made:
                state[DYNAMIC_MIG_STATE_KEY] = started[DYNAMIC_MIG_STATE_KEY]
            self._checkpoint.put(
                CheckpointEntry(
                    claim=claim,
                    phase=ClaimPhase.PREPARE_COMPLETED,
                    devices=devices,
                    state=state,
                )
            )
        except BaseException:
            self._undo(claim.uid, handles)
            raise
        return devices

    def _join_shares(
        self,
        claim: ClaimRef,
        shares: Sequence[PlannedShare],
        started: Mapping[str, JsonValue],
        handles: list[DaemonHandle],
    ) -> dict[str, ContainerEdits]:
        """Join each share's GPU daemon, recording its handle (appended to ``handles``) in the
        claim's `PrepareStarted` entry before another claim could stop it; the CDI edits (pipe
        dir, shm, the share's caps) by device name."""
        edits: dict[str, ContainerEdits] = {}
        for share in shares:
            assert self._shared is not None  # checked in _plan_shares

            def record(joined: DaemonHandle) -> None:
                handles.append(joined)
                self._record_started(claim, started, handles)

            handle = self._shared.join(claim.uid, share, record)
            edits[share.device_name] = workload_edits(handle.paths, share.caps())
        return edits

    def _start_daemon(
        self,
        claim: ClaimRef,
        group: _MpsGroup,
        started: Mapping[str, JsonValue],
        handles: list[DaemonHandle],
        mps_edits: dict[str, ContainerEdits],
    ) -> None:
        """Start one MPS daemon, record its handle (with ``started``) in a `PrepareStarted`
        record at once, and note its workload edits for the group's devices."""
        assert self._mps is not None  # checked in _mps_groups
        handle = self._mps.start(group.daemon_id, group.uuids, group.settings)
        handles.append(handle)
        # On disk before anything else: a crash from here on is rolled back from it.
        self._record_started(claim, started, handles)
        mps_edits.update(dict.fromkeys(group.device_names, workload_edits(handle.paths)))

    def _made_or_published(self, made: Mapping[str, MigDevice], name: str) -> Gpu | MigDevice:
        device = made.get(name) or self._inventory.by_name(name)
        assert isinstance(device, Gpu | MigDevice)  # partitions are in `made`
        return device

    def _make_mig_devices(
        self,
        claim: ClaimRef,
        intents: Sequence[MigIntent],
        started: dict[str, JsonValue],
        handles: Sequence[DaemonHandle],
    ) -> dict[str, MigDevice]:
        """Make the claim's MIG devices and record their ids in `started` and in a
        `PrepareStarted` record (the intents are on disk already); the devices by name."""
        if not intents:
            return {}
        assert self._dynamic_mig is not None  # checked in _mig_intents
        created, made = self._dynamic_mig.create(intents)
        started[DYNAMIC_MIG_STATE_KEY] = intents_to_state(created)
        self._record_started(claim, started, handles)
        return made

    def _record_started(
        self,
        claim: ClaimRef,
        started: Mapping[str, JsonValue],
        handles: Sequence[DaemonHandle],
    ) -> None:
        """Put the claim's `PrepareStarted` entry: ``started`` and, if any, the MPS daemons it
        holds so far."""
        state = dict(started)
        if handles:
            state[MPS_STATE_KEY] = handles_to_state(handles)
        self._checkpoint.put(
            CheckpointEntry(claim=claim, phase=ClaimPhase.PREPARE_STARTED, state=state)
        )

    def _apply_time_slices(self, time_slices: Sequence[_TimeSlice]) -> dict[str, int]:
        """Set each GPU's interval; ``{uuid: value}`` of those set. "Not Supported" fails the
        claim, except for Default: such a GPU has no other interval, nothing to change."""
        applied: dict[str, int] = {}
        for ts in time_slices:
            assert self._time_slicer is not None  # checked in _time_slices
            try:
                self._time_slicer.set_interval(ts.uuid, ts.interval)
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
        return applied

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
        except (
            InvalidNameError,
            OSError,
            DomainError,
            MpsError,
            TimeSlicingError,
            MigError,
        ) as error:
            log.exception("unprepare failed claim_uid=%s", claim.uid)
            return f"claim {claim.namespace}/{claim.name} ({claim.uid}): {error}"
        log.info("unprepared claim_uid=%s", claim.uid)
        return None

    def _undo(self, claim_uid: str, started: Sequence[DaemonHandle] = ()) -> None:
        """Remove everything a prepare of this claim may have left; the checkpoint entry last.

        MPS daemons go first: those the entry records and ``started`` (daemons of the prepare
        being rolled back that may not be recorded yet). A daemon that cannot be stopped
        raises, and the entry stays for the next try."""
        entry = self._checkpoint.get(claim_uid)
        handles = list(started)
        if entry is not None:
            recorded = handles_from_state(entry.state)
            handles += [h for h in recorded if h not in handles]
        if handles:
            if self._mps is None:
                raise MpsError(
                    f"claim {claim_uid} has MPS daemons ({', '.join(h.daemon_id for h in handles)})"
                    " but this plugin has no MPS control daemon manager to stop them"
                )
            for handle in handles:
                if is_shared_daemon(handle.daemon_id) and self._shared is not None:
                    self._shared.release(claim_uid, handle)  # stops it after the last share
                else:
                    self._mps.stop(handle)
        if entry is not None:
            self._reset_time_slices(claim_uid, time_slices_from_state(entry.state))
        self._cdi.remove(claim_uid)
        shutil.rmtree(self._claims_dir / claim_uid, ignore_errors=True)
        if entry is not None:
            self._release_mig(claim_uid, intents_from_state(entry.state))
        self._checkpoint.remove(claim_uid)

    def _release_mig(self, claim_uid: str, intents: Sequence[MigIntent]) -> None:
        """Destroy the claim's MIG devices (after its CDI spec is gone); raises, keeping the
        entry for the next try, when one cannot be destroyed."""
        if not intents:
            return
        if self._dynamic_mig is None:
            raise MigError(
                f"claim {claim_uid} has MIG devices ({', '.join(i.device for i in intents)}) but "
                "this plugin runs without dynamic MIG and cannot destroy them; restart it with "
                "dynamic MIG on"
            )
        self._dynamic_mig.release(claim_uid, intents, self._checkpoint.all())

    def _reset_time_slices(self, claim_uid: str, slices: Mapping[str, int]) -> None:
        """Set the GPUs of ``slices`` back to Default, except those another claim in the
        checkpoint still records. Every GPU is tried; the first failure is raised after."""
        if not slices:
            return
        if self._time_slicer is None:
            raise TimeSlicingError(
                f"claim {claim_uid} set time-slice intervals on {', '.join(sorted(slices))} but "
                "this plugin has no nvidia-smi to reset them with"
            )
        kept: set[str] = set()
        for uid, entry in self._checkpoint.all().items():
            if uid != claim_uid:
                with contextlib.suppress(TimeSlicingError):
                    kept.update(time_slices_from_state(entry.state))
        failures: list[TimeSlicingError] = []
        for uuid in sorted(slices):
            if uuid in kept:
                log.info("time-slice of uuid=%s kept: another claim still uses it", uuid)
                continue
            try:
                self._time_slicer.reset(uuid)
            except TimeSlicingNotSupportedError:
                log.info("time-slice reset of uuid=%s: not supported, nothing to reset", uuid)
            except TimeSlicingError as error:
                log.error(
                    "time-slice reset of uuid=%s failed claim_uid=%s: %s", uuid, claim_uid, error
                )
                failures.append(error)
        if failures:
            raise failures[0]

    def _remove_unrecorded_daemons(self, entries: Mapping[str, CheckpointEntry]) -> None:
        """Remove daemons no entry of ``entries`` (the checkpoint's) records: started by a
        plugin that died before it could record them (the window between `MpsControl.start`
        and the checkpoint write)."""
        assert self._mps is not None
        recorded: set[str] = set()
        for uid, entry in entries.items():
            try:
                recorded.update(h.daemon_id for h in handles_from_state(entry.state))
            except MpsError as error:
                # Its daemons cannot be told apart from leftovers: remove none at all.
                log.error("mps state of claim_uid=%s unusable, leftovers kept: %s", uid, error)
                return
        for daemon_id in self._mps.leftovers():
            if daemon_id in recorded:
                continue
            log.info("removing MPS daemon no claim records daemon_id=%s", daemon_id)
            try:
                self._mps.remove_leftover(daemon_id)
            except MpsError as error:
                log.error("mps leftover daemon_id=%s not removed: %s", daemon_id, error)

    def _adopt_daemons(self, entry: CheckpointEntry) -> None:
        """Re-attach to the MPS daemons of a prepared claim; a dead or faulty one is logged
        (the claim stays prepared: its pods keep running, unprepare cleans up)."""
        try:
            handles = handles_from_state(entry.state)
        except MpsError as error:
            log.error("mps state of claim_uid=%s unusable: %s", entry.uid, error)
            return
        for handle in handles:
            if self._mps is None:
                log.error(
                    "claim_uid=%s has MPS daemon %s but MPS is not available in this plugin",
                    entry.uid,
                    handle.daemon_id,
                )
                continue
            try:
                self._mps.adopt(handle)
                status = self._mps.status(handle)
            except MpsDaemonGoneError as error:
                log.error(
                    "mps daemon of prepared claim is gone claim_uid=%s: %s; CUDA processes that "
                    "start now run without MPS; unprepare cleans up",
                    entry.uid,
                    error,
                )
                continue
            except MpsError as error:
                log.error("mps daemon not adopted claim_uid=%s: %s", entry.uid, error)
                continue
            if not status.healthy:
                log.warning(
                    "mps daemon adopted in state %s claim_uid=%s daemon_id=%s: %s",
                    status.state,
                    entry.uid,
                    handle.daemon_id,
                    status.detail,
                )

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


def _exclusive_devices(entry: CheckpointEntry) -> set[str]:
    """Devices `entry` holds for itself: all but those it was given with adminAccess and its
    MPS shares."""
    admin = entry.state.get(ADMIN_ACCESS_STATE)
    shared = {name for name in admin if isinstance(name, str)} if isinstance(admin, list) else set()
    return {d.device_name for d in entry.devices} - shared - share_devices(entry.state)


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
