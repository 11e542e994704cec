"""The NVML subset gpu-dra uses, as a Protocol, plus the NVML error vocabulary.

Method names are the pynvml function names without the ``nvml`` prefix, in snake_case
(``nvmlDeviceGetUUID`` -> ``device_get_uuid``); arguments, return types and raised exceptions are
pynvml's. New calls (MIG create/destroy, events) are added the same way. Events (health
monitoring): `NvmlLibrary.event_set_create`, ``device_register_events`` and ``event_set_wait``
(``nvmlEventSetWait_v2``, raising ``NVMLError_Timeout`` when no event came in time). Utilization
(docs/metrics.md): ``device_get_utilization_rates`` (NotSupported on MIG), compute processes
and per-process utilization samples.

Errors are pynvml's own classes: ``pynvml.NVMLError(code)`` instantiates the subclass for the code
(``NVMLError_NotSupported`` for 3) and keeps the code in ``.value``. pynvml is imported only for
these classes and constants; it loads libnvidia-ml on ``nvmlInit``, never on import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol

import pynvml

DeviceHandle = object
"""Opaque device handle: pynvml's ``c_nvmlDevice_t`` or a simulator's handle (GPU or MIG device)."""
GpuInstanceHandle = object
"""Opaque GPU-instance handle: pynvml's ``c_nvmlGpuInstance_t`` or a simulator's handle."""
ComputeInstanceHandle = object
"""Opaque compute-instance handle: pynvml's ``c_nvmlComputeInstance_t`` or a simulator's handle."""
EventSetHandle = object
"""Opaque event-set handle: pynvml's ``c_nvmlEventSet_t`` or a simulator's handle."""
GpmSample = object
"""An opaque GPM sample (``nvmlGpmSample_t``) of `NvmlLibrary.gpm_mig_sample_get`."""

# Exception classes (typed as plain exception classes; pynvml has no type hints).
NVMLError: Final[type[Exception]] = pynvml.NVMLError
NVMLError_Uninitialized: Final[type[Exception]] = pynvml.NVMLError_Uninitialized
NVMLError_InvalidArgument: Final[type[Exception]] = pynvml.NVMLError_InvalidArgument
NVMLError_NotSupported: Final[type[Exception]] = pynvml.NVMLError_NotSupported
NVMLError_NotFound: Final[type[Exception]] = pynvml.NVMLError_NotFound
NVMLError_InUse: Final[type[Exception]] = pynvml.NVMLError_InUse
NVMLError_InsufficientResources: Final[type[Exception]] = pynvml.NVMLError_InsufficientResources
NVMLError_Timeout: Final[type[Exception]] = pynvml.NVMLError_Timeout
NVMLError_GpuIsLost: Final[type[Exception]] = pynvml.NVMLError_GpuIsLost

# Return codes (nvml.h).
NVML_ERROR_UNINITIALIZED: Final[int] = pynvml.NVML_ERROR_UNINITIALIZED
NVML_ERROR_INVALID_ARGUMENT: Final[int] = pynvml.NVML_ERROR_INVALID_ARGUMENT
NVML_ERROR_NOT_SUPPORTED: Final[int] = pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NO_PERMISSION: Final[int] = pynvml.NVML_ERROR_NO_PERMISSION
NVML_ERROR_NOT_FOUND: Final[int] = pynvml.NVML_ERROR_NOT_FOUND
NVML_ERROR_FUNCTION_NOT_FOUND: Final[int] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
NVML_ERROR_IN_USE: Final[int] = pynvml.NVML_ERROR_IN_USE
NVML_ERROR_INSUFFICIENT_RESOURCES: Final[int] = pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
NVML_ERROR_TIMEOUT: Final[int] = pynvml.NVML_ERROR_TIMEOUT
NVML_ERROR_GPU_IS_LOST: Final[int] = pynvml.NVML_ERROR_GPU_IS_LOST
NVML_SUCCESS: Final[int] = pynvml.NVML_SUCCESS

NVML_INIT_FLAG_NO_GPUS: Final[int] = pynvml.NVML_INIT_FLAG_NO_GPUS
NVML_DEVICE_MIG_DISABLE: Final[int] = pynvml.NVML_DEVICE_MIG_DISABLE
NVML_DEVICE_MIG_ENABLE: Final[int] = pynvml.NVML_DEVICE_MIG_ENABLE
NVML_DEVICE_ARCH_HOPPER: Final[int] = pynvml.NVML_DEVICE_ARCH_HOPPER
GPM_ABSENT: Final = frozenset(
    {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
)
"""Answers to a GPM call that mean "no GPM here" (pre-Hopper GPUs, drivers without GPM)."""

# MIG profile constants. GPU-instance profile *indexes* (0 .. COUNT-1) go to
# GetGpuInstanceProfileInfo only; every later call takes the device-specific profile *ID* it
# returns (``info.id``: 19 for 1g on A100).
NVML_GPU_INSTANCE_PROFILE_COUNT: Final[int] = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
NVML_COMPUTE_INSTANCE_PROFILE_COUNT: Final[int] = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED: Final[int] = (
    pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
)
NVML_COMPUTEMODE_DEFAULT: Final[int] = pynvml.NVML_COMPUTEMODE_DEFAULT
NVML_COMPUTEMODE_EXCLUSIVE_THREAD: Final[int] = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD
"""Removed from NVML (CUDA 8+): setting it is an invalid argument."""
NVML_COMPUTEMODE_PROHIBITED: Final[int] = pynvml.NVML_COMPUTEMODE_PROHIBITED
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: Final[int] = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS

# Event types (``nvmlEventType*``, bits of a mask) and the instance id of a whole-GPU event.
NVML_EVENT_TYPE_SINGLE_BIT_ECC_ERROR: Final[int] = pynvml.nvmlEventTypeSingleBitEccError
NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR: Final[int] = pynvml.nvmlEventTypeDoubleBitEccError
NVML_EVENT_TYPE_XID_CRITICAL_ERROR: Final[int] = pynvml.nvmlEventTypeXidCriticalError
"""``eventData`` is the XID."""
# ECC error counters (``nvmlDeviceGetTotalEccErrors``): which errors, since when.
NVML_MEMORY_ERROR_TYPE_CORRECTED: Final[int] = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
"""Single-bit errors ECC corrected."""
NVML_MEMORY_ERROR_TYPE_UNCORRECTED: Final[int] = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
"""Double-bit errors ECC could not correct."""
NVML_VOLATILE_ECC: Final[int] = pynvml.NVML_VOLATILE_ECC
"""Counted since the driver last loaded or the GPU was last reset."""
NVML_NO_INSTANCE_ID: Final[int] = 0xFFFFFFFF
"""``gpuInstanceId`` / ``computeInstanceId`` of an event that concerns the whole GPU."""
EVENT_TYPE_SIMULATED_RECOVERY: Final[int] = 1 << 63
"""Not an NVML event type: `SimulatedNvml` reports it when a simulated GPU is repaired
(``recover_gpu``). Real NVML reports no recovery and never sets this bit."""


def nvml_error(code: int) -> Exception:
    """The pynvml exception NVML raises for `code` (e.g. ``NVMLError_NotSupported`` for 3)."""
    error: Exception = pynvml.NVMLError(code)
    return error


def return_code(error: Exception) -> int | None:
    """The NVML return code carried by a pynvml error, or None for other exceptions."""
    if not isinstance(error, NVMLError):
        return None
    value = getattr(error, "value", None)
    return value if isinstance(value, int) else None


def return_code_name(code: int) -> str:
    """``NVML_ERROR_<NAME>`` for a return code, ``NVML_ERROR_<code>`` if unknown."""
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == code:
            return str(name)
    return f"NVML_ERROR_{code}"


class PciInfo(Protocol):
    """Fields of pynvml's ``nvmlPciInfo_t`` the driver reads.

    pynvml 13 decodes char arrays on attribute access, so ``busId`` is ``str``
    (``"00000000:1B:00.0"``: 8-digit domain, upper-case hex).
    """

    busId: str  # noqa: N815
    busIdLegacy: str  # noqa: N815
    domain: int
    bus: int
    device: int
    pciDeviceId: int  # noqa: N815
    pciSubSystemId: int  # noqa: N815


class MemoryInfo(Protocol):
    """Fields of pynvml's ``c_nvmlMemory_t``, in bytes."""

    total: int
    free: int
    used: int


