"""MIG of one simulated GPU: the profile table of its model and NVML's instance bookkeeping.

Pure values and rules, no pynvml: failures raise the pynvml error NVML returns (through
`nvml_error`). Placements, GI/CI ids, MIG device order and MIG UUIDs follow real NVML as far as
the driver can tell; `MigState.snapshot` / `MigState.restore` carry a GPU's MIG state across a
restart of the process. See docs/config.md#what-the-simulator-models.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Concatenate, Final, ParamSpec, TypeVar

from gpu_dra.driver.nvml.interface import (
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    NVMLError,
    nvml_error,
)

_P = ParamSpec("_P")
_R = TypeVar("_R")

_MIG_UUID_NAMESPACE: Final = uuid.UUID("0b0c5d0e-7f3a-5e61-9d2c-4a8e1b6f3c27")

COMPUTE_INSTANCE_PROFILE_FOR_SLICES: Final = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
"""``NVML_COMPUTE_INSTANCE_PROFILE_*`` of the full CI of a GI with that many compute slices."""

MAX_COMPUTE_INSTANCES_PER_GI: Final = 8
"""CI ids are 0..7."""


@dataclass(frozen=True)
class GpuInstanceProfile:
    """One row of ``nvidia-smi mig -lgip`` / ``nvmlGpuInstanceProfileInfo_t``."""

    index: int
    """``NVML_GPU_INSTANCE_PROFILE_*`` constant passed to GetGpuInstanceProfileInfo."""
    id: int
    """The device-specific profile ID (``info.id``) every later call takes."""
    name: str
    """As nvidia-smi prints it, e.g. ``1g.10gb+me`` (NVML's v2 name adds ``MIG ``)."""
    slice_count: int
    instance_count: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    placement_starts: tuple[int, ...]
    placement_size: int
    """In memory slices: 8 for a 7g, 4 for a 3g, 2 for a 1g.REV2."""


@dataclass(frozen=True)
class MigGeometry:
    """The MIG profiles of a GPU model."""

    memory_slices: int
    max_devices: int
    profiles: tuple[GpuInstanceProfile, ...]

    def by_index(self, index: int) -> GpuInstanceProfile | None:
        return next((p for p in self.profiles if p.index == index), None)

    def by_id(self, profile_id: int) -> GpuInstanceProfile | None:
        return next((p for p in self.profiles if p.id == profile_id), None)

    @property
    def media_engines(self) -> tuple[int, int] | None:
        """(JPEG, OFA) engines of the whole GPU: those of the profile spanning every slice."""
        full = next((p for p in self.profiles if p.placement_size == self.memory_slices), None)
        return None if full is None else (full.jpegs, full.ofas)


@dataclass(eq=False)
class ComputeInstance:
    """A live (or destroyed: `alive` False) compute instance and its MIG device."""

    gpu_instance: GpuInstance
    id: int
    profile_id: int
    uuid: str
    alive: bool = True


@dataclass(eq=False)
class GpuInstance:
    """A live (or destroyed: `alive` False) GPU instance."""

    id: int
    profile: GpuInstanceProfile
    start: int
    compute_instances: dict[int, ComputeInstance] = field(default_factory=dict)
    alive: bool = True

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.profile.placement_size)


