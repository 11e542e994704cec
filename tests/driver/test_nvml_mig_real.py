"""On a lent GPU machine: the real MIG profile table matches the simulator's for the same model.

Read-only: profile info and possible placements answer with MIG off, so the GPU's MIG mode and
instances are never touched.
"""

from __future__ import annotations

import os
from pathlib import Path

import pynvml
import pytest

from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.driver.nvml.real import RealNvml, find_nvml_library
from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.nvml.simulated_profiles import builtin_models, parse_profile


def _has_gpu() -> bool:
    return find_nvml_library(Path("/")) is not None and os.path.exists("/dev/nvidiactl")


def _table(nvml: NvmlLibrary, handle: object) -> dict[int, tuple[object, ...]]:
    """index -> (ID, slices, instances, placements); memory sizes vary between drivers."""
    table = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.device_get_gpu_instance_profile_info(handle, index)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        placements = nvml.device_get_gpu_instance_possible_placements(handle, info.id)
        table[index] = (
            info.id,
            info.sliceCount,
            info.instanceCount,
            [(p.start, p.size) for p in placements],
        )
    return table


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU and libnvidia-ml")
def test_real_mig_profiles_and_placements_match_the_simulated_model():
    real = RealNvml(Path("/"))
    real.init()
    try:
        handle = real.device_get_handle_by_index(0)
        try:
            real.device_get_mig_mode(handle)
        except pynvml.NVMLError_NotSupported:
            pytest.skip("GPU 0 has no MIG")
        name = real.device_get_name(handle)
        keys = [key for key, model in builtin_models().items() if model.name == name]
        if not keys:
            pytest.skip(f"{name} is not a simulated model")
        doc = {
            "driverVersion": "580.95.05",
            "cudaDriverVersion": 13000,
            "gpus": [{"model": keys[0], "busId": "00000000:01:00.0"}],
        }
        sim = SimulatedNvml(parse_profile(doc, name="real-twin", node_name="n"))
        sim.init()
        assert _table(real, handle) == _table(sim, sim.device_get_handle_by_index(0))
        assert real.device_is_mig_device_handle(handle) is False
    finally:
        real.shutdown()
