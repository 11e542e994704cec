"""`NvmlLibrary` on the real libnvidia-ml through pynvml: the only module that calls pynvml.

The library is looked up under the configured driver root (``/`` on hosts with the driver
installed, ``/run/nvidia/driver`` with the GPU Operator, a mount such as ``/driver-root`` in a
container) and handed to pynvml before the first ``nvmlInit``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Final, cast

import pynvml

from gpu_dra.driver.nvml.interface import (
    GPM_ABSENT,
    ComputeInstanceHandle,
    ComputeInstanceInfo,
    ComputeInstanceProfileInfo,
    DeviceHandle,
    EventData,
    EventSetHandle,
    GpmSample,
    GpuInstanceHandle,
    GpuInstanceInfo,
    GpuInstancePlacement,
    GpuInstanceProfileInfo,
    MemoryInfo,
    MemoryLimits,
    NvmlLibrary,
    PciInfo,
    ProcessInfo,
    ProcessUtilizationSample,
    Utilization,
    nvml_error,
    return_code,
)

NVML_LIBRARY_NAME: Final = "libnvidia-ml.so.1"

_MAX_INSTANCES: Final = 32
"""Array size for GetGpuInstances/GetComputeInstances (NVML: >= the profile's instanceCount)."""

LIBRARY_DIRS: Final = (
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib",
)
"""Directories, relative to the driver root, searched in order for ``libnvidia-ml.so.1``."""

_MAX_SYMLINKS: Final = 40


def find_nvml_library(driver_root: Path) -> Path | None:
    """The first ``libnvidia-ml.so.1`` under `driver_root` (see `LIBRARY_DIRS`), or None.

    A symlink at the library path is followed inside the root: an absolute target such as
    ``/usr/lib/libnvidia-ml.so.580.95.05`` means ``<driver_root>/usr/lib/...``.
    """
    for directory in LIBRARY_DIRS:
        found = _resolve_in_root(driver_root, driver_root / directory / NVML_LIBRARY_NAME)
        if found is not None:
            return found
    return None


def _resolve_in_root(root: Path, path: Path) -> Path | None:
    for _ in range(_MAX_SYMLINKS):
        if path.is_symlink():
            target = PurePosixPath(os.readlink(path))
            path = root / target.relative_to("/") if target.is_absolute() else path.parent / target
        elif path.is_file():
            return path
        else:
            return None
    return None


def load_nvml_library(driver_root: Path) -> None:
    """Make pynvml use the ``libnvidia-ml.so.1`` of `driver_root` (no-op once one is loaded).

    With driver root ``/`` and nothing found in `LIBRARY_DIRS`, pynvml's own lookup (the dynamic
    linker's search path) is used. Otherwise raises ``NVMLError_LibraryNotFound`` with a note
    naming the directories searched.
    """
    if pynvml.nvmlLib is not None:
        return
    path = find_nvml_library(driver_root)
    if path is None:
        if driver_root == Path("/"):
            return
        error = nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        searched = ", ".join(str(driver_root / directory) for directory in LIBRARY_DIRS)
        error.add_note(f"{NVML_LIBRARY_NAME} not found under driver root {driver_root}: {searched}")
        raise error
    with pynvml.libLoadLock:
        if pynvml.nvmlLib is None:
            pynvml.nvmlLib = ctypes.CDLL(str(path))


class RealNvml:
    """pynvml with driver-root aware library loading."""

    def __init__(self, driver_root: Path = Path("/")) -> None:
        self.driver_root = driver_root

    def init(self) -> None:
        load_nvml_library(self.driver_root)
        pynvml.nvmlInit()

    def init_with_flags(self, flags: int) -> None:
        load_nvml_library(self.driver_root)
        pynvml.nvmlInitWithFlags(flags)

    def shutdown(self) -> None:
        pynvml.nvmlShutdown()

    def system_get_driver_version(self) -> str:
        return str(pynvml.nvmlSystemGetDriverVersion())

    def system_get_cuda_driver_version(self) -> int:
        return int(pynvml.nvmlSystemGetCudaDriverVersion())

    def device_get_count(self) -> int:
        return int(pynvml.nvmlDeviceGetCount())

    def device_get_handle_by_index(self, index: int) -> DeviceHandle:
        return cast(DeviceHandle, pynvml.nvmlDeviceGetHandleByIndex(index))

    def device_get_handle_by_uuid(self, uuid: str) -> DeviceHandle:
        return cast(DeviceHandle, pynvml.nvmlDeviceGetHandleByUUID(uuid))

    def device_get_uuid(self, handle: DeviceHandle) -> str:
        return str(pynvml.nvmlDeviceGetUUID(handle))

    def device_get_name(self, handle: DeviceHandle) -> str:
        return str(pynvml.nvmlDeviceGetName(handle))

    def device_get_brand(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetBrand(handle))

    def device_get_architecture(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetArchitecture(handle))

    def device_get_cuda_compute_capability(self, handle: DeviceHandle) -> tuple[int, int]:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)

    def device_get_minor_number(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))

    def device_get_pci_info(self, handle: DeviceHandle) -> PciInfo:
        return cast(PciInfo, pynvml.nvmlDeviceGetPciInfo(handle))

    def device_get_memory_info(self, handle: DeviceHandle) -> MemoryInfo:
        return cast(MemoryInfo, pynvml.nvmlDeviceGetMemoryInfo(handle))

    def device_get_memory_limits(self, handle: DeviceHandle, cgroup: str) -> MemoryLimits:
        limits = pynvml.c_nvmlGetMemoryLimits_v1_t()
        limits.nameSpace = os.fsencode(cgroup)
        pynvml.nvmlDeviceGetMemoryLimits_v1(handle, limits)
        return MemoryLimits(
            soft=int(limits.softLimit), hard=int(limits.hardLimit), used=int(limits.currentUsed)
        )

    def device_get_numa_node_id(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetNumaNodeId(handle))

    def device_get_addressing_mode(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetAddressingMode(handle))

    def device_get_mig_mode(self, handle: DeviceHandle) -> list[int]:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        return [int(current), int(pending)]

    def device_set_mig_mode(self, handle: DeviceHandle, mode: int) -> int:
        return int(pynvml.nvmlDeviceSetMigMode(handle, mode))

    def device_get_compute_mode(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetComputeMode(handle))

    def device_set_compute_mode(self, handle: DeviceHandle, mode: int) -> None:
        pynvml.nvmlDeviceSetComputeMode(handle, mode)

    def device_get_gpu_instance_profile_info(
        self, handle: DeviceHandle, profile: int, version: int = 2
    ) -> GpuInstanceProfileInfo:
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile, version)
        return cast(GpuInstanceProfileInfo, info)

    def device_get_gpu_instance_possible_placements(
        self, handle: DeviceHandle, profile_id: int
    ) -> list[GpuInstancePlacement]:
        count = ctypes.c_uint(0)
        # NULL placements: NVML returns how many there are.
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, profile_id, None, ctypes.byref(count)
        )
        placements = (pynvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, profile_id, placements, ctypes.byref(count)
        )
        return [cast(GpuInstancePlacement, placements[i]) for i in range(count.value)]

    def device_get_gpu_instance_remaining_capacity(
        self, handle: DeviceHandle, profile_id: int
    ) -> int:
        return int(pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, profile_id))

    def device_create_gpu_instance(
        self, handle: DeviceHandle, profile_id: int
    ) -> GpuInstanceHandle:
        return cast(GpuInstanceHandle, pynvml.nvmlDeviceCreateGpuInstance(handle, profile_id))

    def device_create_gpu_instance_with_placement(
        self, handle: DeviceHandle, profile_id: int, placement: GpuInstancePlacement
    ) -> GpuInstanceHandle:
        # The C call takes a pointer; pynvml passes its argument through unchanged.
        c_placement = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
        gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            handle, profile_id, ctypes.byref(c_placement)
        )
        return cast(GpuInstanceHandle, gi)

    def device_get_gpu_instances(
        self, handle: DeviceHandle, profile_id: int
    ) -> list[GpuInstanceHandle]:
        count = ctypes.c_uint(0)
        instances = (pynvml.c_nvmlGpuInstance_t * _MAX_INSTANCES)()
        pynvml.nvmlDeviceGetGpuInstances(handle, profile_id, instances, ctypes.byref(count))
        return [cast(GpuInstanceHandle, instances[i]) for i in range(count.value)]

    def device_get_gpu_instance_by_id(self, handle: DeviceHandle, gi_id: int) -> GpuInstanceHandle:
        return cast(GpuInstanceHandle, pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id))

    def gpu_instance_get_info(self, gpu_instance: GpuInstanceHandle) -> GpuInstanceInfo:
        return cast(GpuInstanceInfo, pynvml.nvmlGpuInstanceGetInfo(gpu_instance))

    def gpu_instance_get_compute_instance_profile_info(
        self, gpu_instance: GpuInstanceHandle, profile: int, eng_profile: int, version: int = 2
    ) -> ComputeInstanceProfileInfo:
        info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gpu_instance, profile, eng_profile, version
        )
        return cast(ComputeInstanceProfileInfo, info)

    def gpu_instance_create_compute_instance(
        self, gpu_instance: GpuInstanceHandle, profile_id: int
    ) -> ComputeInstanceHandle:
        ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, profile_id)
        return cast(ComputeInstanceHandle, ci)

    def gpu_instance_get_compute_instances(
        self, gpu_instance: GpuInstanceHandle, profile_id: int
    ) -> list[ComputeInstanceHandle]:
        count = ctypes.c_uint(0)
        instances = (pynvml.c_nvmlComputeInstance_t * _MAX_INSTANCES)()
        pynvml.nvmlGpuInstanceGetComputeInstances(
            gpu_instance, profile_id, instances, ctypes.byref(count)
        )
        return [cast(ComputeInstanceHandle, instances[i]) for i in range(count.value)]

    def gpu_instance_get_compute_instance_by_id(
        self, gpu_instance: GpuInstanceHandle, ci_id: int
    ) -> ComputeInstanceHandle:
        ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, ci_id)
        return cast(ComputeInstanceHandle, ci)

    def compute_instance_get_info(
        self, compute_instance: ComputeInstanceHandle
    ) -> ComputeInstanceInfo:
        return cast(ComputeInstanceInfo, pynvml.nvmlComputeInstanceGetInfo(compute_instance))

    def compute_instance_destroy(self, compute_instance: ComputeInstanceHandle) -> None:
        pynvml.nvmlComputeInstanceDestroy(compute_instance)

    def gpu_instance_destroy(self, gpu_instance: GpuInstanceHandle) -> None:
        pynvml.nvmlGpuInstanceDestroy(gpu_instance)

    def device_get_max_mig_device_count(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))

    def device_get_mig_device_handle_by_index(
        self, handle: DeviceHandle, index: int
    ) -> DeviceHandle:
        return cast(DeviceHandle, pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index))

    def device_get_device_handle_from_mig_device_handle(self, handle: DeviceHandle) -> DeviceHandle:
        return cast(DeviceHandle, pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle))

    def device_is_mig_device_handle(self, handle: DeviceHandle) -> bool:
        # pynvml returns the c_uint itself here, not its value.
        result = pynvml.nvmlDeviceIsMigDeviceHandle(handle)
        return bool(getattr(result, "value", result))

    def device_get_gpu_instance_id(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetGpuInstanceId(handle))

    def device_get_compute_instance_id(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetComputeInstanceId(handle))

    def device_get_utilization_rates(self, handle: DeviceHandle) -> Utilization:
        return cast(Utilization, pynvml.nvmlDeviceGetUtilizationRates(handle))

    def device_get_compute_running_processes(self, handle: DeviceHandle) -> list[ProcessInfo]:
        return [cast(ProcessInfo, p) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]

    def gpm_query_device_support(self, handle: DeviceHandle) -> bool:
        try:
            support = pynvml.nvmlGpmQueryDeviceSupport(handle)
        except pynvml.NVMLError as error:
            if return_code(error) in GPM_ABSENT:
                return False
            raise
        return bool(support.isSupportedDevice)

    def gpm_mig_sample_get(self, handle: DeviceHandle, gpu_instance_id: int) -> GpmSample:
        sample = pynvml.nvmlGpmSampleAlloc()
        try:
            pynvml.nvmlGpmMigSampleGet(handle, gpu_instance_id, sample)
        except pynvml.NVMLError:
            pynvml.nvmlGpmSampleFree(sample)
            raise
        return cast(GpmSample, sample)

    def gpm_sm_utilization(self, older: GpmSample, newer: GpmSample) -> float:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1 = older
        request.sample2 = newer
        request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
        answer = pynvml.nvmlGpmMetricsGet(request)
        metric = answer.metrics[0]
        if metric.nvmlReturn != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(metric.nvmlReturn)
        return float(metric.value)

    def gpm_sample_free(self, sample: GpmSample) -> None:
        pynvml.nvmlGpmSampleFree(sample)

    def device_get_process_utilization(
        self, handle: DeviceHandle, last_seen_us: int
    ) -> list[ProcessUtilizationSample]:
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, last_seen_us)
        except pynvml.NVMLError as error:
            # NotFound: no sample newer than last_seen_us. pynvml raises its error for SUCCESS
            # when the size query already succeeded: no process ran.
            if return_code(error) in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_SUCCESS):
                return []
            raise
        return [cast(ProcessUtilizationSample, sample) for sample in samples]

    def event_set_create(self) -> EventSetHandle:
        return cast(EventSetHandle, pynvml.nvmlEventSetCreate())

    def event_set_free(self, event_set: EventSetHandle) -> None:
        pynvml.nvmlEventSetFree(event_set)

    def device_get_supported_event_types(self, handle: DeviceHandle) -> int:
        return int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))

    def device_get_total_ecc_errors(
        self, handle: DeviceHandle, error_type: int, counter_type: int
    ) -> int:
        return int(pynvml.nvmlDeviceGetTotalEccErrors(handle, error_type, counter_type))

    def device_register_events(
        self, handle: DeviceHandle, event_types: int, event_set: EventSetHandle
    ) -> None:
        pynvml.nvmlDeviceRegisterEvents(handle, event_types, event_set)

    def event_set_wait(self, event_set: EventSetHandle, timeout_ms: int) -> EventData:
        # Blocks in libnvidia-ml; ctypes lets other threads run meanwhile.
        return cast(EventData, pynvml.nvmlEventSetWait_v2(event_set, timeout_ms))


if TYPE_CHECKING:
    _conforms_to_nvml: type[NvmlLibrary] = RealNvml
