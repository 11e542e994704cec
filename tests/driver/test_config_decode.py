"""Decoding ``opaque.parameters``: strict like NVIDIA's decoder; messages say what to fix."""

from typing import Any

import pytest

from gpu_dra.driver.config import (
    API_VERSION,
    ConfigError,
    GpuConfig,
    GpuSharing,
    MigDeviceConfig,
    MpsConfig,
    TimeSlicingConfig,
    decode_parameters,
)

ENTRY = "spec.devices.config[0]"


def gpu(sharing: Any = None, **extra: Any) -> dict[str, Any]:
    parameters: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "GpuConfig", **extra}
    if sharing is not None:
        parameters["sharing"] = sharing
    return parameters


def mig(sharing: Any = None) -> dict[str, Any]:
    parameters: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "MigDeviceConfig"}
    if sharing is not None:
        parameters["sharing"] = sharing
    return parameters


def mps(**config: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mpsConfig": config}


def error_of(parameters: object) -> str:
    with pytest.raises(ConfigError) as caught:
        decode_parameters(parameters, config=ENTRY, claim="team-a/train")
    return str(caught.value)


def test_decodes_a_full_mps_gpu_config_by_json_names() -> None:
    config = decode_parameters(
        gpu(
            mps(
                defaultActiveThreadPercentage=50,
                defaultPinnedDeviceMemoryLimit="10Gi",
                defaultPerDevicePinnedMemoryLimit={"0": "4Gi"},
                multiUser=True,
            )
        )
    )
    assert config == GpuConfig(
        sharing=GpuSharing(
            strategy="MPS",
            mps_config=MpsConfig(
                default_active_thread_percentage=50,
                default_pinned_device_memory_limit="10Gi",
                default_per_device_pinned_memory_limit={"0": "4Gi"},
                multi_user=True,
            ),
        )
    )


def test_decodes_mig_device_config_kind() -> None:
    config = decode_parameters(mig({"strategy": "MPS"}))
    assert isinstance(config, MigDeviceConfig)
    assert config.sharing is not None
    assert config.sharing.mps_config == MpsConfig()


def test_config_without_sharing_means_no_sharing() -> None:
    assert decode_parameters(gpu()).sharing is None
    assert decode_parameters(mig()).sharing is None


def test_default_config_objects_carry_api_version_and_kind() -> None:
    assert GpuConfig().model_dump(exclude_none=True) == {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
    }
    assert MigDeviceConfig().kind == "MigDeviceConfig"


def test_decoded_config_serializes_back_to_nvidia_json_names() -> None:
    config = decode_parameters(gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {}}))
    assert config.model_dump(mode="json", exclude_none=True) == gpu(
        {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}}
    )


# --- normalization (nvidia-compat §4.4) ---


