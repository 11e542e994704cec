"""MigLifecycle against the simulated NVML: create at a placement, destroy, MIG mode on Hopper
vs Ampere, clear errors, and nothing left behind when a step fails."""

from __future__ import annotations

import signal
import subprocess
import sys

import pynvml
import pytest

from gpu_dra.driver.discovery import discover_gpus
from gpu_dra.driver.model import Gpu
from gpu_dra.driver.nvml.simulated import SimulatedHost, SimulatedNvml
from gpu_dra.driver.nvml.simulated_profiles import parse_profile
from gpu_dra.kubelet_plugin.crash_points import MIG_AFTER_MODE_ON
from gpu_dra.kubelet_plugin.mig import (
    CRASH_AFTER_GPU_INSTANCE,
    TEST_CRASH_ENV,
    MigError,
    MigLifecycle,
    crash_point_from_env,
)

ON, OFF = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE


class Node:
    def __init__(self, host: SimulatedHost) -> None:
        self.nvml = host.nvml
        self.gpus = discover_gpus(host.nvml, host.pci)
        self.mig = MigLifecycle(host.nvml)

    def mode(self, gpu: Gpu) -> list[int]:
        self.nvml.init()
        try:
            return self.nvml.device_get_mig_mode(self.nvml.device_get_handle_by_uuid(gpu.uuid))
        finally:
            self.nvml.shutdown()

    def layout(self, gpu: Gpu) -> list[tuple[int, int, tuple[int, ...]]]:
        return [(i.gi_profile_id, i.placement_start, i.ci_ids) for i in self.mig.instances(gpu)]


@pytest.fixture
def h100() -> Node:
    return Node(SimulatedHost.load("hgx-h100", "node-a"))


def a100(mig_mode: list[int]) -> Node:
    doc = {
        "driverVersion": "580.95.05",
        "cudaDriverVersion": 13000,
        "gpus": [{"model": "A100-SXM4-40GB", "busId": "0000:07:00.0", "migMode": mig_mode}],
    }
    return Node(SimulatedHost.from_profile(parse_profile(doc, name="a100", node_name="node-a")))


def test_create_turns_mig_on_and_makes_the_slice_at_the_placement(h100: Node) -> None:
    gpu = h100.gpus[0]

    device = h100.mig.create(gpu, 9, 4)

    assert h100.mode(gpu) == [ON, ON]
    assert (device.profile, device.gi_profile_id, device.placement_start) == ("3g.40gb", 9, 4)
    assert device.placement_size == 4
    assert device.parent.uuid == gpu.uuid
    assert device.uuid.startswith("MIG-")
    assert h100.layout(gpu) == [(9, 4, (device.ci_id,))]
    assert h100.nvml.initialized is False  # every NVML session is closed again


def test_four_slices_fill_one_gpu_each_with_its_own_uuid(h100: Node) -> None:
    gpu = h100.gpus[1]

    made = [h100.mig.create(gpu, pid, start) for pid, start in ((19, 0), (19, 1), (14, 2), (9, 4))]

    assert len({d.uuid for d in made}) == 4
    assert [d.profile for d in made] == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    assert [(pid, start) for pid, start, _ in h100.layout(gpu)] == [
        (19, 0),
        (19, 1),
        (14, 2),
        (9, 4),
    ]


def test_destroying_the_last_slice_turns_mig_off_on_hopper(h100: Node) -> None:
    gpu = h100.gpus[0]
    h100.mig.create(gpu, 19, 0)
    h100.mig.create(gpu, 19, 3)

    assert h100.mig.destroy(gpu, 19, 0) is True
    assert h100.mode(gpu) == [ON, ON]  # one slice left
    assert h100.mig.destroy(gpu, 19, 3) is True

    assert h100.mode(gpu) == [OFF, OFF]
    assert h100.mig.instances(gpu) == []


