"""The simulated NVML answers like libnvidia-ml through pynvml: same values, types and errors."""

from __future__ import annotations

import pynvml
import pytest

from gpu_dra.driver.nvml.interface import NVML_INIT_FLAG_NO_GPUS, return_code
from gpu_dra.driver.nvml.simulated import SimulatedHost, SimulatedNvml
from gpu_dra.driver.nvml.simulated_profiles import load_profile, parse_profile


def _nvml(spec: str = "hgx-h100", node: str = "node-a") -> SimulatedNvml:
    nvml = SimulatedNvml(load_profile(spec, node))
    nvml.init()
    return nvml


@pytest.mark.parametrize(
    "call",
    [
        lambda nvml: nvml.device_get_count(),
        lambda nvml: nvml.system_get_driver_version(),
        lambda nvml: nvml.system_get_cuda_driver_version(),
        lambda nvml: nvml.device_get_handle_by_index(0),
        lambda nvml: nvml.shutdown(),
    ],
)
def test_calls_before_init_raise_uninitialized(call):
    nvml = SimulatedNvml(load_profile("t4", "node-a"))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        call(nvml)


def test_device_calls_after_shutdown_raise_uninitialized():
    nvml = _nvml()
    handle = nvml.device_get_handle_by_index(0)
    nvml.shutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.device_get_uuid(handle)


def test_init_is_reference_counted_like_nvml():
    nvml = _nvml()
    nvml.init_with_flags(NVML_INIT_FLAG_NO_GPUS)
    nvml.shutdown()
    assert nvml.device_get_count() == 8
    nvml.shutdown()
    assert not nvml.initialized
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.shutdown()


