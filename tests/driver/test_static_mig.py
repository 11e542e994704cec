"""Static MIG: discovery of existing MIG devices, their published form, names and device classes.

The simulated ``hgx-h100-mig`` node has seven H100s in MIG mode with slices made before the
driver started and one H100 with MIG off (layouts in ``machine_profiles.json``). Expected sizes
are NVIDIA's (nvidia-compat.md §3.2, gpu-hardware.json).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

import pytest
import yaml

from gpu_dra.driver.attributes import (
    MAX_ATTRIBUTES_AND_CAPACITIES,
    check_limits,
    mig_device,
    published_devices,
)
from gpu_dra.driver.cel import compile_selector, to_cel_device
from gpu_dra.driver.discovery import discover_devices, discover_gpus
from gpu_dra.driver.model import MigDevice, NodeDevices
from gpu_dra.driver.naming import (
    InvalidNameError,
    MigDeviceName,
    mig_device_name,
    mig_profile_name,
    mig_profile_slug,
    parse_device_name,
)
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.simulated_mig import full_compute_instance_profile
from gpu_dra.driver.nvml.simulated_profiles import builtin_models, parse_profile

DRIVER = "gpu.nvidia.com"
DEVICECLASSES = Path(__file__).resolve().parents[2] / "deviceclasses"
H100_MIG_NAMES = [
    "gpu-0-mig-1g10gb-19-0",
    "gpu-0-mig-1g10gb-19-1",
    "gpu-0-mig-1g10gb-19-2",
    "gpu-0-mig-1g10gb-19-3",
    "gpu-0-mig-1g10gb-19-4",
    "gpu-0-mig-1g10gb-19-5",
    "gpu-0-mig-1g10gb-19-6",
    "gpu-1-mig-2g20gb-14-0",
    "gpu-1-mig-1g10gb-19-2",
    "gpu-1-mig-1g10gb-me-20-3",
    "gpu-1-mig-3g40gb-9-4",
    "gpu-2-mig-4g40gb-5-0",
    "gpu-2-mig-3g40gb-9-4",
    "gpu-3-mig-7g80gb-0-0",
    "gpu-4-mig-1g20gb-15-0",
    "gpu-4-mig-1g20gb-15-2",
    "gpu-4-mig-1g20gb-15-4",
    "gpu-4-mig-1g20gb-15-6",
    "gpu-6-mig-3g40gb-9-4",
]


@cache
def hgx_mig() -> tuple[NodeDevices, SimulatedHost]:
    host = SimulatedHost.load("hgx-h100-mig", "node-a")
    return discover_devices(host.nvml, host.pci), host


def name_of(mig: MigDevice) -> str:
    return mig_device_name(mig.parent.minor, mig.profile, mig.gi_profile_id, mig.placement_start)


def host_of(gpus: list[dict[str, object]]) -> SimulatedHost:
    doc = {"driverVersion": "580.65.06", "cudaDriverVersion": 13000, "gpus": gpus}
    return SimulatedHost.from_profile(parse_profile(doc, name="test", node_name="node-a"))


def the(devices: NodeDevices, name: str) -> MigDevice:
    (found,) = [mig for mig in devices.mig_devices if name_of(mig) == name]
    return found


# ---- discovery ---------------------------------------------------------------------------------


def test_gpus_in_mig_mode_are_discovered_with_mig_on_and_the_others_with_mig_off():
    devices, _ = hgx_mig()
    assert [gpu.minor for gpu in devices.gpus] == list(range(8))
    assert [gpu.mig_enabled for gpu in devices.gpus] == [True] * 7 + [False]


def test_existing_mig_devices_are_discovered_with_nvidias_names_by_gpu_then_placement():
    devices, _ = hgx_mig()
    assert [name_of(mig) for mig in devices.mig_devices] == H100_MIG_NAMES


def test_mig_devices_carry_the_simulators_mig_uuids_and_their_parent():
    devices, host = hgx_mig()
    host.nvml.init()
    try:
        for mig in devices.mig_devices:
            handle = host.nvml.device_get_handle_by_uuid(mig.uuid)
            assert host.nvml.device_is_mig_device_handle(handle)
            parent = host.nvml.device_get_device_handle_from_mig_device_handle(handle)
            assert host.nvml.device_get_uuid(parent) == mig.parent.uuid
            assert host.nvml.device_get_gpu_instance_id(handle) == mig.gi_id
            assert host.nvml.device_get_compute_instance_id(handle) == mig.ci_id
    finally:
        host.nvml.shutdown()
    assert all(mig.uuid.startswith("MIG-") for mig in devices.mig_devices)
    assert len({mig.uuid for mig in devices.mig_devices}) == len(devices.mig_devices)
    assert {mig.parent for mig in devices.mig_devices} == set(devices.gpus[:7]) - {devices.gpus[5]}


def test_a_mig_device_holds_its_profile_placement_and_sizes():
    devices, _ = hgx_mig()
    mig = the(devices, "gpu-1-mig-3g40gb-9-4")
    assert mig == MigDevice(
        parent=devices.gpus[1],
        profile="3g.40gb",
        gi_profile_id=9,
        placement_start=4,
        placement_size=4,
        gi_id=mig.gi_id,  # driver-assigned
        ci_id=0,
        ci_profile_id=2,
        uuid=mig.uuid,
        memory_bytes=40448 * 1024 * 1024,
        multiprocessors=60,
        copy_engines=3,
        decoders=3,
        encoders=0,
        jpeg_engines=3,
        ofa_engines=0,
    )
    assert list(mig.memory_slices) == [4, 5, 6, 7]


def test_media_extension_and_rev2_profiles_get_go_nvlib_names():
    devices, _ = hgx_mig()
    assert the(devices, "gpu-1-mig-1g10gb-me-20-3").profile == "1g.10gb+me"
    rev2 = the(devices, "gpu-4-mig-1g20gb-15-2")
    assert (rev2.profile, rev2.placement_size) == ("1g.20gb", 2)
    assert the(devices, "gpu-3-mig-7g80gb-0-0").placement_size == 8


def test_mig_on_without_instances_and_a_gpu_instance_without_compute_instance_publish_nothing():
    devices, _ = hgx_mig()
    assert not [mig for mig in devices.mig_devices if mig.parent.minor == 5]
    # GPU 6 has a 3g GPU instance at slice 0 with no compute instance: no MIG device there.
    assert [name_of(mig) for mig in devices.mig_devices if mig.parent.minor == 6] == [
        "gpu-6-mig-3g40gb-9-4"
    ]


def test_discover_gpus_still_lists_every_gpu_without_walking_mig():
    _, host = hgx_mig()
    gpus = discover_gpus(host.nvml, host.pci)
    assert gpus == list(hgx_mig()[0].gpus)


def test_whole_gpu_profiles_have_no_mig_devices():
    for spec in ("hgx-h100", "dgx-a100", "mixed", "l4x4", "t4"):
        host = SimulatedHost.load(spec, "node-a")
        devices = discover_devices(host.nvml, host.pci)
        assert devices.mig_devices == ()
        assert list(devices.gpus) == discover_gpus(host.nvml, host.pci)


def test_ampere_static_mig_has_a100_names_and_sizes():
    host = host_of(
        [
            {
                "model": "A100-SXM4-40GB",
                "busId": "0000:07:00.0",
                "migDevices": [{"profileId": 19, "start": 6}, {"profileId": 9, "start": 0}],
            }
        ]
    )
    devices = discover_devices(host.nvml, host.pci)
    assert [name_of(mig) for mig in devices.mig_devices] == [
        "gpu-0-mig-3g20gb-9-0",
        "gpu-0-mig-1g5gb-19-6",
    ]
    small = devices.mig_devices[1]
    sizes = (small.multiprocessors, small.copy_engines, small.decoders, small.encoders)
    assert (*sizes, small.jpeg_engines, small.ofa_engines) == (14, 1, 0, 0, 0, 0)
    assert mig_device(small)["capacity"]["memory"] == {"value": "4864Mi"}


def test_a_pending_mig_mode_is_mig_off_until_the_reset():
    host = host_of([{"model": "A100-SXM4-80GB", "busId": "0000:07:00.0", "migMode": [0, 1]}])
    devices = discover_devices(host.nvml, host.pci)
    assert devices.mig_devices == ()
    assert [d["name"] for d in published_devices(devices.gpus)] == ["gpu-0"]


def test_mig_mode_not_supported_is_mig_off():
    host = host_of(
        [
            {
                "model": "H100-SXM5-80GB",
                "busId": "0000:1b:00.0",
                "migMode": [1, 1],
                "faults": {"device_get_mig_mode": "NOT_SUPPORTED"},
            }
        ]
    )
    devices = discover_devices(host.nvml, host.pci)
    assert not devices.gpus[0].mig_enabled
    assert [d["name"] for d in published_devices(devices.gpus, devices.mig_devices)] == ["gpu-0"]


def test_gpus_with_mig_off_are_not_asked_about_mig():
    host = host_of(
        [
            {
                "model": "H100-SXM5-80GB",
                "busId": "0000:1b:00.0",
                "faults": {"device_get_max_mig_device_count": "UNKNOWN"},
            }
        ]
    )
    assert discover_devices(host.nvml, host.pci).mig_devices == ()


@pytest.mark.parametrize(
    ("call", "nvml_name"),
    [
        ("device_get_max_mig_device_count", "nvmlDeviceGetMaxMigDeviceCount"),
        ("device_get_mig_device_handle_by_index", "nvmlDeviceGetMigDeviceHandleByIndex"),
        ("device_get_gpu_instance_by_id", "nvmlDeviceGetGpuInstanceById"),
        ("gpu_instance_get_info", "nvmlGpuInstanceGetInfo"),
        ("compute_instance_get_info", "nvmlComputeInstanceGetInfo"),
        ("device_get_gpu_instance_profile_info", "nvmlDeviceGetGpuInstanceProfileInfo"),
    ],
)
def test_a_gpu_whose_mig_devices_cannot_be_read_is_left_out_with_the_call_and_code(call, nvml_name):
    host = host_of(
        [
            {
                "model": "H100-SXM5-80GB",
                "busId": "0000:1b:00.0",
                "migDevices": [{"profileId": 19, "start": 0}],
                "faults": {call: "UNKNOWN"},
            },
            {
                "model": "H100-SXM5-80GB",
                "busId": "0000:43:00.0",
                "migDevices": [{"profileId": 19, "start": 0}],
            },
        ]
    )
    found = discover_devices(host.nvml, host.pci)

    (problem,) = found.problems
    assert problem.message.startswith(f"GPU 0 (0000:1b:00.0): {nvml_name} failed")
    assert (problem.index, problem.call, problem.reason) == (0, nvml_name, "NVML_ERROR_UNKNOWN")
    assert (problem.pci_bus_id, problem.uuid) == ("0000:1b:00.0", host.profile.gpus[0].uuid)
    assert [gpu.index for gpu in found.gpus] == [1]
    assert [mig.parent.index for mig in found.mig_devices] == [1]
    assert not host.nvml.initialized


def test_mig_on_without_a_memory_size_is_a_clear_problem():
    host = host_of(
        [
            {
                "model": "H100-SXM5-80GB",
                "busId": "0000:1b:00.0",
                "migDevices": [{"profileId": 19, "start": 0}],
                "faults": {"device_get_memory_info": "NOT_SUPPORTED"},
            }
        ]
    )
    found = discover_devices(host.nvml, host.pci)
    (problem,) = found.problems
    assert "MIG is on but nvmlDeviceGetMemoryInfo" in problem.message
    assert (problem.call, problem.reason) == (
        "nvmlDeviceGetMemoryInfo",
        "NVML_ERROR_NOT_SUPPORTED",
    )
    assert found.gpus == ()
    assert found.mig_devices == ()


@pytest.mark.parametrize("mig_devices", [[{"profileId": 19, "start": 0}], []])
def test_mig_on_whose_profiles_all_answer_not_supported_is_a_problem_not_empty(mig_devices):
    """Issue 10: MIG on, every GPU-instance profile query NOT_SUPPORTED; with or without MIG
    devices, the GPU's MIG state cannot be read."""
    host = host_of(
        [
            {
                "model": "H100-SXM5-80GB",
                "busId": "0000:1b:00.0",
                "migMode": [1, 1],
                "migDevices": mig_devices,
                "faults": {"device_get_gpu_instance_profile_info": "NOT_SUPPORTED"},
            }
        ]
    )
    found = discover_devices(host.nvml, host.pci)
    (problem,) = found.problems
    assert (problem.call, problem.reason) == (
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "NVML_ERROR_NOT_SUPPORTED",
    )
    assert "for every GPU-instance profile index" in problem.message
    assert found.gpus == ()
    assert found.mig_devices == ()


