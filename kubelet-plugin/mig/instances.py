"""A GPU's MIG state through NVML: sessions, errors, profiles, and the instances that exist.

`MigState` is the reading half of `MigLifecycle`: a per-GPU lock (MIG mode goes off only when no
create on that GPU is under way; node-wide with `NodeLocks`, ``mig-<UUID>``, when two plugin
instances share the node), an NVML session with the GPU's handle, and every NVML failure as a
`MigError` naming the GPU, what was being done, the return code and what to do. An NVML error
is never read as "no instances": when the GPU instances cannot be listed (a profile scan where
no index answers included), listing fails. Return codes that mean "absent":
docs/real-nodes.md, "NVML errors".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Final, TypeVar

from gpu_dra.driver.discovery import DiscoveryError, gpu_instance_profiles
from gpu_dra.driver.model import Gpu
from gpu_dra.driver.nvml.interface import (
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    DeviceHandle,
    GpuInstanceHandle,
    GpuInstanceProfileInfo,
    NVMLError,
    NvmlLibrary,
    return_code,
    return_code_name,
)
from gpu_dra.kubelet_plugin.node_locks import NodeLocks

_T = TypeVar("_T")

NO_SUCH_PROFILE: Final = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT})
"""Per profile index: a profile the GPU (or GPU instance) does not have; for every index: error."""
NOT_RETRYABLE: Final = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT})


class MigError(Exception):
    """A MIG create or destroy failed; the message says what, where, and what to do."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance on a GPU and the ids of its compute instances."""

    parent_uuid: str
    gi_id: int
    gi_profile_id: int
    placement_start: int
    placement_size: int
    ci_ids: tuple[int, ...]

    @property
    def slices(self) -> range:
        return range(self.placement_start, self.placement_start + self.placement_size)


def gpu_label(gpu: Gpu) -> str:
    """``gpu-3 (GPU-..., NVIDIA H100 80GB HBM3)``: how messages name a GPU."""
    return f"gpu-{gpu.minor} ({gpu.uuid}, {gpu.product_name})"


