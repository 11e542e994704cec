"""The simulator's utilization: rates per GPU, processes per GPU and MIG device, memory used,
and what NVML does not offer on MIG (utilization rates, per-process utilization)."""

from __future__ import annotations

import pynvml
import pytest

from gpu_dra.driver.nvml.interface import NVML_ERROR_GPU_IS_LOST
from gpu_dra.driver.nvml.simulated import SimulatedHost, SimulatedNvml
from gpu_dra.driver.nvml.simulated_utilization import (
    DeviceActivity,
    SimulatedProcess,
    UtilizationError,
)

GIB = 2**30


@pytest.fixture
def nvml() -> SimulatedNvml:
    nvml = SimulatedHost.load("hgx-h100", "node-a").nvml
    nvml.init()
    return nvml


def test_devices_are_idle_until_set(nvml: SimulatedNvml) -> None:
    handle = nvml.device_get_handle_by_index(0)
    rates = nvml.device_get_utilization_rates(handle)
    assert (rates.gpu, rates.memory) == (0, 0)
    assert nvml.device_get_compute_running_processes(handle) == []
    assert nvml.device_get_memory_info(handle).used == 0


def test_rates_processes_and_memory_follow_what_was_set(nvml: SimulatedNvml) -> None:
    uuid = nvml.set_activity(
        1,
        DeviceActivity(
            gpu_percent=85,
            memory_percent=40,
            processes=(
                SimulatedProcess(100, used_memory_bytes=3 * GIB, sm_percent=60),
                SimulatedProcess(200, used_memory_bytes=GIB, sm_percent=25),
            ),
        ),
    )
    handle = nvml.device_get_handle_by_uuid(uuid)
    assert handle is nvml.device_get_handle_by_index(1)
    rates = nvml.device_get_utilization_rates(handle)
    assert (rates.gpu, rates.memory) == (85, 40)
    memory = nvml.device_get_memory_info(handle)
    assert (memory.used, memory.free) == (4 * GIB, memory.total - 4 * GIB)
    listed = nvml.device_get_compute_running_processes(handle)
    assert [(p.pid, p.usedGpuMemory) for p in listed] == [(100, 3 * GIB), (200, GIB)]
    samples = nvml.device_get_process_utilization(handle, 0)
    assert {(s.pid, s.smUtil) for s in samples} == {(100, 60), (200, 25)}
    newest = max(s.timeStamp for s in samples)
    assert nvml.device_get_process_utilization(handle, newest + 10**9) == []
    # other GPUs stay idle
    assert nvml.device_get_utilization_rates(nvml.device_get_handle_by_index(0)).gpu == 0


def test_explicit_memory_used_wins_and_is_capped_at_the_total(nvml: SimulatedNvml) -> None:
    nvml.set_activity(0, DeviceActivity(memory_used_bytes=10**15))
    memory = nvml.device_get_memory_info(nvml.device_get_handle_by_index(0))
    assert (memory.used, memory.free) == (memory.total, 0)


def test_mig_devices_report_memory_and_processes_but_no_utilization(nvml: SimulatedNvml) -> None:
    gpu = nvml.device_get_handle_by_index(0)
    nvml.device_set_mig_mode(gpu, pynvml.NVML_DEVICE_MIG_ENABLE)
    info = nvml.device_get_gpu_instance_profile_info(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    gi = nvml.device_create_gpu_instance(gpu, info.id)
    ci = nvml.gpu_instance_create_compute_instance(gi, 0)
    mig = nvml.compute_instance_get_info(ci).device
    uuid = nvml.device_get_uuid(mig)
    nvml.set_activity(uuid, DeviceActivity(processes=(SimulatedProcess(7, 2 * GIB, 50),)))
    assert nvml.device_get_memory_info(mig).used == 2 * GIB
    (process,) = nvml.device_get_compute_running_processes(mig)
    assert (process.pid, process.gpuInstanceId) == (7, nvml.device_get_gpu_instance_id(mig))
    for call in (nvml.device_get_utilization_rates, nvml.device_get_process_utilization):
        args = (mig,) if call == nvml.device_get_utilization_rates else (mig, 0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(*args)  # type: ignore[operator]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_utilization_rates(gpu)  # NVML: not supported on MIG-enabled GPUs


def test_utilization_calls_take_injected_faults_and_lost_gpus(nvml: SimulatedNvml) -> None:
    nvml.set_fault("device_get_utilization_rates", pynvml.NVML_ERROR_UNKNOWN, gpu=2)
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.device_get_utilization_rates(nvml.device_get_handle_by_index(2))
    nvml.device_get_utilization_rates(nvml.device_get_handle_by_index(3))
    handle = nvml.device_get_handle_by_index(4)
    nvml.lose_gpu(4)
    with pytest.raises(pynvml.NVMLError) as raised:
        nvml.device_get_compute_running_processes(handle)
    assert raised.value.value == NVML_ERROR_GPU_IS_LOST


@pytest.mark.parametrize(
    ("activity", "message"),
    [
        (lambda: DeviceActivity(gpu_percent=101), "gpu utilization 101"),
        (lambda: DeviceActivity(memory_used_bytes=-1), "negative"),
        (lambda: SimulatedProcess(0), "pid must be positive"),
        (lambda: SimulatedProcess(5, sm_percent=-1), "sm -1"),
        (
            lambda: DeviceActivity(processes=(SimulatedProcess(5), SimulatedProcess(5))),
            "listed twice",
        ),
    ],
)
def test_impossible_activity_is_refused(activity, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UtilizationError, match=message):
        activity()


def test_unknown_gpu_is_refused(nvml: SimulatedNvml) -> None:
    with pytest.raises(ValueError, match="no simulated GPU"):
        nvml.set_activity("GPU-nope", DeviceActivity())
