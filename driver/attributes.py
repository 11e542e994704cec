"""`Gpu` / `MigDevice` -> the `resourceapi.Device` NVIDIA's driver publishes (nvidia-compat.md §3).

Bare attribute names (``productName``) live in the driver's own domain (``gpu.nvidia.com`` unless
configured otherwise; see `qualified_name`); the PCI/NUMA ones are in the standard
``resource.kubernetes.io`` domain. Values respect the API limits: strings and versions at most 64
characters, at most 32 attributes and capacities per device.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final, Protocol

from gpu_dra.driver.model import Gpu, MigDevice, MigPartition
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME, gpu_device_name, mig_device_name
from gpu_dra.driver.resourceapi import (
    STANDARD_ATTRIBUTE_DOMAIN,
    Device,
    DeviceAttribute,
    DeviceCapacity,
)

MAX_STRING_LENGTH: Final = 64
MAX_ATTRIBUTES_AND_CAPACITIES: Final = 32

PCI_BUS_ID: Final = f"{STANDARD_ATTRIBUTE_DOMAIN}/pciBusID"
PCIE_ROOT: Final = f"{STANDARD_ATTRIBUTE_DOMAIN}/pcieRoot"
NUMA_NODE: Final = f"{STANDARD_ATTRIBUTE_DOMAIN}/numaNode"

# go-nvlib GetArchitectureAsString, keyed by NVML_DEVICE_ARCH_*. go-nvlib fails on values it does
# not know (Rubin 13, ...); gpu-dra publishes "Unknown" instead, and likewise for brands.
ARCHITECTURE_NAMES: Final = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    0xFFFFFFFF: "Unknown",
}

# go-nvlib GetBrandAsString, keyed by NVML_BRAND_*.
BRAND_NAMES: Final = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}

# go-nvlib GetAddressingModeAsString, keyed by NVML_DEVICE_ADDRESSING_MODE_*.
ADDRESSING_MODE_NAMES: Final = {0: "None", 1: "HMM", 2: "ATS"}

# What a MIG device copies from its parent GPU's attributes (when the parent has them).
_COPIED_FROM_PARENT: Final = (
    "productName",
    "brand",
    "architecture",
    "cudaComputeCapability",
    "driverVersion",
    "cudaDriverVersion",
    "addressingMode",
    PCI_BUS_ID,
    PCIE_ROOT,
    NUMA_NODE,
)

_BINARY_SUFFIXES: Final = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_VERSION: Final = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?$")


class DeviceAttributeError(ValueError):
    """A value cannot be published as a device attribute; the message names device and attribute."""


def gpu_device(gpu: Gpu) -> Device:
    """The ResourceSlice device for a full GPU: name ``gpu-<minor>``, attributes, ``memory``."""
    name = gpu_device_name(gpu.minor)
    device: Device = {"name": name, "attributes": gpu_attributes(gpu)}
    capacity = gpu_capacity(gpu)
    if capacity:
        device["capacity"] = capacity
    check_limits(device)
    return device


def gpu_attributes(gpu: Gpu) -> dict[str, DeviceAttribute]:
    """Attributes of a full GPU, NVIDIA's names and types; unknown optional facts are left out."""
    where = f"device {gpu_device_name(gpu.minor)}"
    attributes: dict[str, DeviceAttribute] = {
        "type": {"string": "gpu"},
        "uuid": {"string": gpu.uuid},
        "productName": {"string": gpu.product_name},
        "brand": {"string": BRAND_NAMES.get(gpu.brand, "Unknown")},
        "architecture": {"string": ARCHITECTURE_NAMES.get(gpu.architecture, "Unknown")},
        "cudaComputeCapability": {"version": "{}.{}.0".format(*gpu.cuda_compute_capability)},
        "driverVersion": {"version": semver(gpu.driver_version, f"{where}: driverVersion")},
        "cudaDriverVersion": {"version": cuda_driver_semver(gpu.cuda_driver_version)},
        PCI_BUS_ID: {"string": gpu.pci_bus_id},
    }
    if gpu.pcie_root is not None:
        attributes[PCIE_ROOT] = {"string": gpu.pcie_root}
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attributes[NUMA_NODE] = {"int": gpu.numa_node}
    if gpu.addressing_mode in ADDRESSING_MODE_NAMES:
        attributes["addressingMode"] = {"string": ADDRESSING_MODE_NAMES[gpu.addressing_mode]}
    return attributes


