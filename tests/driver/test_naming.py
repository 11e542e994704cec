"""Device, pool and CDI names: NVIDIA's formats, round trips, and rejection of bad input."""

from __future__ import annotations

import pytest

from gpu_dra.driver.naming import (
    GpuDeviceName,
    InvalidNameError,
    MigDeviceName,
    cdi_device_name,
    cdi_kind,
    cdi_spec_file_name,
    gpu_device_name,
    mig_profile_slug,
    parse_cdi_device_name,
    parse_cdi_spec_file_name,
    parse_device_name,
    pool_name,
    qualified_cdi_device,
    validate_claim_uid,
    validate_device_name,
    validate_driver_name,
)

UID = "0b4e1b48-8a2c-4d2f-9a51-3c1f2d3e4f50"


def test_full_gpu_is_named_after_its_minor_number():
    assert gpu_device_name(0) == "gpu-0"
    assert gpu_device_name(12) == "gpu-12"


@pytest.mark.parametrize(
    ("profile", "slug"),
    [
        ("1g.10gb", "1g10gb"),
        ("1g.10gb+me", "1g10gb-me"),
        ("2g.47gb", "2g47gb"),
        ("7g.80gb", "7g80gb"),
        ("1c.3g.20gb", "1c3g20gb"),
        ("1g.24gb+me.all", "1g24gb-meall"),
        ("1g.12gb-me", "1g12gb-me"),
    ],
)
def test_mig_profile_slug_matches_nvidia_device_names(profile, slug):
    assert mig_profile_slug(profile) == slug


def test_mig_device_names_match_nvidias_examples():
    assert str(MigDeviceName.for_profile(1, "2g.47gb", 14, 0)) == "gpu-1-mig-2g47gb-14-0"
    assert str(MigDeviceName.for_profile(0, "1g.12gb", 19, 0)) == "gpu-0-mig-1g12gb-19-0"


@pytest.mark.parametrize(
    "name",
    [
        GpuDeviceName(0),
        GpuDeviceName(31),
        MigDeviceName(1, "2g47gb", 14, 0),
        MigDeviceName(7, "1g10gb-me", 20, 6),
        MigDeviceName(0, "7g80gb", 0, 0),
        MigDeviceName(3, "4g-20", 5, 0),
    ],
)
def test_device_names_round_trip(name):
    assert parse_device_name(str(name)) == name
    assert validate_device_name(str(name)) == str(name)


@pytest.mark.parametrize(
    "text",
    ["gpu", "gpu-", "gpu-01", "gpu--1", "GPU-0", "gpu-0-mig-1g.5gb-0", "gpu-0-mig--19-0", "mig-0"],
)
def test_malformed_device_names_are_rejected(text):
    with pytest.raises(InvalidNameError):
        parse_device_name(text)


def test_negative_numbers_and_bad_slugs_are_rejected():
    with pytest.raises(InvalidNameError):
        GpuDeviceName(-1)
    with pytest.raises(InvalidNameError):
        MigDeviceName(0, "1g.5gb", 19, 0)
    with pytest.raises(InvalidNameError):
        MigDeviceName(0, "1g5gb", -19, 0)
    with pytest.raises(InvalidNameError):
        mig_profile_slug("+++")


def test_pool_is_named_after_the_node():
    assert pool_name("worker-1.example.com") == "worker-1.example.com"
    with pytest.raises(InvalidNameError):
        pool_name("Worker_1")


def test_cdi_names_follow_nvidias_layout():
    assert cdi_kind() == "k8s.gpu.nvidia.com/claim"
    assert cdi_device_name(UID, "gpu-0") == f"{UID}-gpu-0"
    assert qualified_cdi_device(UID, "gpu-0") == f"k8s.gpu.nvidia.com/claim={UID}-gpu-0"
    assert cdi_spec_file_name(UID) == f"k8s.gpu.nvidia.com-claim_{UID}.yaml"


def test_cdi_names_follow_a_configured_driver_name():
    assert cdi_kind("gpu.example.com") == "k8s.gpu.example.com/claim"
    assert cdi_spec_file_name(UID, "gpu.example.com") == f"k8s.gpu.example.com-claim_{UID}.yaml"


@pytest.mark.parametrize("device", ["gpu-0", "gpu-3-mig-1g10gb-me-20-6"])
def test_cdi_device_names_round_trip(device):
    assert parse_cdi_device_name(cdi_device_name(UID, device)) == (UID, device)


def test_cdi_spec_file_names_round_trip():
    assert parse_cdi_spec_file_name(cdi_spec_file_name(UID)) == UID
    with pytest.raises(InvalidNameError):
        parse_cdi_spec_file_name(cdi_spec_file_name(UID, "gpu.example.com"))
    with pytest.raises(InvalidNameError):
        parse_cdi_spec_file_name(f"k8s.gpu.nvidia.com-claim_{UID}.json")


@pytest.mark.parametrize(
    "uid",
    [
        "",
        "not-a-uid",
        UID.upper(),
        UID + "0",
        "../../etc/passwd",
        "0b4e1b48-8a2c-4d2f-9a51-3c1f2d3e4f5/",
    ],
)
def test_claim_uids_that_are_not_lower_case_uuids_are_rejected(uid):
    with pytest.raises(InvalidNameError, match="claim UID"):
        validate_claim_uid(uid)
    with pytest.raises(InvalidNameError):
        cdi_spec_file_name(uid)


@pytest.mark.parametrize("device", ["", "GPU-0", "gpu_0", "gpu-0-", "-gpu", "a" * 64, "gpu/0"])
def test_device_names_that_are_not_dns_labels_are_rejected(device):
    with pytest.raises(InvalidNameError, match="DNS label"):
        validate_device_name(device)
    with pytest.raises(InvalidNameError):
        cdi_device_name(UID, device)


@pytest.mark.parametrize("name", [f"{UID}", f"{UID}gpu-0", f"{UID}-", "gpu-0", f"{UID}-GPU-0"])
def test_malformed_cdi_device_names_are_rejected(name):
    with pytest.raises(InvalidNameError):
        parse_cdi_device_name(name)


@pytest.mark.parametrize("driver", ["", "GPU.nvidia.com", "gpu..nvidia.com", "a" * 64])
def test_invalid_driver_names_are_rejected(driver):
    with pytest.raises(InvalidNameError, match="driver name"):
        validate_driver_name(driver)
