"""Simulated NVML and PCI topology of a machine profile: a real backend chosen by a setting.

Behaves like NVML where the driver can tell: calls before ``init`` raise
``NVMLError_Uninitialized``, a bad index or a foreign handle ``NVMLError_InvalidArgument``, an
unknown UUID ``NVMLError_NotFound``, MIG and NUMA calls ``NVMLError_NotSupported`` where real
hardware does, and profile ``faults`` inject any NVML error into a chosen call. Return values have
pynvml's types (structs included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import pynvml

from gpu_dra.driver.nvml.interface import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    DeviceHandle,
    MemoryInfo,
    NvmlLibrary,
    PciInfo,
    PciTopology,
    nvml_error,
    short_pci_bus_id,
)
from gpu_dra.driver.nvml.profiles import MachineProfile, SimulatedGpu, load_profile

_MIB: Final = 1024 * 1024


class SimulatedDeviceHandle:
    """Handle returned by `SimulatedNvml`; one object per GPU, like NVML's stable pointers."""

    __slots__ = ("_owner", "index")

    def __init__(self, owner: SimulatedNvml, index: int) -> None:
        self._owner = owner
        self.index = index

    def __repr__(self) -> str:
        return f"<SimulatedDeviceHandle index={self.index}>"


class SimulatedNvml:
    """`NvmlLibrary` over a `MachineProfile`."""

    def __init__(self, profile: MachineProfile) -> None:
        self.profile = profile
        self._init_count = 0
        self._handles = tuple(SimulatedDeviceHandle(self, gpu.index) for gpu in profile.gpus)
        self._mig_modes = {gpu.index: gpu.mig_mode for gpu in profile.gpus}

    @property
    def initialized(self) -> bool:
        """Whether at least one ``init`` has not been matched by ``shutdown``."""
        return self._init_count > 0

    def init(self) -> None:
        self.init_with_flags(0)

    def init_with_flags(self, flags: int) -> None:
        fault = self.profile.fault("init_with_flags") or self.profile.fault("init")
        if fault is not None:
            raise nvml_error(fault)
        if flags < 0:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        self._init_count += 1

    def shutdown(self) -> None:
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
        return self._handles[index]

    def device_get_handle_by_uuid(self, uuid: str) -> DeviceHandle:
        self._system("device_get_handle_by_uuid")
        if not uuid.startswith(("GPU-", "MIG-")):
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        for gpu in self.profile.gpus:
            if gpu.uuid == uuid:
                return self._handles[gpu.index]
        raise nvml_error(NVML_ERROR_NOT_FOUND)

    def device_get_uuid(self, handle: DeviceHandle) -> str:
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
        gpu = self._gpu(handle, "device_get_memory_info")
        if gpu.model.memory_total_mib is None:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        memory: MemoryInfo = pynvml.c_nvmlMemory_t()
        memory.total = gpu.model.memory_total_mib * _MIB
        memory.used = 0
        memory.free = memory.total
        return memory

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
        gpu = self._gpu(handle, "device_get_mig_mode")
        if not gpu.model.mig_capable:
            raise nvml_error(NVML_ERROR_NOT_SUPPORTED)
        return list(self._mig_modes[gpu.index])

    def _system(self, call: str) -> None:
        if not self.initialized:
            raise nvml_error(NVML_ERROR_UNINITIALIZED)
        fault = self.profile.fault(call)
        if fault is not None:
            raise nvml_error(fault)

    def _gpu(self, handle: DeviceHandle, call: str) -> SimulatedGpu:
        if not self.initialized:
            raise nvml_error(NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, SimulatedDeviceHandle) or handle._owner is not self:
            raise nvml_error(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.profile.gpus[handle.index]
        fault = gpu.fault(call)
        if fault is not None:
            raise nvml_error(fault)
        return gpu


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
    def from_profile(cls, profile: MachineProfile) -> SimulatedHost:
        return cls(profile, SimulatedNvml(profile), SimulatedPciTopology(profile))

    @classmethod
    def load(cls, spec: str, node_name: str) -> SimulatedHost:
        """`load_profile(spec, node_name)` wired into a host; raises `ProfileError`."""
        return cls.from_profile(load_profile(spec, node_name))


if TYPE_CHECKING:
    _conforms_to_nvml: type[NvmlLibrary] = SimulatedNvml
    _conforms_to_pci: type[PciTopology] = SimulatedPciTopology
