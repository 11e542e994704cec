"""Whole-GPU discovery over the simulated NVML: facts, optional facts, and failures."""

from __future__ import annotations

import pytest

from gpu_dra.driver.discovery import DiscoveryError, discover_devices, discover_gpus
from gpu_dra.driver.model import Gpu
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.simulated_profiles import parse_profile
from tests.fakes.gpus import h100


def _discover(spec: str, node: str = "node-a") -> tuple[list[Gpu], SimulatedHost]:
    host = SimulatedHost.load(spec, node)
    return discover_gpus(host.nvml, host.pci), host


def _host(gpus: list[dict[str, object]], **extra: object) -> SimulatedHost:
    doc = {"driverVersion": "580.65.06", "cudaDriverVersion": 13000, "gpus": gpus, **extra}
    return SimulatedHost.from_profile(parse_profile(doc, name="test", node_name="node-a"))


def test_hgx_h100_gpus_are_discovered_in_pci_order_with_all_facts():
    gpus, host = _discover("hgx-h100")
    assert [gpu.index for gpu in gpus] == list(range(8))
    assert [gpu.minor for gpu in gpus] == list(range(8))
    first = gpus[0]
    assert first == h100(
        minor=0,
        uuid=host.profile.gpus[0].uuid,
        driver_version="580.95.05",
        pci_bus_id="0000:1b:00.0",
        pcie_root="pci0000:18",
        numa_node=0,
    )
    assert (first.product_name, first.memory_bytes) == ("NVIDIA H100 80GB HBM3", 81559 * 2**20)
    assert (first.addressing_mode, first.mig_capable, first.mig_enabled) == (None, True, False)
    assert [gpu.numa_node for gpu in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_nvml_is_shut_down_after_discovery():
    _, host = _discover("l4x4")
    assert not host.nvml.initialized


def test_gpus_without_mig_are_not_mig_capable():
    gpus, _ = _discover("l4x4")
    assert not any(gpu.mig_capable or gpu.mig_enabled for gpu in gpus)


def test_vm_without_numa_information_has_no_numa_node():
    gpus, _ = _discover("t4")
    assert gpus[0].numa_node is None
    assert gpus[0].pci_bus_id == "0000:00:1e.0"


def test_mig_mode_current_and_pending_are_read_separately():
    host = _host([{"model": "A100-SXM4-80GB", "busId": "00000000:07:00.0", "migMode": [0, 1]}])
    (gpu,) = discover_gpus(host.nvml, host.pci)
    assert (gpu.mig_capable, gpu.mig_enabled, gpu.mig_pending_enabled) == (True, False, True)


def test_device_name_source_is_the_minor_number_not_the_index():
    host = _host(
        [
            {"model": "L4", "busId": "00000000:01:00.0", "minor": 3},
            {"model": "L4", "busId": "00000000:41:00.0", "minor": 0},
        ]
    )
    gpus = discover_gpus(host.nvml, host.pci)
    assert [(gpu.index, gpu.minor) for gpu in gpus] == [(0, 3), (1, 0)]


def test_not_supported_optional_facts_are_left_out():
    host = _host(
        [
            {
                "model": "H100-SXM5-80GB",
                "busId": "00000000:1B:00.0",
                "faults": {"device_get_memory_info": "NOT_SUPPORTED"},
            }
        ]
    )
    (gpu,) = discover_gpus(host.nvml, host.pci)
    assert gpu.memory_bytes is None


def test_addressing_mode_is_read_where_nvml_supports_it():
    host = _host(
        [{"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0", "addressingMode": "ATS"}]
    )
    (gpu,) = discover_gpus(host.nvml, host.pci)
    assert gpu.addressing_mode == 2


def test_a_failing_required_call_names_the_gpu_the_call_and_the_nvml_error():
    host = _host(
        [
            {"model": "L4", "busId": "00000000:01:00.0"},
            {
                "model": "L4",
                "busId": "00000000:41:00.0",
                "faults": {"device_get_uuid": "GPU_IS_LOST"},
            },
        ]
    )
    with pytest.raises(DiscoveryError) as raised:
        discover_gpus(host.nvml, host.pci)
    message = str(raised.value)
    assert "GPU 1 (0000:41:00.0)" in message
    assert "nvmlDeviceGetUUID" in message
    assert "NVML_ERROR_GPU_IS_LOST" in message
    assert raised.value.gpu_index == 1
    assert not host.nvml.initialized


def test_discover_devices_leaves_a_gpu_out_with_its_problem_and_keeps_the_others():
    host = _host(
        [
            {"model": "L4", "busId": "00000000:01:00.0"},
            {
                "model": "L4",
                "busId": "00000000:41:00.0",
                "faults": {"device_get_name": "GPU_IS_LOST"},
            },
            {"model": "L4", "busId": "00000000:81:00.0"},
        ]
    )
    found = discover_devices(host.nvml, host.pci)

    assert [gpu.index for gpu in found.gpus] == [0, 2]
    (problem,) = found.problems
    assert problem.index == 1
    assert problem.pci_bus_id == "0000:41:00.0"
    assert problem.uuid == host.profile.gpus[1].uuid
    assert problem.call == "nvmlDeviceGetName"
    assert problem.reason == "NVML_ERROR_GPU_IS_LOST"
    assert problem.message.startswith("GPU 1 (0000:41:00.0): nvmlDeviceGetName failed")
    assert "NVML_ERROR_GPU_IS_LOST" in problem.message
    assert not host.nvml.initialized


def test_a_gpu_whose_handle_or_pci_info_fails_is_a_problem_without_identity():
    host = _host(
        [{"model": "L4", "busId": "00000000:01:00.0", "faults": {"device_get_pci_info": 777}}]
    )
    found = discover_devices(host.nvml, host.pci)
    assert found.gpus == ()
    (problem,) = found.problems
    assert (problem.index, problem.pci_bus_id, problem.uuid) == (0, None, None)
    assert (problem.call, problem.reason) == ("nvmlDeviceGetPciInfo", "NVML_ERROR_777")


def test_mig_mode_errors_other_than_not_supported_are_problems_not_mig_off():
    host = _host(
        [
            {
                "model": "H100-SXM5-80GB",
                "busId": "00000000:1B:00.0",
                "faults": {"device_get_mig_mode": "UNKNOWN"},
            }
        ]
    )
    found = discover_devices(host.nvml, host.pci)
    assert found.gpus == ()
    (problem,) = found.problems
    assert (problem.call, problem.reason) == ("nvmlDeviceGetMigMode", "NVML_ERROR_UNKNOWN")


def test_discover_gpus_is_strict_and_counts_the_other_failed_gpus():
    lost = {"device_get_uuid": "GPU_IS_LOST"}
    host = _host(
        [
            {"model": "L4", "busId": "00000000:01:00.0", "faults": lost},
            {"model": "L4", "busId": "00000000:41:00.0", "faults": lost},
        ]
    )
    with pytest.raises(DiscoveryError, match=r"and 1 more GPU\(s\)") as raised:
        discover_gpus(host.nvml, host.pci)
    assert raised.value.gpu_index == 0
    assert raised.value.call == "nvmlDeviceGetUUID"


def test_node_wide_failures_carry_the_call_and_return_code():
    host = _host(
        [{"model": "L4", "busId": "00000000:01:00.0"}], faults={"device_get_count": "UNKNOWN"}
    )
    with pytest.raises(DiscoveryError) as raised:
        discover_devices(host.nvml, host.pci)
    assert raised.value.call == "nvmlDeviceGetCount"
    assert raised.value.return_code == 999
    assert "NVML_ERROR_UNKNOWN" in str(raised.value)


def test_other_errors_from_optional_calls_are_not_swallowed():
    host = _host(
        [{"model": "L4", "busId": "00000000:01:00.0", "faults": {"device_get_memory_info": 999}}]
    )
    with pytest.raises(DiscoveryError, match="nvmlDeviceGetMemoryInfo"):
        discover_gpus(host.nvml, host.pci)


def test_nvml_init_failure_tells_to_check_the_driver_and_driver_root():
    host = _host([], faults={"init": "DRIVER_NOT_LOADED"})
    with pytest.raises(DiscoveryError) as raised:
        discover_gpus(host.nvml, host.pci)
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in str(raised.value)
    assert "driver root" in str(raised.value)
    assert raised.value.gpu_index is None


def test_a_failing_system_call_is_reported_by_name():
    host = _host(
        [{"model": "L4", "busId": "00000000:01:00.0"}],
        faults={"system_get_cuda_driver_version": "FUNCTION_NOT_FOUND"},
    )
    with pytest.raises(DiscoveryError, match="nvmlSystemGetCudaDriverVersion"):
        discover_gpus(host.nvml, host.pci)


def test_node_without_gpus_yields_no_gpus():
    host = _host([])
    assert discover_gpus(host.nvml, host.pci) == []
