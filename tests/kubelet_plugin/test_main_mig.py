"""The plugin's composition root wires dynamic MIG: simulated MIG state from and to
``<data-dir>/simulated-nvml.json``, and the MIG lifecycle over the partitionable GPUs only with
--dynamic-mig (with the test crash point only when asked for)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.kubelet_plugin.mig import SIMULATED_STATE_FILE, TEST_CRASH_ENV, MigLifecycle
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup import StartupError, arm_test_crash_point
from gpu_dra.kubelet_plugin.startup.discovery import dynamic_mig, node_nvml


def settings(data_dir: Path, *flags: str) -> KubeletPluginSettings:
    return KubeletPluginSettings.parse(
        ["--node-name=node-a", "--simulate=hgx-h100", f"--data-dir={data_dir}", *flags], {}
    )


def inventory_of(plugin: KubeletPluginSettings) -> tuple[NvmlLibrary, NodeInventory]:
    nvml, pci = node_nvml(plugin)
    found = discover_devices(nvml, pci, mig_profiles=plugin.dynamic_mig_enabled)
    inventory = NodeInventory.from_discovery(
        found, simulated=True, dynamic_mig=plugin.dynamic_mig_enabled
    )
    return nvml, inventory


def test_simulated_mig_made_by_one_plugin_process_is_there_for_the_next(tmp_path: Path) -> None:
    plugin = settings(tmp_path / "data", "--dynamic-mig")
    nvml, inventory = inventory_of(plugin)
    dynamic = dynamic_mig(plugin, nvml, inventory)
    assert dynamic is not None
    gpu = dynamic.gpus[0]
    made = MigLifecycle(nvml).create(gpu, 9, 0)

    saved = json.loads((tmp_path / "data" / SIMULATED_STATE_FILE).read_text())
    assert saved["profile"] == "hgx-h100"
    assert saved["gpus"][gpu.uuid]["gpuInstances"][0]["computeInstances"][0]["uuid"] == made.uuid
    again, _ = inventory_of(plugin)
    (instance,) = MigLifecycle(again).instances(gpu)
    assert (instance.gi_id, instance.gi_profile_id, instance.placement_start) == (made.gi_id, 9, 0)


def test_dynamic_mig_covers_the_partitionable_gpus_and_only_with_the_flag(tmp_path: Path) -> None:
    plain = settings(tmp_path / "plain")
    nvml, inventory = inventory_of(plain)
    assert dynamic_mig(plain, nvml, inventory) is None

    dynamic = settings(tmp_path / "dynamic", "--dynamic-mig")
    nvml, inventory = inventory_of(dynamic)
    made = dynamic_mig(dynamic, nvml, inventory)
    assert made is not None
    assert made.gpus == inventory.partitionable_gpus()
    assert len(made.gpus) == 8


def test_an_unknown_crash_point_stops_the_plugin_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = settings(tmp_path / "data", "--dynamic-mig")
    monkeypatch.setenv(TEST_CRASH_ENV, "nowhere")

    with pytest.raises(StartupError, match="names no fault injection point"):
        arm_test_crash_point(plugin)