# ---- profile names (go-nvlib) -------------------------------------------------------------------


def mig_models():
    return [
        (model, profile)
        for model in builtin_models().values()
        if model.mig is not None
        for profile in model.mig.profiles
    ]


@pytest.mark.parametrize(
    ("model", "profile"),
    mig_models(),
    ids=lambda value: getattr(value, "key", None) or getattr(value, "name", None),
)
def test_go_nvlib_profile_names_reproduce_the_models_profile_tables(model, profile):
    assert model.memory_total_mib is not None
    name = mig_profile_name(
        profile.index,
        full_compute_instance_profile(profile),
        profile.memory_mib,
        model.memory_total_mib * 1024 * 1024,
    )
    assert name == profile.name


def test_a_compute_instance_smaller_than_its_gpu_instance_is_named_c_g():
    total = 81559 * 1024 * 1024
    assert mig_profile_name(2, 0, 40448, total) == "1c.3g.40gb"  # 3g GI, 1-slice CI
    assert mig_profile_name(7, 0, 9984, total) == "1g.10gb+me"
    assert mig_profile_name(3, 1, 40448, total) == "2c.4g.40gb"


def test_unknown_profile_constants_use_the_slice_counts_or_fail():
    total = 81559 * 1024 * 1024
    assert mig_profile_name(17, 99, 40448, total, gi_slices=3, ci_slices=3) == "3g.40gb"
    with pytest.raises(InvalidNameError):
        mig_profile_name(17, 2, 40448, total)
    with pytest.raises(InvalidNameError):
        mig_profile_name(2, 2, 40448, 0)