@pytest.mark.parametrize(
    ("sharing", "normalized"),
    [
        (
            {"strategy": "TimeSlicing"},
            GpuSharing(
                strategy="TimeSlicing", time_slicing_config=TimeSlicingConfig(interval="Default")
            ),
        ),
        (
            {"strategy": "TimeSlicing", "timeSlicingConfig": {}},
            GpuSharing(
                strategy="TimeSlicing", time_slicing_config=TimeSlicingConfig(interval="Default")
            ),
        ),
        (
            {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
            GpuSharing(
                strategy="TimeSlicing", time_slicing_config=TimeSlicingConfig(interval="Long")
            ),
        ),
        ({"strategy": "MPS"}, GpuSharing(strategy="MPS", mps_config=MpsConfig())),
        ({"strategy": "MPS", "mpsConfig": {}}, GpuSharing(strategy="MPS", mps_config=MpsConfig())),
    ],
)
def test_normalization_fills_in_strategy_defaults(
    sharing: dict[str, Any], normalized: GpuSharing
) -> None:
    assert decode_parameters(gpu(sharing)).sharing == normalized


def test_mig_time_slicing_normalizes_to_itself() -> None:
    config = decode_parameters(mig({"strategy": "TimeSlicing"}))
    assert config.sharing is not None
    assert config.sharing.strategy == "TimeSlicing"
    assert config.sharing.mps_config is None


@pytest.mark.parametrize(
    ("interval", "value"), [("Default", 0), ("Short", 1), ("Medium", 2), ("Long", 3)]
)
def test_time_slice_intervals_map_to_nvidia_smi_values(interval: str, value: int) -> None:
    assert TimeSlicingConfig(interval=interval).nvidia_smi_value == value  # type: ignore[arg-type]


def test_quantities_given_as_json_numbers_are_accepted_as_text() -> None:
    config = decode_parameters(gpu(mps(defaultPinnedDeviceMemoryLimit=1073741824)))
    assert config.sharing is not None
    assert config.sharing.mps_config is not None
    assert config.sharing.mps_config.default_pinned_device_memory_limit == "1073741824"


# --- strict decoding ---


def test_unknown_top_level_field_is_named_with_the_allowed_ones() -> None:
    message = error_of(gpu(replicas=2))
    assert message == (
        "resource claim team-a/train: spec.devices.config[0]: parameters.replicas: "
        "unknown field (allowed here: apiVersion, kind, sharing)"
    )


def test_unknown_nested_field_is_named_by_its_json_path() -> None:
    message = error_of(gpu(mps(defaultActiveThreadPercent=50)))
    assert "parameters.sharing.mpsConfig.defaultActiveThreadPercent: unknown field" in message
    assert "defaultActiveThreadPercentage" in message  # the allowed names show the right one


def test_mig_sharing_rejects_time_slicing_config() -> None:
    message = error_of(mig({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}))
    assert (
        "parameters.sharing.timeSlicingConfig: unknown field (allowed here: strategy, mpsConfig)"
        in message
    )


def test_python_field_names_are_not_accepted_in_json() -> None:
    message = error_of(gpu(mps(default_active_thread_percentage=50)))
    assert "parameters.sharing.mpsConfig.default_active_thread_percentage: unknown field" in message


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        (
            gpu(mps(defaultActiveThreadPercentage="50")),
            "parameters.sharing.mpsConfig.defaultActiveThreadPercentage: "
            "expected an integer, got a string ('50')",
        ),
        (
            gpu(mps(defaultActiveThreadPercentage=50.5)),
            "defaultActiveThreadPercentage: expected an integer, got number 50.5",
        ),
        (
            gpu(mps(defaultActiveThreadPercentage=True)),
            "defaultActiveThreadPercentage: expected an integer, got true",
        ),
        (
            gpu(mps(multiUser="yes")),
            "parameters.sharing.mpsConfig.multiUser: expected true or false, got a string ('yes')",
        ),
        (gpu("MPS"), "parameters.sharing: expected an object, got a string ('MPS')"),
        (
            gpu(mps(defaultPerDevicePinnedMemoryLimit=["1Gi"])),
            "defaultPerDevicePinnedMemoryLimit: expected an object, got an array",
        ),
        (
            gpu(mps(defaultPinnedDeviceMemoryLimit=True)),
            "defaultPinnedDeviceMemoryLimit: expected a quantity such as 10Gi or 512Mi, got true",
        ),
    ],
)
def test_wrong_json_types_are_refused_without_coercion(parameters: object, expected: str) -> None:
    assert expected in error_of(parameters)


def test_parameters_must_be_a_json_object() -> None:
    assert error_of(["GpuConfig"]) == (
        "resource claim team-a/train: spec.devices.config[0]: parameters: "
        "expected a JSON object with apiVersion and kind, got an array"
    )


def test_missing_parameters_are_reported_as_null() -> None:
    assert "parameters: expected a JSON object with apiVersion and kind, got null" in error_of(None)


# --- apiVersion / kind dispatch ---


def test_unknown_api_version_lists_the_supported_one() -> None:
    message = error_of({"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"})
    assert (
        "parameters.apiVersion: unsupported apiVersion 'resource.nvidia.com/v1': "
        "the supported one is resource.nvidia.com/v1beta1"
    ) in message


def test_unknown_kind_lists_the_supported_kinds() -> None:
    message = error_of({"apiVersion": API_VERSION, "kind": "VfioDeviceConfig"})
    assert (
        "parameters.kind: unsupported kind 'VfioDeviceConfig' of apiVersion "
        "resource.nvidia.com/v1beta1: supported kinds are GpuConfig, MigDeviceConfig"
    ) in message


def test_missing_api_version_and_kind_are_both_reported() -> None:
    message = error_of({})
    assert message == (
        "resource claim team-a/train: "
        "spec.devices.config[0]: parameters.apiVersion: apiVersion is missing: "
        "set it to resource.nvidia.com/v1beta1; "
        "spec.devices.config[0]: parameters.kind: kind is missing: "
        "set it to one of GpuConfig, MigDeviceConfig"
    )


# --- validation (nvidia-compat §4.5) ---


def test_unknown_strategy_lists_the_supported_ones() -> None:
    assert error_of(gpu({"strategy": "Exclusive"})).endswith(
        "parameters.sharing.strategy: unknown GPU sharing strategy 'Exclusive': "
        "supported are TimeSlicing, MPS"
    )


def test_missing_strategy_lists_the_supported_ones() -> None:
    assert error_of(gpu({})).endswith(
        "parameters.sharing.strategy: required field is missing: set it to one of TimeSlicing, MPS"
    )


def test_unknown_interval_lists_the_supported_ones() -> None:
    message = error_of(gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "1ms"}}))
    assert message.endswith(
        "parameters.sharing.timeSlicingConfig.interval: unknown time-slice interval '1ms': "
        "supported are Default, Short, Medium, Long"
    )