def gpu_capacity(gpu: Gpu) -> dict[str, DeviceCapacity]:
    """``memory`` in bytes (BinarySI), left out when NVML does not report it."""
    if gpu.memory_bytes is None:
        return {}
    return {"memory": {"value": binary_si_quantity(gpu.memory_bytes)}}


def mig_device(mig: MigDevice) -> Device:
    """The ResourceSlice device for a static MIG device (nvidia-compat.md §3.2).

    Name ``gpu-<parent minor>-mig-<profile slug>-<GI profile ID>-<placement start>``; attributes
    ``type: mig``, ``uuid`` (``MIG-...``), ``parentUUID``, ``profile`` and the parent's
    product, brand, architecture, versions, PCI bus id, PCIe root, NUMA node and addressing mode;
    capacities from the GPU-instance profile plus ``memorySlice<i> = 1`` per memory slice of the
    placement.
    """
    name = mig_device_name(mig.parent.minor, mig.profile, mig.gi_profile_id, mig.placement_start)
    device: Device = {
        "name": name,
        "attributes": mig_attributes(mig),
        "capacity": mig_capacity(mig),
    }
    check_limits(device)
    return device


def mig_attributes(mig: MigDevice) -> dict[str, DeviceAttribute]:
    """``type``, ``uuid``, ``parentUUID``, ``profile``, then the parent's copied attributes."""
    return _mig_attributes(mig.parent, mig.profile, mig.uuid)


def mig_partition_attributes(partition: MigPartition) -> dict[str, DeviceAttribute]:
    """A dynamic MIG partition's attributes: those of a static MIG device of its profile without
    ``uuid``, since the slice does not exist until a claim is prepared (nvidia-compat.md §3.2)."""
    return _mig_attributes(partition.parent, partition.profile_name, None)


def _mig_attributes(parent: Gpu, profile: str, uuid: str | None) -> dict[str, DeviceAttribute]:
    copied = gpu_attributes(parent)
    attributes: dict[str, DeviceAttribute] = {"type": {"string": "mig"}}
    if uuid is not None:
        attributes["uuid"] = {"string": uuid}
    attributes["parentUUID"] = {"string": parent.uuid}
    attributes["profile"] = {"string": profile}
    for key in _COPIED_FROM_PARENT:
        if key in copied:
            attributes[key] = copied[key]
    return attributes


class MigSizes(Protocol):
    """What a GPU-instance profile provides (`MigDevice` and `MigProfile` both carry it)."""

    @property
    def multiprocessors(self) -> int: ...
    @property
    def copy_engines(self) -> int: ...
    @property
    def decoders(self) -> int: ...
    @property
    def encoders(self) -> int: ...
    @property
    def jpeg_engines(self) -> int: ...
    @property
    def ofa_engines(self) -> int: ...
    @property
    def memory_bytes(self) -> int: ...


def mig_sizes(sizes: MigSizes) -> dict[str, int]:
    """Published capacity name -> amount: SMs, engines and memory (bytes) of a GI profile."""
    return {
        "multiprocessors": sizes.multiprocessors,
        "copyEngines": sizes.copy_engines,
        "decoders": sizes.decoders,
        "encoders": sizes.encoders,
        "jpegEngines": sizes.jpeg_engines,
        "ofaEngines": sizes.ofa_engines,
        "memory": sizes.memory_bytes,
    }