class MigState:
    """Reads the MIG state of GPUs through NVML (see the module doc); `MigLifecycle` adds
    create and destroy."""

    def __init__(
        self,
        nvml: NvmlLibrary,
        *,
        locks: NodeLocks | None = None,
        refresh: Callable[[str], None] | None = None,
    ) -> None:
        """``locks``: the node's locks, taken beside the in-process ones when other plugin
        instances may change the same GPUs. ``refresh(uuid)`` runs under a GPU's locks before
        each use of it (a simulated GPU's state as another instance left it)."""
        self._nvml = nvml
        self._node_locks = locks
        self._refresh = refresh
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # ---- listing ---------------------------------------------------------------------------------
    def instances(self, parent: Gpu) -> list[MigInstance]:
        """The GPU instances of `parent`, by placement start; none while MIG mode is off."""
        with self._gpu_lock(parent.uuid), self._session(parent) as handle:
            return self._instances(parent, handle)

    def _instances(self, parent: Gpu, handle: DeviceHandle) -> list[MigInstance]:
        return [instance for instance, _ in self._instance_handles(parent, handle)]

    def _instance_handles(
        self, parent: Gpu, handle: DeviceHandle
    ) -> list[tuple[MigInstance, GpuInstanceHandle]]:
        current, _ = self._call(
            parent, "read the MIG mode", lambda: self._nvml.device_get_mig_mode(handle)
        )
        if current != NVML_DEVICE_MIG_ENABLE:
            return []
        profile_ids = sorted(self._gi_profiles(parent, handle))
        found = []
        for profile_id in profile_ids:
            gis = self._call(
                parent,
                f"list the GPU instances of profile ID {profile_id}",
                partial(self._nvml.device_get_gpu_instances, handle, profile_id),
            )
            for gi in gis:
                info = self._call(
                    parent, "read a GPU instance", partial(self._nvml.gpu_instance_get_info, gi)
                )
                ci_ids = tuple(
                    sorted(
                        self._call(
                            parent,
                            "read a compute instance",
                            partial(self._nvml.compute_instance_get_info, ci),
                        ).id
                        for ci in self._compute_instances(parent, gi)
                    )
                )
                found.append(
                    (
                        MigInstance(
                            parent_uuid=parent.uuid,
                            gi_id=info.id,
                            gi_profile_id=info.profileId,
                            placement_start=info.placement.start,
                            placement_size=info.placement.size,
                            ci_ids=ci_ids,
                        ),
                        gi,
                    )
                )
        return sorted(found, key=lambda pair: (pair[0].placement_start, pair[0].gi_id))

    def _gi_profiles(
        self, parent: Gpu, handle: DeviceHandle
    ) -> dict[int, tuple[int, GpuInstanceProfileInfo]]:
        """The GPU's GPU-instance profiles by ID; never empty (no profile answering is a
        `MigError` naming the return code)."""
        try:
            return gpu_instance_profiles(self._nvml, handle, parent)
        except DiscoveryError as error:
            raise MigError(
                f"{gpu_label(parent)}: cannot list the MIG profiles: {error}",
                retryable=error.return_code not in NOT_RETRYABLE,
            ) from error

    def _compute_instances(self, parent: Gpu, gi: GpuInstanceHandle) -> list[object]:
        """Every compute instance of `gi`, over the compute-instance profile indexes (NOT_SUPPORTED
        / INVALID_ARGUMENT: a profile the GI does not have); an error when no index answers."""
        found: list[object] = []
        absent: list[int] = []
        for index in range(NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                found.extend(self._nvml.gpu_instance_get_compute_instances(gi, index))
            except NVMLError as error:
                code = return_code(error)
                if code is not None and code in NO_SUCH_PROFILE:
                    absent.append(code)
                    continue
                raise self._error(parent, "list compute instances", error) from error
        if len(absent) == NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise MigError(
                f"{gpu_label(parent)}: cannot list compute instances: "
                f"nvmlGpuInstanceGetComputeInstances answered {nvml_names(absent)} for every "
                "compute-instance profile index; the GPU's MIG state cannot be read",
                retryable=not set(absent) <= NOT_RETRYABLE,
            )
        return found

    # ---- plumbing --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _gpu_lock(self, uuid: str) -> Iterator[None]:
        with self._locks_lock:
            lock = self._locks.setdefault(uuid, threading.Lock())
        with lock, contextlib.ExitStack() as stack:
            if self._node_locks is not None:
                try:
                    stack.enter_context(self._node_locks.blocking(f"mig-{uuid}"))
                except TimeoutError as error:
                    raise MigError(f"GPU {uuid}: {error}", retryable=True) from error
            if self._refresh is not None:
                self._refresh(uuid)
            yield

    @contextlib.contextmanager
    def _session(self, parent: Gpu) -> Iterator[DeviceHandle]:
        """NVML initialised (reference-counted) and `parent`'s handle, by UUID."""
        try:
            self._nvml.init()
        except NVMLError as error:
            raise self._error(parent, "initialise NVML", error) from error
        try:
            yield self._call(
                parent,
                "find the GPU by UUID",
                lambda: self._nvml.device_get_handle_by_uuid(parent.uuid),
            )
        finally:
            with contextlib.suppress(NVMLError):
                self._nvml.shutdown()

    def _call(self, parent: Gpu, what: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except NVMLError as error:
            raise self._error(parent, what, error) from error

    def _error(self, parent: Gpu, what: str, error: Exception) -> MigError:
        code = return_code(error)
        name = "" if code is None else f" ({return_code_name(code)})"
        retryable = code not in NOT_RETRYABLE
        hint = ""
        if code == NVML_ERROR_NOT_FOUND:
            hint = "; was the GPU removed or reset?"
        return MigError(
            f"{gpu_label(parent)}: cannot {what}: {error}{name}{hint}", retryable=retryable
        )


def nvml_names(codes: Collection[int]) -> str:
    """``NVML_ERROR_NOT_SUPPORTED`` (``A / B`` when several codes were seen)."""
    return " / ".join(return_code_name(code) for code in sorted(set(codes)))


def profile_label(profile: GpuInstanceProfileInfo, profile_id: int) -> str:
    name = getattr(profile, "name", "")
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    name = str(name).removeprefix("MIG ")
    return f"{name} (profile ID {profile_id})" if name else f"profile ID {profile_id}"
