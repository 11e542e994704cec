"""MPS pinned-memory limits per device UUID of a config group, rendered as the daemon takes them."""

from typing import Any

import pytest

from gpu_dra.driver.config import (
    API_VERSION,
    AllocatedDevice,
    ConfigError,
    ConfigGroup,
    render_pinned_limit,
    resolve_configs,
)
from gpu_dra.driver.config.limits import pinned_memory_limits

DEVICES = [
    AllocatedDevice(request="mps", device="gpu-0", type="gpu"),
    AllocatedDevice(request="mps", device="gpu-1", type="gpu"),
]
# Deliberately not in sorted order: indexes refer to the sorted list.
UUIDS = ["GPU-bbbb", "GPU-aaaa"]


def group_with(sharing: dict[str, Any] | None) -> ConfigGroup:
    parameters: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "GpuConfig"}
    if sharing is not None:
        parameters["sharing"] = sharing
    configs = [
        {"source": "FromClaim", "opaque": {"driver": "gpu.nvidia.com", "parameters": parameters}}
    ]
    [group] = resolve_configs(configs, DEVICES, driver="gpu.nvidia.com", claim="ns/c").groups
    return group


def mps_group(**mps_config: Any) -> ConfigGroup:
    return group_with({"strategy": "MPS", "mpsConfig": mps_config})


@pytest.mark.parametrize(
    ("quantity", "rendered"),
    [
        ("10Gi", "10240M"),
        ("1Gi", "1024M"),
        ("10Mi", "10M"),
        ("10M", "9M"),
        ("1G", "953M"),
        ("1.5Gi", "1536M"),
        ("1Mi", "1M"),
        ("1073741824", "1024M"),
    ],
)
def test_pinned_limits_render_as_whole_mib_truncating(quantity: str, rendered: str) -> None:
    assert render_pinned_limit(quantity) == rendered


def test_default_limit_applies_to_every_device_of_the_group() -> None:
    limits = pinned_memory_limits(
        mps_group(defaultPinnedDeviceMemoryLimit="10Gi"), UUIDS, claim="ns/c"
    )
    assert limits == {"GPU-aaaa": "10240M", "GPU-bbbb": "10240M"}


def test_per_device_index_counts_in_sorted_uuid_order_and_overrides_the_default() -> None:
    group = mps_group(
        defaultPinnedDeviceMemoryLimit="10Gi", defaultPerDevicePinnedMemoryLimit={"0": "2Gi"}
    )
    assert pinned_memory_limits(group, UUIDS, claim="ns/c") == {
        "GPU-aaaa": "2048M",
        "GPU-bbbb": "10240M",
    }


def test_per_device_uuid_key_sets_that_device_only() -> None:
    group = mps_group(defaultPerDevicePinnedMemoryLimit={"GPU-bbbb": "1G"})
    assert pinned_memory_limits(group, UUIDS, claim="ns/c") == {"GPU-bbbb": "953M"}


def test_groups_without_mps_or_limits_have_no_limits() -> None:
    assert pinned_memory_limits(group_with(None), UUIDS, claim="ns/c") == {}
    assert pinned_memory_limits(group_with({"strategy": "TimeSlicing"}), UUIDS, claim="ns/c") == {}
    assert (
        pinned_memory_limits(mps_group(defaultActiveThreadPercentage=50), UUIDS, claim="ns/c") == {}
    )


def test_per_device_index_out_of_range_is_refused_with_the_valid_range() -> None:
    group = mps_group(defaultPerDevicePinnedMemoryLimit={"2": "1Gi"})
    with pytest.raises(ConfigError) as caught:
        pinned_memory_limits(group, UUIDS, claim="ns/c")
    assert str(caught.value) == (
        "resource claim ns/c: config[0] (FromClaim): "
        "parameters.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[2]: device index 2 is "
        "out of range: this config group has 2 device(s), indexes 0..1 in sorted UUID order"
    )


def test_per_device_uuid_outside_the_group_is_refused_naming_the_group_uuids() -> None:
    group = mps_group(defaultPerDevicePinnedMemoryLimit={"GPU-cccc": "1Gi"})
    with pytest.raises(ConfigError) as caught:
        pinned_memory_limits(group, UUIDS, claim="ns/c")
    assert str(caught.value).endswith(
        "defaultPerDevicePinnedMemoryLimit[GPU-cccc]: key 'GPU-cccc' is neither the UUID of a "
        "device in this config group (GPU-aaaa, GPU-bbbb) nor an index (0..1)"
    )


def test_two_keys_naming_one_device_with_different_limits_are_refused() -> None:
    group = mps_group(defaultPerDevicePinnedMemoryLimit={"0": "1Gi", "GPU-aaaa": "2Gi"})
    with pytest.raises(ConfigError, match="keys '0' and 'GPU-aaaa' both name device GPU-aaaa"):
        pinned_memory_limits(group, UUIDS, claim="ns/c")


def test_two_keys_naming_one_device_with_the_same_limit_are_accepted() -> None:
    group = mps_group(defaultPerDevicePinnedMemoryLimit={"0": "1Gi", "GPU-aaaa": "1024Mi"})
    assert pinned_memory_limits(group, UUIDS, claim="ns/c") == {"GPU-aaaa": "1024M"}


def test_mig_uuids_work_as_keys() -> None:
    mig = AllocatedDevice(request="mig", device="gpu-0-mig-1g5gb-19-0", type="mig")
    parameters = {
        "apiVersion": API_VERSION,
        "kind": "MigDeviceConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"MIG-1111": "2Gi"}},
        },
    }
    configs = [
        {"source": "FromClaim", "opaque": {"driver": "gpu.nvidia.com", "parameters": parameters}}
    ]
    [group] = resolve_configs(configs, [mig], driver="gpu.nvidia.com", claim="ns/c").groups
    assert pinned_memory_limits(group, ["MIG-1111"], claim="ns/c") == {"MIG-1111": "2048M"}