def mig_capacity(mig: MigDevice) -> dict[str, DeviceCapacity]:
    """The GPU-instance profile's SMs, engines and memory, and one ``memorySlice<i>`` per slice."""
    counts = {**mig_sizes(mig), **{f"memorySlice{i}": 1 for i in mig.memory_slices}}
    return quantities(counts)


def quantities(counts: dict[str, int]) -> dict[str, DeviceCapacity]:
    """Capacities from plain amounts, each in canonical BinarySI form."""
    return {key: {"value": binary_si_quantity(value)} for key, value in counts.items()}


def published_devices(gpus: Iterable[Gpu], mig_devices: Iterable[MigDevice] = ()) -> list[Device]:
    """A node's devices as NVIDIA's driver publishes them without dynamic MIG.

    Whole GPUs whose MIG mode is off, and the existing MIG devices; a GPU in MIG mode is not
    offered whole. Ordered by PCI bus id, then placement start (the scheduler takes the first
    match top-down).
    """
    entries: list[tuple[tuple[str, int, int, int], Device]] = [
        ((gpu.pci_bus_id, -1, 0, 0), gpu_device(gpu)) for gpu in gpus if not gpu.mig_enabled
    ]
    entries.extend(
        ((mig.parent.pci_bus_id, mig.placement_start, mig.gi_id, mig.ci_id), mig_device(mig))
        for mig in mig_devices
    )
    return [device for _, device in sorted(entries, key=lambda entry: entry[0])]


def check_limits(device: Device) -> None:
    """Raise `DeviceAttributeError` if `device` breaks the API's per-device limits."""
    attributes = device.get("attributes", {})
    count = len(attributes) + len(device.get("capacity", {}))
    if count > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise DeviceAttributeError(
            f"device {device['name']}: {count} attributes and capacities, "
            f"at most {MAX_ATTRIBUTES_AND_CAPACITIES} allowed"
        )
    for key, attribute in attributes.items():
        text = attribute.get("string", attribute.get("version"))
        if isinstance(text, str) and len(text) > MAX_STRING_LENGTH:
            raise DeviceAttributeError(
                f"device {device['name']}: attribute {key} is {len(text)} characters long, "
                f"at most {MAX_STRING_LENGTH} allowed: {text!r}"
            )


def qualified_name(key: str, driver_name: str = DEFAULT_DRIVER_NAME) -> str:
    """``<domain>/<identifier>`` of an attribute or capacity key (bare keys are the driver's)."""
    return key if "/" in key else f"{driver_name}/{key}"


def semver(version: str, what: str = "version") -> str:
    """Semantic version the way Masterminds semver prints it: ``580.65.06`` -> ``580.65.6``.

    One to three numeric parts; missing parts are 0 (``8.0`` -> ``8.0.0``).
    """
    match = _VERSION.match(version.strip())
    if match is None:
        raise DeviceAttributeError(f"{what}: {version!r} is not a version like 580.95.05")
    return ".".join(str(int(part or "0")) for part in match.groups())


def cuda_driver_semver(version: int) -> str:
    """``nvmlSystemGetCudaDriverVersion`` (``major*1000 + minor*10``) as ``major.minor.0``."""
    return f"{version // 1000}.{version % 1000 // 10}.0"


def binary_si_quantity(value: int) -> str:
    """`value` in Kubernetes' canonical BinarySI form, as the apiserver prints it.

    The largest power-of-1024 suffix that divides exactly: 85899345920 -> ``80Gi``,
    85520809984 -> ``81559Mi``, 1536 -> ``1536`` (never ``1.5Ki``), 512 -> ``512``.
    """
    if value < 0:
        raise ValueError(f"quantity must not be negative, got {value}")
    exponent = 0
    while value >= 1024 and value % 1024 == 0 and exponent < len(_BINARY_SUFFIXES) - 1:
        value //= 1024
        exponent += 1
    return f"{value}{_BINARY_SUFFIXES[exponent]}"
