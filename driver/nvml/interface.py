"""The NVML subset gpu-dra uses, as a Protocol, plus the NVML error vocabulary.

Method names are the pynvml function names without the ``nvml`` prefix, in snake_case
(``nvmlDeviceGetUUID`` -> ``device_get_uuid``); arguments, return types and raised exceptions are
pynvml's. New calls (MIG create/destroy, events) are added the same way.

Errors are pynvml's own classes: ``pynvml.NVMLError(code)`` instantiates the subclass for the code
(``NVMLError_NotSupported`` for 3) and keeps the code in ``.value``. pynvml is imported only for
these classes and constants; it loads libnvidia-ml on ``nvmlInit``, never on import.
"""

from __future__ import annotations

from typing import Final, Protocol

import pynvml

DeviceHandle = object
"""Opaque device handle: pynvml's ``c_nvmlDevice_t`` or a simulator's handle."""

# Exception classes (typed as plain exception classes; pynvml has no type hints).
NVMLError: Final[type[Exception]] = pynvml.NVMLError
NVMLError_Uninitialized: Final[type[Exception]] = pynvml.NVMLError_Uninitialized
NVMLError_InvalidArgument: Final[type[Exception]] = pynvml.NVMLError_InvalidArgument
NVMLError_NotSupported: Final[type[Exception]] = pynvml.NVMLError_NotSupported
NVMLError_NotFound: Final[type[Exception]] = pynvml.NVMLError_NotFound

# Return codes (nvml.h).
NVML_ERROR_UNINITIALIZED: Final[int] = pynvml.NVML_ERROR_UNINITIALIZED
NVML_ERROR_INVALID_ARGUMENT: Final[int] = pynvml.NVML_ERROR_INVALID_ARGUMENT
NVML_ERROR_NOT_SUPPORTED: Final[int] = pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NOT_FOUND: Final[int] = pynvml.NVML_ERROR_NOT_FOUND
NVML_ERROR_FUNCTION_NOT_FOUND: Final[int] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND

NVML_INIT_FLAG_NO_GPUS: Final[int] = pynvml.NVML_INIT_FLAG_NO_GPUS
NVML_DEVICE_MIG_DISABLE: Final[int] = pynvml.NVML_DEVICE_MIG_DISABLE
NVML_DEVICE_MIG_ENABLE: Final[int] = pynvml.NVML_DEVICE_MIG_ENABLE


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
        """Handle by ``GPU-...`` UUID; NotFound when no GPU has it."""

    def device_get_uuid(self, handle: DeviceHandle) -> str:
        """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""

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
        """Frame-buffer memory in bytes; NotSupported on some integrated parts."""

    def device_get_numa_node_id(self, handle: DeviceHandle) -> int:
        """NUMA node of the GPU's own memory; NotSupported on x86 (only Grace systems have one)."""

    def device_get_addressing_mode(self, handle: DeviceHandle) -> int:
        """``NVML_DEVICE_ADDRESSING_MODE_*`` (0 None, 1 HMM, 2 ATS); NotSupported on most x86."""

    def device_get_mig_mode(self, handle: DeviceHandle) -> list[int]:
        """[current, pending], each ``NVML_DEVICE_MIG_*``; NotSupported on GPUs without MIG."""


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
