"""MPS shares through consumable capacity: what is published, what a share is.

A whole GPU offered as MPS shares (``--mps-shares``), a static MIG device
(``--mps-shares-on-mig``) or a dynamic MIG partition (``--mps-shares-on-dynamic-mig``: the MIG
device is made for its first share) is published with ``allowMultipleAllocations: true`` and two
consumable capacities, ``memory`` and ``compute`` (percent of the device's SMs: of the slice's
for a MIG device), whose defaults are an equal part, 1/N of the device (N the node's
``--mps-share-replicas``: `default_share`), so an amount a request does not name is 1/N of it.
Offered devices are share-only: the whole-device DeviceClasses do not select them (they test for the
``compute`` capacity). A share's consumed amounts become its clients' MPS caps. GPUs offered as
capped time-sliced shares (``--capped-shares``) are published the same way plus the attribute
`CAPPED`. Pure: values in, values out. The kubelet plugin decides which devices are offered
(`ShareSelection`, `MigShareSelection`, `PartitionShareSelection`) and reads allocation results back
with `consumed_share`. See docs/mps.md#offering-gpus-as-shares and docs/shares.md.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Final

from gpu_dra.driver.attributes import binary_si_quantity
from gpu_dra.driver.config.quantity import QuantityError, parse_quantity
from gpu_dra.driver.jsonbounds import describe, short_key
from gpu_dra.driver.model import Gpu, MigDevice, MigPartition
from gpu_dra.driver.naming import gpu_device_name, mig_device_name
from gpu_dra.driver.resourceapi import Device, DeviceCapacity

MEMORY: Final = "memory"
"""Capacity: pinned device memory in bytes (BinarySI)."""
COMPUTE: Final = "compute"
"""Capacity: percent of the GPU's SMs, the unit of ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``."""
MIB: Final = 2**20
FULL_COMPUTE: Final = 100
DEFAULT_SHARE_REPLICAS: Final = 4
"""``--mps-share-replicas``: an amount a share does not name is 1/4 of the device (docs/mps.md)."""
MAX_SHARE_REPLICAS: Final = FULL_COMPUTE
"""At most 100 equal parts: each gets at least 1 % of the SMs (the ``compute`` step)."""
VOLTA: Final = 5
"""``NVML_DEVICE_ARCH_VOLTA``: MPS memory and thread caps need Volta or newer (mps.md §11)."""
CAPPED: Final = "cappedShares"
"""Attribute (bool, true) of a GPU offered as capped time-sliced shares (``--capped-shares``):
the same capacities as an MPS-offered GPU, told apart by DeviceClasses (docs/shares.md)."""


SharedDevice = Gpu | MigDevice
"""What an MPS share's daemon serves: a whole GPU (MIG off) or a MIG device (static, or made
from a partition)."""

OfferedDevice = SharedDevice | MigPartition
"""What can be offered as MPS shares: a `SharedDevice`, or a dynamic MIG partition, whose MIG
device exists only while a claim holds it."""


class ShareSelectionError(ValueError):
    """An ``--mps-shares`` (``--mps-shares-on-mig``) value is malformed or names no GPU (MIG
    device) of the node."""


class ShareError(ValueError):
    """An allocation result's consumed capacity cannot be read as an MPS share."""


@dataclass(frozen=True)
class ShareSize:
    """An amount of one GPU: pinned memory (whole MiB, in bytes) and percent of its SMs."""

    memory_bytes: int
    compute_percent: int

    @property
    def memory_mib(self) -> int:
        return self.memory_bytes // MIB

    def __str__(self) -> str:
        return f"{MEMORY} {binary_si_quantity(self.memory_bytes)}, {COMPUTE} {self.compute_percent}"


def shared_device_name(device: OfferedDevice) -> str:
    """The published name: ``gpu-<minor>`` or ``gpu-<minor>-mig-<profile>-<id>-<start>``."""
    if isinstance(device, MigPartition):
        return mig_device_name(
            device.parent.minor, device.profile_name, device.gi_profile_id, device.placement_start
        )
    if isinstance(device, MigDevice):
        return mig_device_name(
            device.parent.minor, device.profile, device.gi_profile_id, device.placement_start
        )
    return gpu_device_name(device.minor)


