"""Hostile opaque configs and config lists: every one is a `ConfigError` naming the field, never
another exception (RecursionError, ValueError, TypeError, AttributeError). Regression tests of
the defects the fuzz tests (test_config_fuzz.py) found."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_dra.driver.config import (
    API_VERSION,
    AllocatedDevice,
    ConfigError,
    ConfigProblem,
    decode_parameters,
    resolve_configs,
)
from gpu_dra.driver.config.decode import MAX_PARAMETERS_BYTES, MAX_PARAMETERS_DEPTH
from gpu_dra.driver.config.limits import pinned_memory_limits
from gpu_dra.driver.config.objects import check_config_list

ENTRY = "spec.devices.config[0]"
DRIVER = "gpu.nvidia.com"
GPU0 = AllocatedDevice(request="gpu", device="gpu-0", type="gpu")


def gpu(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", **fields}


def mps(**config: Any) -> dict[str, Any]:
    return gpu(sharing={"strategy": "MPS", "mpsConfig": config})


def nested(levels: int) -> Any:
    value: Any = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def problem_of(parameters: object) -> ConfigProblem:
    with pytest.raises(ConfigError) as caught:
        decode_parameters(parameters, config=ENTRY, claim="ns/c")
    (problem,) = caught.value.problems
    assert problem.config == ENTRY
    return problem


def test_parameters_nested_thousands_of_levels_deep_are_refused_with_the_field() -> None:
    # Was RecursionError from json.dumps: one tenant's claim broke every node's decoding.
    problem = problem_of(gpu(sharing=nested(3000)))
    assert problem.field == "parameters.sharing.a.a.a.a.a.a...(+25 more)"
    assert problem.reason == (
        f"nested too deeply: at most {MAX_PARAMETERS_DEPTH} levels of objects and arrays are "
        "allowed"
    )


def test_a_config_nested_to_the_depth_limit_is_decoded_to_its_field_problems() -> None:
    with pytest.raises(ConfigError) as caught:
        decode_parameters(gpu(sharing=nested(MAX_PARAMETERS_DEPTH - 1)))
    assert [p.field for p in caught.value.problems] == [
        "parameters.sharing.strategy",
        "parameters.sharing.a",
    ]


def test_parameters_above_the_size_limit_are_refused() -> None:
    limits = {f"GPU-{i:08d}": "1Gi" for i in range(MAX_PARAMETERS_BYTES // 20)}
    problem = problem_of(mps(defaultPerDevicePinnedMemoryLimit=limits))
    assert problem.field.startswith("parameters.sharing.mpsConfig.defaultPerDevicePinnedMemory")
    assert problem.reason == f"too large: at most {MAX_PARAMETERS_BYTES} bytes of JSON are allowed"


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        # Was "parameters: not valid JSON: Exceeds the limit (4300 digits) ...".
        ({"defaultActiveThreadPercentage": 10**5000}, "integer with more than 64 digits"),
        # Was "parameters: not valid JSON: Out of range float values ...".
        ({"defaultActiveThreadPercentage": float("nan")}, "nan is not a JSON number"),
        ({"defaultPinnedDeviceMemoryLimit": float("inf")}, "inf is not a JSON number"),
        # Was "parameters: invalid JSON: unexpected end of hex escape ...".
        ({"defaultPinnedDeviceMemoryLimit": "1Gi\ud800"}, "string is not valid Unicode"),
        # Was "parameters: not valid JSON: Object of type bytes is not JSON serializable".
        ({"multiUser": b"yes"}, "expected a JSON value, got bytes"),
    ],
    ids=["huge-int", "nan", "inf", "surrogate", "bytes"],
)
def test_values_json_cannot_hold_are_refused_at_their_field(
    config: dict[str, Any], reason: str
) -> None:
    problem = problem_of(mps(**config))
    (name,) = config
    assert problem.field == f"parameters.sharing.mpsConfig.{name}"
    assert problem.reason.startswith(reason)


def test_a_key_that_is_not_a_string_is_refused_at_its_object() -> None:
    problem = problem_of(gpu(sharing={"strategy": "MPS", ("a", "b"): 1}))
    assert problem.field == "parameters.sharing"
    assert problem.reason == "object keys must be strings, got tuple"


def test_unknown_fields_with_odd_names_keep_the_message_on_one_short_line() -> None:
    problem = problem_of(gpu(**{"x\n" * 200: 1}))
    assert "\n" not in str(problem)
    assert problem.field == "parameters[" + repr(("x\n" * 200)[:37] + "...") + "]"
    assert problem.reason.startswith("unknown field")


def test_an_index_key_with_thousands_of_digits_is_out_of_range_not_a_value_error() -> None:
    # Was ValueError (int() of more than 4300 digits) at prepare, in pinned_memory_limits.
    key = "0" * 10 + "9" * 5000
    configs = [
        {
            "source": "FromClaim",
            "opaque": {
                "driver": DRIVER,
                "parameters": mps(defaultPerDevicePinnedMemoryLimit={key: "1Gi"}),
            },
        }
    ]
    (group,) = resolve_configs(configs, [GPU0], driver=DRIVER, claim="ns/c").groups
    with pytest.raises(ConfigError) as caught:
        pinned_memory_limits(group, ["GPU-a"], claim="ns/c")
    (problem,) = caught.value.problems
    assert problem.field.startswith(
        "parameters.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit['0000"
    )
    assert problem.reason.startswith(f"device index {'9' * 37}... is out of range")


# ---- the config list of a claim's allocation -------------------------------------------------
def resolve_error(configs: object, spec_configs: object = None) -> list[ConfigProblem]:
    with pytest.raises(ConfigError) as caught:
        resolve_configs(configs, [GPU0], driver=DRIVER, claim="ns/c", spec_configs=spec_configs)
    return list(caught.value.problems)


def test_a_config_list_that_is_no_list_is_a_config_error() -> None:
    (problem,) = resolve_error({"source": "FromClaim"})
    assert problem.field == "status.allocation.devices.config"
    assert problem.reason == "expected a list of config entries, got an object"


def test_a_null_config_list_means_no_entries() -> None:
    (group,) = resolve_configs(None, [GPU0], driver=DRIVER, claim="ns/c").groups
    assert group.origin.source == "default"


def test_an_entry_that_is_no_object_is_a_config_error() -> None:
    # Was AttributeError: 'int' object has no attribute 'get'.
    (problem,) = resolve_error([5])
    assert str(problem) == "config[0]: expected a config entry (an object), got number 5"


@pytest.mark.parametrize("source", [["FromClaim"], {"a": 1}, 10**5000], ids=["list", "obj", "int"])
def test_a_source_of_another_json_type_is_a_config_error(source: object) -> None:
    # Was TypeError: unhashable type (lists, objects) and ValueError (huge integers).
    (problem,) = resolve_error([{"source": source, "opaque": {"driver": DRIVER}}])
    assert problem.config == "config[0]"
    assert problem.field == "source"
    assert problem.reason.startswith("unknown config source ")


def test_deep_entries_in_the_spec_and_the_allocation_are_not_compared_recursively() -> None:
    # Was RecursionError in comparison, while naming the entries for messages.
    deep = {"driver": "other.example.com", "parameters": nested(5000)}
    allocated = [{"source": "FromClaim", "opaque": deep}]
    spec = [{"opaque": deep}]
    (group,) = resolve_configs(
        allocated, [GPU0], driver=DRIVER, claim="ns/c", spec_configs=spec
    ).groups
    assert group.origin.source == "default"
    (problem,) = resolve_error(
        [{"source": "FromClaim", "opaque": {**deep, "driver": DRIVER}}],
        spec_configs=[{"opaque": {**deep, "driver": DRIVER}}],
    )
    assert problem.config == "config[0] (FromClaim)"
    assert problem.reason.startswith("nested too deeply")


def test_spec_entries_that_are_no_objects_are_ignored_for_naming() -> None:
    opaque = {"driver": DRIVER, "parameters": {"kind": "GpuConfig"}}
    (problem,) = resolve_error(
        [{"source": "FromClaim", "opaque": opaque}], spec_configs=[5, None, {"opaque": opaque}]
    )
    assert problem.config == "spec.devices.config[2]"


def test_a_message_lists_ten_problems_then_counts_the_rest() -> None:
    entries = [{"source": "Bad", "opaque": {}} for _ in range(13)]
    with pytest.raises(ConfigError) as caught:
        resolve_configs(entries, [GPU0], driver=DRIVER, claim="ns/c")
    assert len(caught.value.problems) == 13
    message = str(caught.value)
    assert message.count("unknown config source") == 10
    assert message.endswith("; (3 more problems)")


def test_a_request_name_with_odd_characters_is_quoted_in_the_kind_mismatch_message() -> None:
    # Was the name as is: a newline in a request name split the pod event.
    entry = {
        "source": "FromClaim",
        "requests": ["gpu\nx"],
        "opaque": {"driver": DRIVER, "parameters": {**gpu(), "kind": "MigDeviceConfig"}},
    }
    device = AllocatedDevice(request="gpu\nx", device="gpu-0", type="gpu")
    with pytest.raises(ConfigError) as caught:
        resolve_configs([entry], [device], driver=DRIVER, claim="ns/c")
    assert str(caught.value) == (
        "resource claim ns/c: config[0] (FromClaim): cannot apply MigDeviceConfig to device "
        '"gpu-0" of type "gpu" (request: \'gpu\\nx\'): use kind GpuConfig for gpu devices'
    )


# ---- the admission webhook's judgement of an object's config list ------------------------------
@pytest.mark.parametrize(
    ("driver", "shown"),
    [
        (10**5000, "an integer with more than 64 digits"),  # was ValueError in the f-string
        ("x\n" * 100, repr("x\n" * 18 + "x...")),  # was the text as is: a message of 101 lines
        ({"a": 1}, "an object"),
    ],
    ids=["huge-int", "newlines", "object"],
)
def test_an_entry_of_another_driver_is_skipped_with_a_short_one_line_message(
    driver: object, shown: str
) -> None:
    claim = {"spec": {"devices": {"config": [{"opaque": {"driver": driver, "parameters": {}}}]}}}
    (check,) = check_config_list("ResourceClaim", claim, driver=DRIVER)
    assert (check.verdict, check.message) == ("SKIP", f"driver {shown} is not {DRIVER}")


def test_the_webhook_message_lists_ten_problems_then_counts_the_rest() -> None:
    parameters = gpu(**{f"unknown{i}": 1 for i in range(12)})
    claim = {
        "spec": {"devices": {"config": [{"opaque": {"driver": DRIVER, "parameters": parameters}}]}}
    }
    (check,) = check_config_list("ResourceClaim", claim, driver=DRIVER)
    assert check.verdict == "ERROR"
    assert check.message.count("unknown field") == 10
    assert check.message.endswith("; (2 more problems)")