def _locked(
    method: Callable[Concatenate[MigState, _P], _R],
) -> Callable[Concatenate[MigState, _P], _R]:
    def locked(self: MigState, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.lock:
            return method(self, *args, **kwargs)

    locked.__doc__ = method.__doc__
    return locked


class MigState:
    """MIG mode and instances of one GPU (mutable: this is the GPU's state).

    Thread-safe like NVML: every change and every listing holds the GPU's lock.
    """

    def __init__(self, geometry: MigGeometry | None, mode: tuple[int, int], parent_uuid: str):
        self.geometry = geometry
        self.current, self.pending = mode
        self.parent_uuid = parent_uuid
        self.gpu_instances: dict[int, GpuInstance] = {}
        self._compute_instances_created = 0
        self.lock = threading.RLock()

    @property
    def enabled(self) -> bool:
        return self.current == NVML_DEVICE_MIG_ENABLE

    def profile(self, profile_id: int, *, unknown: int) -> GpuInstanceProfile:
        """The profile with ID `profile_id`; raises `unknown` (an NVML code) when there is none."""
        profile = None if self.geometry is None else self.geometry.by_id(profile_id)
        if profile is None:
            raise nvml_error(unknown)
        return profile

    def require_enabled(self) -> None:
        if not self.enabled:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)

    @_locked
    def create_gpu_instance(
        self, profile_id: int, placement: tuple[int, int] | None = None
    ) -> GpuInstance:
        """A new GI of `profile_id` at `placement` (start, size), or where NVML would put it."""
        self.require_enabled()
        profile = self.profile(profile_id, unknown=NVML_ERROR_INVALID_ARGUMENT)
        if placement is not None:
            start, size = placement
            if size != profile.placement_size or start not in profile.placement_starts:
                raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
            refusal = self._refusal(profile, start)
            if refusal is not None:
                raise nvml_error(refusal)
        else:
            chosen = self._choose_start(profile)
            if chosen is None:
                raise nvml_error(NVML_ERROR_INSUFFICIENT_RESOURCES)
            start = chosen
        gi = GpuInstance(self._free_gi_id(profile.placement_size), profile, start)
        self.gpu_instances[gi.id] = gi
        return gi

    @_locked
    def remaining_capacity(self, profile_id: int) -> int:
        """How many more GIs of `profile_id` NVML could create now."""
        self.require_enabled()
        profile = self.profile(profile_id, unknown=NVML_ERROR_INVALID_ARGUMENT)
        trial = MigState(self.geometry, (self.current, self.pending), self.parent_uuid)
        trial.gpu_instances = {
            gi.id: GpuInstance(gi.id, gi.profile, gi.start) for gi in self.gpu_instances.values()
        }
        count = 0
        while (start := trial._choose_start(profile)) is not None:
            trial.create_gpu_instance(profile.id, (start, profile.placement_size))
            count += 1
        return count

    @_locked
    def destroy_gpu_instance(self, gi: GpuInstance) -> None:
        if gi.compute_instances:
            raise nvml_error(NVML_ERROR_IN_USE)
        gi.alive = False
        del self.gpu_instances[gi.id]

    @_locked
    def create_compute_instance(self, gi: GpuInstance, ci_profile: int) -> ComputeInstance:
        """The full CI of `gi` (the only one simulated); a second one is INSUFFICIENT_RESOURCES."""
        if ci_profile != full_compute_instance_profile(gi.profile):
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        if gi.compute_instances:
            raise nvml_error(NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci_id = min(set(range(MAX_COMPUTE_INSTANCES_PER_GI)) - set(gi.compute_instances))
        generation = self._compute_instances_created
        self._compute_instances_created += 1
        seed = f"{self.parent_uuid}/{gi.profile.id}/{gi.start}/{ci_id}/{generation}"
        ci = ComputeInstance(gi, ci_id, ci_profile, f"MIG-{uuid.uuid5(_MIG_UUID_NAMESPACE, seed)}")
        gi.compute_instances[ci_id] = ci
        return ci

    @_locked
    def destroy_compute_instance(self, ci: ComputeInstance) -> None:
        ci.alive = False
        del ci.gpu_instance.compute_instances[ci.id]

    @_locked
    def mig_devices(self) -> list[ComputeInstance]:
        """MIG devices in NVML index order: one per compute instance, by (GI id, CI id)."""
        return [
            gi.compute_instances[ci_id]
            for _, gi in sorted(self.gpu_instances.items())
            for ci_id in sorted(gi.compute_instances)
        ]

    @_locked
    def set_mode(self, mode: int, *, resetless: bool) -> int:
        """Request MIG `mode`; returns NVML's activation status.

        `resetless` (Hopper and later): applied at once, refused with IN_USE while GIs exist when
        turning MIG off. Otherwise (Ampere) only `pending` changes; the status is IN_USE because
        a node's GPU always has clients, so the reset NVML tries cannot happen (`reset` applies it).
        """
        if mode not in (NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE):
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        if resetless:
            if mode == NVML_DEVICE_MIG_DISABLE and self.gpu_instances:
                raise nvml_error(NVML_ERROR_IN_USE)
            self.current = self.pending = mode
            return 0
        self.pending = mode
        return 0 if mode == self.current else NVML_ERROR_IN_USE

    @_locked
    def reset(self) -> None:
        """A GPU reset: the pending mode becomes current and every MIG instance is gone."""
        for gi in list(self.gpu_instances.values()):
            for ci in list(gi.compute_instances.values()):
                self.destroy_compute_instance(ci)
            self.destroy_gpu_instance(gi)
        self.current = self.pending

    @_locked
    def snapshot(self) -> dict[str, object]:
        """Mode, instances and creation counter as JSON values (`restore` reads them back)."""
        return {
            "current": self.current,
            "pending": self.pending,
            "computeInstancesCreated": self._compute_instances_created,
            "gpuInstances": [
                {
                    "id": gi.id,
                    "profileId": gi.profile.id,
                    "start": gi.start,
                    "computeInstances": [
                        {"id": ci.id, "profileId": ci.profile_id, "uuid": ci.uuid}
                        for _, ci in sorted(gi.compute_instances.items())
                    ],
                }
                for _, gi in sorted(self.gpu_instances.items())
            ],
        }

    @_locked
    def restore(self, saved: Mapping[str, object]) -> None:
        """Replace mode and instances with a `snapshot`; raises `MigSnapshotError` (this state
        unchanged) when it does not fit the profile table: unknown profile, bad placement,
        overlap, duplicate ids."""
        trial = MigState(self.geometry, (self.current, self.pending), self.parent_uuid)
        try:
            trial.current = _int(saved, "current")
            trial.pending = _int(saved, "pending")
            trial._compute_instances_created = _int(saved, "computeInstancesCreated")
            for raw_gi in _list(saved, "gpuInstances"):
                trial._restore_gpu_instance(raw_gi)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise MigSnapshotError(f"MIG state of GPU {self.parent_uuid}: {error}") from error
        except NVMLError as error:
            raise MigSnapshotError(
                f"MIG state of GPU {self.parent_uuid} does not fit its profiles: {error}"
            ) from error
        self.current, self.pending = trial.current, trial.pending
        self._compute_instances_created = trial._compute_instances_created
        self.gpu_instances = trial.gpu_instances

    def _restore_gpu_instance(self, raw: object) -> None:
        if not isinstance(raw, Mapping):
            raise TypeError(f"GPU instance {raw!r} is not an object")
        gi_id, profile_id, start = _int(raw, "id"), _int(raw, "profileId"), _int(raw, "start")
        if gi_id in self.gpu_instances:
            raise ValueError(f"GPU instance id {gi_id} appears twice")
        profile = self.profile(profile_id, unknown=NVML_ERROR_INVALID_ARGUMENT)
        if start not in profile.placement_starts:
            raise ValueError(f"GPU instance {gi_id}: {start} is no placement of {profile.name}")
        refusal = self._refusal(profile, start)
        if refusal is not None:
            raise nvml_error(refusal)
        gi = GpuInstance(gi_id, profile, start)
        for raw_ci in _list(raw, "computeInstances"):
            if not isinstance(raw_ci, Mapping):
                raise TypeError(f"compute instance {raw_ci!r} is not an object")
            ci_id, ci_uuid = _int(raw_ci, "id"), raw_ci["uuid"]
            if not isinstance(ci_uuid, str) or ci_id in gi.compute_instances:
                raise ValueError(f"GPU instance {gi_id}: bad compute instance {raw_ci!r}")
            gi.compute_instances[ci_id] = ComputeInstance(
                gi, ci_id, _int(raw_ci, "profileId"), ci_uuid
            )
        self.gpu_instances[gi_id] = gi

    def _refusal(self, profile: GpuInstanceProfile, start: int) -> int | None:
        """Why a GI of `profile` cannot go at `start` now (an NVML code), or None if it can."""
        used = {s for gi in self.gpu_instances.values() for s in gi.slices}
        if used & set(range(start, start + profile.placement_size)):
            return NVML_ERROR_INSUFFICIENT_RESOURCES
        same = sum(1 for gi in self.gpu_instances.values() if gi.profile.id == profile.id)
        if same >= profile.instance_count:
            return NVML_ERROR_INSUFFICIENT_RESOURCES
        budget = None if self.geometry is None else self.geometry.media_engines
        if budget is not None:
            jpegs = profile.jpegs + sum(gi.profile.jpegs for gi in self.gpu_instances.values())
            ofas = profile.ofas + sum(gi.profile.ofas for gi in self.gpu_instances.values())
            if jpegs > budget[0] or ofas > budget[1]:
                return NVML_ERROR_INSUFFICIENT_RESOURCES
        return None

    def _choose_start(self, profile: GpuInstanceProfile) -> int | None:
        """Where NVML puts a GI created without a placement: the highest start that fits."""
        starts = sorted(profile.placement_starts, reverse=True)
        return next((start for start in starts if self._refusal(profile, start) is None), None)

    def _free_gi_id(self, size: int) -> int:
        slices = self.geometry.memory_slices if self.geometry is not None else 8
        first = max(slices // size, 1) - 1
        level = range(first, first + max(slices // size, 1))
        free = [gi_id for gi_id in level if gi_id not in self.gpu_instances]
        if not free:  # cannot happen: a level has as many ids as disjoint placements
            raise nvml_error(NVML_ERROR_INSUFFICIENT_RESOURCES)
        return free[0]


class MigSnapshotError(ValueError):
    """A saved MIG state does not fit this GPU's profile table; the message says what."""


def full_compute_instance_profile(profile: GpuInstanceProfile) -> int:
    """``NVML_COMPUTE_INSTANCE_PROFILE_*`` of the CI spanning every compute slice of a GI."""
    return COMPUTE_INSTANCE_PROFILE_FOR_SLICES[profile.slice_count]


def _int(raw: Mapping[str, object], key: str) -> int:
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _list(raw: Mapping[str, object], key: str) -> list[object]:
    value = raw[key]
    if not isinstance(value, list):
        raise TypeError(f"{key} must be a list, got {value!r}")
    return value