def shareable_memory(gpu: OfferedDevice) -> int:
    """The device's memory rounded down to a whole MiB (the ``memory`` capacity of an offered
    GPU or MIG device: a MIG device's is its slice's, from its GPU-instance profile, as is a
    partition's, the same the MIG device made from it reports)."""
    if isinstance(gpu, MigPartition):
        return gpu.profile.memory_bytes // MIB * MIB
    if isinstance(gpu, MigDevice):
        return gpu.memory_bytes // MIB * MIB
    if gpu.memory_bytes is None:
        raise ShareSelectionError(
            f"GPU {gpu.index} ({gpu.uuid}) reports no memory size; it cannot be offered as MPS "
            "shares"
        )
    return gpu.memory_bytes // MIB * MIB


def whole_gpu(gpu: OfferedDevice) -> ShareSize:
    """All of an offered GPU (or MIG device): what a result without ``consumedCapacity``
    consumed."""
    return ShareSize(shareable_memory(gpu), FULL_COMPUTE)


def check_replicas(replicas: int) -> int:
    """``replicas`` if it is a valid ``--mps-share-replicas`` (1-100), else `ValueError`."""
    if not 1 <= replicas <= MAX_SHARE_REPLICAS:
        raise ValueError(
            f"--mps-share-replicas must be between 1 and {MAX_SHARE_REPLICAS}, got {replicas}"
        )
    return replicas