# ---- names --------------------------------------------------------------------------------------


def test_mig_device_names_round_trip_through_the_parser():
    devices, _ = hgx_mig()
    for mig in devices.mig_devices:
        name = name_of(mig)
        parsed = parse_device_name(name)
        assert parsed == MigDeviceName(
            mig.parent.minor, mig_profile_slug(mig.profile), mig.gi_profile_id, mig.placement_start
        )
        assert str(parsed) == name


# ---- published form -----------------------------------------------------------------------------


def test_h100_3g40gb_has_nvidias_capacities_and_memory_slices():
    devices, _ = hgx_mig()
    device = mig_device(the(devices, "gpu-1-mig-3g40gb-9-4"))
    assert device["capacity"] == {
        "multiprocessors": {"value": "60"},
        "copyEngines": {"value": "3"},
        "decoders": {"value": "3"},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": "3"},
        "ofaEngines": {"value": "0"},
        "memory": {"value": "40448Mi"},
        "memorySlice4": {"value": "1"},
        "memorySlice5": {"value": "1"},
        "memorySlice6": {"value": "1"},
        "memorySlice7": {"value": "1"},
    }


def test_memory_slices_follow_the_placement():
    devices, _ = hgx_mig()
    for mig in devices.mig_devices:
        capacity = mig_device(mig)["capacity"]
        slices = sorted(int(key.removeprefix("memorySlice")) for key in capacity if "Slice" in key)
        assert slices == list(range(mig.placement_start, mig.placement_start + mig.placement_size))