@pytest.mark.parametrize("percentage", [-1, 101, 150])
def test_thread_percentage_outside_0_to_100_is_refused_with_the_value(percentage: int) -> None:
    message = error_of(gpu(mps(defaultActiveThreadPercentage=percentage)))
    assert message.endswith(
        "parameters.sharing.mpsConfig.defaultActiveThreadPercentage: active thread percentage "
        f"must be between 0 and 100 (percent of the GPU's SMs), got {percentage}"
    )


@pytest.mark.parametrize("percentage", [0, 1, 100])
def test_thread_percentage_bounds_are_accepted(percentage: int) -> None:
    config = decode_parameters(gpu(mps(defaultActiveThreadPercentage=percentage)))
    assert config.sharing is not None
    assert config.sharing.mps_config is not None
    assert config.sharing.mps_config.default_active_thread_percentage == percentage


def test_mps_strategy_with_time_slicing_config_is_refused() -> None:
    message = error_of(gpu({"strategy": "MPS", "timeSlicingConfig": {"interval": "Long"}}))
    assert message.endswith(
        "parameters.sharing.timeSlicingConfig: timeSlicingConfig cannot be used with strategy "
        "MPS: remove timeSlicingConfig or set strategy: TimeSlicing"
    )


@pytest.mark.parametrize("parameters", [gpu, mig])
def test_time_slicing_strategy_with_mps_config_is_refused(parameters: Any) -> None:
    message = error_of(parameters({"strategy": "TimeSlicing", "mpsConfig": {}}))
    assert message.endswith(
        "parameters.sharing.mpsConfig: mpsConfig cannot be used with strategy TimeSlicing: "
        "remove mpsConfig or set strategy: MPS"
    )


def test_default_pinned_limit_below_1mi_is_refused() -> None:
    message = error_of(gpu(mps(defaultPinnedDeviceMemoryLimit="512Ki")))
    assert message.endswith(
        "parameters.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "
        "pinned memory limit '512Ki' is too low: it must be at least 1Mi"
    )


def test_per_device_pinned_limit_below_1mi_names_its_key() -> None:
    message = error_of(gpu(mps(defaultPerDevicePinnedMemoryLimit={"GPU-a": "1000k"})))
    assert message.endswith(
        "parameters.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[GPU-a]: "
        "pinned memory limit '1000k' is too low: it must be at least 1Mi"
    )


def test_pinned_limit_of_exactly_1mi_is_accepted() -> None:
    decode_parameters(gpu(mps(defaultPinnedDeviceMemoryLimit="1Mi")))


def test_pinned_limit_that_is_not_a_quantity_is_refused_with_an_example() -> None:
    message = error_of(gpu(mps(defaultPinnedDeviceMemoryLimit="10GB")))
    assert (
        "parameters.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: '10GB' is not a " in message
    )
    assert "e.g. 10Gi" in message


def test_per_device_key_that_is_neither_uuid_nor_index_is_refused_at_decode() -> None:
    message = error_of(gpu(mps(defaultPerDevicePinnedMemoryLimit={"first": "1Gi"})))
    assert message.endswith(
        "parameters.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[first]: invalid device "
        "key 'first': use a device UUID (GPU-... or MIG-...) or an index 0, 1, ... into the "
        "config group's device UUIDs in sorted order"
    )


def test_every_problem_is_reported_joined_by_semicolons() -> None:
    message = error_of(
        gpu(
            mps(
                defaultPinnedDeviceMemoryLimit="1Ki",
                defaultPerDevicePinnedMemoryLimit={"x": "2Gi"},
            )
        )
    )
    problems = message.removeprefix("resource claim team-a/train: ").split("; ")
    assert [problem.split(": ")[1] for problem in problems] == [
        "parameters.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
        "parameters.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[x]",
    ]


def test_each_problem_is_one_short_line_even_for_huge_values() -> None:
    message = error_of(gpu({"strategy": "x" * 5000}))
    assert "\n" not in message
    assert len(message) < 400
    assert "'xxxxxxxx" in message


def test_error_carries_claim_and_structured_problems() -> None:
    with pytest.raises(ConfigError) as caught:
        decode_parameters(gpu({"strategy": "Nope"}), config=ENTRY, claim="ns/c")
    error = caught.value
    assert error.claim == "ns/c"
    assert not error.retryable
    [problem] = error.problems
    assert (problem.config, problem.field) == (ENTRY, "parameters.sharing.strategy")


def test_configs_are_hashable_and_equal_by_value_whatever_the_map_order() -> None:
    first = decode_parameters(gpu(mps(defaultPerDevicePinnedMemoryLimit={"0": "1Gi", "1": "2Gi"})))
    second = decode_parameters(gpu(mps(defaultPerDevicePinnedMemoryLimit={"1": "2Gi", "0": "1Gi"})))
    assert first == second
    assert hash(first) == hash(second)
    assert len({first, second, GpuConfig(), MigDeviceConfig()}) == 3
