"""The devices published for every built-in simulated machine match the checked-in golden files.

Published as the kubelet plugin publishes them: whole GPUs with MIG off and static MIG devices,
in PCI bus order, then placement.

Golden files: ``tests/driver/golden/<profile>.json`` (node name ``node-a``). After an intended
change, rewrite them with::

    GPU_DRA_UPDATE_GOLDEN=1 .venv/bin/pytest tests/driver/test_attributes_golden.py

and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpu_dra.driver.attributes import published_devices
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.simulated_profiles import builtin_profile_names

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("GPU_DRA_UPDATE_GOLDEN") == "1"


def _published(profile: str) -> str:
    host = SimulatedHost.load(profile, "node-a")
    found = discover_devices(host.nvml, host.pci)
    devices = published_devices(found.gpus, found.mig_devices)
    return json.dumps(devices, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("profile", builtin_profile_names())
def test_published_devices_match_the_golden_file(profile):
    path = GOLDEN / f"{profile}.json"
    published = _published(profile)
    if UPDATE:
        path.write_text(published)
    assert path.exists(), f"{path} missing: run with GPU_DRA_UPDATE_GOLDEN=1"
    assert published == path.read_text()


def test_every_golden_file_belongs_to_a_builtin_profile():
    assert sorted(path.stem for path in GOLDEN.glob("*.json")) == builtin_profile_names()