def test_mig_attributes_are_nvidias_with_the_parents_copied():
    devices, _ = hgx_mig()
    mig = the(devices, "gpu-2-mig-4g40gb-5-0")
    parent = mig.parent
    assert mig_device(mig)["attributes"] == {
        "type": {"string": "mig"},
        "uuid": {"string": mig.uuid},
        "parentUUID": {"string": parent.uuid},
        "profile": {"string": "4g.40gb"},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "brand": {"string": "Nvidia"},
        "architecture": {"string": "Hopper"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "580.95.5"},
        "cudaDriverVersion": {"version": "13.0.0"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:52:00.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:4f"},
        "resource.kubernetes.io/numaNode": {"int": 0},
    }


def test_the_largest_mig_device_with_every_optional_attribute_is_within_the_api_limits():
    devices, _ = hgx_mig()
    mig = the(devices, "gpu-3-mig-7g80gb-0-0")
    full = dataclasses.replace(mig, parent=dataclasses.replace(mig.parent, addressing_mode=1))
    device = mig_device(full)
    count = len(device["attributes"]) + len(device["capacity"])
    assert count == 14 + 7 + 8  # attributes, sizes, memory slices
    assert count <= MAX_ATTRIBUTES_AND_CAPACITIES
    assert device["attributes"]["addressingMode"] == {"string": "HMM"}
    check_limits(device)


def test_optional_parent_attributes_are_left_out_when_the_parent_lacks_them():
    devices, _ = hgx_mig()
    mig = the(devices, "gpu-0-mig-1g10gb-19-0")
    bare = dataclasses.replace(mig.parent, pcie_root=None, numa_node=None)
    attributes = mig_device(dataclasses.replace(mig, parent=bare))["attributes"]
    assert "resource.kubernetes.io/pcieRoot" not in attributes
    assert "resource.kubernetes.io/numaNode" not in attributes


def test_published_devices_hide_mig_parents_and_order_by_bus_then_placement():
    devices, _ = hgx_mig()
    published = published_devices(devices.gpus, devices.mig_devices)
    assert [d["name"] for d in published] == [*H100_MIG_NAMES, "gpu-7"]
    assert [d["attributes"]["type"]["string"] for d in published] == ["mig"] * 19 + ["gpu"]
    reversed_input = published_devices(devices.gpus[::-1], devices.mig_devices[::-1])
    assert reversed_input == published


def test_a_mig_parent_is_hidden_even_without_mig_devices():
    devices, _ = hgx_mig()
    assert [d["name"] for d in published_devices(devices.gpus)] == ["gpu-7"]
    assert devices.gpus[0].mig_enabled


# ---- device classes (CEL as the scheduler evaluates it) ------------------------------------------


@cache
def device_class(name: str) -> list[str]:
    doc = yaml.safe_load((DEVICECLASSES / f"{name}.yaml").read_text())
    return [selector["cel"]["expression"] for selector in doc["spec"]["selectors"]]


def selected(class_name: str) -> list[str]:
    devices, _ = hgx_mig()
    selectors = [compile_selector(text) for text in device_class(class_name)]
    return [
        device["name"]
        for device in published_devices(devices.gpus, devices.mig_devices)
        if all(s.matches(to_cel_device(DRIVER, device)) for s in selectors)
    ]


def test_the_mig_device_class_selects_exactly_the_static_mig_devices():
    assert selected("mig.nvidia.com") == H100_MIG_NAMES


@pytest.mark.parametrize(
    "class_name",
    [
        "gpu.nvidia.com",
        "hopper.gpu.nvidia.com",
        "large-memory.gpu.nvidia.com",
        "training.gpu.nvidia.com",
    ],
)
def test_whole_gpu_classes_select_only_the_gpu_with_mig_off(class_name):
    assert selected(class_name) == ["gpu-7"]


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("device.attributes['gpu.nvidia.com'].profile == '3g.40gb'", 3),
        ("device.attributes['gpu.nvidia.com'].profile == '1g.10gb+me'", 1),
        ("device.capacity['gpu.nvidia.com'].multiprocessors.isGreaterThan(quantity('30'))", 6),
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('39Gi')) >= 0", 5),
        ("'memorySlice7' in device.capacity['gpu.nvidia.com']", 5),
    ],
)
def test_nvidia_style_mig_selectors_pick_the_expected_slices(expression, expected):
    devices, _ = hgx_mig()
    selector = compile_selector(expression)
    migs = [mig_device(mig) for mig in devices.mig_devices]
    assert sum(selector.matches(to_cel_device(DRIVER, d)) for d in migs) == expected
