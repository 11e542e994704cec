"""Which config applies to each allocated device: precedence, request scoping, config groups."""

from typing import Any

import pytest

from gpu_dra.driver.config import (
    API_VERSION,
    AllocatedDevice,
    ConfigError,
    GpuConfig,
    MigDeviceConfig,
    resolve_configs,
)

DRIVER = "gpu.nvidia.com"

GPU0 = AllocatedDevice(request="gpu", device="gpu-0", type="gpu")
GPU1 = AllocatedDevice(request="gpu", device="gpu-1", type="gpu")
MIG0 = AllocatedDevice(request="mig", device="gpu-2-mig-1g5gb-19-0", type="mig")


def gpu_params(**sharing: Any) -> dict[str, Any]:
    parameters: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "GpuConfig"}
    if sharing:
        parameters["sharing"] = sharing
    return parameters


def mig_params(**sharing: Any) -> dict[str, Any]:
    parameters: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "MigDeviceConfig"}
    if sharing:
        parameters["sharing"] = sharing
    return parameters


def entry(
    parameters: Any,
    *,
    source: str = "FromClaim",
    requests: list[str] | None = None,
    driver: str = DRIVER,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "source": source,
        "opaque": {"driver": driver, "parameters": parameters},
    }
    if requests is not None:
        result["requests"] = requests
    return result


