"""Simulated NVML and PCI topology of a machine profile: a real backend chosen by a setting.

`SimulatedNvml` behaves like NVML where the driver can tell (errors, return types, MIG mode and
instances per `gpu_dra.driver.nvml.simulated_mig`, compute modes, XID/ECC events, lost GPUs,
utilization and processes per `gpu_dra.driver.nvml.simulated_utilization`),
injects any NVML return code into any call (profile ``faults``, `SimulatedNvml.set_fault`), and
hands its MIG state to the caller as JSON snapshots so MIG instances outlive the process.
See docs/config.md#what-the-simulator-models and docs/real-nodes.md#trying-it-without-a-gpu.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import pynvml

from gpu_dra.driver.nvml.interface import (
    EVENT_TYPE_SIMULATED_RECOVERY,
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_COMPUTEMODE_DEFAULT,
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    NVML_COMPUTEMODE_PROHIBITED,
    NVML_DEVICE_ARCH_HOPPER,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_SINGLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
    NVML_GPU_INSTANCE_PROFILE_COUNT,
    NVML_MEMORY_ERROR_TYPE_CORRECTED,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_NO_INSTANCE_ID,
    NVML_VOLATILE_ECC,
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
    PciTopology,
    ProcessInfo,
    ProcessUtilizationSample,
    Utilization,
    nvml_error,
    short_pci_bus_id,
)
from gpu_dra.driver.nvml.simulated_mig import (
    MAX_COMPUTE_INSTANCES_PER_GI,
    ComputeInstance,
    GpuInstance,
    MigSnapshotError,
    MigState,
    full_compute_instance_profile,
)
from gpu_dra.driver.nvml.simulated_profiles import (
    DEVICE_FAULT_CALLS,
    SYSTEM_FAULT_CALLS,
    MachineProfile,
    SimulatedGpu,
    load_profile,
)
from gpu_dra.driver.nvml.simulated_utilization import DeviceActivity, UtilizationModel

_MIB: Final = 1024 * 1024
SUPPORTED_EVENT_TYPES: Final = (
    NVML_EVENT_TYPE_SINGLE_BIT_ECC_ERROR
    | NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR
    | NVML_EVENT_TYPE_XID_CRITICAL_ERROR
)
"""What every simulated GPU can report (``device_get_supported_event_types``)."""

# pynvml has no text for these codes and asks libnvidia-ml (nvmlErrorString), which the simulator
# does not load; these are the strings the real library returns. setdefault: a loaded library's
# own answer, cached by pynvml in the same table, wins.
for _code, _text in (
    (NVML_ERROR_IN_USE, "In use by another client"),
    (NVML_ERROR_INSUFFICIENT_RESOURCES, "Insufficient Resources"),
):
    pynvml.NVMLError._errcode_to_string.setdefault(_code, _text)


class SimulatedDeviceHandle:
    """Handle returned by `SimulatedNvml`; one object per GPU, like NVML's stable pointers."""

    __slots__ = ("_owner", "index")

    def __init__(self, owner: SimulatedNvml, index: int) -> None:
        self._owner = owner
        self.index = index

    def __repr__(self) -> str:
        return f"<SimulatedDeviceHandle index={self.index}>"


class SimulatedGpuInstanceHandle:
    """Handle of one GPU instance of GPU `index`; stale (InvalidArgument) once destroyed."""

    __slots__ = ("_owner", "index", "instance")

    def __init__(self, owner: SimulatedNvml, index: int, instance: GpuInstance) -> None:
        self._owner = owner
        self.index = index
        self.instance = instance

    def __repr__(self) -> str:
        return f"<SimulatedGpuInstanceHandle gpu={self.index} gi={self.instance.id}>"


class SimulatedComputeInstanceHandle:
    """Handle of one compute instance; stale (InvalidArgument) once destroyed."""

    __slots__ = ("_owner", "index", "instance")

    def __init__(self, owner: SimulatedNvml, index: int, instance: ComputeInstance) -> None:
        self._owner = owner
        self.index = index
        self.instance = instance

    def __repr__(self) -> str:
        gi = self.instance.gpu_instance.id
        return f"<SimulatedComputeInstanceHandle gpu={self.index} gi={gi} ci={self.instance.id}>"


class SimulatedMigDeviceHandle:
    """Device handle of the MIG device of one compute instance; stale once it is destroyed."""

    __slots__ = ("_owner", "index", "instance")

    def __init__(self, owner: SimulatedNvml, index: int, instance: ComputeInstance) -> None:
        self._owner = owner
        self.index = index
        self.instance = instance

    def __repr__(self) -> str:
        return f"<SimulatedMigDeviceHandle uuid={self.instance.uuid}>"


@dataclass(frozen=True)
class SimulatedGpuInstanceInfo:
    """``nvmlGpuInstanceInfo_t`` with a simulated device handle."""

    device: DeviceHandle
    id: int
    profileId: int  # noqa: N815
    placement: GpuInstancePlacement


@dataclass(frozen=True)
class SimulatedComputeInstanceInfo:
    """``nvmlComputeInstanceInfo_t`` with simulated handles."""

    device: DeviceHandle
    gpuInstance: GpuInstanceHandle  # noqa: N815
    id: int
    profileId: int  # noqa: N815
    placement: GpuInstancePlacement


@dataclass(frozen=True)
class SimulatedEventData:
    """``nvmlEventData_t`` with a simulated device handle (the GPU, also for a MIG device)."""

    device: DeviceHandle
    eventType: int  # noqa: N815
    eventData: int  # noqa: N815
    gpuInstanceId: int = NVML_NO_INSTANCE_ID  # noqa: N815
    computeInstanceId: int = NVML_NO_INSTANCE_ID  # noqa: N815