@dataclass(frozen=True)
class MemoryLimits:
    """``nvmlGetMemoryLimits_v1_t``: a cgroup's GPU memory limits on one device, in bytes."""

    soft: int
    hard: int
    used: int


class Utilization(Protocol):
    """``nvmlUtilization_t``: percent of the last sample period (1/6 s to 1 s) in which a
    kernel ran (`gpu`) and device memory was read or written (`memory`)."""

    gpu: int
    memory: int


class ProcessInfo(Protocol):
    """``nvmlProcessInfo_t`` (v3): a process with a context on the device. `usedGpuMemory` is
    None where NVML cannot tell (``NVML_VALUE_NOT_AVAILABLE``: Windows WDDM, some MIG cases)."""

    pid: int
    usedGpuMemory: int | None  # noqa: N815
    gpuInstanceId: int  # noqa: N815
    computeInstanceId: int  # noqa: N815


class ProcessUtilizationSample(Protocol):
    """``nvmlProcessUtilizationSample_t``: one process's share of a sample period, percent of
    the GPU's SMs (`smUtil`) and memory bandwidth (`memUtil`); `timeStamp` in microseconds."""

    pid: int
    timeStamp: int  # noqa: N815
    smUtil: int  # noqa: N815
    memUtil: int  # noqa: N815
    encUtil: int  # noqa: N815
    decUtil: int  # noqa: N815