def test_destroying_what_is_not_there_is_success_and_touches_nothing_else(h100: Node) -> None:
    gpu = h100.gpus[0]
    kept = h100.mig.create(gpu, 19, 0)

    assert h100.mig.destroy(gpu, 19, 5) is False
    assert h100.mig.destroy(gpu, 19, 0, gi_id=kept.gi_id + 1) is False  # another GI's id

    assert h100.layout(gpu) == [(19, 0, (kept.ci_id,))]
    assert h100.mig.destroy(h100.gpus[2], 19, 0) is False  # MIG off: nothing to destroy


def test_an_occupied_placement_is_refused_naming_what_occupies_it(h100: Node) -> None:
    gpu = h100.gpus[0]
    big = h100.mig.create(gpu, 9, 4)

    with pytest.raises(MigError) as raised:
        h100.mig.create(gpu, 14, 4)

    message = str(raised.value)
    assert "answered NVML_ERROR_INSUFFICIENT_RESOURCES: placement 4..5" in message
    assert f"occupied by GPU instance {big.gi_id} (profile ID 9) at memory slices 4..7" in message
    assert gpu.uuid in message
    assert raised.value.retryable
    assert h100.layout(gpu) == [(9, 4, (big.ci_id,))]


def test_a_start_that_is_no_placement_of_the_profile_is_refused(h100: Node) -> None:
    with pytest.raises(MigError, match="1 is no placement start of GPU-instance profile 3g"):
        h100.mig.create(h100.gpus[0], 9, 1)
    with pytest.raises(MigError, match="has no GPU-instance profile ID 42"):
        h100.mig.create(h100.gpus[0], 42, 0)
    assert h100.mig.instances(h100.gpus[0]) == []


def test_ampere_with_mig_off_is_refused_without_touching_the_mode() -> None:
    node = a100([0, 0])

    with pytest.raises(MigError) as raised:
        node.mig.create(node.gpus[0], 19, 0)

    assert "has MIG mode off" in str(raised.value)
    assert "only on Hopper and later" in str(raised.value)
    assert f"nvidia-smi -i {node.gpus[0].uuid} -mig 1" in str(raised.value)
    assert node.mode(node.gpus[0]) == [OFF, OFF]


def test_ampere_with_mig_pending_says_a_reset_is_needed() -> None:
    node = a100([0, 1])

    with pytest.raises(MigError, match="at the next GPU reset"):
        node.mig.create(node.gpus[0], 19, 0)


def test_ampere_with_mig_on_gets_slices_and_keeps_mig_on_after_the_last() -> None:
    node = a100([1, 1])
    gpu = node.gpus[0]

    device = node.mig.create(gpu, 19, 6)
    assert device.profile == "1g.5gb"
    node.mig.destroy(gpu, 19, 6)

    assert node.mode(gpu) == [ON, ON]
    assert node.mig.instances(gpu) == []


def test_a_failed_compute_instance_destroys_the_gpu_instance_it_made() -> None:
    doc = {
        "driverVersion": "580.95.05",
        "cudaDriverVersion": 13000,
        "gpus": [
            {
                "model": "H100-SXM5-80GB",
                "busId": "0000:1b:00.0",
                "faults": {"gpu_instance_create_compute_instance": "UNKNOWN"},
            }
        ],
    }
    node = Node(SimulatedHost.from_profile(parse_profile(doc, name="h", node_name="node-a")))

    with pytest.raises(MigError) as raised:
        node.mig.create(node.gpus[0], 19, 0)

    assert "cannot create the compute instance of GPU instance" in str(raised.value)
    assert "NVML_ERROR_UNKNOWN" in str(raised.value)
    assert node.mig.instances(node.gpus[0]) == []
    assert node.mode(node.gpus[0]) == [OFF, OFF]  # turned on for it, off again