class SimulatedEventSet:
    """Event-set handle of `SimulatedNvml`: which GPUs report into it (index -> type mask), the
    events waiting in it, and the GPUs whose loss it has still to report."""

    __slots__ = ("_owner", "freed", "lost", "queue", "registered")

    def __init__(self, owner: SimulatedNvml) -> None:
        self._owner = owner
        self.registered: dict[int, int] = {}
        self.queue: deque[SimulatedEventData] = deque()
        self.lost: set[int] = set()
        self.freed = False

    def __repr__(self) -> str:
        return f"<SimulatedEventSet gpus={sorted(self.registered)}>"


MigSnapshot = dict[str, object]
"""`SimulatedNvml.mig_snapshot`: ``{"gpus": {<GPU UUID>: <MigState.snapshot>}}``."""


@dataclass
class SimulatedGpmSample:
    """A GPM sample of one GPU instance: the SM utilization its MIG devices had."""

    parent: str
    gi_id: int
    sm_percent: int
    freed: bool = False


class SimulatedNvml:
    """`NvmlLibrary` over a `MachineProfile`."""

    def __init__(
        self,
        profile: MachineProfile,
        *,
        saved_mig: Mapping[str, object] | None = None,
        on_mig_change: Callable[[MigSnapshot], None] | None = None,
    ) -> None:
        """`saved_mig`: a `mig_snapshot` to start from (GPUs it does not name start from the
        profile); raises `MigSnapshotError` when it does not fit the profile. `on_mig_change`
        gets a snapshot after every MIG change."""
        self.profile = profile
        self._init_count = 0
        self._init_lock = threading.Lock()  # NVML's reference count is thread-safe
        self._handles = tuple(SimulatedDeviceHandle(self, gpu.index) for gpu in profile.gpus)
        self._mig = tuple(MigState(gpu.model.mig, gpu.mig_mode, gpu.uuid) for gpu in profile.gpus)
        self._gi_handles: dict[GpuInstance, SimulatedGpuInstanceHandle] = {}
        self._ci_handles: dict[ComputeInstance, SimulatedComputeInstanceHandle] = {}
        self._mig_handles: dict[ComputeInstance, SimulatedMigDeviceHandle] = {}
        self._handles_lock = threading.Lock()
        self._compute_modes = [NVML_COMPUTEMODE_DEFAULT] * len(profile.gpus)
        self._faults: dict[tuple[int | None, str], int | None] = {}
        for gpu in profile.gpus:
            state = self._mig[gpu.index]
            for device in gpu.mig_devices:  # checked by the profile parser
                found = state.profile(device.profile_id, unknown=NVML_ERROR_INVALID_ARGUMENT)
                gi = state.create_gpu_instance(
                    device.profile_id, (device.start, found.placement_size)
                )
                if device.compute_instance:
                    state.create_compute_instance(gi, full_compute_instance_profile(gi.profile))
        if saved_mig is not None:
            self._restore(saved_mig)
        self._on_mig_change = on_mig_change
        self._persist_lock = threading.Lock()
        self._events = threading.Condition()  # guards event sets and lost GPUs
        self._event_sets: list[SimulatedEventSet] = []
        self._lost: set[int] = set()
        self._ecc: dict[tuple[int, int], int] = {}
        """(GPU index, NVML_MEMORY_ERROR_TYPE_*) -> volatile ECC error count (`add_ecc_errors`)."""
        self.utilization = UtilizationModel()
        """What the devices do (utilization, processes, memory used), by UUID."""

    def _restore(self, saved: Mapping[str, object]) -> None:
        gpus = saved.get("gpus")
        if not isinstance(gpus, Mapping):
            raise MigSnapshotError("saved MIG state has no 'gpus' object")
        by_uuid = {gpu.uuid: gpu.index for gpu in self.profile.gpus}
        unknown = sorted(set(gpus) - set(by_uuid))
        if unknown:
            raise MigSnapshotError(
                f"saved MIG state names GPUs this profile does not have: {', '.join(unknown)}"
            )
        for uuid, state in gpus.items():
            if not isinstance(state, Mapping):
                raise MigSnapshotError(f"saved MIG state of GPU {uuid} is not an object")
            self._mig[by_uuid[uuid]].restore(state)

    def restore_gpu(self, uuid: str, saved: Mapping[str, object]) -> None:
        """Replace the MIG mode and instances of GPU `uuid` with its part of a `mig_snapshot`
        (another process changed the GPU: the caller keeps both in step); raises
        `MigSnapshotError` (the GPU unchanged) when it does not fit, as `saved_mig` does."""
        self._restore({"gpus": {uuid: saved}})

    def mig_snapshot(self) -> MigSnapshot:
        """MIG mode and instances of every MIG-capable GPU, by UUID (JSON values)."""
        return {
            "gpus": {
                gpu.uuid: self._mig[gpu.index].snapshot()
                for gpu in self.profile.gpus
                if gpu.model.mig_capable
            }
        }

    def _mig_changed(self) -> None:
        """Hand a snapshot to `on_mig_change`; serialized, so a later one has every change."""
        if self._on_mig_change is None:
            return
        with self._persist_lock:
            self._on_mig_change(self.mig_snapshot())

    def set_fault(self, call: str, code: int | None, *, gpu: int | None = None) -> None:
        """From now on `call` (an `NvmlLibrary` method name) raises the NVML error `code` for GPU
        `gpu` (NVML index; calls taking a device, GPU-instance or compute-instance handle), or
        node-wide when `gpu` is None (the other calls). ``code=None`` makes the call succeed
        again, whatever the profile's ``faults`` say. Raises ValueError for an unknown call, or
        one of the other kind."""
        calls = SYSTEM_FAULT_CALLS if gpu is None else DEVICE_FAULT_CALLS
        if call not in calls:
            kind = "node-wide" if gpu is None else "per-GPU"
            raise ValueError(f"{call!r} is no {kind} NVML call; known: {sorted(calls)}")
        if gpu is not None and not 0 <= gpu < len(self.profile.gpus):
            raise ValueError(f"no GPU {gpu}: the profile has {len(self.profile.gpus)}")
        self._faults[(gpu, call)] = code

    def gpu_index(self, ref: int | str) -> int:
        """The NVML index of GPU `ref`: an index, or a ``GPU-`` UUID; ValueError if unknown."""
        for gpu in self.profile.gpus:
            if ref in (gpu.index, gpu.uuid) or (isinstance(ref, str) and ref == str(gpu.index)):
                return gpu.index
        known = ", ".join(f"{gpu.index} ({gpu.uuid})" for gpu in self.profile.gpus)
        raise ValueError(f"no simulated GPU {ref!r}; GPUs: {known}")

    def inject_event(
        self,
        gpu: int | str,
        event_type: int,
        data: int = 0,
        *,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> int:
        """Let GPU `gpu` (index or UUID) report an event of `event_type` with `data` (the XID
        for ``NVML_EVENT_TYPE_XID_CRITICAL_ERROR``); with both instance ids, an event of that
        MIG device (it must exist). Returns how many event sets it reached (those the GPU is
        registered in for `event_type`). ValueError for an unknown GPU or MIG device."""
        index = self.gpu_index(gpu)
        if (gpu_instance_id is None) != (compute_instance_id is None):
            raise ValueError("give both the GPU instance and the compute instance id, or neither")
        if gpu_instance_id is not None:
            instance = self._mig[index].gpu_instances.get(gpu_instance_id)
            if instance is None or compute_instance_id not in instance.compute_instances:
                raise ValueError(
                    f"simulated GPU {index} has no MIG device with GPU instance "
                    f"{gpu_instance_id} and compute instance {compute_instance_id}"
                )
        event = SimulatedEventData(
            device=self._handles[index],
            eventType=event_type,
            eventData=data,
            gpuInstanceId=NVML_NO_INSTANCE_ID if gpu_instance_id is None else gpu_instance_id,
            computeInstanceId=(
                NVML_NO_INSTANCE_ID if compute_instance_id is None else compute_instance_id
            ),
        )
        with self._events:
            reached = [es for es in self._event_sets if es.registered.get(index, 0) & event_type]
            for event_set in reached:
                event_set.queue.append(event)
            self._events.notify_all()
        return len(reached)

    def add_ecc_errors(self, gpu: int | str, *, corrected: int = 0, uncorrected: int = 0) -> None:
        """GPU `gpu` (index or UUID) counts that many more corrected (single-bit) and uncorrected
        (double-bit) ECC errors; no event is sent (`inject_event` sends one)."""
        index = self.gpu_index(gpu)
        with self._events:
            for kind, added in ((NVML_MEMORY_ERROR_TYPE_CORRECTED, corrected),
                                (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, uncorrected)):  # fmt: skip
                self._ecc[index, kind] = self._ecc.get((index, kind), 0) + added

    def lose_gpu(self, gpu: int | str) -> None:
        """GPU `gpu` falls off the bus: calls on it raise ``NVMLError_GpuIsLost`` (lookups of it
        too), and so does the next ``event_set_wait`` of every event set it is registered in."""
        index = self.gpu_index(gpu)
        with self._events:
            self._lost.add(index)
            for event_set in self._event_sets:
                if index in event_set.registered:
                    event_set.lost.add(index)
            self._events.notify_all()

    def recover_gpu(self, gpu: int | str) -> int:
        """GPU `gpu` is repaired: calls on it work again and every event set it is registered
        in gets an ``EVENT_TYPE_SIMULATED_RECOVERY`` event. Returns how many sets it reached."""
        index = self.gpu_index(gpu)
        with self._events:
            self._lost.discard(index)
            event = SimulatedEventData(self._handles[index], EVENT_TYPE_SIMULATED_RECOVERY, 0)
            reached = [es for es in self._event_sets if index in es.registered]
            for event_set in reached:
                event_set.lost.discard(index)
                event_set.queue.append(event)
            self._events.notify_all()
        return len(reached)

    def set_activity(self, device: int | str, activity: DeviceActivity) -> str:
        """Let device `device` (a GPU's index or UUID, or a ``MIG-`` UUID, which need not exist
        yet: dynamic MIG devices come and go) do `activity`; returns the UUID it is kept by."""
        uuid = device if isinstance(device, str) and device.startswith("MIG-") else None
        if uuid is None:
            uuid = self.profile.gpus[self.gpu_index(device)].uuid
        self.utilization.set(uuid, activity)
        return uuid

    def device_get_utilization_rates(self, handle: DeviceHandle) -> Utilization:
        if isinstance(handle, SimulatedMigDeviceHandle):
            self._mig_device(handle, "device_get_utilization_rates")
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        gpu = self._gpu(handle, "device_get_utilization_rates")
        if self._mig[gpu.index].enabled:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        activity = self.utilization.get(gpu.uuid)
        rates: Utilization = pynvml.c_nvmlUtilization_t()
        rates.gpu = activity.gpu_percent
        rates.memory = activity.memory_percent
        return rates

    def device_get_compute_running_processes(self, handle: DeviceHandle) -> list[ProcessInfo]:
        gi_id = ci_id = NVML_NO_INSTANCE_ID
        if isinstance(handle, SimulatedMigDeviceHandle):
            ci = self._mig_device(handle, "device_get_compute_running_processes")
            uuid, gi_id, ci_id = ci.uuid, ci.gpu_instance.id, ci.id
        else:
            uuid = self._gpu(handle, "device_get_compute_running_processes").uuid
        processes: list[ProcessInfo] = []
        for process in self.utilization.get(uuid).processes:
            info: ProcessInfo = pynvml.c_nvmlProcessInfo_t()
            info.pid = process.pid
            info.usedGpuMemory = process.used_memory_bytes
            info.gpuInstanceId = gi_id
            info.computeInstanceId = ci_id
            processes.append(info)
        return processes

    def gpm_query_device_support(self, handle: DeviceHandle) -> bool:
        if isinstance(handle, SimulatedMigDeviceHandle):
            self._mig_device(handle, "gpm_query_device_support")
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        gpu = self._gpu(handle, "gpm_query_device_support")
        return gpu.model.architecture >= NVML_DEVICE_ARCH_HOPPER

    def gpm_mig_sample_get(self, handle: DeviceHandle, gpu_instance_id: int) -> GpmSample:
        """A sample holding the SM utilization of the GPU instance's MIG devices now (the
        largest `DeviceActivity.gpu_percent` set on them): the simulator's SM activity."""
        if not self.gpm_query_device_support(handle):
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        state = self._mig_state(handle, "gpm_mig_sample_get")
        state.require_enabled()
        gi = state.gpu_instances.get(gpu_instance_id)
        if gi is None:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        percents = [
            self.utilization.get(ci.uuid).gpu_percent for ci in gi.compute_instances.values()
        ]
        parent = self.profile.gpus[self._index(handle)].uuid
        return SimulatedGpmSample(parent, gpu_instance_id, max(percents, default=0))

    def gpm_sm_utilization(self, older: GpmSample, newer: GpmSample) -> float:
        self._system("gpm_sm_utilization")
        if not isinstance(older, SimulatedGpmSample) or not isinstance(newer, SimulatedGpmSample):
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        if older.freed or newer.freed or (older.parent, older.gi_id) != (newer.parent, newer.gi_id):
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        return float(newer.sm_percent)

    def gpm_sample_free(self, sample: GpmSample) -> None:
        if not isinstance(sample, SimulatedGpmSample) or sample.freed:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        sample.freed = True

    def device_get_process_utilization(
        self, handle: DeviceHandle, last_seen_us: int
    ) -> list[ProcessUtilizationSample]:
        if isinstance(handle, SimulatedMigDeviceHandle):
            self._mig_device(handle, "device_get_process_utilization")
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        gpu = self._gpu(handle, "device_get_process_utilization")
        now_us = time.time_ns() // 1000
        if now_us <= last_seen_us:
            return []
        samples: list[ProcessUtilizationSample] = []
        for process in self.utilization.get(gpu.uuid).processes:
            sample: ProcessUtilizationSample = pynvml.c_nvmlProcessUtilizationSample_t()
            sample.pid = process.pid
            sample.timeStamp = now_us
            sample.smUtil = process.sm_percent
            sample.memUtil = process.memory_percent
            sample.encUtil = 0
            sample.decUtil = 0
            samples.append(sample)
        return samples

    def event_set_create(self) -> EventSetHandle:
        self._system("event_set_create")
        event_set = SimulatedEventSet(self)
        with self._events:
            self._event_sets.append(event_set)
        return event_set

    def event_set_free(self, event_set: EventSetHandle) -> None:
        self._system("event_set_free")
        found = self._event_set(event_set)
        with self._events:
            found.freed = True
            self._event_sets.remove(found)
            self._events.notify_all()

    def device_get_supported_event_types(self, handle: DeviceHandle) -> int:
        self._gpu(handle, "device_get_supported_event_types")
        return SUPPORTED_EVENT_TYPES

    def device_get_total_ecc_errors(
        self, handle: DeviceHandle, error_type: int, counter_type: int
    ) -> int:
        gpu = self._gpu(handle, "device_get_total_ecc_errors")
        if counter_type != NVML_VOLATILE_ECC or error_type not in (
            NVML_MEMORY_ERROR_TYPE_CORRECTED,
            NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        ):
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)  # only volatile counts are simulated
        with self._events:
            return self._ecc.get((gpu.index, error_type), 0)

    def device_register_events(
        self, handle: DeviceHandle, event_types: int, event_set: EventSetHandle
    ) -> None:
        gpu = self._gpu(handle, "device_register_events")
        found = self._event_set(event_set)
        if event_types & ~SUPPORTED_EVENT_TYPES:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        with self._events:
            found.registered[gpu.index] = found.registered.get(gpu.index, 0) | event_types

    def event_set_wait(self, event_set: EventSetHandle, timeout_ms: int) -> EventData:
        self._system("event_set_wait")
        found = self._event_set(event_set)
        with self._events:
            self._events.wait_for(
                lambda: bool(found.queue or found.lost or found.freed), max(timeout_ms, 0) / 1000
            )
            if found.freed:
                raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
            if found.lost:
                found.lost.remove(min(found.lost))
                raise nvml_error(NVML_ERROR_GPU_IS_LOST)
            if found.queue:
                return found.queue.popleft()
        raise nvml_error(NVML_ERROR_TIMEOUT)

    def _event_set(self, event_set: EventSetHandle) -> SimulatedEventSet:
        if (
            not isinstance(event_set, SimulatedEventSet)
            or event_set._owner is not self
            or event_set.freed
        ):
            self._initialized()
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        self._initialized()
        return event_set

    def _fault(self, call: str, gpu: SimulatedGpu | None = None) -> int | None:
        key = (None if gpu is None else gpu.index, call)
        if key in self._faults:
            return self._faults[key]
        return self.profile.fault(call) if gpu is None else gpu.fault(call)

    @property
    def initialized(self) -> bool:
        """Whether at least one ``init`` has not been matched by ``shutdown``."""
        return self._init_count > 0

    def init(self) -> None:
        self.init_with_flags(0)

    def init_with_flags(self, flags: int) -> None:
        fault = self._fault("init_with_flags") or self._fault("init")
        if fault is not None:
            raise nvml_error(fault)
        if flags < 0:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        with self._init_lock:
            self._init_count += 1

    def shutdown(self) -> None:
        with self._init_lock:
            self._system("shutdown")
            self._init_count -= 1

    def system_get_driver_version(self) -> str:
        self._system("system_get_driver_version")
        return self.profile.driver_version

    def system_get_cuda_driver_version(self) -> int:
        self._system("system_get_cuda_driver_version")
        return self.profile.cuda_driver_version

    def device_get_count(self) -> int:
        self._system("device_get_count")
        return len(self._handles)

    def device_get_handle_by_index(self, index: int) -> DeviceHandle:
        self._system("device_get_handle_by_index")
        if not 0 <= index < len(self._handles):
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        if index in self._lost:
            raise nvml_error(NVML_ERROR_GPU_IS_LOST)
        return self._handles[index]

    def device_get_handle_by_uuid(self, uuid: str) -> DeviceHandle:
        self._system("device_get_handle_by_uuid")
        if not uuid.startswith(("GPU-", "MIG-")):
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        for gpu in self.profile.gpus:
            if gpu.uuid == uuid:
                if gpu.index in self._lost:
                    raise nvml_error(NVML_ERROR_GPU_IS_LOST)
                return self._handles[gpu.index]
        for index, state in enumerate(self._mig):
            for ci in state.mig_devices():
                if ci.uuid == uuid:
                    if index in self._lost:
                        raise nvml_error(NVML_ERROR_GPU_IS_LOST)
                    return self._mig_handle(index, ci)
        raise nvml_error(NVML_ERROR_NOT_FOUND)

    def device_get_uuid(self, handle: DeviceHandle) -> str:
        if isinstance(handle, SimulatedMigDeviceHandle):
            return self._mig_device(handle, "device_get_uuid").uuid
        return self._gpu(handle, "device_get_uuid").uuid

    def device_get_name(self, handle: DeviceHandle) -> str:
        return self._gpu(handle, "device_get_name").model.name

    def device_get_brand(self, handle: DeviceHandle) -> int:
        return self._gpu(handle, "device_get_brand").model.brand

    def device_get_architecture(self, handle: DeviceHandle) -> int:
        return self._gpu(handle, "device_get_architecture").model.architecture

    def device_get_cuda_compute_capability(self, handle: DeviceHandle) -> tuple[int, int]:
        return self._gpu(handle, "device_get_cuda_compute_capability").model.cuda_compute_capability

    def device_get_minor_number(self, handle: DeviceHandle) -> int:
        return self._gpu(handle, "device_get_minor_number").minor

    def device_get_pci_info(self, handle: DeviceHandle) -> PciInfo:
        gpu = self._gpu(handle, "device_get_pci_info")
        domain_text, bus_text, rest = gpu.bus_id.split(":")
        domain, bus, device = int(domain_text, 16), int(bus_text, 16), int(rest.split(".")[0], 16)
        info: PciInfo = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id
        info.busIdLegacy = f"{domain:04X}:{bus:02X}:{device:02X}.0"
        info.domain = domain
        info.bus = bus
        info.device = device
        info.pciDeviceId = gpu.model.pci_device_id
        info.pciSubSystemId = gpu.model.pci_subsystem_id
        return info

    def device_get_memory_info(self, handle: DeviceHandle) -> MemoryInfo:
        if isinstance(handle, SimulatedMigDeviceHandle):
            ci = self._mig_device(handle, "device_get_memory_info")
            return _memory(ci.gpu_instance.profile.memory_mib, self.utilization.get(ci.uuid))
        gpu = self._gpu(handle, "device_get_memory_info")
        if gpu.model.memory_total_mib is None:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        return _memory(gpu.model.memory_total_mib, self.utilization.get(gpu.uuid))

    def device_get_numa_node_id(self, handle: DeviceHandle) -> int:
        gpu = self._gpu(handle, "device_get_numa_node_id")
        if gpu.gpu_numa_node_id is None:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        return gpu.gpu_numa_node_id

    def device_get_addressing_mode(self, handle: DeviceHandle) -> int:
        gpu = self._gpu(handle, "device_get_addressing_mode")
        if gpu.addressing_mode is None:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        return gpu.addressing_mode

    def device_get_mig_mode(self, handle: DeviceHandle) -> list[int]:
        state = self._mig_state(handle, "device_get_mig_mode")
        return [state.current, state.pending]

    def device_set_mig_mode(self, handle: DeviceHandle, mode: int) -> int:
        state = self._mig_state(handle, "device_set_mig_mode")
        architecture = self.profile.gpus[self._index(handle)].model.architecture
        status = state.set_mode(mode, resetless=architecture >= NVML_DEVICE_ARCH_HOPPER)
        self._mig_changed()
        return status

    def device_get_compute_mode(self, handle: DeviceHandle) -> int:
        if isinstance(handle, SimulatedMigDeviceHandle):
            self._mig_device(handle, "device_get_compute_mode")
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        return self._compute_modes[self._gpu(handle, "device_get_compute_mode").index]

    def device_set_compute_mode(self, handle: DeviceHandle, mode: int) -> None:
        if isinstance(handle, SimulatedMigDeviceHandle):
            self._mig_device(handle, "device_set_compute_mode")
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        gpu = self._gpu(handle, "device_set_compute_mode")
        allowed = (
            NVML_COMPUTEMODE_DEFAULT,
            NVML_COMPUTEMODE_PROHIBITED,
            NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        )
        if mode not in allowed:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        if mode == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS and self._mig[gpu.index].enabled:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        self._compute_modes[gpu.index] = mode

    def device_get_memory_limits(self, handle: DeviceHandle, cgroup: str) -> MemoryLimits:
        """No limits are ever set (NotFound) on a driver of the 615 branch or newer; older
        drivers' libraries lack the function; MIG devices are NotSupported (nvml.h)."""
        if isinstance(handle, SimulatedMigDeviceHandle):
            self._mig_device(handle, "device_get_memory_limits")
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        self._gpu(handle, "device_get_memory_limits")
        if not cgroup.startswith("/"):
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        if _driver_branch(self.profile.driver_version) < MEMORY_LIMITS_DRIVER_BRANCH:
            raise nvml_error(NVML_ERROR_FUNCTION_NOT_FOUND)
        raise nvml_error(NVML_ERROR_NOT_FOUND)

    def reset_gpu(self, handle: DeviceHandle) -> None:
        """Simulator only: a GPU reset (``nvidia-smi -r``, reboot); the pending MIG mode applies
        and every GPU and compute instance is gone, as on real hardware."""
        gpu = self._gpu(handle, "reset_gpu")
        state = self._mig[gpu.index]
        with state.lock:
            for gi in list(state.gpu_instances.values()):
                for ci in list(gi.compute_instances.values()):
                    self._forget_compute_instance(ci)
                with self._handles_lock:
                    self._gi_handles.pop(gi, None)
            state.reset()
        self._mig_changed()

    def device_get_gpu_instance_profile_info(
        self, handle: DeviceHandle, profile: int, version: int = 2
    ) -> GpuInstanceProfileInfo:
        state = self._mig_state(handle, "device_get_gpu_instance_profile_info")
        if version not in (1, 2):
            raise nvml_error(NVML_ERROR_FUNCTION_NOT_FOUND)
        if not 0 <= profile < NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        found = None if state.geometry is None else state.geometry.by_index(profile)
        if found is None:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        info: GpuInstanceProfileInfo
        if version == 2:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = f"MIG {found.name}"  # type: ignore[attr-defined]
        else:
            info = pynvml.c_nvmlGpuInstanceProfileInfo_t()
        info.id = found.id
        info.isP2pSupported = 0
        info.sliceCount = found.slice_count
        info.instanceCount = found.instance_count
        info.multiprocessorCount = found.multiprocessors
        info.copyEngineCount = found.copy_engines
        info.decoderCount = found.decoders
        info.encoderCount = found.encoders
        info.jpegCount = found.jpegs
        info.ofaCount = found.ofas
        info.memorySizeMB = found.memory_mib
        return info

    def device_get_gpu_instance_possible_placements(
        self, handle: DeviceHandle, profile_id: int
    ) -> list[GpuInstancePlacement]:
        state = self._mig_state(handle, "device_get_gpu_instance_possible_placements")
        found = state.profile(profile_id, unknown=NVML_ERROR_NOT_SUPPORTED)
        return [_placement(start, found.placement_size) for start in found.placement_starts]

    def device_get_gpu_instance_remaining_capacity(
        self, handle: DeviceHandle, profile_id: int
    ) -> int:
        state = self._mig_state(handle, "device_get_gpu_instance_remaining_capacity")
        return state.remaining_capacity(profile_id)

    def device_create_gpu_instance(
        self, handle: DeviceHandle, profile_id: int
    ) -> GpuInstanceHandle:
        state = self._mig_state(handle, "device_create_gpu_instance")
        gi = state.create_gpu_instance(profile_id)
        self._mig_changed()
        return self._gi_handle(self._index(handle), gi)

    def device_create_gpu_instance_with_placement(
        self, handle: DeviceHandle, profile_id: int, placement: GpuInstancePlacement
    ) -> GpuInstanceHandle:
        state = self._mig_state(handle, "device_create_gpu_instance_with_placement")
        gi = state.create_gpu_instance(profile_id, (placement.start, placement.size))
        self._mig_changed()
        return self._gi_handle(self._index(handle), gi)

    def device_get_gpu_instances(
        self, handle: DeviceHandle, profile_id: int
    ) -> list[GpuInstanceHandle]:
        state = self._mig_state(handle, "device_get_gpu_instances")
        state.require_enabled()
        state.profile(profile_id, unknown=NVML_ERROR_INVALID_ARGUMENT)
        index = self._index(handle)
        with state.lock:
            return [
                self._gi_handle(index, gi)
                for _, gi in sorted(state.gpu_instances.items())
                if gi.profile.id == profile_id
            ]

    def device_get_gpu_instance_by_id(self, handle: DeviceHandle, gi_id: int) -> GpuInstanceHandle:
        state = self._mig_state(handle, "device_get_gpu_instance_by_id")
        state.require_enabled()
        gi = state.gpu_instances.get(gi_id)
        if gi is None:
            raise nvml_error(NVML_ERROR_NOT_FOUND)
        return self._gi_handle(self._index(handle), gi)

    def gpu_instance_get_info(self, gpu_instance: GpuInstanceHandle) -> GpuInstanceInfo:
        index, gi = self._gpu_instance(gpu_instance, "gpu_instance_get_info")
        return SimulatedGpuInstanceInfo(
            device=self._handles[index],
            id=gi.id,
            profileId=gi.profile.id,
            placement=_placement(gi.start, gi.profile.placement_size),
        )

    def gpu_instance_get_compute_instance_profile_info(
        self, gpu_instance: GpuInstanceHandle, profile: int, eng_profile: int, version: int = 2
    ) -> ComputeInstanceProfileInfo:
        _, gi = self._gpu_instance(gpu_instance, "gpu_instance_get_compute_instance_profile_info")
        if version not in (1, 2):
            raise nvml_error(NVML_ERROR_FUNCTION_NOT_FOUND)
        if (
            not 0 <= profile < NVML_COMPUTE_INSTANCE_PROFILE_COUNT
            or eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        ):
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        if profile != full_compute_instance_profile(gi.profile):
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)  # only the full CI is simulated
        info: ComputeInstanceProfileInfo
        if version == 2:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            info.name = f"MIG {gi.profile.name}"  # type: ignore[attr-defined]
        else:
            info = pynvml.c_nvmlComputeInstanceProfileInfo_t()
        info.id = profile
        info.sliceCount = gi.profile.slice_count
        info.instanceCount = 1
        info.multiprocessorCount = gi.profile.multiprocessors
        info.sharedCopyEngineCount = gi.profile.copy_engines
        info.sharedDecoderCount = gi.profile.decoders
        info.sharedEncoderCount = gi.profile.encoders
        info.sharedJpegCount = gi.profile.jpegs
        info.sharedOfaCount = gi.profile.ofas
        return info

    def gpu_instance_create_compute_instance(
        self, gpu_instance: GpuInstanceHandle, profile_id: int
    ) -> ComputeInstanceHandle:
        index, gi = self._gpu_instance(gpu_instance, "gpu_instance_create_compute_instance")
        if not 0 <= profile_id < NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        ci = self._mig[index].create_compute_instance(gi, profile_id)
        self._mig_changed()
        return self._ci_handle(index, ci)

    def gpu_instance_get_compute_instances(
        self, gpu_instance: GpuInstanceHandle, profile_id: int
    ) -> list[ComputeInstanceHandle]:
        index, gi = self._gpu_instance(gpu_instance, "gpu_instance_get_compute_instances")
        if not 0 <= profile_id < NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        with self._mig[index].lock:
            return [
                self._ci_handle(index, ci)
                for _, ci in sorted(gi.compute_instances.items())
                if ci.profile_id == profile_id
            ]

    def gpu_instance_get_compute_instance_by_id(
        self, gpu_instance: GpuInstanceHandle, ci_id: int
    ) -> ComputeInstanceHandle:
        index, gi = self._gpu_instance(gpu_instance, "gpu_instance_get_compute_instance_by_id")
        if not 0 <= ci_id < MAX_COMPUTE_INSTANCES_PER_GI:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        ci = gi.compute_instances.get(ci_id)
        if ci is None:
            raise nvml_error(NVML_ERROR_NOT_FOUND)
        return self._ci_handle(index, ci)

    def compute_instance_get_info(
        self, compute_instance: ComputeInstanceHandle
    ) -> ComputeInstanceInfo:
        index, ci = self._compute_instance(compute_instance, "compute_instance_get_info")
        return SimulatedComputeInstanceInfo(
            device=self._mig_handle(index, ci),
            gpuInstance=self._gi_handle(index, ci.gpu_instance),
            id=ci.id,
            profileId=ci.profile_id,
            placement=_placement(0, ci.gpu_instance.profile.slice_count),
        )

    def compute_instance_destroy(self, compute_instance: ComputeInstanceHandle) -> None:
        index, ci = self._compute_instance(compute_instance, "compute_instance_destroy")
        self._mig[index].destroy_compute_instance(ci)
        self._forget_compute_instance(ci)
        self._mig_changed()

    def gpu_instance_destroy(self, gpu_instance: GpuInstanceHandle) -> None:
        index, gi = self._gpu_instance(gpu_instance, "gpu_instance_destroy")
        self._mig[index].destroy_gpu_instance(gi)
        with self._handles_lock:
            self._gi_handles.pop(gi, None)
        self._mig_changed()

    def device_get_max_mig_device_count(self, handle: DeviceHandle) -> int:
        gpu = self._gpu(handle, "device_get_max_mig_device_count")
        state = self._mig[gpu.index]
        if state.geometry is None or not state.enabled:
            return 0
        return state.geometry.max_devices

    def device_get_mig_device_handle_by_index(
        self, handle: DeviceHandle, index: int
    ) -> DeviceHandle:
        state = self._mig_state(handle, "device_get_mig_device_handle_by_index")
        maximum = state.geometry.max_devices if state.geometry and state.enabled else 0
        if not 0 <= index < maximum:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        devices = state.mig_devices()
        if index >= len(devices):
            raise nvml_error(NVML_ERROR_NOT_FOUND)
        return self._mig_handle(self._index(handle), devices[index])

    def device_get_device_handle_from_mig_device_handle(self, handle: DeviceHandle) -> DeviceHandle:
        if not isinstance(handle, SimulatedMigDeviceHandle):
            self._gpu(handle, "device_get_device_handle_from_mig_device_handle")
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        self._mig_device(handle, "device_get_device_handle_from_mig_device_handle")
        return self._handles[handle.index]

    def device_is_mig_device_handle(self, handle: DeviceHandle) -> bool:
        if isinstance(handle, SimulatedMigDeviceHandle):
            self._mig_device(handle, "device_is_mig_device_handle")
            return True
        self._gpu(handle, "device_is_mig_device_handle")
        return False

    def device_get_gpu_instance_id(self, handle: DeviceHandle) -> int:
        if not isinstance(handle, SimulatedMigDeviceHandle):
            self._gpu(handle, "device_get_gpu_instance_id")
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        return self._mig_device(handle, "device_get_gpu_instance_id").gpu_instance.id

    def device_get_compute_instance_id(self, handle: DeviceHandle) -> int:
        if not isinstance(handle, SimulatedMigDeviceHandle):
            self._gpu(handle, "device_get_compute_instance_id")
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        return self._mig_device(handle, "device_get_compute_instance_id").id

    def _mig_state(self, handle: DeviceHandle, call: str) -> MigState:
        gpu = self._gpu(handle, call)
        if not gpu.model.mig_capable:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        return self._mig[gpu.index]

    def _index(self, handle: DeviceHandle) -> int:
        assert isinstance(handle, SimulatedDeviceHandle)
        return handle.index

    def _gi_handle(self, index: int, gi: GpuInstance) -> SimulatedGpuInstanceHandle:
        with self._handles_lock:
            handle = self._gi_handles.get(gi)
            if handle is None:
                handle = self._gi_handles[gi] = SimulatedGpuInstanceHandle(self, index, gi)
            return handle

    def _ci_handle(self, index: int, ci: ComputeInstance) -> SimulatedComputeInstanceHandle:
        with self._handles_lock:
            handle = self._ci_handles.get(ci)
            if handle is None:
                handle = self._ci_handles[ci] = SimulatedComputeInstanceHandle(self, index, ci)
            return handle

    def _mig_handle(self, index: int, ci: ComputeInstance) -> SimulatedMigDeviceHandle:
        with self._handles_lock:
            handle = self._mig_handles.get(ci)
            if handle is None:
                handle = self._mig_handles[ci] = SimulatedMigDeviceHandle(self, index, ci)
            return handle

    def _forget_compute_instance(self, ci: ComputeInstance) -> None:
        with self._handles_lock:
            self._ci_handles.pop(ci, None)
            self._mig_handles.pop(ci, None)

    def _gpu_instance(self, handle: GpuInstanceHandle, call: str) -> tuple[int, GpuInstance]:
        if (
            not isinstance(handle, SimulatedGpuInstanceHandle)
            or handle._owner is not self
            or not handle.instance.alive
        ):
            self._initialized()
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        self._gpu(self._handles[handle.index], call)
        return handle.index, handle.instance

    def _compute_instance(
        self, handle: ComputeInstanceHandle, call: str
    ) -> tuple[int, ComputeInstance]:
        if (
            not isinstance(handle, SimulatedComputeInstanceHandle)
            or handle._owner is not self
            or not handle.instance.alive
        ):
            self._initialized()
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        self._gpu(self._handles[handle.index], call)
        return handle.index, handle.instance

    def _mig_device(self, handle: SimulatedMigDeviceHandle, call: str) -> ComputeInstance:
        if handle._owner is not self or not handle.instance.alive:
            self._initialized()
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        self._gpu(self._handles[handle.index], call)
        return handle.instance

    def _initialized(self) -> None:
        if not self.initialized:
            raise nvml_error(NVML_ERROR_UNINITIALIZED)

    def _system(self, call: str) -> None:
        if not self.initialized:
            raise nvml_error(NVML_ERROR_UNINITIALIZED)
        fault = self._fault(call)
        if fault is not None:
            raise nvml_error(fault)

    def _gpu(self, handle: DeviceHandle, call: str) -> SimulatedGpu:
        if not self.initialized:
            raise nvml_error(NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, SimulatedDeviceHandle) or handle._owner is not self:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.profile.gpus[handle.index]
        if gpu.index in self._lost:
            raise nvml_error(NVML_ERROR_GPU_IS_LOST)
        fault = self._fault(call, gpu)
        if fault is not None:
            raise nvml_error(fault)
        return gpu


