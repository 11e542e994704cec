"""Simulated machine profiles: built-in names, profile files, stable UUIDs and clear errors."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from gpu_dra.driver.nvml.simulated_profiles import (
    ProfileError,
    builtin_profile_names,
    load_profile,
    nvml_bus_id,
    parse_profile,
)

GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
NVML_BUS_ID = re.compile(r"^[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$")

PROFILES = ["dgx-a100", "hgx-h100", "hgx-h100-mig", "l4x4", "mixed", "t4"]


def _doc(**overrides):
    doc = {
        "driverVersion": "580.95.05",
        "cudaDriverVersion": 13000,
        "gpus": [{"model": "L4", "busId": "00000000:01:00.0"}],
    }
    doc.update(overrides)
    return doc


def test_builtin_profiles_are_the_documented_ones():
    assert builtin_profile_names() == PROFILES


@pytest.mark.parametrize(
    ("spec", "count", "name"),
    [
        ("hgx-h100", 8, "NVIDIA H100 80GB HBM3"),
        ("dgx-a100", 8, "NVIDIA A100-SXM4-80GB"),
        ("l4x4", 4, "NVIDIA L4"),
        ("t4", 1, "Tesla T4"),
    ],
)
def test_builtin_profiles_hold_real_product_names(spec, count, name):
    gpus = load_profile(spec, "node-a").gpus
    assert len(gpus) == count
    assert {gpu.model.name for gpu in gpus} == {name}


def test_mixed_profile_has_two_a100_pcie_and_two_l4():
    names = [gpu.model.name for gpu in load_profile("mixed", "node-a").gpus]
    assert names == ["NVIDIA A100 80GB PCIe"] * 2 + ["NVIDIA L4"] * 2


def test_dgx_a100_spreads_gpus_over_four_of_eight_numa_nodes():
    gpus = load_profile("dgx-a100", "node-a").gpus
    assert [gpu.numa_node for gpu in gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert gpus[0].pcie_root == gpus[1].pcie_root != gpus[2].pcie_root


@pytest.mark.parametrize("spec", PROFILES)
def test_uuids_and_bus_ids_have_the_real_nvml_formats(spec):
    for gpu in load_profile(spec, "node-a").gpus:
        assert GPU_UUID.match(gpu.uuid), gpu.uuid
        assert NVML_BUS_ID.match(gpu.bus_id), gpu.bus_id


@pytest.mark.parametrize("spec", PROFILES)
def test_uuids_are_stable_across_loads_and_unique_within_a_node(spec):
    first = [gpu.uuid for gpu in load_profile(spec, "node-a").gpus]
    assert [gpu.uuid for gpu in load_profile(spec, "node-a").gpus] == first
    assert len(set(first)) == len(first)


def test_uuids_differ_between_nodes_and_profiles():
    node_a = {gpu.uuid for gpu in load_profile("hgx-h100", "node-a").gpus}
    node_b = {gpu.uuid for gpu in load_profile("hgx-h100", "node-b").gpus}
    other = {gpu.uuid for gpu in load_profile("dgx-a100", "node-a").gpus}
    assert not node_a & node_b
    assert not node_a & other


def test_unknown_profile_name_lists_the_valid_names():
    with pytest.raises(ProfileError) as raised:
        load_profile("h100", "node-a")
    message = str(raised.value)
    assert "'h100'" in message
    for name in PROFILES:
        assert name in message


def test_node_name_is_required():
    with pytest.raises(ProfileError, match="node name"):
        load_profile("t4", "")


def test_profile_file_in_json_or_yaml_gives_the_same_machine(tmp_path):
    doc = _doc(gpus=[{"model": "T4", "busId": "0000:00:1e.0", "numaNode": -1}])
    (tmp_path / "vm.json").write_text(json.dumps(doc))
    (tmp_path / "vm.yaml").write_text(yaml.safe_dump(doc))
    from_json = load_profile(str(tmp_path / "vm.json"), "node-a")
    from_yaml = load_profile(str(tmp_path / "vm.yaml"), "node-a")
    assert from_json == from_yaml
    assert from_json.name == "vm"
    assert from_json.gpus[0].bus_id == "00000000:00:1E.0"
    assert from_json.gpus[0].numa_node is None


def test_missing_profile_file_is_reported_with_its_path(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(str(tmp_path / "absent.yaml"), "node-a")


def test_gpus_are_enumerated_in_pci_order_with_minor_defaulting_to_index():
    profile = parse_profile(
        _doc(
            gpus=[
                {"model": "L4", "busId": "00000000:C1:00.0"},
                {"model": "L4", "busId": "00000000:01:00.0", "minor": 5},
            ]
        ),
        name="p",
        node_name="n",
    )
    assert [(gpu.index, gpu.bus_id, gpu.minor) for gpu in profile.gpus] == [
        (0, "00000000:01:00.0", 5),
        (1, "00000000:C1:00.0", 1),
    ]


def test_explicit_uuid_is_kept():
    uuid = "GPU-a75cda02-62ce-2c30-9150-555ef08935e2"
    profile = parse_profile(
        _doc(gpus=[{"model": "L4", "busId": "00000000:01:00.0", "uuid": uuid}]),
        name="p",
        node_name="n",
    )
    assert profile.gpus[0].uuid == uuid


def test_profile_can_define_its_own_gpu_models():
    model = {
        "name": "NVIDIA GB10",
        "architecture": 10,
        "brand": 14,
        "cudaComputeCapability": [12, 1],
        "memoryTotalMiB": None,
        "pciDeviceId": "0x2E1210DE",
        "pciSubSystemId": "0x00000000",
        "migCapable": False,
    }
    profile = parse_profile(
        _doc(models={"GB10": model}, gpus=[{"model": "GB10", "busId": "0000000F:01:00.0"}]),
        name="spark",
        node_name="n",
    )
    assert profile.gpus[0].model.name == "NVIDIA GB10"
    assert profile.gpus[0].model.memory_total_mib is None


@pytest.mark.parametrize(
    ("gpus", "message"),
    [
        ([{"model": "X100", "busId": "00000000:01:00.0"}], "unknown model 'X100'"),
        ([{"model": "L4", "busId": "1:2:3"}], "not like 00000000:1B:00.0"),
        ([{"model": "L4"}], "missing field 'busId'"),
        ([{"model": "L4", "busId": "00000000:01:00.0", "colour": "green"}], "unknown fields"),
        ([{"model": "L4", "busId": "00000000:01:00.0", "migMode": [1, 1]}], "no MIG support"),
        ([{"model": "L4", "busId": "00000000:01:00.0", "minor": True}], "minor must be"),
        ([{"model": "L4", "busId": "00000000:01:00.0", "uuid": "GPU-1"}], "uuid 'GPU-1'"),
        ([{"model": "L4", "busId": "00000000:01:00.0", "pcieRoot": "root"}], "pcieRoot"),
        (
            [{"model": "L4", "busId": "00000000:01:00.0", "faults": {"device_frobnicate": 3}}],
            "unknown call 'device_frobnicate'",
        ),
        (
            [{"model": "L4", "busId": "00000000:01:00.0", "faults": {"device_get_uuid": "OOPS"}}],
            "unknown NVML error 'OOPS'",
        ),
        (
            [
                {"model": "L4", "busId": "00000000:01:00.0"},
                {"model": "L4", "busId": "0000:01:00.0"},
            ],
            "duplicate busId: 00000000:01:00.0",
        ),
        (
            [
                {"model": "L4", "busId": "00000000:01:00.0", "minor": 1},
                {"model": "L4", "busId": "00000000:02:00.0"},
            ],
            "duplicate minor: 1",
        ),
    ],
)
def test_malformed_profiles_are_rejected_with_the_field_to_fix(gpus, message):
    with pytest.raises(ProfileError, match=re.escape(message)):
        parse_profile(_doc(gpus=gpus), name="bad", node_name="n")


def test_driver_version_must_look_like_an_nvidia_version():
    with pytest.raises(ProfileError, match="driverVersion"):
        parse_profile(_doc(driverVersion="latest"), name="bad", node_name="n")


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("0000:1b:00.0", "00000000:1B:00.0"),
        ("00000000:1B:00.0", "00000000:1B:00.0"),
        ("00000009:01:00.0", "00000009:01:00.0"),
    ],
)
def test_bus_ids_are_stored_in_the_nvml_form(given, canonical):
    assert nvml_bus_id(given) == canonical


def test_unknown_top_level_fields_are_rejected():
    with pytest.raises(ProfileError, match=re.escape("unknown fields ['gpu']")):
        parse_profile(_doc(gpu=[]), name="bad", node_name="n")


def test_faults_of_calls_without_a_handle_belong_to_the_profile_not_a_gpu():
    gpu = {"model": "L4", "busId": "00000000:01:00.0", "faults": {"device_get_count": 3}}
    with pytest.raises(ProfileError, match="unknown call 'device_get_count'"):
        parse_profile(_doc(gpus=[gpu]), name="bad", node_name="n")
    profile = parse_profile(_doc(faults={"device_get_count": 3}), name="ok", node_name="n")
    assert profile.fault("device_get_count") == 3
