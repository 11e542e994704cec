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


@dataclass(frozen=True)
class MigResources:
    """What a GPU-instance profile gives each of its instances (from
    ``nvmlDeviceGetGpuInstanceProfileInfo``): shared by MIG devices and the profiles themselves."""

    memory_bytes: int
    """The profile's ``memorySizeMB`` (MiB) in bytes."""
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int


@dataclass(frozen=True)
class MigDevice(MigResources):
    """One existing MIG device (a GPU instance and its compute instance) of a GPU in MIG mode.

    Static MIG: created before the driver started (by an admin or mig-parted) and discovered
    through NVML. Sizes come from the GPU-instance profile, as NVIDIA's driver publishes them.
    """

    parent: Gpu
    """The physical GPU; its MIG mode is on, so it is not offered whole."""
    profile: str
    """go-nvlib profile name: ``1g.10gb``, ``1g.10gb+me``, ``1c.3g.40gb`` (CI smaller than GI)."""
    gi_profile_id: int
    """GPU-instance profile *ID* (``info.id``: 19 for 1g on 8-slice parts), as in device names."""
    placement_start: int
    """First memory slice of the GPU instance."""
    placement_size: int
    """Memory slices it spans (8 for a 7g, 4 for a 3g, 2 for a 1g.REV2)."""
    gi_id: int
    """Driver-assigned GPU-instance id (0..14), not a function of the placement."""
    ci_id: int
    """Compute-instance id within the GPU instance (0 for the first)."""
    ci_profile_id: int
    """``NVML_COMPUTE_INSTANCE_PROFILE_*`` of the compute instance."""
    uuid: str
    """``MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""

    @property
    def memory_slices(self) -> range:
        """The memory slices of the placement: ``start .. start+size-1``."""
        return range(self.placement_start, self.placement_start + self.placement_size)


@dataclass(frozen=True)
class NodeDevices:
    """Everything discovery found on a node."""

    gpus: tuple[Gpu, ...]
    """Every GPU in NVML index order, MIG parents included (`Gpu.mig_enabled` tells them apart)."""
    mig_devices: tuple[MigDevice, ...] = ()
    """The existing MIG devices of the GPUs in MIG mode, by parent index, then placement."""
    mig_profiles: tuple[MigCapableGpu, ...] = ()
    """The MIG-capable GPUs with their GPU-instance profiles (read for dynamic MIG only)."""
    problems: tuple[GpuProblem, ...] = ()
    """The GPUs NVML could not describe, in NVML index order: they are in none of the fields
    above (not published), and each says why."""


@dataclass(frozen=True)
class GpuProblem:
    """A GPU that discovery leaves out because NVML could not describe it (an NVML error, or
    answers that cannot be used, e.g. MIG on but no GPU-instance profile)."""

    index: int
    """NVML index."""
    pci_bus_id: str | None
    """``0000:1b:00.0``; None when ``nvmlDeviceGetPciInfo`` itself failed."""
    uuid: str | None
    """``GPU-...``; None when it was not read (yet)."""
    call: str | None
    """The NVML function whose answer made the GPU unusable (``nvmlDeviceGetMigMode``)."""
    reason: str
    """The NVML return code name (``NVML_ERROR_GPU_IS_LOST``), or ``UNUSABLE_ANSWER`` when
    every call succeeded but the answers cannot be used."""
    message: str
    """The whole sentence: the GPU, the call, NVML's text and the return code name."""


@dataclass(frozen=True)
class MigProfile(MigResources):
    """One GPU-instance profile of a MIG-capable GPU, as dynamic MIG offers it.

    From ``nvmlDeviceGetGpuInstanceProfileInfo`` and ``...PossiblePlacements``; only the full
    compute instance (C == G) is offered, so `name` never has a ``<C>c.`` part.
    """

    name: str
    """go-nvlib profile name: ``1g.10gb``, ``1g.10gb+me``, ``3g.40gb``."""
    gi_profile_id: int
    """GPU-instance profile *ID* (``info.id``: 19 for 1g on 8-slice parts), as in device names."""
    gi_profile_index: int
    """``NVML_GPU_INSTANCE_PROFILE_*`` index (``nvmlDeviceGetGpuInstanceProfileInfo`` argument)."""
    slice_count: int
    """Compute slices (the G of ``<G>g``)."""
    placement_starts: tuple[int, ...]
    """Every possible placement's first memory slice, ascending."""
    placement_size: int
    """Memory slices one instance spans (8 for a 7g, 4 for a 3g, 2 for a 1g.REV2)."""


@dataclass(frozen=True)
class MigPartition:
    """One possible placement of one MIG profile on a GPU: a MIG device that can be made on demand.

    Dynamic MIG publishes every partition of every MIG-capable GPU as a partitionable device (see
    `gpu_dra.driver.partitions`); the GPU instance exists only while a claim holds it, so a
    partition has no ``MIG-`` UUID of its own. Named like the static MIG device it becomes:
    ``gpu-<parent minor>-mig-<profile slug>-<GI profile ID>-<placement start>``.
    """

    parent: Gpu
    """The physical GPU the instance is (to be) made on."""
    profile: MigProfile
    """The GPU-instance profile; `gi_profile_id` and `profile_name` are shortcuts into it."""
    placement_start: int
    """First memory slice of the placement (one of `MigProfile.placement_starts`)."""

    @property
    def gi_profile_id(self) -> int:
        return self.profile.gi_profile_id

    @property
    def profile_name(self) -> str:
        return self.profile.name

    @property
    def placement_size(self) -> int:
        return self.profile.placement_size

    @property
    def memory_slices(self) -> range:
        """The memory slices of the placement: ``start .. start+size-1``."""
        return range(self.placement_start, self.placement_start + self.placement_size)


@dataclass(frozen=True)
class MigCapableGpu:
    """A MIG-capable GPU with the GPU-instance profiles it offers (dynamic MIG)."""

    gpu: Gpu
    profiles: tuple[MigProfile, ...]
    """By profile index, i.e. NVML's ``NVML_GPU_INSTANCE_PROFILE_*`` order."""

    @property
    def memory_slices(self) -> int:
        """Memory slices of the GPU: the largest placement size (8 on A100/H100/H200, 4 on A30)."""
        return max((profile.placement_size for profile in self.profiles), default=0)

    def partitions(self) -> list[MigPartition]:
        """Every (profile, possible placement), by profile order, then placement start."""
        return [
            MigPartition(self.gpu, profile, start)
            for profile in self.profiles
            for start in profile.placement_starts
        ]