MEMORY_LIMITS_DRIVER_BRANCH: Final = 615
"""The first driver branch with per-cgroup GPU memory limits (``nvmlDeviceGetMemoryLimits_v1``)."""


def _driver_branch(version: str) -> int:
    """``615`` of ``"615.71.09"``; 0 when unreadable."""
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def _memory(total_mib: int, activity: DeviceActivity) -> MemoryInfo:
    memory: MemoryInfo = pynvml.c_nvmlMemory_t()
    memory.total = total_mib * _MIB
    memory.used = activity.used_bytes(memory.total)
    memory.free = memory.total - memory.used
    return memory


def _placement(start: int, size: int) -> GpuInstancePlacement:
    placement: GpuInstancePlacement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    return placement


class SimulatedPciTopology:
    """`PciTopology` from the profile's ``pcieRoot`` and ``numaNode`` entries."""

    def __init__(self, profile: MachineProfile) -> None:
        self._gpus = {short_pci_bus_id(gpu.bus_id): gpu for gpu in profile.gpus}

    def pcie_root(self, pci_bus_id: str) -> str | None:
        gpu = self._gpus.get(pci_bus_id)
        return None if gpu is None else gpu.pcie_root

    def numa_node(self, pci_bus_id: str) -> int | None:
        gpu = self._gpus.get(pci_bus_id)
        return None if gpu is None else gpu.numa_node


