"""Dynamic MIG on one node: create a MIG device at a placement, destroy it, list what exists.

`MigLifecycle` makes the NVML calls NVIDIA's driver makes (``gpu-hardware.md`` §6). **create**:
MIG mode on if it is off (Hopper and later switch without a reset; on Ampere MIG must already be
on, else a clear error), the GPU instance at the allocated placement, then the compute instance
spanning all of it; the result is the `MigDevice` as discovery describes static ones. Profile
and placement are read before MIG mode is touched. **destroy**: the compute instances, then the
GPU instance (one already gone is success); on Hopper and later MIG mode goes off when the last
GPU instance is gone. Reading, locks and errors: `instances.MigState`. See docs/mig.md,
"Dynamic MIG: lifecycle".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from functools import partial
from typing import Final

from gpu_dra.driver.discovery import DiscoveryError, describe_mig_device
from gpu_dra.driver.model import Gpu, MigDevice
from gpu_dra.driver.nvml.interface import (
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    ComputeInstanceHandle,
    DeviceHandle,
    GpuInstanceHandle,
    GpuInstancePlacement,
    GpuInstanceProfileInfo,
    NVMLError,
    NvmlLibrary,
    return_code,
    return_code_name,
)
from gpu_dra.driver.partitions import toggles_mig_without_reset
from gpu_dra.kubelet_plugin.crash_points import (
    CRASH_AFTER_GPU_INSTANCE,
    MIG_AFTER_COMPUTE_INSTANCE,
    MIG_AFTER_COMPUTE_INSTANCE_DESTROYED,
    MIG_AFTER_GPU_INSTANCE_DESTROYED,
    MIG_AFTER_MODE_ON,
    CrashPoint,
    reached,
)
from gpu_dra.kubelet_plugin.mig.instances import (
    NO_SUCH_PROFILE,
    MigError,
    MigState,
    gpu_label,
    nvml_names,
    profile_label,
)
from gpu_dra.kubelet_plugin.node_locks import NodeLocks

log = logging.getLogger(__name__)

_CI_PROFILE_1_SLICE_REV1: Final = 7
"""``NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1``: NVIDIA's dynamic MIG skips it."""