def test_the_crash_point_sits_between_the_gpu_instance_and_the_compute_instance() -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    gpus = discover_gpus(host.nvml, host.pci)
    seen: list[tuple[str, list[tuple[int, tuple[int, ...]]]]] = []
    mig = MigLifecycle(host.nvml)

    class Crash(BaseException):
        pass

    def crash(point: str) -> None:
        seen.append((point, [(i.placement_start, i.ci_ids) for i in mig.instances(gpus[0])]))
        if point == CRASH_AFTER_GPU_INSTANCE:
            raise Crash

    crashing = MigLifecycle(host.nvml, crash_point=crash)
    with pytest.raises(Crash):
        crashing.create(gpus[0], 19, 2)

    # MIG mode on, no GPU instance; then the GPU instance made, no compute instance yet.
    assert seen[:2] == [(MIG_AFTER_MODE_ON, []), (CRASH_AFTER_GPU_INSTANCE, [(2, ())])]


def test_listing_is_empty_on_a_gpu_with_mig_off(h100: Node) -> None:
    assert h100.mig.instances(h100.gpus[5]) == []
    assert isinstance(h100.nvml, SimulatedNvml)


def test_the_test_crash_setting_is_honoured_on_simulated_nodes_only() -> None:
    assert crash_point_from_env({}, simulated=True) is None
    assert crash_point_from_env({TEST_CRASH_ENV: CRASH_AFTER_GPU_INSTANCE}, simulated=False) is None
    with pytest.raises(ValueError, match="names no fault injection point"):
        crash_point_from_env({TEST_CRASH_ENV: "somewhere"}, simulated=True)
    crash = crash_point_from_env({TEST_CRASH_ENV: CRASH_AFTER_GPU_INSTANCE}, simulated=True)
    assert crash is not None
    crash("another-point")  # not the one asked for: nothing happens


def test_the_test_crash_point_kills_the_process_with_sigkill() -> None:
    code = (
        "from gpu_dra.kubelet_plugin.mig import crash_point_from_env as c\n"
        "c({'GPU_DRA_TEST_CRASH_AT': 'mig-after-gpu-instance'}, simulated=True)"
        "('mig-after-gpu-instance')\n"
        "print('survived')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, timeout=60
    )

    assert done.returncode == -signal.SIGKILL
    assert b"survived" not in done.stdout


# ---- NVML errors are never "no instances" (issue 10) ---------------------------------------------

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


