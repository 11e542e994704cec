"""The simulated node's MIG state file: what one plugin process made, the next one finds."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.mig import SimulatedMigStateFile, SimulatedStateError


def host_with(state: SimulatedMigStateFile) -> SimulatedHost:
    host = SimulatedHost.load(
        state.profile, "node-a", saved_mig=state.load(), on_mig_change=state.save
    )
    host.nvml.init()
    return host


def test_mig_made_by_one_process_is_found_by_the_next(tmp_path: Path) -> None:
    path = tmp_path / "simulated-nvml.json"
    first = host_with(SimulatedMigStateFile(path, "hgx-h100"))
    handle = first.nvml.device_get_handle_by_index(2)
    first.nvml.device_set_mig_mode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
    first.nvml.device_create_gpu_instance_with_placement(
        handle, 9, pynvml.c_nvmlGpuInstancePlacement_t(0, 4)
    )

    second = host_with(SimulatedMigStateFile(path, "hgx-h100"))

    again = second.nvml.device_get_handle_by_index(2)
    (gi,) = second.nvml.device_get_gpu_instances(again, 9)
    assert second.nvml.gpu_instance_get_info(gi).placement.start == 0
    saved = json.loads(path.read_text())
    assert saved["version"] == 1
    assert saved["profile"] == "hgx-h100"
    uuid = second.nvml.device_get_uuid(again)
    assert [gi["profileId"] for gi in saved["gpus"][uuid]["gpuInstances"]] == [9]


def test_no_file_means_the_profile_as_written(tmp_path: Path) -> None:
    assert SimulatedMigStateFile(tmp_path / "none.json", "hgx-h100").load() is None


def test_a_file_of_another_profile_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "simulated-nvml.json"
    host = host_with(SimulatedMigStateFile(path, "hgx-h100"))
    host.nvml.device_set_mig_mode(
        host.nvml.device_get_handle_by_index(0), pynvml.NVML_DEVICE_MIG_ENABLE
    )

    assert SimulatedMigStateFile(path, "hgx-h100-mig").load() is None


@pytest.mark.parametrize("content", ["{not json", '{"version": 7, "gpus": {}}', "[]"])
def test_an_unreadable_file_is_an_error_naming_it_and_the_way_out(
    tmp_path: Path, content: str
) -> None:
    path = tmp_path / "simulated-nvml.json"
    path.write_text(content)

    with pytest.raises(SimulatedStateError, match="delete it") as raised:
        SimulatedMigStateFile(path, "hgx-h100").load()
    assert str(path) in str(raised.value)


def attached_host(path: Path) -> tuple[SimulatedHost, SimulatedMigStateFile]:
    state = SimulatedMigStateFile(path, "hgx-h100")
    host = host_with(state)
    state.attach(host.nvml)
    return host, state


def gpu_instances(path: Path, uuid: str) -> list[int]:
    saved = json.loads(path.read_text())
    return [gi["start"] for gi in saved["gpus"][uuid]["gpuInstances"]]


def test_two_attached_processes_keep_each_others_changes_and_refresh_takes_them_in(
    tmp_path: Path,
) -> None:
    path = tmp_path / "simulated-nvml.json"
    old, old_state = attached_host(path)
    new, new_state = attached_host(path)  # both started before either changed anything
    placement = pynvml.c_nvmlGpuInstancePlacement_t(0, 4)

    def make(host: SimulatedHost, index: int) -> str:
        handle = host.nvml.device_get_handle_by_index(index)
        host.nvml.device_set_mig_mode(handle, pynvml.NVML_DEVICE_MIG_ENABLE)
        host.nvml.device_create_gpu_instance_with_placement(handle, 9, placement)
        return host.nvml.device_get_uuid(handle)

    on_old = make(old, 2)
    on_new = make(new, 3)  # its save does not turn back the old one's GPU 2

    assert gpu_instances(path, on_old) == [0]
    assert gpu_instances(path, on_new) == [0]
    # The new process does not see GPU 2's instance until it refreshes that GPU.
    handle = new.nvml.device_get_handle_by_index(2)
    assert new.nvml.device_get_mig_mode(handle)[0] == pynvml.NVML_DEVICE_MIG_DISABLE
    new_state.refresh(on_old)
    (gi,) = new.nvml.device_get_gpu_instances(handle, 9)
    new.nvml.gpu_instance_destroy(gi)  # and its change is saved for that GPU alone
    assert gpu_instances(path, on_old) == []
    assert gpu_instances(path, on_new) == [0]
    old_state.refresh(on_old)
    assert old.nvml.device_get_gpu_instances(old.nvml.device_get_handle_by_index(2), 9) == []