class MigLifecycle(MigState):
    """Creates and destroys MIG devices through NVML (see the module doc)."""

    def __init__(
        self,
        nvml: NvmlLibrary,
        *,
        crash_point: CrashPoint = reached,
        locks: NodeLocks | None = None,
        refresh: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(nvml, locks=locks, refresh=refresh)
        self._crash_point = crash_point

    # ---- create ----------------------------------------------------------------------------------
    def create(
        self,
        parent: Gpu,
        gi_profile_id: int,
        placement_start: int,
    ) -> MigDevice:
        """Create the GPU instance of `gi_profile_id` at `placement_start` on `parent` and its
        full compute instance. Raises `MigError` after destroying what it created (and turning
        MIG mode off again when it turned it on and nothing else is there)."""
        with self._gpu_lock(parent.uuid), self._session(parent) as handle:
            try:
                return self._create(parent, handle, gi_profile_id, placement_start)
            except BaseException:
                try:
                    self._disable_mig_if_unused(parent, handle)
                except MigError as cleanup:
                    log.warning("after a failed create, MIG mode is left as it is: %s", cleanup)
                raise

    def _create(
        self, parent: Gpu, handle: DeviceHandle, gi_profile_id: int, placement_start: int
    ) -> MigDevice:
        # Profile and placement first: MIG mode is not touched for a create that cannot work.
        profile = self._gi_profile(parent, handle, gi_profile_id)
        placement = self._placement(parent, handle, profile, gi_profile_id, placement_start)
        self._enable_mig(parent, handle)
        where = (
            f"{profile_label(profile, gi_profile_id)} at memory slices "
            f"{placement.start}..{placement.start + placement.size - 1}"
        )
        try:
            gi = self._nvml.device_create_gpu_instance_with_placement(
                handle, gi_profile_id, placement
            )
        except NVMLError as error:
            if return_code(error) == NVML_ERROR_INSUFFICIENT_RESOURCES:
                raise MigError(
                    f"cannot create GPU instance {where} on {gpu_label(parent)}: "
                    "nvmlDeviceCreateGpuInstanceWithPlacement answered "
                    f"{return_code_name(NVML_ERROR_INSUFFICIENT_RESOURCES)}: "
                    f"{self._occupied_by(parent, handle, placement.start, placement.size)}",
                    retryable=True,
                ) from error
            raise self._error(parent, f"create GPU instance {where}", error) from error
        try:
            device = self._fill_gpu_instance(parent, handle, gi, profile, where)
        except BaseException as error:
            try:
                self._destroy_gpu_instance(parent, gi)
            except MigError as cleanup:
                log.error("GPU instance of a failed create not destroyed: %s", cleanup)
                error.add_note(f"the GPU instance it made is left: {cleanup}")
            raise
        log.info(
            "created MIG device %s %s gi_id=%d ci_id=%d on %s",
            device.uuid,
            device.profile,
            device.gi_id,
            device.ci_id,
            parent.uuid,
        )
        return device

    def _placement(
        self,
        parent: Gpu,
        handle: DeviceHandle,
        profile: GpuInstanceProfileInfo,
        gi_profile_id: int,
        placement_start: int,
    ) -> GpuInstancePlacement:
        """The placement of `gi_profile_id` that starts at `placement_start`; a `MigError` when
        the GPU has none (a stale ResourceSlice) or lists no placement at all."""
        placements = self._call(
            parent,
            f"list the placements of GPU-instance profile {profile_label(profile, gi_profile_id)}",
            lambda: self._nvml.device_get_gpu_instance_possible_placements(handle, gi_profile_id),
        )
        if not placements:
            raise MigError(
                f"{gpu_label(parent)}: nvmlDeviceGetGpuInstancePossiblePlacements lists no "
                f"placement of GPU-instance profile {profile_label(profile, gi_profile_id)}, "
                "which discovery offered: the GPU answers differently now"
            )
        placement = next((p for p in placements if p.start == placement_start), None)
        if placement is None:
            raise MigError(
                f"{gpu_label(parent)}: {placement_start} is no placement start of "
                f"GPU-instance profile {profile_label(profile, gi_profile_id)}; the device "
                "name does not match this GPU (a stale ResourceSlice?)"
            )
        return placement

    def _fill_gpu_instance(
        self,
        parent: Gpu,
        handle: DeviceHandle,
        gi: GpuInstanceHandle,
        profile: GpuInstanceProfileInfo,
        where: str,
    ) -> MigDevice:
        """The compute instance spanning the new GPU instance `gi`, as a `MigDevice`."""
        gi_id = self._call(
            parent,
            "read the new GPU instance",
            lambda: self._nvml.gpu_instance_get_info(gi).id,
        )
        log.info("created GPU instance %s gi_id=%d on %s", where, gi_id, parent.uuid)
        self._crash_point(CRASH_AFTER_GPU_INSTANCE)
        ci_profile = self._full_ci_profile(parent, gi, profile)
        ci = self._call(
            parent,
            f"create the compute instance of GPU instance {gi_id} ({where})",
            lambda: self._nvml.gpu_instance_create_compute_instance(gi, ci_profile),
        )
        self._crash_point(MIG_AFTER_COMPUTE_INSTANCE)
        return self._mig_device(parent, handle, ci, "the new compute instance")

    def _enable_mig(self, parent: Gpu, handle: DeviceHandle) -> None:
        current, pending = self._call(
            parent, "read the MIG mode", lambda: self._nvml.device_get_mig_mode(handle)
        )
        if current == NVML_DEVICE_MIG_ENABLE:
            return
        if not toggles_mig_without_reset(parent):
            pending_note = (
                " (it is set to turn on at the next GPU reset: reset the GPU or reboot)"
                if pending == NVML_DEVICE_MIG_ENABLE
                else ""
            )
            raise MigError(
                f"{gpu_label(parent)} has MIG mode off{pending_note}; gpu-dra switches MIG mode "
                "only on Hopper and later GPUs, because an Ampere GPU needs a reset for it. "
                f"Turn MIG on by hand (nvidia-smi -i {parent.uuid} -mig 1, then reset the GPU) "
                "to use dynamic MIG on it"
            )
        self._set_mig_mode(
            parent, handle, NVML_DEVICE_MIG_ENABLE, "; is the GPU in use by another process?"
        )
        log.info("MIG mode on gpu=%s", parent.uuid)
        self._crash_point(MIG_AFTER_MODE_ON)

    def _gi_profile(
        self, parent: Gpu, handle: DeviceHandle, gi_profile_id: int
    ) -> GpuInstanceProfileInfo:
        profiles = self._gi_profiles(parent, handle)
        found = profiles.get(gi_profile_id)
        if found is None:
            raise MigError(
                f"{gpu_label(parent)} has no GPU-instance profile ID {gi_profile_id} (it has "
                f"{', '.join(str(i) for i in sorted(profiles)) or 'none'}); the device name "
                "does not match this GPU (a stale ResourceSlice?)"
            )
        return found[1]

    def _full_ci_profile(
        self, parent: Gpu, gi: GpuInstanceHandle, profile: GpuInstanceProfileInfo
    ) -> int:
        """The compute-instance profile spanning the GI (as many slices), shared engines."""
        absent: list[int] = []
        for index in range(NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            if index == _CI_PROFILE_1_SLICE_REV1:
                continue
            try:
                info = self._nvml.gpu_instance_get_compute_instance_profile_info(
                    gi, index, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except NVMLError as error:
                code = return_code(error)
                if code is not None and code in NO_SUCH_PROFILE:
                    absent.append(code)
                    continue
                raise self._error(parent, "read compute-instance profiles", error) from error
            if info.sliceCount == profile.sliceCount:
                return info.id
        answered = NVML_COMPUTE_INSTANCE_PROFILE_COUNT - 1 - len(absent)
        why = (
            f"nvmlGpuInstanceGetComputeInstanceProfileInfo answered {nvml_names(absent)} for every "
            "compute-instance profile index"
            if answered == 0
            else f"none of the {answered} compute-instance profiles it lists does"
        )
        raise MigError(
            f"{gpu_label(parent)}: no compute-instance profile spans all {profile.sliceCount} "
            f"slices of the GPU instance: {why}"
        )

    def _occupied_by(self, parent: Gpu, handle: DeviceHandle, start: int, size: int) -> str:
        """What keeps a GI from `start`..`start+size-1`: the GIs overlapping it, or why not."""
        try:
            existing = self._instances(parent, handle)
        except MigError as error:
            return f"what occupies the placement is unknown: listing the instances failed: {error}"
        wanted = set(range(start, start + size))
        overlapping = [i for i in existing if wanted & set(i.slices)]
        if overlapping:
            names = ", ".join(
                f"GPU instance {i.gi_id} (profile ID {i.gi_profile_id}) at memory slices "
                f"{i.placement_start}..{i.placement_start + i.placement_size - 1}"
                for i in overlapping
            )
            return (
                f"placement {start}..{start + size - 1} is occupied by {names}; the scheduler "
                "should not have allocated it (another claim's MIG device, or one made outside "
                "gpu-dra); the kubelet retries"
            )
        return (
            f"placement {start}..{start + size - 1} is free, but NVML reports insufficient "
            f"resources ({len(existing)} GPU instance(s) exist: the profile's instance limit or "
            "the GPU's single media engine set is taken); the kubelet retries"
        )

    # ---- find ------------------------------------------------------------------------------------
    def existing(self, parent: Gpu, gi_profile_id: int, placement_start: int) -> MigDevice | None:
        """The MIG device of the GPU instance of `gi_profile_id` at `placement_start` on
        `parent` (its first compute instance), as `create` returns it; None when there is no
        such GPU instance, or it has no compute instance."""
        with self._gpu_lock(parent.uuid), self._session(parent) as handle:
            for instance, gi in self._instance_handles(parent, handle):
                if (instance.gi_profile_id, instance.placement_start) != (
                    gi_profile_id,
                    placement_start,
                ):
                    continue
                cis = self._compute_instances(parent, gi)
                if not cis:
                    return None
                what = f"the compute instance of GPU instance {instance.gi_id}"
                return self._mig_device(parent, handle, cis[0], what)
            return None

    def _mig_device(
        self, parent: Gpu, handle: DeviceHandle, ci: ComputeInstanceHandle, what: str
    ) -> MigDevice:
        """The MIG device of compute instance `ci` (`what`, for messages), as discovery
        describes static ones."""
        mig = self._call(
            parent, f"read {what}", partial(self._nvml.compute_instance_get_info, ci)
        ).device
        try:
            return describe_mig_device(self._nvml, handle, parent, mig)
        except DiscoveryError as error:
            raise MigError(f"cannot describe the MIG device of {what}: {error}") from error

    # ---- destroy ---------------------------------------------------------------------------------
    def destroy(
        self, parent: Gpu, gi_profile_id: int, placement_start: int, *, gi_id: int | None = None
    ) -> bool:
        """Destroy the GPU instance of `gi_profile_id` at `placement_start` (if `gi_id` is given,
        only if it has that id) and its compute instances; False when there is none. Turns MIG
        mode off on Hopper and later when no GPU instance is left."""
        with self._gpu_lock(parent.uuid), self._session(parent) as handle:
            found = None
            for instance, gi in self._instance_handles(parent, handle):
                if (
                    instance.gi_profile_id == gi_profile_id
                    and instance.placement_start == placement_start
                    and (gi_id is None or instance.gi_id == gi_id)
                ):
                    found = gi
            if found is not None:
                self._destroy_gpu_instance(parent, found)
            self._disable_mig_if_unused(parent, handle)
            return found is not None

    def destroy_all_but(self, parent: Gpu, keep: Collection[tuple[int, int]]) -> None:
        """Destroy every GPU instance of `parent` (and its compute instances) whose
        ``(gi_profile_id, placement_start)`` is not in `keep`, from one listing; then MIG mode
        off on a Hopper-or-later GPU that has no GPU instance left (a crash can also leave it on
        between turning it on and creating the first instance)."""
        with self._gpu_lock(parent.uuid), self._session(parent) as handle:
            for instance, gi in self._instance_handles(parent, handle):
                if (instance.gi_profile_id, instance.placement_start) in keep:
                    continue
                log.info(
                    "destroying MIG instance no prepared claim owns: %s GI %d (profile ID %d, "
                    "memory slices %d..%d)",
                    gpu_label(parent),
                    instance.gi_id,
                    instance.gi_profile_id,
                    instance.placement_start,
                    instance.placement_start + instance.placement_size - 1,
                )
                self._destroy_gpu_instance(parent, gi)
            self._disable_mig_if_unused(parent, handle)

    def _destroy_gpu_instance(self, parent: Gpu, gi: GpuInstanceHandle) -> None:
        gi_id = self._call(
            parent, "read a GPU instance", lambda: self._nvml.gpu_instance_get_info(gi).id
        )
        for ci in self._compute_instances(parent, gi):
            try:
                self._nvml.compute_instance_destroy(ci)
            except NVMLError as error:
                if return_code(error) == NVML_ERROR_IN_USE:
                    raise MigError(
                        f"cannot destroy compute instance of GPU instance {gi_id} on "
                        f"{gpu_label(parent)}: processes still use it "
                        f"({return_code_name(NVML_ERROR_IN_USE)}); it is "
                        "retried with the next unprepare or at the next start",
                        retryable=True,
                    ) from error
                raise self._error(
                    parent, f"destroy a compute instance of GPU instance {gi_id}", error
                ) from error
        self._crash_point(MIG_AFTER_COMPUTE_INSTANCE_DESTROYED)
        try:
            self._nvml.gpu_instance_destroy(gi)
        except NVMLError as error:
            raise self._error(parent, f"destroy GPU instance {gi_id}", error) from error
        log.info("destroyed GPU instance gi_id=%d on %s", gi_id, parent.uuid)
        self._crash_point(MIG_AFTER_GPU_INSTANCE_DESTROYED)

    def _disable_mig_if_unused(self, parent: Gpu, handle: DeviceHandle) -> None:
        if not toggles_mig_without_reset(parent):
            return  # Ampere: MIG mode stays as the administrator set it
        current, _ = self._call(
            parent, "read the MIG mode", lambda: self._nvml.device_get_mig_mode(handle)
        )
        if current != NVML_DEVICE_MIG_ENABLE or self._instances(parent, handle):
            return
        self._set_mig_mode(parent, handle, NVML_DEVICE_MIG_DISABLE)
        log.info("MIG mode off gpu=%s (no MIG device left)", parent.uuid)

    def _set_mig_mode(self, parent: Gpu, handle: DeviceHandle, mode: int, hint: str = "") -> None:
        """Turn MIG mode on or off (`mode`); a status NVML did not apply is a retryable error
        (with `hint` appended)."""
        turning = "on" if mode == NVML_DEVICE_MIG_ENABLE else "off"
        status = self._call(
            parent,
            f"turn MIG mode {turning}",
            lambda: self._nvml.device_set_mig_mode(handle, mode),
        )
        if status != 0:
            raise MigError(
                f"{gpu_label(parent)}: turning MIG mode {turning} was not applied "
                f"({return_code_name(status)}){hint}",
                retryable=True,
            )
