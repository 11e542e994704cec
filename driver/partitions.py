"""Dynamic MIG publication: MIG-capable GPUs as partitionable devices (nvidia-compat.md §3.3).

Pure: values in, values out. For each partitionable GPU (`is_partitionable`): one counter set
holding the GPU's MIG resources and one counter per memory slice; the full GPU (when
`offers_whole`) consuming every counter; and one device per (GPU-instance profile the
`MigPolicy` offers, possible placement), named like the static MIG device it becomes, consuming
its profile's sizes and its memory slices. So the scheduler never allocates overlapping
placements, nor the full GPU next to a slice of it. Counters that can never run out for the
offered partitions (`binding_counters`) are left out, as are zero amounts.
See docs/mig.md#dynamic-mig-publication.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from gpu_dra.driver import attributes
from gpu_dra.driver.mig_policy import DEFAULT, MigPolicy
from gpu_dra.driver.model import Gpu, MigCapableGpu, MigDevice, MigPartition
from gpu_dra.driver.naming import gpu_device_name, mig_device_name
from gpu_dra.driver.resourceapi import Counter, CounterSet, Device, DeviceCounterConsumption

COUNTER_NAMES: Final = {
    "multiprocessors": "multiprocessors",
    "copyEngines": "copy-engines",
    "decoders": "decoders",
    "encoders": "encoders",
    "jpegEngines": "jpeg-engines",
    "ofaEngines": "ofa-engines",
    "memory": "memory",
}
"""Published capacity name -> counter name (counter names are DNS labels)."""

HOPPER_ARCHITECTURE: Final = 9
"""``NVML_DEVICE_ARCH_HOPPER``: from Hopper on, MIG mode toggles without a GPU reset."""


def counter_set_name(minor: int) -> str:
    """``gpu-<minor>-counter-set``: the counter set of one physical GPU."""
    return f"{gpu_device_name(minor)}-counter-set"


def memory_slice_counter(index: int) -> str:
    """``memory-slice-<index>``: one memory slice of a GPU, value 1."""
    return f"memory-slice-{index}"


def toggles_mig_without_reset(gpu: Gpu) -> bool:
    """Hopper and later switch MIG mode on and off without a GPU reset; Ampere needs a reset."""
    return gpu.architecture >= HOPPER_ARCHITECTURE


def offered_partitions(mig_gpu: MigCapableGpu, policy: MigPolicy = DEFAULT) -> list[MigPartition]:
    """The partitions dynamic MIG publishes for the GPU: every possible placement of every
    profile `policy` offers on it, by profile order, then placement start."""
    offered = {profile.name for profile in policy.offered(mig_gpu.gpu, mig_gpu.profiles)}
    return [p for p in mig_gpu.partitions() if p.profile_name in offered]


def is_partitionable(mig_gpu: MigCapableGpu, policy: MigPolicy = DEFAULT) -> bool:
    """Whether dynamic MIG offers the GPU's partitions.

    Hopper and later always (the MIG mode is switched when the first slice is made). Ampere only
    when its MIG mode is already on: turning it on needs a GPU reset, so an A100 or A30 with MIG
    off stays a plain whole GPU. A GPU without profiles, or whose profiles `policy` offers none
    of, has nothing to partition.
    """
    if not offered_partitions(mig_gpu, policy):
        return False
    return toggles_mig_without_reset(mig_gpu.gpu) or mig_gpu.gpu.mig_enabled


def offers_whole(mig_gpu: MigCapableGpu) -> bool:
    """Whether a partitionable GPU is also offered whole.

    Yes where MIG mode can be turned off again without a reset (Hopper and later); an Ampere GPU
    in MIG mode is offered only as slices, as without dynamic MIG.
    """
    return toggles_mig_without_reset(mig_gpu.gpu) or not mig_gpu.gpu.mig_enabled


def gpu_counters(mig_gpu: MigCapableGpu) -> dict[str, int]:
    """Counter name -> the GPU's amount: each MIG resource at its maximum across all the GPU's
    profiles (the full 7g), and one per memory slice."""
    counters = dict.fromkeys(COUNTER_NAMES.values(), 0)
    for profile in mig_gpu.profiles:
        for capacity, amount in attributes.mig_sizes(profile).items():
            counter = COUNTER_NAMES[capacity]
            counters[counter] = max(counters[counter], amount)
    counters.update((memory_slice_counter(i), 1) for i in range(mig_gpu.memory_slices))
    return counters


def binding_counters(mig_gpu: MigCapableGpu, offered: Iterable[MigPartition]) -> frozenset[str]:
    """The counters that can stop the scheduler from allocating some set of `offered`.

    A memory slice counter binds when an offered partition uses that slice. Any set the memory
    slice counters let through is a set of non-overlapping placements; a resource counter (SMs,
    engines, memory) binds only if some such set needs more of it than the GPU has (an exact
    weighted interval packing over the memory slices). Leaving the others out changes nothing the
    scheduler can allocate, only the bytes it reads for every device.
    """
    partitions = list(offered)
    amounts = gpu_counters(mig_gpu)
    binding = {memory_slice_counter(i) for p in partitions for i in p.memory_slices}
    for capacity, counter in COUNTER_NAMES.items():
        need = {id(p): attributes.mig_sizes(p.profile)[capacity] for p in partitions}
        if _max_packing(partitions, need, mig_gpu.memory_slices) > amounts[counter]:
            binding.add(counter)
    return frozenset(binding)


def _max_packing(partitions: list[MigPartition], need: dict[int, int], slices: int) -> int:
    """The largest total `need` of partitions whose placements do not overlap."""
    best = [0] * (slices + 2)
    for start in range(slices - 1, -1, -1):
        best[start] = best[start + 1]
        for p in partitions:
            end = p.placement_start + p.placement_size
            if p.placement_start == start and end <= slices:
                best[start] = max(best[start], need[id(p)] + best[end])
    return best[0]


def counter_set(mig_gpu: MigCapableGpu, policy: MigPolicy = DEFAULT) -> CounterSet:
    """The GPU's ``gpu-<minor>-counter-set``: the `binding_counters` of what `policy` offers."""
    binding = binding_counters(mig_gpu, offered_partitions(mig_gpu, policy))
    counters = {name: n for name, n in gpu_counters(mig_gpu).items() if name in binding}
    return {"name": counter_set_name(mig_gpu.gpu.minor), "counters": _counters(counters)}


