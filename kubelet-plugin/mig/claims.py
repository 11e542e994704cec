"""Dynamic MIG devices of prepared claims: what the checkpoint records, create, release, sweep.

`DynamicMig` does the dynamic-MIG tier's work (`tiers.dynamic_mig`): `plan` turns partition devices
into `MigIntent`s (recorded before any NVML call); `create` makes them, destroying what it made on
a failure; `release` destroys a claim's (an intent without a GI id is found by its placement,
unless another claim records it). A partition offered as MPS shares (`MigIntent.shared`) has one
MIG device for all its claims: the first makes it, the others join it (`joinable`: the device at
the placement whose UUID another claim records), the last to release destroys it. `remove_unowned`
destroys at start-up every instance on a dynamic-MIG GPU that no ``PrepareCompleted`` claim records
(nor any entry of a plugin instance that still runs), MIG mode off on Hopper-or-later GPUs left
empty (a GPU whose instances cannot be read, or that a claim with unreadable MIG state may use, is
left as it is). Ownership is by (parent UUID, GI profile ID, placement start). See docs/mig.md,
"Dynamic MIG: lifecycle".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import replace

from gpu_dra.driver.model import Gpu, MigDevice, MigPartition
from gpu_dra.driver.naming import (
    GpuDeviceName,
    InvalidNameError,
    MigDeviceName,
    mig_device_name,
    parse_device_name,
)
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.mig.instances import MigError, gpu_label
from gpu_dra.kubelet_plugin.mig.intents import MigIntent
from gpu_dra.kubelet_plugin.mig.lifecycle import MigLifecycle
from gpu_dra.kubelet_plugin.tiers.state import intents_from_state

log = logging.getLogger(__name__)


class DynamicMig:
    """The dynamic-MIG part of preparing claims on one node (see the module doc)."""

    def __init__(self, lifecycle: MigLifecycle, gpus: Sequence[Gpu]) -> None:
        """`gpus`: the GPUs whose MIG devices are made on demand (their partitions are
        published); only their instances are ever destroyed by `remove_unowned`."""
        self._lifecycle = lifecycle
        self._gpus = {gpu.uuid: gpu for gpu in gpus}
        self._unswept: dict[str, str] = {}
        """GPUs whose start-up sweep failed, by UUID, with why: they may hold instances no
        claim owns (and MIG mode on), so they are not handed out whole until a sweep of them
        succeeds (`conflict` tries again)."""

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return tuple(self._gpus.values())

    def plan(
        self, partitions: Mapping[str, MigPartition], shared: Set[str] = frozenset()
    ) -> list[MigIntent]:
        """One intent per partition device (by device name), nothing created yet; those named
        in ``shared`` are offered as MPS shares (`MigIntent.shared`)."""
        return [
            MigIntent(
                name, p.parent.uuid, p.gi_profile_id, p.placement_start, shared=name in shared
            )
            for name, p in sorted(partitions.items())
        ]

    def create(
        self,
        intents: Sequence[MigIntent],
        others: Mapping[str, CheckpointEntry] | None = None,
    ) -> tuple[list[MigIntent], dict[str, MigDevice]]:
        """Make every intent's MIG device, in order; returns the intents with their ids and the
        devices by name. A shared intent joins the MIG device another claim of ``others`` (the
        other claims' records, read under the GPU's device lock) records at its placement,
        when that device still exists (`joinable`). On failure destroys the devices it made
        (never one it joined), then raises `MigError`."""
        done: list[MigIntent] = []
        made: list[MigIntent] = []
        devices: dict[str, MigDevice] = {}
        try:
            for intent in intents:
                parent = self._gpu(intent)
                device = self.joinable(intent, others or {})
                if device is None:
                    device = self._lifecycle.create(
                        parent, intent.gi_profile_id, intent.placement_start
                    )
                    made.append(replace(intent, gi_id=device.gi_id))
                else:
                    log.info("joined shared MIG device %s (%s) of another claim",
                             intent.device, device.uuid)  # fmt: skip
                done.append(
                    replace(intent, gi_id=device.gi_id, ci_id=device.ci_id, uuid=device.uuid)
                )
                devices[intent.device] = device
                name = mig_device_name(
                    parent.minor, device.profile, device.gi_profile_id, device.placement_start
                )
                if name != intent.device:
                    raise MigError(
                        f"the MIG device made for {intent.device} on {gpu_label(parent)} is "
                        f"{name} ({device.profile}); the published partition does not match "
                        "what NVML makes"
                    )
        except BaseException:
            self._destroy_made(made)
            raise
        return done, devices

    def joinable(
        self, intent: MigIntent, others: Mapping[str, CheckpointEntry]
    ) -> MigDevice | None:
        """The MIG device at a shared intent's placement that another claim in ``others``
        records by its UUID (made for an earlier share); None for an intent that is not shared,
        when no other claim records the placement, or when the device they record is gone (then
        a new one is made: the others find theirs gone at their next prepare, `missing`)."""
        if not intent.shared:
            return None
        recorded = {
            other.uuid
            for uid, entry in others.items()
            for other in _recorded(uid, entry)
            if other.key == intent.key and other.uuid is not None
        }
        if not recorded:
            return None
        found = self._lifecycle.existing(
            self._gpu(intent), intent.gi_profile_id, intent.placement_start
        )
        return found if found is not None and found.uuid in recorded else None

    def _destroy_made(self, made: Sequence[MigIntent]) -> None:
        for intent in reversed(made):
            try:
                self._lifecycle.destroy(
                    self._gpu(intent),
                    intent.gi_profile_id,
                    intent.placement_start,
                    gi_id=intent.gi_id,
                )
            except MigError as error:
                # The claim's rollback retries from the recorded intents (and start-up sweeps).
                log.error("rollback of MIG device %s failed: %s", intent.device, error)

    def release(
        self,
        claim_uid: str,
        intents: Sequence[MigIntent],
        others: Mapping[str, CheckpointEntry],
    ) -> None:
        """Destroy the MIG devices of `intents` (a claim's), leaving alone any placement that
        another claim in `others` records. Every intent is tried; the first failure is raised
        after."""
        taken = {
            intent.key: uid
            for uid, entry in others.items()
            if uid != claim_uid
            for intent in _recorded(uid, entry)
        }
        failures: list[MigError] = []
        for intent in intents:
            owner = taken.get(intent.key)
            if owner is not None:
                log.warning(
                    "MIG device %s of claim_uid=%s not destroyed: claim_uid=%s records its "
                    "placement",
                    intent.device,
                    claim_uid,
                    owner,
                )
                continue
            try:
                destroyed = self._lifecycle.destroy(
                    self._gpu(intent),
                    intent.gi_profile_id,
                    intent.placement_start,
                    # A shared device may have been made again by another claim, since gone:
                    # the last claim recording the placement destroys what is there.
                    gi_id=None if intent.shared else intent.gi_id,
                )
            except MigError as error:
                log.error("MIG device %s of claim_uid=%s: %s", intent.device, claim_uid, error)
                failures.append(error)
                continue
            if destroyed:
                log.info("destroyed MIG device %s claim_uid=%s", intent.device, claim_uid)
        if failures:
            raise failures[0]

    def missing(self, intents: Sequence[MigIntent]) -> list[str]:
        """The MIG devices of ``intents`` (a prepared claim's) that no longer exist, one phrase
        each: no GPU instance at the placement with the recorded id. Raises `MigError` when a
        GPU's instances cannot be listed."""
        gone = []
        listed: dict[str, set[tuple[int, int, int]]] = {}
        for intent in intents:
            parent = self._gpu(intent)
            here = (intent.gi_profile_id, intent.placement_start)
            if intent.shared and intent.uuid is not None:
                # Shared devices are made again by whichever claim comes first, maybe with the
                # same GI id: the UUID tells a new device from the one this claim holds.
                found_device = self._lifecycle.existing(parent, *here)
                if found_device is None or found_device.uuid != intent.uuid:
                    gone.append(f"MIG device {intent.device} ({intent.uuid}) on "
                                f"{gpu_label(parent)} is gone")  # fmt: skip
                continue
            if parent.uuid not in listed:
                listed[parent.uuid] = {
                    (i.gi_profile_id, i.placement_start, i.gi_id)
                    for i in self._lifecycle.instances(parent)
                }
            if not any(
                found[:2] == here and intent.gi_id in (None, found[2])
                for found in listed[parent.uuid]
            ):
                gone.append(f"MIG device {intent.device} on {gpu_label(parent)} is gone")
        return gone

    def conflict(
        self,
        claim_uid: str,
        intents: Sequence[MigIntent],
        whole_gpus: Iterable[Gpu],
        others: Mapping[str, CheckpointEntry],
    ) -> str | None:
        """Why the claim cannot have its MIG devices and whole GPUs beside what other claims
        hold: a whole GPU another claim has MIG devices on, or a MIG device on a GPU another
        claim holds whole (the scheduler's counters prevent both; this guards races). Fails
        closed: a whole GPU an unreadable record may have MIG devices on is refused, and one
        whose start-up sweep failed is swept again first (refused if that fails too). None when
        there is no conflict."""
        mine_whole = {gpu.uuid: gpu for gpu in whole_gpus}
        mine_mig = {intent.parent_uuid: intent for intent in intents}
        by_minor = {gpu.minor: gpu for gpu in self._gpus.values()}
        recorded: list[MigIntent] = []
        for uid, entry in others.items():
            if uid == claim_uid:
                continue
            owner = f"claim {entry.claim.namespace}/{entry.claim.name} ({uid})"
            try:
                theirs = intents_from_state(entry.state)
            except MigError as error:
                # Fails closed, as the start-up sweep does: the claim may have MIG devices on
                # any GPU its devices name (on every one when they name none).
                used = self._gpus_it_may_use(entry)
                gpu = next((mine_whole[u] for u in sorted(used) if u in mine_whole), None)
                if gpu is not None:
                    return (
                        f"GPU {gpu_label(gpu)} may have MIG devices of {owner}, whose dynamic "
                        f"MIG state cannot be read ({error}); it is not handed out whole until "
                        "that claim is unprepared or its record repaired"
                    )
                continue
            recorded += theirs
            for intent in theirs:
                gpu = mine_whole.get(intent.parent_uuid)
                if gpu is not None:
                    return (
                        f"GPU {gpu_label(gpu)} has MIG device {intent.device} of {owner}; a "
                        "GPU with MIG devices cannot be handed out whole"
                    )
            for device in entry.devices:
                gpu = by_minor.get(_whole_gpu_minor(device.device_name))
                held = None if gpu is None else mine_mig.get(gpu.uuid)
                if gpu is not None and held is not None:
                    return (
                        f"MIG device {held.device} cannot be made: its GPU {gpu_label(gpu)} is "
                        f"prepared whole for {owner}"
                    )
        for gpu in mine_whole.values():
            why = self._sweep_again(gpu, recorded)
            if why is not None:
                return why
        return None

    @property
    def unswept(self) -> dict[str, str]:
        """The GPUs whose start-up sweep failed and no later one succeeded: UUID -> why."""
        return dict(self._unswept)

    def sweep_again(self, gpu_uuid: str, entries: Mapping[str, CheckpointEntry]) -> str | None:
        """Sweep a GPU whose start-up sweep failed, keeping every instance ``entries`` record
        (call it under the GPU's lock); why it still cannot be handed out whole, or None. Fails
        closed: a record whose MIG state cannot be read and that may use the GPU keeps it."""
        gpu = self._gpus.get(gpu_uuid)
        if gpu is None or gpu_uuid not in self._unswept:
            return None
        recorded: list[MigIntent] = []
        for uid, entry in sorted(entries.items()):
            try:
                recorded += intents_from_state(entry.state)
            except MigError as error:
                if gpu_uuid in self._gpus_it_may_use(entry):
                    return (
                        f"GPU {gpu_label(gpu)} is not swept: claim_uid={uid} may have MIG "
                        f"devices on it and its dynamic MIG state cannot be read ({error})"
                    )
        return self._sweep_again(gpu, recorded)

    def _sweep_again(self, gpu: Gpu, recorded: Iterable[MigIntent]) -> str | None:
        """For a GPU whose start-up sweep failed: sweep it now (under the claim's lock of the
        GPU, so no prepare or unprepare of it runs beside), keeping every instance a record
        names; why it still cannot be handed out whole, or None."""
        failed = self._unswept.get(gpu.uuid)
        if failed is None:
            return None
        keep = {(i.gi_profile_id, i.placement_start) for i in recorded if i.parent_uuid == gpu.uuid}
        try:
            self._lifecycle.destroy_all_but(gpu, keep)
        except MigError as error:
            return (
                f"GPU {gpu_label(gpu)} may hold MIG instances no claim owns: the start-up sweep "
                f"could not remove them ({failed}), nor could this try ({error}); it is not "
                "handed out whole until a sweep succeeds (each prepare of it tries again)"
            )
        del self._unswept[gpu.uuid]
        log.info("leftover MIG instances of %s removed on a second try", gpu_label(gpu))
        return None

    def remove_unowned(
        self,
        entries: Mapping[str, CheckpointEntry],
        *,
        owner_alive: Callable[[str | None], bool] = lambda _: False,
    ) -> None:
        """Destroy every MIG instance of the dynamic-MIG GPUs that no ``PrepareCompleted`` entry
        records, nor an entry whose writer still runs (``owner_alive``: another plugin instance
        during a rolling update, whose prepare or unprepare is under way); MIG mode off where
        nothing is left (Hopper and later). Errors are logged; a GPU whose instances cannot be
        listed keeps its instances and its MIG mode, and is not handed out whole until a later
        sweep of it (`conflict`, at its next whole prepare) succeeds. Fails closed: a kept entry
        whose MIG state
        cannot be read may own any instance of the GPUs its devices name (of every GPU when
        they name none), so those are left alone."""
        owned: set[tuple[str, int, int]] = set()
        untouchable: set[str] = set()
        for uid, entry in entries.items():
            if entry.phase is not ClaimPhase.PREPARE_COMPLETED and not owner_alive(entry.owner):
                continue
            try:
                owned.update(intent.key for intent in intents_from_state(entry.state))
            except MigError as error:
                gpus = self._gpus_it_may_use(entry)
                untouchable.update(gpus)
                log.error(
                    "MIG instances of %s kept at start-up: they may be claim_uid=%s's, whose "
                    "dynamic MIG state cannot be read (%s); unprepare or repair the claim, then "
                    "restart the plugin to remove leftovers there",
                    ", ".join(sorted(gpu_label(self._gpus[u]) for u in gpus)),
                    uid,
                    error,
                )
        for gpu in self._gpus.values():
            if gpu.uuid in untouchable:
                continue
            try:
                keep = {(profile, start) for uuid, profile, start in owned if uuid == gpu.uuid}
                self._lifecycle.destroy_all_but(gpu, keep)
            except MigError as error:
                self._unswept[gpu.uuid] = str(error)
                log.error(
                    "leftover MIG instances of %s not removed: %s; the GPU is not handed out "
                    "whole until a later try succeeds",
                    gpu_label(gpu),
                    error,
                )
            else:
                self._unswept.pop(gpu.uuid, None)

    def _gpus_it_may_use(self, entry: CheckpointEntry) -> set[str]:
        """UUIDs of the dynamic-MIG GPUs a claim whose MIG state cannot be read may have MIG
        devices on (fail closed): those its MIG device names name, every one when they name
        none. The sweep, the conflict check and `sweep_again` all keep them."""
        minors = set()
        for device in entry.devices:
            try:
                name = parse_device_name(device.device_name)
            except InvalidNameError:
                continue
            if isinstance(name, MigDeviceName):
                minors.add(name.parent_minor)
        named = {gpu.uuid for gpu in self._gpus.values() if gpu.minor in minors}
        return named or set(self._gpus)

    def _gpu(self, intent: MigIntent) -> Gpu:
        gpu = self._gpus.get(intent.parent_uuid)
        if gpu is None:
            raise MigError(
                f"MIG device {intent.device}: GPU {intent.parent_uuid} is not a dynamic-MIG GPU "
                "of this node (was the plugin started without --dynamic-mig, the GPU removed, or "
                "left out at start because NVML could not read it? The plugin's start-up log "
                "names the NVML error)"
            )
        return gpu


def shared_mig_devices(entries: Mapping[str, CheckpointEntry]) -> dict[str, MigIntent]:
    """The MIG devices made from partitions offered as MPS shares that ``entries`` record, by
    MIG UUID (one intent each: the shares of a device record the same placement)."""
    return {
        intent.uuid: intent
        for uid, entry in sorted(entries.items())
        for intent in _recorded(uid, entry)
        if intent.shared and intent.uuid is not None
    }


def _recorded(uid: str, entry: CheckpointEntry) -> list[MigIntent]:
    try:
        return intents_from_state(entry.state)
    except MigError as error:
        log.error("dynamic MIG state of claim_uid=%s unusable: %s", uid, error)
        return []


def _whole_gpu_minor(device_name: str) -> int:
    """N of a ``gpu-<N>`` device name; -1 for any other name."""
    try:
        name = parse_device_name(device_name)
    except InvalidNameError:
        return -1
    return name.minor if isinstance(name, GpuDeviceName) else -1