class GpuInstancePlacement(Protocol):
    """``nvmlGpuInstancePlacement_t``: `start` and `size` in memory slices (a 7g uses all 8)."""

    @property
    def start(self) -> int: ...

    @property
    def size(self) -> int: ...


class GpuInstanceProfileInfo(Protocol):
    """Fields of ``nvmlGpuInstanceProfileInfo_v2_t`` (``memorySizeMB`` is in MiB).

    ``name`` (v2 only) is ``"MIG 1g.10gb"``; version 1 structs have no name.
    """

    id: int
    isP2pSupported: int  # noqa: N815
    sliceCount: int  # noqa: N815
    instanceCount: int  # noqa: N815
    multiprocessorCount: int  # noqa: N815
    copyEngineCount: int  # noqa: N815
    decoderCount: int  # noqa: N815
    encoderCount: int  # noqa: N815
    jpegCount: int  # noqa: N815
    ofaCount: int  # noqa: N815
    memorySizeMB: int  # noqa: N815


class GpuInstanceInfo(Protocol):
    """``nvmlGpuInstanceInfo_t``: parent device, GI id, GI profile ID and placement."""

    @property
    def device(self) -> DeviceHandle: ...

    @property
    def id(self) -> int: ...

    @property
    def profileId(self) -> int: ...  # noqa: N802

    @property
    def placement(self) -> GpuInstancePlacement: ...


class ComputeInstanceProfileInfo(Protocol):
    """Fields of ``nvmlComputeInstanceProfileInfo_v2_t`` (shared engines = the GI's)."""

    id: int
    sliceCount: int  # noqa: N815
    instanceCount: int  # noqa: N815
    multiprocessorCount: int  # noqa: N815
    sharedCopyEngineCount: int  # noqa: N815
    sharedDecoderCount: int  # noqa: N815
    sharedEncoderCount: int  # noqa: N815
    sharedJpegCount: int  # noqa: N815
    sharedOfaCount: int  # noqa: N815