@dataclass(frozen=True)
class SimulatedHost:
    """A simulated node: its profile, NVML and PCI topology."""

    profile: MachineProfile
    nvml: SimulatedNvml
    pci: SimulatedPciTopology

    @classmethod
    def from_profile(
        cls,
        profile: MachineProfile,
        *,
        saved_mig: Mapping[str, object] | None = None,
        on_mig_change: Callable[[MigSnapshot], None] | None = None,
    ) -> SimulatedHost:
        """A host over `profile`; `saved_mig` and `on_mig_change` as `SimulatedNvml` takes them."""
        nvml = SimulatedNvml(profile, saved_mig=saved_mig, on_mig_change=on_mig_change)
        return cls(profile, nvml, SimulatedPciTopology(profile))

    @classmethod
    def load(
        cls,
        spec: str,
        node_name: str,
        *,
        saved_mig: Mapping[str, object] | None = None,
        on_mig_change: Callable[[MigSnapshot], None] | None = None,
    ) -> SimulatedHost:
        """`load_profile(spec, node_name)` wired into a host; raises `ProfileError` (and
        `MigSnapshotError` for a `saved_mig` that does not fit)."""
        return cls.from_profile(
            load_profile(spec, node_name), saved_mig=saved_mig, on_mig_change=on_mig_change
        )


if TYPE_CHECKING:
    _conforms_to_nvml: type[NvmlLibrary] = SimulatedNvml
    _conforms_to_pci: type[PciTopology] = SimulatedPciTopology
