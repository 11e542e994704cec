"""EXCLUSIVE_PROCESS while an MPS daemon runs (``--mps-exclusive-compute-mode``, by default for
the shared daemons of MPS shares): the real manager and the nvidia-cuda-mps-control test double,
compute modes through `NvmlComputeMode` on the simulated NVML (same calls and errors as the real
one). Full GPUs only, never MIG devices; reset on stop, on a failed start and when a leftover is
removed after a crash; set again by `ensure` when a GPU lost it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pynvml
import pytest

from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.nvml.simulated_profiles import load_profile, parse_profile
from gpu_dra.kubelet_plugin.mps import (
    ComputeModeError,
    MpsDaemonManager,
    MpsSettings,
    MpsStartError,
    NvmlComputeMode,
    PlainDirectoryShm,
    claim_daemon_id,
    shared_daemon_id,
)
from gpu_dra.kubelet_plugin.mps.ids import is_shared_daemon
from tests.doubles.mps_helpers import (
    DOUBLE_BINARY,
    double_env,
)
from tests.kubelet_plugin.nodes import wait_dead

CLAIM = "0f6c2c6e-8a3c-4d0e-9a63-8e2b5e0c1d11"
EXCLUSIVE = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
DEFAULT = pynvml.NVML_COMPUTEMODE_DEFAULT


@pytest.fixture
def root(mps_root: Path) -> Path:
    """The daemons' scratch data dir (conftest's `mps_root`: fails on leftover processes)."""
    return mps_root


def manager_on(root: Path, nvml: SimulatedNvml | None) -> MpsDaemonManager:
    return MpsDaemonManager(
        root,
        binary=DOUBLE_BINARY,
        base_env=double_env(),
        shm=PlainDirectoryShm(),
        compute_mode=NvmlComputeMode(nvml) if nvml is not None else None,
    )


def modes(nvml: SimulatedNvml) -> dict[str, int]:
    """Compute mode of every full GPU by UUID."""
    nvml.init()
    try:
        result = {}
        for index in range(nvml.device_get_count()):
            handle = nvml.device_get_handle_by_index(index)
            result[nvml.device_get_uuid(handle)] = nvml.device_get_compute_mode(handle)
        return result
    finally:
        nvml.shutdown()


def uuids(nvml: SimulatedNvml) -> list[str]:
    return sorted(modes(nvml))


def test_full_gpus_are_exclusive_process_while_the_daemon_runs(root: Path) -> None:
    nvml = SimulatedNvml(load_profile("hgx-h100", "node-a"))
    first, second, *_ = uuids(nvml)
    manager = manager_on(root, nvml)

    handle = manager.start(claim_daemon_id(CLAIM, [first, second]), [first, second], MpsSettings())

    assert {u: m for u, m in modes(nvml).items() if m != DEFAULT} == {
        first: EXCLUSIVE,
        second: EXCLUSIVE,
    }
    assert (handle.root / "compute-mode").read_text().split() == [first, second]
    manager.stop(handle)
    assert set(modes(nvml).values()) == {DEFAULT}
    assert not nvml.initialized  # every init was matched by a shutdown


def test_without_the_setting_compute_modes_are_left_alone(root: Path) -> None:
    nvml = SimulatedNvml(load_profile("hgx-h100", "node-a"))
    gpu = uuids(nvml)[0]
    manager = manager_on(root, None)

    handle = manager.start(claim_daemon_id(CLAIM, [gpu]), [gpu], MpsSettings())

    assert set(modes(nvml).values()) == {DEFAULT}
    assert not (handle.root / "compute-mode").exists()
    manager.stop(handle)


def test_mig_devices_are_never_switched(root: Path) -> None:
    nvml = SimulatedNvml(load_profile("hgx-h100-mig", "node-a"))
    nvml.init()
    parent = nvml.device_get_handle_by_index(0)
    mig = nvml.device_get_uuid(nvml.device_get_mig_device_handle_by_index(parent, 0))
    nvml.shutdown()
    manager = manager_on(root, nvml)

    handle = manager.start(claim_daemon_id(CLAIM, [mig]), [mig], MpsSettings())

    assert set(modes(nvml).values()) == {DEFAULT}
    assert not (handle.root / "compute-mode").exists()
    manager.stop(handle)


def test_nvml_refusing_exclusive_process_fails_the_start_and_resets_what_was_set(
    root: Path,
) -> None:
    profile = parse_profile(
        {
            "driverVersion": "580.95.05",
            "cudaDriverVersion": 13000,
            "gpus": [
                {"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0"},
                {
                    "model": "H100-SXM5-80GB",
                    "busId": "00000000:43:00.0",
                    "faults": {"device_set_compute_mode": "NO_PERMISSION"},
                },
            ],
        },
        name="no-permission",
        node_name="node-a",
    )
    nvml = SimulatedNvml(profile)
    ok, refused = uuids(nvml)
    manager = manager_on(root, nvml)

    with pytest.raises(
        MpsStartError, match=f"cannot set compute mode EXCLUSIVE_PROCESS of {refused}: "
    ):
        manager.start(claim_daemon_id(CLAIM, [ok, refused]), [ok, refused], MpsSettings())

    assert set(modes(nvml).values()) == {DEFAULT}
    assert manager.leftovers() == []


def test_a_leftover_daemon_of_a_crashed_plugin_gets_its_gpus_reset(root: Path) -> None:
    nvml = SimulatedNvml(load_profile("hgx-h100", "node-a"))
    gpu = uuids(nvml)[0]
    handle = manager_on(root, nvml).start(claim_daemon_id(CLAIM, [gpu]), [gpu], MpsSettings())
    assert modes(nvml)[gpu] == EXCLUSIVE

    restarted = manager_on(root, nvml)  # the handle never reached the checkpoint
    assert restarted.leftovers() == [handle.daemon_id]
    restarted.remove_leftover(handle.daemon_id)

    assert modes(nvml)[gpu] == DEFAULT
    assert not handle.root.exists()


def test_nvml_compute_mode_refuses_mig_uuids_without_calling_nvml() -> None:
    nvml = SimulatedNvml(load_profile("hgx-h100", "node-a"))
    with pytest.raises(ComputeModeError, match="MIG devices are never changed") as error:
        NvmlComputeMode(nvml).set_mode("MIG-99999999-8888-7777-6666-555555555555", EXCLUSIVE)
    assert error.value.not_supported
    assert not nvml.initialized


def test_by_default_only_the_gpus_of_shared_daemons_are_made_exclusive(root: Path) -> None:
    nvml = SimulatedNvml(load_profile("hgx-h100", "node-a"))
    shared_gpu, claim_gpu, *_ = uuids(nvml)
    manager = manager_on(root, nvml)
    manager.exclusive = is_shared_daemon  # --mps-exclusive-compute-mode=shares

    shared = manager.start(shared_daemon_id(shared_gpu), [shared_gpu], MpsSettings())
    claim = manager.start(claim_daemon_id(CLAIM, [claim_gpu]), [claim_gpu], MpsSettings())

    assert {u: m for u, m in modes(nvml).items() if m != DEFAULT} == {shared_gpu: EXCLUSIVE}
    manager.stop(claim)
    manager.stop(shared)
    assert set(modes(nvml).values()) == {DEFAULT}


def test_a_gpu_that_lost_exclusive_process_gets_it_back_from_ensure(root: Path) -> None:
    nvml = SimulatedNvml(load_profile("hgx-h100", "node-a"))
    gpu = uuids(nvml)[0]
    manager = manager_on(root, nvml)
    handle = manager.start(shared_daemon_id(gpu), [gpu], MpsSettings())
    NvmlComputeMode(nvml).set_mode(gpu, DEFAULT)  # a GPU reset, or someone with root

    repair = manager.ensure(handle)

    assert repair.restored == (f"compute mode of {gpu} DEFAULT, not EXCLUSIVE_PROCESS",)
    assert modes(nvml)[gpu] == EXCLUSIVE
    assert manager.ensure(handle).restored == ()
    manager.stop(handle)
    assert modes(nvml)[gpu] == DEFAULT


def test_a_restart_in_place_sets_exclusive_process_again(root: Path) -> None:
    nvml = SimulatedNvml(load_profile("hgx-h100", "node-a"))
    gpu = uuids(nvml)[0]
    manager = manager_on(root, nvml)
    handle = manager.start(shared_daemon_id(gpu), [gpu], MpsSettings())
    os.kill(handle.pid, signal.SIGKILL)
    assert wait_dead(handle.pid)
    NvmlComputeMode(nvml).set_mode(gpu, DEFAULT)

    repair = manager.ensure(handle)

    assert repair.restarted is not None
    assert repair.restored == ()  # set by the restart itself
    assert modes(nvml)[gpu] == EXCLUSIVE
    manager.stop(handle)
    assert modes(nvml)[gpu] == DEFAULT


def test_a_plugin_that_is_not_root_is_told_how_to_turn_the_mode_off(root: Path) -> None:
    profile = parse_profile(
        {
            "driverVersion": "580.95.05",
            "cudaDriverVersion": 13000,
            "gpus": [
                {
                    "model": "H100-SXM5-80GB",
                    "busId": "00000000:1B:00.0",
                    "faults": {"device_set_compute_mode": "NO_PERMISSION"},
                },
            ],
        },
        name="not-root",
        node_name="node-a",
    )
    nvml = SimulatedNvml(profile)
    [gpu] = uuids(nvml)

    with pytest.raises(ComputeModeError, match=r"needs root.*--mps-exclusive-compute-mode=none"):
        NvmlComputeMode(nvml).set_mode(gpu, EXCLUSIVE)
    assert NvmlComputeMode(nvml).get_mode(gpu) == DEFAULT
