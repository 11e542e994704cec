"""A cluster-sized device inventory, rendered by the driver's own code.

Nodes alternate between the simulated ``hgx-h100`` and ``dgx-a100`` machines (8 GPUs each; the
node name seeds the UUIDs). Every GPU is published whole plus one MIG device per GPU-instance
profile and placement the GPU offers (with the full compute instance), i.e. every partition the
GPU could be cut into, as a driver publishing all possible MIG devices offers them: 25 per H100
or A100, 26 devices per GPU. Devices are rendered by `published_devices` (the kubelet plugin's
code), so they look exactly as published.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import pynvml

from gpu_dra.driver.attributes import published_devices
from gpu_dra.driver.discovery import discover_gpus, mig_resources
from gpu_dra.driver.model import Gpu, MigDevice
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME, mig_profile_name
from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.simulated_mig import COMPUTE_INSTANCE_PROFILE_FOR_SLICES
from gpu_dra.driver.resourceapi import Device

DRIVER: Final = DEFAULT_DRIVER_NAME
PROFILES: Final = ("hgx-h100", "dgx-a100")


@dataclass(frozen=True)
class PoolDevice:
    node: str
    device: Device


def node_devices(profile: str, node: str) -> list[Device]:
    """The devices of one simulated node: each GPU whole and all of its MIG partitions."""
    host = SimulatedHost.load(profile, node)
    nvml = host.nvml
    gpus = discover_gpus(nvml, host.pci)
    nvml.init()
    try:
        migs = [mig for gpu in gpus for mig in _partitions(nvml, gpu)]
    finally:
        nvml.shutdown()
    return published_devices(gpus, migs)


def inventory(nodes: int) -> Iterator[PoolDevice]:
    for n in range(nodes):
        node = f"node-{n:04d}"
        for device in node_devices(PROFILES[n % len(PROFILES)], node):
            yield PoolDevice(node, device)


def _partitions(nvml: NvmlLibrary, gpu: Gpu) -> list[MigDevice]:
    if gpu.memory_bytes is None:
        return []
    handle = nvml.device_get_handle_by_index(gpu.index)
    found = []
    gi_id = 0
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.device_get_gpu_instance_profile_info(handle, index)
        except pynvml.NVMLError:
            continue  # a profile this GPU does not have
        ci_profile = COMPUTE_INSTANCE_PROFILE_FOR_SLICES[info.sliceCount]
        name = mig_profile_name(index, ci_profile, info.memorySizeMB, gpu.memory_bytes)
        for placement in nvml.device_get_gpu_instance_possible_placements(handle, info.id):
            seed = f"{gpu.uuid}/{info.id}/{placement.start}"
            found.append(
                MigDevice(
                    parent=gpu,
                    profile=name,
                    gi_profile_id=info.id,
                    placement_start=placement.start,
                    placement_size=placement.size,
                    gi_id=gi_id,
                    ci_id=0,
                    ci_profile_id=ci_profile,
                    uuid=f"MIG-{uuid.uuid5(uuid.NAMESPACE_OID, seed)}",
                    **mig_resources(info),
                )
            )
            gi_id += 1
    return found