def partition_counters(partition: MigPartition) -> dict[str, int]:
    """What one partition consumes: its profile's capacities and its memory slices."""
    counters = {
        COUNTER_NAMES[capacity]: amount
        for capacity, amount in attributes.mig_sizes(partition.profile).items()
    }
    counters.update((memory_slice_counter(i), 1) for i in partition.memory_slices)
    return counters


def _consumption(
    minor: int, counters: dict[str, int], binding: frozenset[str]
) -> DeviceCounterConsumption:
    kept = {name: n for name, n in counters.items() if name in binding and n > 0}
    return {"counterSet": counter_set_name(minor), "counters": _counters(kept)}


def full_gpu_device(mig_gpu: MigCapableGpu, policy: MigPolicy = DEFAULT) -> Device:
    """The whole GPU in partitionable form: its usual attributes, the MIG capacities at their
    maximum across profiles (``memory`` stays the GPU's total), consuming every counter of its
    counter set."""
    gpu = mig_gpu.gpu
    counters = gpu_counters(mig_gpu)
    binding = binding_counters(mig_gpu, offered_partitions(mig_gpu, policy))
    capacity = {name: counters[counter] for name, counter in COUNTER_NAMES.items()}
    if gpu.memory_bytes is not None:
        capacity["memory"] = gpu.memory_bytes
    device: Device = {
        "name": gpu_device_name(gpu.minor),
        "attributes": attributes.gpu_attributes(gpu),
        "capacity": attributes.quantities(capacity),
        "consumesCounters": [_consumption(gpu.minor, counters, binding)],
    }
    attributes.check_limits(device)
    return device