def mig_mode_calls(node: Node, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every MIG mode `node`'s NVML is asked to set from now on."""
    calls: list[int] = []
    real = node.nvml.device_set_mig_mode

    def recorded(handle: object, mode: int) -> int:
        calls.append(mode)
        return real(handle, mode)

    monkeypatch.setattr(node.nvml, "device_set_mig_mode", recorded)
    return calls


def test_destroy_after_a_profile_read_error_fails_and_never_turns_mig_off(
    h100: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = h100.gpus[0]
    made = h100.mig.create(gpu, 19, 0)
    set_modes = mig_mode_calls(h100, monkeypatch)
    h100.nvml.set_fault("device_get_gpu_instance_profile_info", NOT_SUPPORTED, gpu=gpu.index)

    with pytest.raises(MigError) as raised:
        h100.mig.destroy(gpu, 19, 0, gi_id=made.gi_id)

    message = str(raised.value)
    assert "nvmlDeviceGetGpuInstanceProfileInfo answered NVML_ERROR_NOT_SUPPORTED" in message
    assert gpu.uuid in message
    assert set_modes == []
    h100.nvml.set_fault("device_get_gpu_instance_profile_info", None, gpu=gpu.index)
    assert h100.mode(gpu) == [ON, ON]
    assert h100.layout(gpu) == [(19, 0, (made.ci_id,))]
    assert h100.mig.destroy(gpu, 19, 0, gi_id=made.gi_id) is True  # the retry works
    assert h100.mode(gpu) == [OFF, OFF]


def test_mig_on_without_instances_stays_on_when_the_instances_cannot_be_read(
    h100: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = h100.gpus[6]
    h100.nvml.init()
    h100.nvml.device_set_mig_mode(h100.nvml.device_get_handle_by_uuid(gpu.uuid), ON)
    h100.nvml.shutdown()
    set_modes = mig_mode_calls(h100, monkeypatch)
    h100.nvml.set_fault("device_get_gpu_instance_profile_info", NOT_SUPPORTED, gpu=gpu.index)

    with pytest.raises(MigError, match="NVML_ERROR_NOT_SUPPORTED"):
        h100.mig.destroy(gpu, 19, 0)
    with pytest.raises(MigError, match="NVML_ERROR_NOT_SUPPORTED"):
        h100.mig.destroy_all_but(gpu, ())
    with pytest.raises(MigError, match="NVML_ERROR_NOT_SUPPORTED"):
        h100.mig.instances(gpu)

    assert set_modes == []
    assert h100.mode(gpu) == [ON, ON]


def test_create_reports_the_nvml_return_code_not_a_stale_resource_slice(
    h100: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = h100.gpus[0]
    set_modes = mig_mode_calls(h100, monkeypatch)
    h100.nvml.set_fault("device_get_gpu_instance_profile_info", NOT_SUPPORTED, gpu=gpu.index)

    with pytest.raises(MigError) as raised:
        h100.mig.create(gpu, 19, 0)

    message = str(raised.value)
    assert "nvmlDeviceGetGpuInstanceProfileInfo answered NVML_ERROR_NOT_SUPPORTED" in message
    assert "stale ResourceSlice" not in message
    assert set_modes == []  # MIG mode is not touched before the profile is known
    assert h100.mode(gpu) == [OFF, OFF]


def test_create_names_the_code_when_no_compute_instance_profile_answers(h100: Node) -> None:
    gpu = h100.gpus[0]
    h100.nvml.set_fault(
        "gpu_instance_get_compute_instance_profile_info", NOT_SUPPORTED, gpu=gpu.index
    )

    with pytest.raises(MigError) as raised:
        h100.mig.create(gpu, 19, 0)

    message = str(raised.value)
    assert "nvmlGpuInstanceGetComputeInstanceProfileInfo answered NVML_ERROR_NOT_SUPPORTED" in (
        message
    )
    h100.nvml.set_fault("gpu_instance_get_compute_instance_profile_info", None, gpu=gpu.index)
    assert h100.mig.instances(gpu) == []  # the GPU instance it made is gone again
    assert h100.mode(gpu) == [OFF, OFF]


def test_compute_instances_that_cannot_be_listed_are_an_error_not_none(
    h100: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = h100.gpus[0]
    made = h100.mig.create(gpu, 19, 0)
    set_modes = mig_mode_calls(h100, monkeypatch)
    h100.nvml.set_fault("gpu_instance_get_compute_instances", NOT_SUPPORTED, gpu=gpu.index)

    with pytest.raises(MigError, match="nvmlGpuInstanceGetComputeInstances answered"):
        h100.mig.instances(gpu)
    with pytest.raises(MigError, match="NVML_ERROR_NOT_SUPPORTED"):
        h100.mig.destroy(gpu, 19, 0, gi_id=made.gi_id)

    h100.nvml.set_fault("gpu_instance_get_compute_instances", None, gpu=gpu.index)
    assert h100.layout(gpu) == [(19, 0, (made.ci_id,))]
    assert set_modes == []


def test_a_profile_without_any_placement_is_no_stale_slice(
    h100: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        h100.nvml, "device_get_gpu_instance_possible_placements", lambda handle, profile_id: []
    )
    with pytest.raises(MigError) as raised:
        h100.mig.create(h100.gpus[0], 9, 4)
    message = str(raised.value)
    assert "nvmlDeviceGetGpuInstancePossiblePlacements lists no placement" in message
    assert "stale ResourceSlice" not in message
