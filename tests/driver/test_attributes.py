"""A discovered GPU becomes the device NVIDIA's driver publishes: names, types and values."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_dra.driver.attributes import (
    DeviceAttributeError,
    binary_si_quantity,
    check_limits,
    cuda_driver_semver,
    gpu_device,
    qualified_name,
    semver,
)
from tests.fakes.gpus import h100

H100 = h100()


def test_full_gpu_device_has_nvidias_name_attributes_and_types():
    assert gpu_device(H100) == {
        "name": "gpu-4",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": "GPU-a75cda02-62ce-2c30-9150-555ef08935e2"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "580.65.6"},
            "cudaDriverVersion": {"version": "13.0.0"},
            "resource.kubernetes.io/pciBusID": {"string": "0000:65:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:64"},
            "resource.kubernetes.io/numaNode": {"int": 1},
        },
        "capacity": {"memory": {"value": "81559Mi"}},
    }


def test_unknown_topology_and_memory_are_left_out():
    gpu = dataclasses.replace(H100, pcie_root=None, numa_node=None, memory_bytes=None)
    device = gpu_device(gpu)
    assert "capacity" not in device
    standard = [key for key in device["attributes"] if key.startswith("resource.kubernetes.io/")]
    assert standard == ["resource.kubernetes.io/pciBusID"]


def test_negative_numa_node_is_left_out():
    device = gpu_device(dataclasses.replace(H100, numa_node=-1))
    assert "resource.kubernetes.io/numaNode" not in device["attributes"]


@pytest.mark.parametrize(("mode", "name"), [(0, "None"), (1, "HMM"), (2, "ATS")])
def test_addressing_mode_is_published_only_when_nvml_reports_it(mode, name):
    assert "addressingMode" not in gpu_device(H100)["attributes"]
    device = gpu_device(dataclasses.replace(H100, addressing_mode=mode))
    assert device["attributes"]["addressingMode"] == {"string": name}


@pytest.mark.parametrize(
    ("arch", "name"),
    [(6, "Turing"), (7, "Ampere"), (8, "Ada Lovelace"), (9, "Hopper"), (10, "Blackwell")],
)
def test_architecture_uses_go_nvlib_names(arch, name):
    device = gpu_device(dataclasses.replace(H100, architecture=arch))
    assert device["attributes"]["architecture"] == {"string": name}


@pytest.mark.parametrize(("brand", "name"), [(14, "Nvidia"), (2, "Tesla"), (13, "NvidiaRTX")])
def test_brand_uses_go_nvlib_names(brand, name):
    assert gpu_device(dataclasses.replace(H100, brand=brand))["attributes"]["brand"] == {
        "string": name
    }


def test_enum_values_unknown_to_go_nvlib_are_published_as_unknown():
    device = gpu_device(dataclasses.replace(H100, architecture=13, brand=19))
    assert device["attributes"]["architecture"] == {"string": "Unknown"}
    assert device["attributes"]["brand"] == {"string": "Unknown"}


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("580.65.06", "580.65.6"),
        ("580.95.05", "580.95.5"),
        ("550.54.15", "550.54.15"),
        ("535.247.01", "535.247.1"),
        ("8.0", "8.0.0"),
        ("12", "12.0.0"),
        ("v1.2.3", "1.2.3"),
    ],
)
def test_versions_are_normalized_like_masterminds_semver(version, expected):
    assert semver(version) == expected


@pytest.mark.parametrize("version", ["", "580.65.06.1", "r580", "580.x"])
def test_malformed_versions_are_rejected(version):
    with pytest.raises(DeviceAttributeError):
        semver(version)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(13000, "13.0.0"), (12040, "12.4.0"), (12080, "12.8.0"), (11020, "11.2.0")],
)
def test_cuda_driver_version_is_major_minor_from_nvml_encoding(value, expected):
    assert cuda_driver_semver(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, "0"),
        (512, "512"),
        (1023, "1023"),
        (1024, "1Ki"),
        (1536, "1536"),
        (81920 * 2**20, "80Gi"),
        (81559 * 2**20, "81559Mi"),
        (23034 * 2**20, "23034Mi"),
        (15360 * 2**20, "15Gi"),
        (143771 * 2**20, "143771Mi"),
        (2**40, "1Ti"),
        (2**60, "1Ei"),
        (2**62, "4Ei"),
        (85520809985, "85520809985"),
    ],
)
def test_memory_quantity_is_the_canonical_kubernetes_binary_si_form(value, expected):
    assert binary_si_quantity(value) == expected


def test_strings_longer_than_the_api_allows_are_rejected_with_the_attribute_name():
    with pytest.raises(DeviceAttributeError, match="productName"):
        gpu_device(dataclasses.replace(H100, product_name="N" * 65))


def test_more_than_32_attributes_and_capacities_are_rejected():
    device = gpu_device(H100)
    device["attributes"].update({f"extra{i}": {"int": i} for i in range(21)})
    with pytest.raises(DeviceAttributeError, match="at most 32"):
        check_limits(device)


def test_bare_names_belong_to_the_configured_driver_and_standard_names_stay():
    assert qualified_name("productName") == "gpu.nvidia.com/productName"
    assert qualified_name("productName", "gpu.example.com") == "gpu.example.com/productName"
    assert (
        qualified_name("resource.kubernetes.io/pcieRoot", "gpu.example.com")
        == "resource.kubernetes.io/pcieRoot"
    )


def test_attribute_keys_are_valid_qualified_names():
    for key in gpu_device(dataclasses.replace(H100, addressing_mode=1))["attributes"]:
        domain, _, identifier = key.rpartition("/")
        assert len(identifier) <= 32
        assert identifier.isidentifier()
        assert len(domain) <= 63
