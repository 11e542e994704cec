"""Whole-GPU discovery: NVML and PCI topology in, `Gpu` values out.

Pure apart from the calls on the injected `NvmlLibrary` and `PciTopology`. Optional facts that
NVML does not support on a GPU (memory size, MIG mode, addressing mode) are left out; any other
NVML failure raises `DiscoveryError` naming the GPU and the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

from gpu_dra.driver.model import Gpu
from gpu_dra.driver.nvml.interface import (
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_INIT_FLAG_NO_GPUS,
    DeviceHandle,
    NVMLError,
    NvmlLibrary,
    PciTopology,
    return_code,
    return_code_name,
    short_pci_bus_id,
)

_T = TypeVar("_T")

# "This GPU or this libnvidia-ml cannot answer": the fact is omitted, as NVIDIA's driver does.
_ABSENT = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND})


class DiscoveryError(RuntimeError):
    """NVML could not describe the node's GPUs; the message names the GPU and the failed call."""

    def __init__(self, message: str, *, gpu_index: int | None = None) -> None:
        super().__init__(message)
        self.gpu_index = gpu_index


def discover_gpus(nvml: NvmlLibrary, pci: PciTopology) -> list[Gpu]:
    """All GPUs NVML sees, in NVML index (PCI bus) order.

    Initialises NVML with ``NVML_INIT_FLAG_NO_GPUS`` (a node without GPUs yields ``[]``) and shuts
    it down again; NVML counts initialisations, so callers may hold their own.
    """
    try:
        nvml.init_with_flags(NVML_INIT_FLAG_NO_GPUS)
    except NVMLError as error:
        raise DiscoveryError(
            f"cannot initialise NVML: {_describe(error)}; check that the NVIDIA driver is loaded "
            "and that the driver root setting points at its installation"
        ) from error
    try:
        gpus = _read_gpus(nvml, pci)
    except BaseException:
        with contextlib.suppress(NVMLError):  # the error being raised says what went wrong
            nvml.shutdown()
        raise
    try:
        nvml.shutdown()
    except NVMLError as error:
        raise DiscoveryError(f"cannot shut NVML down: {_describe(error)}") from error
    return gpus


def _read_gpus(nvml: NvmlLibrary, pci: PciTopology) -> list[Gpu]:
    driver_version = _system(nvml.system_get_driver_version, "nvmlSystemGetDriverVersion")
    cuda_version = _system(nvml.system_get_cuda_driver_version, "nvmlSystemGetCudaDriverVersion")
    count = _system(nvml.device_get_count, "nvmlDeviceGetCount")
    return [_read_gpu(nvml, pci, index, driver_version, cuda_version) for index in range(count)]


def _read_gpu(
    nvml: NvmlLibrary, pci: PciTopology, index: int, driver_version: str, cuda_version: int
) -> Gpu:
    where = f"GPU {index}"
    handle = _device(
        where, index, "nvmlDeviceGetHandleByIndex", lambda: nvml.device_get_handle_by_index(index)
    )
    pci_info = _device(
        where, index, "nvmlDeviceGetPciInfo", lambda: nvml.device_get_pci_info(handle)
    )
    bus_id = short_pci_bus_id(pci_info.busId)
    where = f"GPU {index} ({bus_id})"

    def required(call: str, getter: Callable[[DeviceHandle], _T]) -> _T:
        return _device(where, index, call, lambda: getter(handle))

    def optional(call: str, getter: Callable[[DeviceHandle], _T]) -> _T | None:
        try:
            return getter(handle)
        except NVMLError as error:
            if return_code(error) in _ABSENT:
                return None
            raise _gpu_error(where, index, call, error) from error

    memory = optional("nvmlDeviceGetMemoryInfo", nvml.device_get_memory_info)
    mig_mode = optional("nvmlDeviceGetMigMode", nvml.device_get_mig_mode)
    return Gpu(
        index=index,
        minor=required("nvmlDeviceGetMinorNumber", nvml.device_get_minor_number),
        uuid=required("nvmlDeviceGetUUID", nvml.device_get_uuid),
        product_name=required("nvmlDeviceGetName", nvml.device_get_name),
        brand=required("nvmlDeviceGetBrand", nvml.device_get_brand),
        architecture=required("nvmlDeviceGetArchitecture", nvml.device_get_architecture),
        cuda_compute_capability=required(
            "nvmlDeviceGetCudaComputeCapability", nvml.device_get_cuda_compute_capability
        ),
        driver_version=driver_version,
        cuda_driver_version=cuda_version,
        pci_bus_id=bus_id,
        pci_device_id=pci_info.pciDeviceId,
        pcie_root=pci.pcie_root(bus_id),
        numa_node=pci.numa_node(bus_id),
        memory_bytes=None if memory is None else memory.total,
        addressing_mode=optional("nvmlDeviceGetAddressingMode", nvml.device_get_addressing_mode),
        mig_capable=mig_mode is not None,
        mig_enabled=mig_mode is not None and mig_mode[0] == NVML_DEVICE_MIG_ENABLE,
        mig_pending_enabled=mig_mode is not None and mig_mode[1] == NVML_DEVICE_MIG_ENABLE,
    )


def _system(getter: Callable[[], _T], call: str) -> _T:
    try:
        return getter()
    except NVMLError as error:
        raise DiscoveryError(f"{call} failed: {_describe(error)}") from error


def _device(where: str, index: int, call: str, getter: Callable[[], _T]) -> _T:
    try:
        return getter()
    except NVMLError as error:
        raise _gpu_error(where, index, call, error) from error


def _gpu_error(where: str, index: int, call: str, error: Exception) -> DiscoveryError:
    return DiscoveryError(f"{where}: {call} failed: {_describe(error)}", gpu_index=index)


def _describe(error: Exception) -> str:
    code = return_code(error)
    text = str(error) if code is None else f"{error} ({return_code_name(code)})"
    notes = getattr(error, "__notes__", None)
    return f"{text}; {'; '.join(notes)}" if notes else text