@pytest.mark.parametrize("index", [-1, 8, 100])
def test_handle_for_index_out_of_range_raises_invalid_argument(index):
    with pytest.raises(pynvml.NVMLError_InvalidArgument) as raised:
        _nvml().device_get_handle_by_index(index)
    assert raised.value.value == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_handle_from_another_library_instance_raises_invalid_argument():
    other = _nvml().device_get_handle_by_index(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _nvml().device_get_name(other)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        _nvml().device_get_name(object())


def test_errors_are_the_exact_pynvml_classes_with_the_code_in_value():
    nvml = _nvml("l4x4")
    with pytest.raises(pynvml.NVMLError) as raised:
        nvml.device_get_mig_mode(nvml.device_get_handle_by_index(0))
    assert type(raised.value) is pynvml.NVMLError_NotSupported
    assert return_code(raised.value) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert str(raised.value) == "Not Supported"


@pytest.mark.parametrize("spec", ["l4x4", "t4"])
def test_mig_mode_is_not_supported_on_gpus_without_mig(spec):
    nvml = _nvml(spec)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_mig_mode(nvml.device_get_handle_by_index(0))


@pytest.mark.parametrize("spec", ["hgx-h100", "dgx-a100"])
def test_mig_mode_of_mig_capable_gpus_is_current_and_pending_like_pynvml(spec):
    nvml = _nvml(spec)
    assert nvml.device_get_mig_mode(nvml.device_get_handle_by_index(0)) == [0, 0]


def test_gpu_numa_id_and_addressing_mode_are_not_supported_on_x86_profiles():
    nvml = _nvml()
    handle = nvml.device_get_handle_by_index(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_numa_node_id(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_addressing_mode(handle)


def test_values_have_pynvml_types_and_formats():
    nvml = _nvml()
    handle = nvml.device_get_handle_by_index(0)
    assert nvml.system_get_driver_version() == "580.95.05"
    assert nvml.system_get_cuda_driver_version() == 13000
    assert nvml.device_get_name(handle) == "NVIDIA H100 80GB HBM3"
    assert nvml.device_get_brand(handle) == pynvml.NVML_BRAND_NVIDIA
    assert nvml.device_get_architecture(handle) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert nvml.device_get_cuda_compute_capability(handle) == (9, 0)
    assert nvml.device_get_minor_number(handle) == 0
    pci = nvml.device_get_pci_info(handle)
    assert isinstance(pci, pynvml.nvmlPciInfo_t)
    assert pci.busId == "00000000:1B:00.0"
    assert pci.busIdLegacy == "0000:1B:00.0"
    assert (pci.domain, pci.bus, pci.device) == (0, 0x1B, 0)
    assert pci.pciDeviceId == 0x233010DE
    memory = nvml.device_get_memory_info(handle)
    assert isinstance(memory, pynvml.c_nvmlMemory_t)
    assert memory.total == 81559 * 1024 * 1024


def test_handles_are_stable_per_gpu_and_found_by_uuid():
    nvml = _nvml()
    handle = nvml.device_get_handle_by_index(3)
    assert nvml.device_get_handle_by_index(3) is handle
    assert nvml.device_get_handle_by_uuid(nvml.device_get_uuid(handle)) is handle


def test_handle_by_unknown_uuid_raises_not_found_and_malformed_invalid_argument():
    nvml = _nvml()
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.device_get_handle_by_uuid("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.device_get_handle_by_uuid("not-a-uuid")


def test_profile_faults_raise_the_chosen_nvml_error_from_that_call_only():
    profile = parse_profile(
        {
            "driverVersion": "580.95.05",
            "cudaDriverVersion": 13000,
            "gpus": [
                {
                    "model": "H100-SXM5-80GB",
                    "busId": "00000000:1B:00.0",
                    "faults": {"device_get_uuid": "GPU_IS_LOST", "device_get_memory_info": 3},
                }
            ],
        },
        name="faulty",
        node_name="node-a",
    )
    nvml = SimulatedHost.from_profile(profile).nvml
    nvml.init()
    handle = nvml.device_get_handle_by_index(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.device_get_uuid(handle)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_memory_info(handle)
    assert nvml.device_get_name(handle) == "NVIDIA H100 80GB HBM3"


def test_init_fault_raises_like_a_missing_driver():
    profile = parse_profile(
        {
            "driverVersion": "580.95.05",
            "cudaDriverVersion": 13000,
            "faults": {"init": "DRIVER_NOT_LOADED"},
            "gpus": [],
        },
        name="no-driver",
        node_name="node-a",
    )
    nvml = SimulatedNvml(profile)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        nvml.init_with_flags(0)
    assert not nvml.initialized


def test_simulated_pci_topology_answers_for_profile_gpus_only():
    host = SimulatedHost.load("dgx-a100", "node-a")
    assert host.pci.pcie_root("0000:07:00.0") == "pci0000:00"
    assert host.pci.numa_node("0000:bd:00.0") == 5
    assert host.pci.pcie_root("0000:99:00.0") is None
    assert host.pci.numa_node("0000:99:00.0") is None


def test_profile_level_fault_hits_system_calls():
    profile = parse_profile(
        {
            "driverVersion": "580.95.05",
            "cudaDriverVersion": 13000,
            "faults": {"device_get_count": "UNKNOWN"},
            "gpus": [{"model": "L4", "busId": "00000000:01:00.0"}],
        },
        name="flaky",
        node_name="node-a",
    )
    nvml = SimulatedNvml(profile)
    nvml.init()
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.device_get_count()
    assert nvml.device_get_name(nvml.device_get_handle_by_index(0)) == "NVIDIA L4"


def test_set_fault_fails_one_call_of_one_gpu_until_cleared():
    nvml = SimulatedHost.load("hgx-h100", "node-a").nvml
    nvml.init()
    first, second = nvml.device_get_handle_by_index(0), nvml.device_get_handle_by_index(1)
    nvml.set_fault("device_get_gpu_instance_profile_info", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_gpu_instance_profile_info(first, 0)
    assert nvml.device_get_gpu_instance_profile_info(second, 0).id == 19
    nvml.set_fault("device_get_gpu_instance_profile_info", None, gpu=0)
    assert nvml.device_get_gpu_instance_profile_info(first, 0).id == 19


def test_set_fault_node_wide_and_over_the_profiles_faults():
    profile = parse_profile(
        {
            "driverVersion": "580.95.05",
            "cudaDriverVersion": 13000,
            "faults": {"device_get_count": "UNKNOWN"},
            "gpus": [{"model": "L4", "busId": "00000000:01:00.0"}],
        },
        name="flaky",
        node_name="node-a",
    )
    nvml = SimulatedNvml(profile)
    nvml.set_fault("init", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        nvml.init()
    nvml.set_fault("init", None)
    nvml.init()
    with pytest.raises(pynvml.NVMLError_Unknown):
        nvml.device_get_count()
    nvml.set_fault("device_get_count", None)  # cleared: the profile's fault is overridden too
    assert nvml.device_get_count() == 1


def test_set_fault_refuses_calls_of_the_other_kind_and_unknown_gpus():
    nvml = SimulatedHost.load("t4", "node-a").nvml
    with pytest.raises(ValueError, match="no per-GPU NVML call"):
        nvml.set_fault("device_get_count", 999, gpu=0)
    with pytest.raises(ValueError, match="no node-wide NVML call"):
        nvml.set_fault("device_get_uuid", 999)
    with pytest.raises(ValueError, match="no GPU 1"):
        nvml.set_fault("device_get_uuid", 999, gpu=1)


# -- compute mode ----------------------------------------------------------------------------


def test_compute_mode_starts_default_and_is_set_per_gpu():
    nvml = _nvml()
    first, second = nvml.device_get_handle_by_index(0), nvml.device_get_handle_by_index(1)
    assert nvml.device_get_compute_mode(first) == pynvml.NVML_COMPUTEMODE_DEFAULT

    nvml.device_set_compute_mode(first, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)

    assert nvml.device_get_compute_mode(first) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert nvml.device_get_compute_mode(second) == pynvml.NVML_COMPUTEMODE_DEFAULT
    nvml.device_set_compute_mode(first, pynvml.NVML_COMPUTEMODE_DEFAULT)
    assert nvml.device_get_compute_mode(first) == pynvml.NVML_COMPUTEMODE_DEFAULT


@pytest.mark.parametrize("mode", [pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD, 4, -1])
def test_a_removed_or_unknown_compute_mode_is_an_invalid_argument(mode):
    nvml = _nvml()
    handle = nvml.device_get_handle_by_index(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.device_set_compute_mode(handle, mode)
    assert nvml.device_get_compute_mode(handle) == pynvml.NVML_COMPUTEMODE_DEFAULT


def test_mig_devices_have_no_compute_mode_and_mig_gpus_refuse_exclusive_process():
    nvml = _nvml("hgx-h100-mig")
    parent = nvml.device_get_handle_by_index(0)
    assert nvml.device_get_mig_mode(parent)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    mig = nvml.device_get_mig_device_handle_by_index(parent, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_set_compute_mode(mig, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_compute_mode(mig)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_set_compute_mode(parent, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    nvml.device_set_compute_mode(parent, pynvml.NVML_COMPUTEMODE_DEFAULT)  # allowed


def test_compute_mode_calls_need_init():
    nvml = _nvml()
    handle = nvml.device_get_handle_by_index(0)
    nvml.shutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.device_set_compute_mode(handle, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.device_get_compute_mode(handle)


def test_memory_limits_per_cgroup_are_a_function_of_the_615_branch():
    old = _nvml()  # driver 580.95.05: the library has no nvmlDeviceGetMemoryLimits_v1
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        old.device_get_memory_limits(old.device_get_handle_by_index(0), "/sys/fs/cgroup/x")
    new = SimulatedNvml(
        parse_profile(
            {
                "driverVersion": "615.71.09",
                "cudaDriverVersion": 13040,
                "gpus": [{"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0"}],
            },
            name="r615",
            node_name="node-a",
        )
    )
    new.init()
    handle = new.device_get_handle_by_index(0)
    with pytest.raises(pynvml.NVMLError_NotFound):  # no limit set for that cgroup
        new.device_get_memory_limits(handle, "/sys/fs/cgroup/kubepods.slice")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        new.device_get_memory_limits(handle, "kubepods.slice")


def test_memory_limits_of_a_mig_device_are_not_supported():
    nvml = _nvml("hgx-h100-mig")
    mig = nvml.device_get_mig_device_handle_by_index(nvml.device_get_handle_by_index(0), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_memory_limits(mig, "/sys/fs/cgroup/x")