TIME_SLICED_LONG = gpu_params(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"})
TIME_SLICED_SHORT = gpu_params(strategy="TimeSlicing", timeSlicingConfig={"interval": "Short"})
MPS = gpu_params(strategy="MPS")


def interval(config: GpuConfig | MigDeviceConfig) -> str | None:
    assert isinstance(config, GpuConfig)
    assert config.sharing is not None
    assert config.sharing.time_slicing_config is not None
    return config.sharing.time_slicing_config.interval


def strategy(config: GpuConfig | MigDeviceConfig) -> str | None:
    return None if config.sharing is None else config.sharing.strategy


def error_of(configs: list[dict[str, Any]], devices: list[AllocatedDevice], **kw: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        resolve_configs(configs, devices, driver=DRIVER, claim="ns/claim", **kw)
    return str(caught.value)


def test_devices_without_configs_get_the_defaults_without_sharing() -> None:
    resolved = resolve_configs([], [GPU0, MIG0], driver=DRIVER, claim="ns/claim")
    assert resolved.config_of(GPU0) == GpuConfig()
    assert resolved.config_of(MIG0) == MigDeviceConfig()
    assert [group.origin.label for group in resolved.groups] == [
        "default GpuConfig",
        "default MigDeviceConfig",
    ]


def test_claim_config_overrides_class_config_even_when_listed_first() -> None:
    configs = [
        entry(TIME_SLICED_LONG, source="FromClaim"),
        entry(TIME_SLICED_SHORT, source="FromClass", requests=["gpu"]),
    ]
    resolved = resolve_configs(configs, [GPU0], driver=DRIVER, claim="ns/claim")
    assert interval(resolved.config_of(GPU0)) == "Long"
    assert resolved.group_of(GPU0).origin.label == "config[0] (FromClaim)"


def test_class_config_applies_when_the_claim_has_none() -> None:
    configs = [entry(MPS, source="FromClass", requests=["gpu"])]
    resolved = resolve_configs(configs, [GPU0], driver=DRIVER, claim="ns/claim")
    assert strategy(resolved.config_of(GPU0)) == "MPS"
    assert resolved.group_of(GPU0).origin.source == "FromClass"
    assert resolved.group_of(GPU0).origin.label == "config[0] (FromClass)"


def test_later_claim_config_wins() -> None:
    configs = [entry(TIME_SLICED_LONG), entry(TIME_SLICED_SHORT)]
    resolved = resolve_configs(configs, [GPU0], driver=DRIVER, claim="ns/claim")
    assert interval(resolved.config_of(GPU0)) == "Short"
    assert resolved.group_of(GPU0).origin.index == 1


def test_later_class_config_wins_among_class_configs() -> None:
    configs = [
        entry(TIME_SLICED_LONG, source="FromClass", requests=["gpu"]),
        entry(TIME_SLICED_SHORT, source="FromClass", requests=["gpu"]),
    ]
    assert (
        interval(resolve_configs(configs, [GPU0], driver=DRIVER, claim="ns/claim").config_of(GPU0))
        == "Short"
    )


def test_config_scoped_to_a_request_applies_only_to_that_request() -> None:
    other = AllocatedDevice(request="other", device="gpu-1", type="gpu")
    configs = [entry(MPS, requests=["gpu"])]
    resolved = resolve_configs(configs, [GPU0, other], driver=DRIVER, claim="ns/claim")
    assert strategy(resolved.config_of(GPU0)) == "MPS"
    assert resolved.config_of(other) == GpuConfig()


def test_highest_precedence_applicable_entry_wins_whether_scoped_or_not() -> None:
    # Walking from the highest precedence down, the unscoped later entry is met first.
    configs = [entry(TIME_SLICED_LONG, requests=["gpu"]), entry(TIME_SLICED_SHORT)]
    assert (
        interval(resolve_configs(configs, [GPU0], driver=DRIVER, claim="ns/claim").config_of(GPU0))
        == "Short"
    )
    configs = [entry(TIME_SLICED_SHORT), entry(TIME_SLICED_LONG, requests=["gpu"])]
    assert (
        interval(resolve_configs(configs, [GPU0], driver=DRIVER, claim="ns/claim").config_of(GPU0))
        == "Long"
    )


def test_request_name_matches_its_first_available_subrequests() -> None:
    sub = AllocatedDevice(request="gpu/large", device="gpu-0", type="gpu")
    configs = [entry(MPS, requests=["gpu"])]
    assert (
        strategy(resolve_configs(configs, [sub], driver=DRIVER, claim="ns/claim").config_of(sub))
        == "MPS"
    )


def test_subrequest_name_matches_only_that_subrequest() -> None:
    large = AllocatedDevice(request="gpu/large", device="gpu-0", type="gpu")
    small = AllocatedDevice(request="gpu/small", device="gpu-1", type="gpu")
    resolved = resolve_configs(
        [entry(MPS, requests=["gpu/large"])], [large, small], driver=DRIVER, claim="ns/claim"
    )
    assert strategy(resolved.config_of(large)) == "MPS"
    assert resolved.config_of(small) == GpuConfig()


def test_request_name_prefix_is_not_a_match() -> None:
    gpus = AllocatedDevice(request="gpus", device="gpu-0", type="gpu")
    resolved = resolve_configs(
        [entry(MPS, requests=["gpu"])], [gpus], driver=DRIVER, claim="ns/claim"
    )
    assert resolved.config_of(gpus) == GpuConfig()


def test_unscoped_config_applies_only_to_devices_of_its_kind() -> None:
    configs = [entry(MPS), entry(mig_params(strategy="TimeSlicing"))]
    resolved = resolve_configs(configs, [GPU0, MIG0], driver=DRIVER, claim="ns/claim")
    assert strategy(resolved.config_of(GPU0)) == "MPS"
    assert isinstance(resolved.config_of(MIG0), MigDeviceConfig)
    assert strategy(resolved.config_of(MIG0)) == "TimeSlicing"


def test_config_naming_a_request_of_the_wrong_device_type_is_a_hard_error() -> None:
    message = error_of([entry(MPS, requests=["mig"])], [MIG0])
    assert message == (
        "resource claim ns/claim: config[0] (FromClaim): cannot apply GpuConfig to device "
        '"gpu-2-mig-1g5gb-19-0" of type "mig" (request: mig): '
        "use kind MigDeviceConfig for mig devices"
    )


def test_mig_config_naming_a_gpu_request_is_a_hard_error() -> None:
    message = error_of([entry(mig_params(), requests=["gpu"])], [GPU0])
    assert 'cannot apply MigDeviceConfig to device "gpu-0" of type "gpu" (request: gpu)' in message


def test_wrong_kind_error_is_not_hidden_by_a_lower_precedence_fitting_config() -> None:
    configs = [entry(MPS, source="FromClass", requests=["mig"]), entry(MPS, requests=["mig"])]
    assert "cannot apply GpuConfig" in error_of(configs, [MIG0])


def test_configs_for_other_drivers_are_skipped_without_decoding() -> None:
    configs = [entry({"anything": "goes"}, driver="net.example.com"), entry(MPS)]
    resolved = resolve_configs(configs, [GPU0], driver=DRIVER, claim="ns/claim")
    assert strategy(resolved.config_of(GPU0)) == "MPS"


def test_non_opaque_config_entry_is_refused() -> None:
    message = error_of([{"source": "FromClaim", "requests": []}], [GPU0])
    assert message == (
        "resource claim ns/claim: config[0] (FromClaim): "
        "only opaque parameters are supported by this driver"
    )


def test_unknown_source_is_refused() -> None:
    message = error_of([entry(MPS, source="FromNowhere")], [GPU0])
    assert "config[0] (FromNowhere): source: unknown config source 'FromNowhere'" in message


def test_invalid_config_is_reported_even_if_it_applies_to_no_device() -> None:
    message = error_of([entry(gpu_params(strategy="Bad"), requests=["unused"])], [GPU0])
    assert "config[0] (FromClaim): parameters.sharing.strategy: unknown GPU sharing strategy" in (
        message
    )


def test_problems_of_all_entries_are_reported_together() -> None:
    configs = [
        entry(gpu_params(strategy="Bad"), source="FromClass", requests=["gpu"]),
        entry(gpu_params(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 200})),
    ]
    message = error_of(configs, [GPU0])
    assert message.count("; ") == 1
    assert "config[0] (FromClass): parameters.sharing.strategy" in message
    assert "config[1] (FromClaim): parameters.sharing.mpsConfig.defaultActiveThread" in message


def test_claim_entries_are_named_by_their_spec_index_when_the_spec_is_given() -> None:
    spec: list[dict[str, Any]] = [
        {"requests": ["unallocated"], "opaque": {"driver": DRIVER, "parameters": MPS}},
        {"opaque": {"driver": DRIVER, "parameters": gpu_params(strategy="Bad")}},
    ]
    # The scheduler drops spec entry 0 (its request was not allocated) and puts a class entry first.
    configs = [
        entry(TIME_SLICED_LONG, source="FromClass", requests=["gpu"]),
        {"source": "FromClaim", **spec[1]},
    ]
    message = error_of(configs, [GPU0], spec_configs=spec)
    assert "spec.devices.config[1]: parameters.sharing.strategy" in message


def test_devices_resolved_to_one_entry_form_one_group() -> None:
    configs = [entry(MPS, requests=["gpu"]), entry(mig_params(strategy="MPS"))]
    other = AllocatedDevice(request="solo", device="gpu-3", type="gpu")
    resolved = resolve_configs(configs, [GPU0, MIG0, GPU1, other], driver=DRIVER, claim="ns/claim")
    assert [group.devices for group in resolved.groups] == [(GPU0, GPU1), (MIG0,), (other,)]
    assert [group.origin.label for group in resolved.groups] == [
        "config[0] (FromClaim)",
        "config[1] (FromClaim)",
        "default GpuConfig",
    ]
    assert resolved.group_of(GPU1) is resolved.group_of(GPU0)


def test_equal_configs_from_different_entries_stay_separate_groups() -> None:
    other = AllocatedDevice(request="other", device="gpu-1", type="gpu")
    configs = [entry(MPS, requests=["gpu"]), entry(MPS, requests=["other"])]
    resolved = resolve_configs(configs, [GPU0, other], driver=DRIVER, claim="ns/claim")
    assert len(resolved.groups) == 2
    assert resolved.config_of(GPU0) == resolved.config_of(other)


def test_a_device_listed_twice_appears_once_in_its_group() -> None:
    resolved = resolve_configs([entry(MPS)], [GPU0, GPU0], driver=DRIVER, claim="ns/claim")
    assert resolved.groups[0].devices == (GPU0,)


def test_group_of_an_unknown_device_raises_key_error() -> None:
    resolved = resolve_configs([], [GPU0], driver=DRIVER, claim="ns/claim")
    with pytest.raises(KeyError):
        resolved.group_of(GPU1)


def test_gpu_test5_demo_resolves_per_request() -> None:
    """NVIDIA's quickstart gpu-test5: one time-sliced and one MPS request in a claim."""
    ts = AllocatedDevice(request="ts-gpu", device="gpu-0", type="gpu")
    mps_device = AllocatedDevice(request="mps-gpu", device="gpu-1", type="gpu")
    configs = [
        entry(TIME_SLICED_LONG, requests=["ts-gpu"]),
        entry(
            gpu_params(
                strategy="MPS",
                mpsConfig={
                    "defaultActiveThreadPercentage": 50,
                    "defaultPinnedDeviceMemoryLimit": "10Gi",
                },
            ),
            requests=["mps-gpu"],
        ),
    ]
    resolved = resolve_configs(configs, [ts, mps_device], driver=DRIVER, claim="ns/claim")
    assert interval(resolved.config_of(ts)) == "Long"
    assert strategy(resolved.config_of(mps_device)) == "MPS"


def test_groups_can_be_used_as_keys() -> None:
    mps_map = {"defaultPerDevicePinnedMemoryLimit": {"0": "1Gi"}}
    configs = [entry(gpu_params(strategy="MPS", mpsConfig=mps_map))]
    resolved = resolve_configs(configs, [GPU0, GPU1], driver=DRIVER, claim="ns/claim")
    assert {resolved.group_of(GPU0), resolved.group_of(GPU1)} == {resolved.groups[0]}