def default_share(gpu: OfferedDevice, replicas: int = DEFAULT_SHARE_REPLICAS) -> ShareSize:
    """What a request consumes of each amount it does not name: 1/``replicas`` of the device's
    memory (rounded down to whole MiB, at least 1Mi) and of its SMs (rounded down, at least 1 %).
    With 1, the whole device."""
    check_replicas(replicas)
    memory = max(shareable_memory(gpu) // replicas // MIB * MIB, MIB)
    return ShareSize(memory, max(FULL_COMPUTE // replicas, 1))


def share_capacity(
    gpu: OfferedDevice, replicas: int = DEFAULT_SHARE_REPLICAS
) -> dict[str, DeviceCapacity]:
    """``memory`` and ``compute`` with their request policies, whose defaults are
    `default_share` (see the module doc)."""
    memory = binary_si_quantity(shareable_memory(gpu))
    default = default_share(gpu, replicas)
    return {
        MEMORY: {
            "value": memory,
            "requestPolicy": {
                "default": binary_si_quantity(default.memory_bytes),
                "validRange": {"min": "1Mi", "max": memory, "step": "1Mi"},
            },
        },
        COMPUTE: {
            "value": str(FULL_COMPUTE),
            "requestPolicy": {
                "default": str(default.compute_percent),
                "validRange": {"min": "1", "max": str(FULL_COMPUTE), "step": "1"},
            },
        },
    }


def offered_device(
    device: Device,
    gpu: OfferedDevice,
    *,
    capped: bool = False,
    replicas: int = DEFAULT_SHARE_REPLICAS,
) -> Device:
    """A copy of ``gpu``'s published device, offered as MPS shares: its capacities are only
    ``memory`` (the device's, a MIG device's being the slice's) and ``compute``, with request
    policies (defaults: 1/``replicas`` of each); or with ``capped`` as capped time-sliced shares
    (attribute `CAPPED`; whole GPUs only). A MIG device's other capacities (SMs, engines, memory
    slices) stay on its attributes' profile and are not offered."""
    offered = copy.deepcopy(device)
    offered["allowMultipleAllocations"] = True
    # Only the share capacities: the scheduler charges every allocation the whole of any
    # capacity without a request policy, so a MIG device's SMs, engines and memory slices
    # would let one share take the device (the second share was unschedulable).
    offered["capacity"] = share_capacity(gpu, replicas)
    if capped:
        offered["attributes"] = {**offered.get("attributes", {}), CAPPED: {"bool": True}}
    return offered


def with_shares(
    devices: Sequence[Device],
    offered: Iterable[OfferedDevice],
    capped: Iterable[Gpu] = (),
    *,
    replicas: int = DEFAULT_SHARE_REPLICAS,
) -> list[Device]:
    """``devices`` (as `attributes.published_devices` orders them) with the ``offered`` GPUs',
    MIG devices' and partitions' devices replaced by their `offered_device` (a partition keeps
    its counter consumption), the ``capped`` GPUs' by their capped one, with ``replicas`` equal
    parts as defaults; everything else unchanged."""
    by_name: dict[str, tuple[OfferedDevice, bool]] = {
        shared_device_name(device): (device, False) for device in offered
    }
    by_name.update({gpu_device_name(gpu.minor): (gpu, True) for gpu in capped})
    published = []
    for device in devices:
        found = by_name.get(device["name"])
        published.append(
            device
            if found is None
            else offered_device(device, found[0], capped=found[1], replicas=replicas)
        )
    return published


@dataclass(frozen=True)
class ShareSelection:
    """Which GPUs are offered as MPS shares: ``all``, ``none`` or a list of indexes/UUIDs."""

    every_gpu: bool = False
    names: tuple[str, ...] = ()
    """NVML indexes (``"0"``) or GPU UUIDs, as given."""
    flag: str = "--mps-shares"
    """The flag it came from, as messages name it (``--capped-shares``: capped shares)."""

    @classmethod
    def parse(cls, text: str, flag: str = "--mps-shares") -> ShareSelection:
        """``all``, ``none`` (or empty), or comma-separated GPU indexes / ``GPU-`` UUIDs."""
        value = text.strip()
        if value.lower() in ("", "none"):
            return cls(flag=flag)
        if value.lower() == "all":
            return cls(every_gpu=True, flag=flag)
        names = tuple(part.strip() for part in value.split(","))
        for name in names:
            if not (name.isdigit() or name.startswith("GPU-")):
                raise ShareSelectionError(
                    f"{flag}: {name!r} is neither a GPU index (0, 1, ...) nor a GPU UUID "
                    "(GPU-...); use all, none, or a comma-separated list of those"
                )
        return cls(names=tuple(dict.fromkeys(names)), flag=flag)

    @property
    def what(self) -> str:
        return "MPS shares" if self.flag == "--mps-shares" else "capped shares"

    @property
    def mig_hint(self) -> str:
        """Where a MIG-mode GPU's devices can be offered instead (MPS shares only)."""
        if self.flag == "--mps-shares":
            return "; offer its MIG devices with --mps-shares-on-mig"
        return ""

    @property
    def empty(self) -> bool:
        return not self.every_gpu and not self.names

    def select(
        self, gpus: Sequence[Gpu], *, partitioned: Set[str] = frozenset()
    ) -> tuple[Gpu, ...]:
        """The offered GPUs among ``gpus``. ``all`` skips GPUs in MIG mode, GPUs whose UUID is in
        ``partitioned`` (dynamic MIG publishes them as partitions), GPUs without a memory size
        and GPUs older than Volta; a listed index or UUID that is not such a whole GPU of the
        node is an error."""
        if self.every_gpu:
            return tuple(
                g
                for g in gpus
                if not g.mig_enabled
                and g.uuid not in partitioned
                and g.memory_bytes is not None
                and g.architecture >= VOLTA
            )
        chosen: list[Gpu] = []
        for name in self.names:
            gpu = next((g for g in gpus if name in (str(g.index), g.uuid)), None)
            if gpu is None:
                known = ", ".join(f"{g.index} ({g.uuid})" for g in gpus) or "none"
                raise ShareSelectionError(
                    f"{self.flag} names GPU {name}, which this node does not have (GPUs: {known})"
                )
            if gpu.mig_enabled:
                raise ShareSelectionError(
                    f"{self.flag} names GPU {name}, which is in MIG mode: {self.flag} offers "
                    f"whole GPUs{self.mig_hint}"
                )
            if gpu.uuid in partitioned:
                raise ShareSelectionError(
                    f"{self.flag} names GPU {name}, which --dynamic-mig publishes as MIG "
                    "partitions: offer shares only on GPUs dynamic MIG does not partition (a "
                    f"GPU is published either as MIG partitions or as {self.what})"
                )
            if gpu.architecture < VOLTA:
                raise ShareSelectionError(
                    f"{self.flag} names GPU {name} ({gpu.product_name}), which is older than "
                    "Volta: shares need Volta or newer (MPS caps, time-slice intervals)"
                )
            shareable_memory(gpu)  # raises for a GPU without a memory size
            if gpu not in chosen:
                chosen.append(gpu)
        return tuple(sorted(chosen, key=lambda g: g.index))


_MIG_PROFILE: Final = re.compile(r"^(\d+c\.)?\d+g\.\d+gb(\+[a-z]+)*$")


@dataclass(frozen=True)
class MigShareSelection:
    """Which static MIG devices are offered as MPS shares (``--mps-shares-on-mig``): ``all``,
    ``none``, or a list of MIG profiles (``3g.40gb``) and MIG device UUIDs (``MIG-...``)."""

    every_device: bool = False
    profiles: tuple[str, ...] = ()
    uuids: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> MigShareSelection:
        """``all``, ``none`` (or empty), or comma-separated profiles / ``MIG-`` UUIDs."""
        value = text.strip()
        if value.lower() in ("", "none"):
            return cls()
        if value.lower() == "all":
            return cls(every_device=True)
        profiles: list[str] = []
        uuids: list[str] = []
        for part in (p.strip() for p in value.split(",")):
            if part.startswith("MIG-"):
                uuids.append(part)
            elif _MIG_PROFILE.match(part):
                profiles.append(part)
            else:
                raise ShareSelectionError(
                    f"--mps-shares-on-mig: {part!r} is neither a MIG profile (1g.10gb, 3g.40gb, "
                    "1c.3g.40gb, ...) nor a MIG device UUID (MIG-...); use all, none, or a "
                    "comma-separated list of those"
                )
        return cls(profiles=tuple(dict.fromkeys(profiles)), uuids=tuple(dict.fromkeys(uuids)))

    @property
    def empty(self) -> bool:
        return not self.every_device and not self.profiles and not self.uuids

    def select(
        self, devices: Sequence[MigDevice], *, partitioned: Set[str] = frozenset()
    ) -> tuple[MigDevice, ...]:
        """The offered MIG devices among the static ``devices``, in their order. Devices of GPUs
        whose UUID is in ``partitioned`` (dynamic MIG publishes those GPUs as partitions, not
        their static devices) are never offered; a profile no device has offers nothing (the
        value is meant for a fleet), a listed UUID that is not a published static MIG device of
        the node is an error."""
        published = [d for d in devices if d.parent.uuid not in partitioned]
        for uuid in self.uuids:
            if not any(d.uuid == uuid for d in devices):
                known = ", ".join(d.uuid for d in published) or "none"
                raise ShareSelectionError(
                    f"--mps-shares-on-mig names MIG device {uuid}, which this node does not "
                    f"have (static MIG devices: {known})"
                )
            if not any(d.uuid == uuid for d in published):
                raise ShareSelectionError(
                    f"--mps-shares-on-mig names MIG device {uuid}, whose GPU --dynamic-mig "
                    "publishes as MIG partitions: --mps-shares-on-mig offers static MIG devices; "
                    "offer the partitions with --mps-shares-on-dynamic-mig"
                )
        return tuple(
            d
            for d in published
            if self.every_device or d.profile in self.profiles or d.uuid in self.uuids
        )


@dataclass(frozen=True)
class PartitionShareSelection:
    """Which dynamic MIG partitions are offered as MPS shares (``--mps-shares-on-dynamic-mig``):
    ``all``, ``none``, or a list of MIG profiles (``3g.40gb``). A partition has no UUID until
    its MIG device is made, so profiles are all it can be named by."""

    every_partition: bool = False
    profiles: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> PartitionShareSelection:
        """``all``, ``none`` (or empty), or comma-separated profiles."""
        value = text.strip()
        if value.lower() in ("", "none"):
            return cls()
        if value.lower() == "all":
            return cls(every_partition=True)
        profiles: list[str] = []
        for part in (p.strip() for p in value.split(",")):
            if not _MIG_PROFILE.match(part) or part.count(".") != 1:
                raise ShareSelectionError(
                    f"--mps-shares-on-dynamic-mig: {part!r} is not a MIG profile that dynamic "
                    "MIG offers (1g.10gb, 3g.40gb, 1g.20gb+me, ...; a partition has no UUID "
                    "until its MIG device is made); use all, none, or a comma-separated list of "
                    "profiles"
                )
            profiles.append(part)
        return cls(profiles=tuple(dict.fromkeys(profiles)))

    @property
    def empty(self) -> bool:
        return not self.every_partition and not self.profiles

    def select(self, partitions: Sequence[MigPartition]) -> tuple[MigPartition, ...]:
        """The offered partitions among the published ``partitions``, in their order (a profile
        no partition has offers nothing: the value is meant for a fleet). Pre-Volta GPUs have
        no MIG, so every partition's GPU takes MPS caps."""
        return tuple(
            p for p in partitions if self.every_partition or p.profile_name in self.profiles
        )


def consumed_share(consumed: object, gpu: OfferedDevice) -> ShareSize:
    """What one allocation result of an offered GPU consumed (``consumedCapacity``).

    The scheduler lists every capacity of the device there; a capacity it does not list (an
    allocator without consumable capacity) counts as the whole of it. ``consumed`` is read as
    untrusted JSON (an object of quantity strings, or null): any other shape is a `ShareError`
    naming the field."""
    whole = whole_gpu(gpu)
    where = f"consumedCapacity of {shared_device_name(gpu)}"
    if consumed is None:
        consumed = {}
    if not isinstance(consumed, Mapping):
        raise ShareError(f"{where}: expected an object of quantities, got {describe(consumed)}")
    given: dict[str, str] = {}
    for key, value in consumed.items():
        if not isinstance(key, str):
            raise ShareError(f"{where}: capacity names must be strings, got {describe(key)}")
        if not isinstance(value, str):
            raise ShareError(
                f"{where}: {short_key(key)}: expected a quantity string, got {describe(value)}"
            )
        # Keys are the device's capacity names; a fully qualified one names the same capacity.
        given[key.rsplit("/", 1)[-1]] = value
    try:
        memory = given.get(MEMORY)
        compute = given.get(COMPUTE)
        memory_bytes = whole.memory_bytes if memory is None else parse_quantity(memory)
        percent = whole.compute_percent if compute is None else parse_quantity(compute)
    except QuantityError as error:
        raise ShareError(f"{where}: {error}") from error
    if memory_bytes <= 0 or memory_bytes > whole.memory_bytes or memory_bytes % MIB:
        raise ShareError(
            f"{where}: {MEMORY} {memory} is not a whole "
            f"number of MiB between 1Mi and {binary_si_quantity(whole.memory_bytes)}"
        )
    if percent.denominator != 1 or not 0 < percent <= FULL_COMPUTE:
        raise ShareError(
            f"{where}: {COMPUTE} {compute} is not a whole percentage between 1 and {FULL_COMPUTE}"
        )
    return ShareSize(int(memory_bytes), int(percent))


def is_partial(size: ShareSize, gpu: OfferedDevice) -> bool:
    """Whether ``size`` is less than the whole device in memory or compute. Offered devices are
    share-only, so a share may also be all of the device; a result that consumed all of both
    under a config that is no share's was allocated through a whole-device class before those
    stopped selecting offered devices, and is prepared as the whole device (the tiers)."""
    return size != whole_gpu(gpu)


def ceiling(gpu: OfferedDevice, max_percent: int) -> ShareSize:
    """The largest share of ``gpu`` (a GPU or MIG device) allowed by ``--mps-share-max-percent``:
    ``max_percent`` of its SMs and of its memory (rounded down to whole MiB). The shared
    daemon's defaults."""
    if not 0 < max_percent <= FULL_COMPUTE:
        raise ValueError(f"max share percent must be 1..100, got {max_percent}")
    memory = shareable_memory(gpu) * max_percent // FULL_COMPUTE // MIB * MIB
    return ShareSize(max(memory, MIB), max_percent)