class ComputeInstanceInfo(Protocol):
    """``nvmlComputeInstanceInfo_t``: `device` is the MIG device handle (UUID, memory)."""

    @property
    def device(self) -> DeviceHandle: ...

    @property
    def gpuInstance(self) -> GpuInstanceHandle: ...  # noqa: N802

    @property
    def id(self) -> int: ...

    @property
    def profileId(self) -> int: ...  # noqa: N802


class EventData(Protocol):
    """``nvmlEventData_t``: the GPU (for a MIG device its parent GPU, with the instance ids),
    the event type bit, its data (the XID for ``NVML_EVENT_TYPE_XID_CRITICAL_ERROR``)."""

    @property
    def device(self) -> DeviceHandle: ...

    @property
    def eventType(self) -> int: ...  # noqa: N802

    @property
    def eventData(self) -> int: ...  # noqa: N802

    @property
    def gpuInstanceId(self) -> int: ...  # noqa: N802

    @property
    def computeInstanceId(self) -> int: ...  # noqa: N802


class NvmlLibrary(Protocol):
    """The NVML calls gpu-dra makes. Every call but ``init*`` raises Uninitialized before init."""

    def init(self) -> None:
        """``nvmlInit``: reference-counted; each call needs one ``shutdown``."""

    def init_with_flags(self, flags: int) -> None:
        """``nvmlInitWithFlags`` (e.g. ``NVML_INIT_FLAG_NO_GPUS``)."""

    def shutdown(self) -> None:
        """``nvmlShutdown``: Uninitialized when not initialised."""

    def system_get_driver_version(self) -> str:
        """Kernel driver version, e.g. ``"580.65.06"``."""

    def system_get_cuda_driver_version(self) -> int:
        """CUDA driver API version as ``major*1000 + minor*10`` (13000 for 13.0)."""

    def device_get_count(self) -> int:
        """Number of GPUs NVML can see."""

    def device_get_handle_by_index(self, index: int) -> DeviceHandle:
        """Handle of GPU `index` (0-based, PCI order); InvalidArgument when out of range."""

    def device_get_handle_by_uuid(self, uuid: str) -> DeviceHandle:
        """Handle by ``GPU-...`` or ``MIG-...`` UUID; NotFound when no device has it."""

    def device_get_uuid(self, handle: DeviceHandle) -> str:
        """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``; ``MIG-...`` for a MIG device handle."""

    def device_get_name(self, handle: DeviceHandle) -> str:
        """Product name, e.g. ``"NVIDIA H100 80GB HBM3"``."""

    def device_get_brand(self, handle: DeviceHandle) -> int:
        """``NVML_BRAND_*`` (14 = NVIDIA for data-center parts)."""

    def device_get_architecture(self, handle: DeviceHandle) -> int:
        """``NVML_DEVICE_ARCH_*`` (9 = Hopper)."""

    def device_get_cuda_compute_capability(self, handle: DeviceHandle) -> tuple[int, int]:
        """(major, minor), e.g. (9, 0)."""

    def device_get_minor_number(self, handle: DeviceHandle) -> int:
        """N of ``/dev/nvidiaN``; not necessarily the index."""

    def device_get_pci_info(self, handle: DeviceHandle) -> PciInfo:
        """``nvmlDeviceGetPciInfo_v3``."""

    def device_get_memory_info(self, handle: DeviceHandle) -> MemoryInfo:
        """Frame-buffer memory in bytes (a MIG device's own); NotSupported on some parts."""

    def device_get_numa_node_id(self, handle: DeviceHandle) -> int:
        """NUMA node of the GPU's own memory; NotSupported on x86 (only Grace systems have one)."""

    def device_get_addressing_mode(self, handle: DeviceHandle) -> int:
        """``NVML_DEVICE_ADDRESSING_MODE_*`` (0 None, 1 HMM, 2 ATS); NotSupported on most x86."""

    def device_get_mig_mode(self, handle: DeviceHandle) -> list[int]:
        """[current, pending], each ``NVML_DEVICE_MIG_*``; NotSupported on GPUs without MIG."""

    # MIG. Calls that fill a caller-allocated array in pynvml (possible placements, GPU and
    # compute instances) return a list here; everything else has pynvml's signature.

    def device_set_mig_mode(self, handle: DeviceHandle, mode: int) -> int:
        """Request MIG on/off; returns the activation status (``NVML_SUCCESS`` once applied).

        Hopper and later apply it at once. Ampere applies it at the next GPU reset: pending
        changes, current stays, and the status says why it is not active yet (``IN_USE`` when
        the GPU has clients, ``RESET_REQUIRED`` in a pass-through VM). NVIDIA's DRA driver
        therefore only toggles MIG on Hopper and later, and on Ampere uses MIG only when it is
        already on. May unbind/reset the device: re-read its minor number afterwards.
        """

    def device_get_gpu_instance_profile_info(
        self, handle: DeviceHandle, profile: int, version: int = 2
    ) -> GpuInstanceProfileInfo:
        """Profile info for the ``NVML_GPU_INSTANCE_PROFILE_*`` index `profile`.

        ``info.id`` is the profile ID every later call takes. InvalidArgument for an index
        >= ``NVML_GPU_INSTANCE_PROFILE_COUNT``, NotSupported for one the GPU lacks.
        """

    def device_get_gpu_instance_possible_placements(
        self, handle: DeviceHandle, profile_id: int
    ) -> list[GpuInstancePlacement]:
        """Every placement of profile ID `profile_id`, free or not, MIG on or off."""

    def device_get_gpu_instance_remaining_capacity(
        self, handle: DeviceHandle, profile_id: int
    ) -> int:
        """How many more GPU instances of `profile_id` fit; NotSupported while MIG is off."""

    def device_create_gpu_instance(
        self, handle: DeviceHandle, profile_id: int
    ) -> GpuInstanceHandle:
        """Create a GPU instance where NVML chooses; InsufficientResources when none fits."""

    def device_create_gpu_instance_with_placement(
        self, handle: DeviceHandle, profile_id: int, placement: GpuInstancePlacement
    ) -> GpuInstanceHandle:
        """Create a GPU instance at `placement`: InsufficientResources when it overlaps one."""

    def device_get_gpu_instances(
        self, handle: DeviceHandle, profile_id: int
    ) -> list[GpuInstanceHandle]:
        """The existing GPU instances of `profile_id`; NotSupported while MIG is off."""

    def device_get_gpu_instance_by_id(self, handle: DeviceHandle, gi_id: int) -> GpuInstanceHandle:
        """The GPU instance with GI id `gi_id`; NotFound when there is none."""

    def gpu_instance_get_info(self, gpu_instance: GpuInstanceHandle) -> GpuInstanceInfo:
        """Parent device, GI id, profile ID and placement."""

    def gpu_instance_get_compute_instance_profile_info(
        self, gpu_instance: GpuInstanceHandle, profile: int, eng_profile: int, version: int = 2
    ) -> ComputeInstanceProfileInfo:
        """Compute-instance profile `profile` (``NVML_COMPUTE_INSTANCE_PROFILE_*``) in the GI."""

    def gpu_instance_create_compute_instance(
        self, gpu_instance: GpuInstanceHandle, profile_id: int
    ) -> ComputeInstanceHandle:
        """Create a compute instance; its MIG device (and UUID) exists from then on."""

    def gpu_instance_get_compute_instances(
        self, gpu_instance: GpuInstanceHandle, profile_id: int
    ) -> list[ComputeInstanceHandle]:
        """The compute instances of `profile_id` in the GI."""

    def gpu_instance_get_compute_instance_by_id(
        self, gpu_instance: GpuInstanceHandle, ci_id: int
    ) -> ComputeInstanceHandle:
        """The compute instance with CI id `ci_id`; NotFound when there is none."""

    def compute_instance_get_info(
        self, compute_instance: ComputeInstanceHandle
    ) -> ComputeInstanceInfo:
        """MIG device handle, GI handle, CI id and CI profile ID."""

    def compute_instance_destroy(self, compute_instance: ComputeInstanceHandle) -> None:
        """Destroy a compute instance (and its MIG device)."""

    def gpu_instance_destroy(self, gpu_instance: GpuInstanceHandle) -> None:
        """Destroy a GPU instance: InUse while it still has compute instances."""

    def device_get_max_mig_device_count(self, handle: DeviceHandle) -> int:
        """7 (4 on A30) with MIG on; 0 with MIG off or unsupported."""

    def device_get_mig_device_handle_by_index(
        self, handle: DeviceHandle, index: int
    ) -> DeviceHandle:
        """MIG device `index`: NotFound for an empty index, InvalidArgument past the max."""

    def device_get_device_handle_from_mig_device_handle(self, handle: DeviceHandle) -> DeviceHandle:
        """The parent GPU of a MIG device handle."""

    def device_is_mig_device_handle(self, handle: DeviceHandle) -> bool:
        """Whether `handle` is a MIG device handle."""

    def device_get_gpu_instance_id(self, handle: DeviceHandle) -> int:
        """GI id of a MIG device handle; NotSupported for a GPU handle."""

    def device_get_compute_instance_id(self, handle: DeviceHandle) -> int:
        """CI id of a MIG device handle; NotSupported for a GPU handle."""

    def device_get_compute_mode(self, handle: DeviceHandle) -> int:
        """``NVML_COMPUTEMODE_*`` of a full GPU (0 default, 2 prohibited, 3 exclusive process)."""
        ...

    def device_set_compute_mode(self, handle: DeviceHandle, mode: int) -> None:
        """Set a full GPU's compute mode (root only; lost on reboot). NotSupported on MIG
        devices and, for EXCLUSIVE_PROCESS, on GPUs with MIG on; InvalidArgument for
        EXCLUSIVE_THREAD or an unknown mode."""
        ...

    # Utilization (docs/metrics.md).

    def device_get_utilization_rates(self, handle: DeviceHandle) -> Utilization:
        """``nvmlDeviceGetUtilizationRates`` of a full GPU; NotSupported on MIG device handles
        and on GPUs with MIG on (NVML: "not currently supported" on MIG-enabled GPUs)."""
        ...

    def device_get_compute_running_processes(self, handle: DeviceHandle) -> list[ProcessInfo]:
        """``nvmlDeviceGetComputeRunningProcesses_v3``: the processes with a compute context on
        the GPU or MIG device (an MPS server's clients are listed, the server too)."""
        ...

    def device_get_process_utilization(
        self, handle: DeviceHandle, last_seen_us: int
    ) -> list[ProcessUtilizationSample]:
        """``nvmlDeviceGetProcessUtilization``: samples newer than `last_seen_us` (0: all the
        driver keeps); an empty list when there are none (NVML's NotFound). NotSupported on MIG
        device handles and on GPUs without per-process accounting."""
        ...

    # GPU performance monitoring (GPM, Hopper and newer): SM activity of MIG devices, which
    # the utilization rates do not give (docs/metrics.md#idle-claims).

    def gpm_query_device_support(self, handle: DeviceHandle) -> bool:
        """``nvmlGpmQueryDeviceSupport`` of a full GPU: whether it offers GPM metrics
        (NotSupported or FunctionNotFound from older drivers mean no)."""
        ...

    def gpm_mig_sample_get(self, handle: DeviceHandle, gpu_instance_id: int) -> GpmSample:
        """A new GPM sample (``nvmlGpmSampleAlloc`` + ``nvmlGpmMigSampleGet``) of the GPU
        instance `gpu_instance_id` of the full GPU `handle`; free it with `gpm_sample_free`."""
        ...

    def gpm_sm_utilization(self, older: GpmSample, newer: GpmSample) -> float:
        """``NVML_GPM_METRIC_SM_UTIL`` between two samples of one GPU instance: percent of the
        time its SMs were busy (``nvmlGpmMetricsGet``)."""
        ...

    def gpm_sample_free(self, sample: GpmSample) -> None:
        """``nvmlGpmSampleFree``."""
        ...

    # Events (health monitoring).

    def event_set_create(self) -> EventSetHandle:
        """``nvmlEventSetCreate``: an empty event set; free it with `event_set_free`."""
        ...

    def event_set_free(self, event_set: EventSetHandle) -> None:
        """``nvmlEventSetFree``."""
        ...

    def device_get_supported_event_types(self, handle: DeviceHandle) -> int:
        """The ``nvmlEventType*`` bits the GPU can report."""
        ...

    def device_get_total_ecc_errors(
        self, handle: DeviceHandle, error_type: int, counter_type: int
    ) -> int:
        """ECC errors of ``error_type`` (``NVML_MEMORY_ERROR_TYPE_*``) counted since
        ``counter_type`` (``NVML_VOLATILE_ECC``: the last driver load or GPU reset);
        NotSupported where the GPU has no ECC or it is off."""
        ...

    def device_register_events(
        self, handle: DeviceHandle, event_types: int, event_set: EventSetHandle
    ) -> None:
        """Report the GPU's events of `event_types` into `event_set`; NotSupported when the GPU
        cannot report some of them."""
        ...

    def event_set_wait(self, event_set: EventSetHandle, timeout_ms: int) -> EventData:
        """``nvmlEventSetWait_v2``: the next event, waiting up to `timeout_ms`; raises
        ``NVMLError_Timeout`` when none came, ``NVMLError_GpuIsLost`` when a registered GPU
        fell off the bus."""
        ...

    # Per-cgroup memory limits (MPS shares).

    def device_get_memory_limits(self, handle: DeviceHandle, cgroup: str) -> MemoryLimits:
        """``nvmlDeviceGetMemoryLimits_v1``: the GPU memory limits of cgroup ``cgroup`` (full
        sysfs path) on a full GPU (drivers 615+). NotFound when none are set, NotSupported
        where the GPU or driver cannot limit memory per cgroup (MIG handles too),
        FunctionNotFound when the library has no such function (older drivers)."""
        ...


