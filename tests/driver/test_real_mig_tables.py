"""The simulator's MIG profile tables against those real GPUs reported (recorded on a lent H100
and H200, driver 580.159.04: tests/driver/real_mig_tables.json, made by tests/real_gpu), field by
field, memory included; every other profile index answers NOT_SUPPORTED on both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.nvml.simulated_profiles import builtin_models, parse_profile

RECORDED = json.loads((Path(__file__).parent / "real_mig_tables.json").read_text())
MODELS = [name for name in RECORDED if not name.startswith("_") and name != "driverVersion"]


def simulated_table(name: str) -> dict[int, dict[str, Any]]:
    (key,) = [key for key, model in builtin_models().items() if model.name == name]
    doc = {
        "driverVersion": RECORDED["driverVersion"],
        "cudaDriverVersion": 13000,
        "gpus": [{"model": key, "busId": "00000000:01:00.0"}],
    }
    nvml = SimulatedNvml(parse_profile(doc, name="real-twin", node_name="n"))
    nvml.init()
    handle = nvml.device_get_handle_by_index(0)
    table = {}
    for index in range(16):
        try:
            info = nvml.device_get_gpu_instance_profile_info(handle, index)
        except pynvml.NVMLError_NotSupported:
            continue
        placements = nvml.device_get_gpu_instance_possible_placements(handle, info.id)
        table[index] = {
            "id": info.id,
            "sliceCount": info.sliceCount,
            "instanceCount": info.instanceCount,
            "multiprocessorCount": info.multiprocessorCount,
            "copyEngineCount": info.copyEngineCount,
            "decoderCount": info.decoderCount,
            "encoderCount": info.encoderCount,
            "jpegCount": info.jpegCount,
            "ofaCount": info.ofaCount,
            "memorySizeMB": info.memorySizeMB,
            "placements": [[p.start, p.size] for p in placements],
        }
    return table


@pytest.mark.parametrize("name", MODELS)
def test_the_simulated_profile_table_is_the_real_one(name: str) -> None:
    real = {
        row["profile"]: {k: v for k, v in row.items() if k not in ("profile", "name")}
        for row in RECORDED[name]
    }

    assert simulated_table(name) == real


def test_the_recording_covers_both_hopper_models() -> None:
    assert set(MODELS) == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}
    assert all(len(RECORDED[name]) == 7 for name in MODELS)