def partition_device_name(partition: MigPartition) -> str:
    """``gpu-<parent minor>-mig-<profile slug>-<GI profile ID>-<placement start>``."""
    return mig_device_name(
        partition.parent.minor,
        partition.profile_name,
        partition.gi_profile_id,
        partition.placement_start,
    )


def partition_device(partition: MigPartition, binding: frozenset[str] | None = None) -> Device:
    """One placement of one profile as a partitionable device (see the module docstring);
    `binding` (default: every counter) are the counters of its GPU's counter set."""
    counters = partition_counters(partition)
    device: Device = {
        "name": partition_device_name(partition),
        "attributes": attributes.mig_partition_attributes(partition),
        "capacity": attributes.quantities(attributes.mig_sizes(partition.profile)),
        "consumesCounters": [
            _consumption(
                partition.parent.minor,
                counters,
                frozenset(counters) if binding is None else binding,
            )
        ],
    }
    attributes.check_limits(device)
    return device


def gpu_partition_devices(mig_gpu: MigCapableGpu, policy: MigPolicy = DEFAULT) -> list[Device]:
    """The devices of one partitionable GPU under `policy`, sorted by name (the full GPU
    first), as NVIDIA's driver sorts them."""
    offered = offered_partitions(mig_gpu, policy)
    binding = binding_counters(mig_gpu, offered)
    devices = [partition_device(partition, binding) for partition in offered]
    if offers_whole(mig_gpu):
        devices.append(full_gpu_device(mig_gpu, policy))
    return sorted(devices, key=lambda device: device["name"])


@dataclass(frozen=True)
class PartitionedNode:
    """A node's devices with dynamic MIG: what gets published, and the counter sets behind it."""

    devices: tuple[Device, ...]
    """Ordered by PCI bus id: plain devices as without dynamic MIG, then per partitionable GPU
    its devices by name."""
    counter_sets: tuple[CounterSet, ...]
    """One per partitionable GPU, in PCI bus order."""
    partitions: tuple[MigPartition, ...]
    """Every published partition, in the order of `devices`."""


def partitioned_node(
    gpus: Iterable[Gpu],
    mig_devices: Iterable[MigDevice],
    mig_capable: Iterable[MigCapableGpu],
    policy: MigPolicy = DEFAULT,
) -> PartitionedNode:
    """The node's devices as NVIDIA's driver publishes them with ``DynamicMIG``, the partitions
    limited to the profiles `policy` offers.

    Partitionable GPUs are published in partitionable form (existing MIG devices on them are not
    published: dynamic MIG owns those GPUs); every other GPU as without dynamic MIG.
    """
    partitionable = sorted(
        (mig_gpu for mig_gpu in mig_capable if is_partitionable(mig_gpu, policy)),
        key=lambda mig_gpu: mig_gpu.gpu.pci_bus_id,
    )
    owned = {mig_gpu.gpu.uuid for mig_gpu in partitionable}
    plain = attributes.published_devices(
        (gpu for gpu in gpus if gpu.uuid not in owned),
        (mig for mig in mig_devices if mig.parent.uuid not in owned),
    )
    devices = plain + [device for g in partitionable for device in gpu_partition_devices(g, policy)]
    devices.sort(key=lambda device: device["attributes"][attributes.PCI_BUS_ID].get("string", ""))
    by_name = {
        partition_device_name(partition): partition
        for mig_gpu in partitionable
        for partition in offered_partitions(mig_gpu, policy)
    }
    return PartitionedNode(
        devices=tuple(devices),
        counter_sets=tuple(counter_set(mig_gpu, policy) for mig_gpu in partitionable),
        partitions=tuple(by_name[d["name"]] for d in devices if d["name"] in by_name),
    )


def _counters(amounts: dict[str, int]) -> dict[str, Counter]:
    return {name: {"value": attributes.binary_si_quantity(n)} for name, n in amounts.items()}
