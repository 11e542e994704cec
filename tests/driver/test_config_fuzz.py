"""Fuzzing the opaque config API (Hypothesis; profiles in tests/fuzzing.py, docs/development.md).

Properties, for any input: decoding returns a config or raises `ConfigError`, nothing else; each
problem names its entry and a field path under ``parameters``, on one line of at most 300
characters; an accepted config re-validates and round-trips through its JSON form. Resolving a
claim's config list and rendering pinned-memory limits keep the same promises. Deep regression
cases are plain tests in test_config_bounds.py (Hypothesis cannot show them as examples).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from gpu_dra.driver.config import (
    AllocatedDevice,
    ConfigError,
    DeviceConfig,
    QuantityError,
    decode_parameters,
    parse_quantity,
    pinned_memory_limits,
    quantity_value,
    resolve_configs,
)
from gpu_dra.driver.config.errors import MAX_PROBLEM_CHARS
from gpu_dra.driver.config.objects import CONFIG_LISTS, check_config_list
from gpu_dra.driver.config.resolve import CONFIG_FIELD
from gpu_dra.driver.config.validate import PER_DEVICE_LIMITS, config_problems
from gpu_dra.driver.jsonbounds import path_key
from tests.fuzzing import (
    Path,
    attempt,
    cases,
    device_keys,
    hostile,
    json_values,
    mps_configs,
    mutated,
    texts,
    valid_parameters,
)

ENTRY = "spec.devices.config[0]"
CLAIM = "team-a/train"
DRIVER = "gpu.nvidia.com"


def decoded(parameters: object) -> DeviceConfig | ConfigError:
    """The config, or the `ConfigError` after checking that it names fields properly."""
    outcome = attempt(lambda: decode_parameters(parameters, config=ENTRY, claim=CLAIM), ConfigError)
    if isinstance(outcome, ConfigError):
        assert_names_fields(outcome, entry=ENTRY)
    else:
        assert_round_trips(outcome)
    return outcome


def assert_names_fields(error: ConfigError, *, entry: str) -> None:
    message = str(error)
    assert message.startswith(f"resource claim {CLAIM}: {entry}: parameters")
    assert "\n" not in message
    assert error.problems
    for problem in error.problems:
        assert problem.config == entry
        assert re.match(r"parameters($|\.|\[)", problem.field), problem
        assert problem.reason
        assert len(str(problem)) <= MAX_PROBLEM_CHARS


def assert_round_trips(config: DeviceConfig) -> None:
    assert config_problems(config) == []
    assert config.normalized() == config
    as_json = json.loads(json.dumps(config.model_dump(mode="json", exclude_none=True)))
    assert decode_parameters(as_json) == config


# ---- decode_parameters ------------------------------------------------------------------------
@cases(ci=150, full=15_000)
@given(json_values(python=True) | hostile(python=True))
@example({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "x": float("nan")})
def test_any_value_is_decoded_or_refused_naming_a_field(parameters: object) -> None:
    decoded(parameters)


def related(field: str, path: Path) -> bool:
    """Whether ``field`` is at, above or below the top-level field of ``path``."""
    top = "parameters" + path_key(str(path[0]), brackets=False)
    return field in ("parameters", top) or field.startswith((f"{top}.", f"{top}["))


@cases(ci=150, full=30_000)
@given(mutated(valid_parameters, python=True))
@example(
    (
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "GpuConfig",
            "sharing": {
                "strategy": "MPS",
                "mpsConfig": {"defaultActiveThreadPercentage": 10**5000},
            },
        },
        ("sharing", "mpsConfig", "defaultActiveThreadPercentage"),
        "extreme",
    )
)
def test_near_valid_configs_are_refused_at_the_changed_field(change: tuple[Any, Path, str]) -> None:
    parameters, path, _ = change
    outcome = decoded(parameters)
    if not isinstance(outcome, ConfigError) or not path or path[0] in ("apiVersion", "kind"):
        return  # still valid, or a change of the kind: any field of the other kind may be named
    if any(p.reason.startswith("too large") for p in outcome.problems):
        return  # the size runs out wherever the bytes add up, not where they were added
    assert any(related(p.field, path) for p in outcome.problems), (path, outcome)


@cases(ci=100, full=10_000)
@given(valid_parameters)
def test_valid_configs_are_accepted_and_round_trip(parameters: dict[str, Any]) -> None:
    config = decoded(parameters)
    assert not isinstance(config, ConfigError), config
    assert parameters["kind"] == config.KIND
    sharing = parameters.get("sharing")
    if sharing is None:
        assert config.sharing is None
    else:
        assert config.sharing is not None
        assert config.sharing.strategy == sharing["strategy"]


# ---- resolve_configs --------------------------------------------------------------------------
REQUESTS = st.sampled_from(["gpu", "mig", "gpu/small", "other"])
valid_entries = st.fixed_dictionaries(
    {
        "source": st.sampled_from(["FromClass", "FromClaim"]),
        "opaque": st.fixed_dictionaries(
            {
                "driver": st.sampled_from([DRIVER, "other.example.com"]),
                "parameters": valid_parameters,
            }
        ),
    },
    optional={"requests": st.lists(REQUESTS, max_size=3)},
)
entries = st.one_of(
    valid_entries, mutated(valid_entries, python=True).map(lambda c: c[0]), json_values()
)
config_lists = st.one_of(
    st.lists(entries, max_size=5), json_values(python=True), hostile(python=True)
)
devices = st.lists(
    st.builds(
        AllocatedDevice,
        request=REQUESTS | texts,
        device=st.sampled_from(["gpu-0", "gpu-1", "gpu-2-mig-1g10gb-19-0"]) | texts,
        type=st.sampled_from(["gpu", "mig"]),
    ),
    max_size=4,
)
LABEL = re.compile(r"config\[\d+\]( \([A-Za-z_]\w*\))?|spec\.devices\.config\[\d+\]")


@cases(ci=150, full=10_000)
@given(config_lists, st.none() | st.lists(entries, max_size=4) | json_values(), devices)
@example([5], None, [])  # AttributeError: 'int' object has no attribute 'get'
@example([{"source": ["FromClaim"]}], None, [])  # TypeError: unhashable type
def test_config_lists_resolve_or_fail_naming_entry_and_field(
    configs: object, spec_configs: object, allocated: list[AllocatedDevice]
) -> None:
    resolved = attempt(
        lambda: resolve_configs(
            configs, allocated, driver=DRIVER, claim=CLAIM, spec_configs=spec_configs
        ),
        ConfigError,
    )
    if isinstance(resolved, ConfigError):
        assert str(resolved).startswith(f"resource claim {CLAIM}: ")
        assert "\n" not in str(resolved)
        for problem in resolved.problems:
            if problem.field == CONFIG_FIELD:
                assert not problem.config
                continue
            assert LABEL.fullmatch(problem.config), problem
            assert re.match(r"(parameters|source|requests)($|\.|\[)", problem.field or "source")
            assert len(str(problem)) <= MAX_PROBLEM_CHARS
        return
    grouped = [device for group in resolved.groups for device in group.devices]
    assert sorted(grouped, key=repr) == sorted(dict.fromkeys(allocated), key=repr)
    for group in resolved.groups:
        for device in group.devices:
            assert device.type == group.config.DEVICE_TYPE
        assert group.config.normalized() == group.config


# ---- the admission webhook's check of an object's config list --------------------------------
def with_config(kind: str, entries: object) -> dict[str, Any]:
    """A `kind` object holding ``entries`` at its config path."""
    keys, _ = CONFIG_LISTS[kind]
    obj: Any = entries
    for key in reversed(keys):
        obj = {key: obj}
    return dict(obj)


@cases(ci=100, full=5_000)
@given(
    st.sampled_from(sorted(CONFIG_LISTS)).flatmap(
        lambda kind: st.tuples(
            st.just(kind),
            st.builds(with_config, st.just(kind), config_lists)
            | mutated(st.builds(with_config, st.just(kind), st.lists(valid_entries, max_size=3)))
            .map(lambda change: change[0])
            .filter(lambda obj: isinstance(obj, dict)),
        )
    )
)
def test_objects_config_lists_are_judged_entry_by_entry_on_one_line(
    kind_and_object: tuple[str, dict[str, Any]],
) -> None:
    kind, obj = kind_and_object
    path = ".".join(CONFIG_LISTS[kind][0])
    for check in check_config_list(kind, obj, driver=DRIVER):
        assert check.verdict in ("OK", "ERROR", "SKIP")
        assert "\n" not in str(check)
        assert len(str(check)) < 4000
        assert path.startswith(check.path) or check.path.startswith(f"{path}[")


# ---- pinned_memory_limits ---------------------------------------------------------------------
mps_parameters = st.builds(
    lambda mps, kind: {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": kind,
        "sharing": {"strategy": "MPS", "mpsConfig": mps},
    },
    mps_configs,
    st.sampled_from(["GpuConfig", "MigDeviceConfig"]),
)
odd_keys = st.one_of(device_keys, texts, st.integers(0, 10**6).map(lambda n: "0" * 3 + str(n)))


@cases(ci=100, full=5_000)
@given(
    mps_parameters,
    st.dictionaries(odd_keys, st.sampled_from(["1Gi", "2Gi", "1024Mi"]), max_size=4),
    st.lists(
        st.uuids().map(lambda u: f"GPU-{u}") | st.uuids().map(lambda u: f"MIG-{u}"), max_size=5
    ),
)
@example(
    {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS"},
    },
    {"9" * 5000: "1Gi"},  # ValueError: int() of more than 4300 digits
    ["GPU-a"],
)
def test_pinned_limits_are_rendered_or_refused_naming_the_key(
    parameters: dict[str, Any], extra_keys: dict[str, str], uuids: list[str]
) -> None:
    mps = parameters["sharing"]["mpsConfig"] = dict(parameters["sharing"].get("mpsConfig", {}))
    mps["defaultPerDevicePinnedMemoryLimit"] = {
        **mps.get("defaultPerDevicePinnedMemoryLimit", {}),
        **extra_keys,
    }
    entry = {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}
    device_type = "gpu" if parameters["kind"] == "GpuConfig" else "mig"
    device = AllocatedDevice(request="gpu", device="gpu-0", type=device_type)
    resolved = attempt(
        lambda: resolve_configs([entry], [device], driver=DRIVER, claim=CLAIM), ConfigError
    )
    if isinstance(resolved, ConfigError):  # a key of the wrong syntax: refused at decode
        assert all(p.field.startswith(PER_DEVICE_LIMITS) for p in resolved.problems), resolved
        return
    (group,) = resolved.groups
    limits = attempt(lambda: pinned_memory_limits(group, uuids, claim=CLAIM), ConfigError)
    if isinstance(limits, ConfigError):
        assert all(p.field.startswith(PER_DEVICE_LIMITS) for p in limits.problems), limits
        assert all(p.config == "config[0] (FromClaim)" for p in limits.problems)
        return
    assert set(limits) <= set(uuids)
    assert all(re.fullmatch(r"[0-9]+M", limit) for limit in limits.values())


# ---- quantities -------------------------------------------------------------------------------
quantity_texts = st.one_of(
    texts,
    st.from_regex(r"[+-]?[0-9]{0,30}(\.[0-9]{0,10})?([eE][+-]?[0-9]{1,4}|[KMGTPE]i|[numkMGTPE])?"),
)


@cases(ci=200, full=10_000)
@given(quantity_texts)
def test_quantities_parse_or_fail_with_a_quantity_error(text: str) -> None:
    value = attempt(lambda: parse_quantity(text), QuantityError)
    if isinstance(value, QuantityError):
        assert str(value)
        return
    assert abs(value) <= 2**63 - 1
    rounded = quantity_value(text)
    assert rounded == (math.ceil(value) if value >= 0 else math.floor(value))
