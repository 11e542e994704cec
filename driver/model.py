"""What the driver knows about a node's devices: frozen values, no behaviour.

Values are as NVML reports them (enums as ints, versions as NVML strings); `attributes` turns them
into the published names and types.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    """One physical GPU, discovered through NVML and the host's PCI topology."""

    index: int
    """NVML index (PCI bus order); changes when GPUs are added or hidden, so not used in names."""
    minor: int
    """N of ``/dev/nvidiaN``; the device is named ``gpu-<minor>``."""
    uuid: str
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    product_name: str
    """``nvmlDeviceGetName``, e.g. ``NVIDIA H100 80GB HBM3``."""
    brand: int
    """``NVML_BRAND_*`` (14 = NVIDIA)."""
    architecture: int
    """``NVML_DEVICE_ARCH_*`` (9 = Hopper)."""
    cuda_compute_capability: tuple[int, int]
    """(major, minor), e.g. (9, 0)."""
    driver_version: str
    """``nvmlSystemGetDriverVersion``, e.g. ``580.65.06``."""
    cuda_driver_version: int
    """``nvmlSystemGetCudaDriverVersion``, ``major*1000 + minor*10``."""
    pci_bus_id: str
    """Lower-case, 4-digit domain: ``0000:1b:00.0`` (the sysfs device name)."""
    pci_device_id: int
    """``(device << 16) | 0x10DE``, e.g. 0x233010DE."""
    pcie_root: str | None = None
    """PCIe root complex ``pci0000:64``; None when the host does not say."""
    numa_node: int | None = None
    """CPU NUMA node of the PCI device; None when the platform has none."""
    memory_bytes: int | None = None
    """Frame-buffer size; None when NVML does not report it."""
    addressing_mode: int | None = None
    """``NVML_DEVICE_ADDRESSING_MODE_*``; None when NVML does not support the query (most x86)."""
    mig_capable: bool = False
    """Whether ``nvmlDeviceGetMigMode`` is supported."""
    mig_enabled: bool = False
    """Current MIG mode."""
    mig_pending_enabled: bool = False
    """MIG mode after the next GPU reset (differs from `mig_enabled` on Ampere until reset)."""