class PciTopology(Protocol):
    """Host PCI facts NVML does not report (sysfs on a real host, the profile in simulation).

    Bus ids are in the published form ``0000:1b:00.0``. Lookups never raise: None means unknown.
    """

    def pcie_root(self, pci_bus_id: str) -> str | None:
        """The PCIe root complex, ``pci<domain>:<bus>`` (e.g. ``pci0000:64``)."""

    def numa_node(self, pci_bus_id: str) -> int | None:
        """The CPU NUMA node the device is attached to; None when the platform has none."""


def return_code_by_name(name: str) -> int:
    """The code of ``"NOT_SUPPORTED"`` or ``"NVML_ERROR_NOT_SUPPORTED"``; KeyError if unknown."""
    full = name if name.startswith("NVML_ERROR_") else f"NVML_ERROR_{name}"
    value = getattr(pynvml, full, None)
    if not isinstance(value, int):
        raise KeyError(name)
    return value


def short_pci_bus_id(nvml_bus_id: str) -> str:
    """go-nvlib's ``GetPCIBusID`` form: lower-case, first ``0000`` of the domain dropped.

    ``00000000:1B:00.0`` -> ``0000:1b:00.0`` (the sysfs name and the published attribute).
    """
    bus_id = nvml_bus_id.strip().lower()
    if bus_id != "0000" and bus_id.startswith("0000"):
        bus_id = bus_id[4:]
    return bus_id
