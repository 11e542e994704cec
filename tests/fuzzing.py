"""Hypothesis profiles and generators shared by the fuzz tests (``tests/**/test_*_fuzz.py``).

Profiles, chosen by ``GPU_DRA_FUZZ`` (loaded in ``tests/conftest.py``): ``ci`` (the default) runs
each fuzz test's small count, so that all fuzz modules together take about 30 s on 2 cores;
``full`` runs each test's full count, more than 100 000 cases in all (docs/development.md,
Fuzzing). Generators: `json_values` (any JSON, optionally values JSON cannot hold), `hostile`
(deep, wide, huge), `valid_parameters` (opaque configs as users write them) and `mutated` (a
valid value with one thing changed, and where).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from gpu_dra.driver.config import API_VERSION

PROFILE: Final = os.environ.get("GPU_DRA_FUZZ", "ci")
if PROFILE not in ("ci", "full"):
    raise ValueError(f"GPU_DRA_FUZZ must be ci or full, got {PROFILE!r}")

_COMMON: Final[dict[str, Any]] = {
    "deadline": None,  # a shared 2-core machine: timing is no property here
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("ci", max_examples=100, **_COMMON)
settings.register_profile("full", max_examples=10_000, **_COMMON)


def cases(*, ci: int, full: int) -> settings:
    """This test's example count under the loaded profile (``ci`` or ``full``)."""
    return settings(max_examples=full if PROFILE == "full" else ci)


Path = tuple[str | int, ...]

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)


def attempt(call: Callable[[], T], error: type[E]) -> T | E:
    """What ``call`` returns, or the ``error`` it raised (any other exception propagates)."""
    try:
        return call()
    except error as raised:
        return raised


# ---- JSON values ------------------------------------------------------------------------------
FIELD_NAMES: Final = (
    "apiVersion",
    "kind",
    "sharing",
    "strategy",
    "timeSlicingConfig",
    "interval",
    "mpsConfig",
    "defaultActiveThreadPercentage",
    "defaultPinnedDeviceMemoryLimit",
    "defaultPerDevicePinnedMemoryLimit",
    "multiUser",
    "source",
    "requests",
    "opaque",
    "driver",
    "parameters",
    "request",
    "device",
    "pool",
    "adminAccess",
    "shareID",
    "consumedCapacity",
    "memory",
    "compute",
    "GpuConfig",
    "MigDeviceConfig",
    "MPS",
    "TimeSlicing",
    "FromClass",
    "FromClaim",
    "gpu.nvidia.com",
    API_VERSION,
)
EXTREME_NUMBERS: Final = (
    0,
    -1,
    100,
    101,
    2**31,
    2**63 - 1,
    2**63,
    -(2**63),
    2**64,
    10**64 - 1,
    10**64,
    1e308,
    -1e-308,
    5e-324,
    0.5,
    float("nan"),
    float("inf"),
    float("-inf"),
)
texts = st.one_of(
    st.sampled_from(FIELD_NAMES),
    st.text(max_size=12),
    st.text(st.characters(codec="utf-8"), max_size=12),
    st.text(st.characters(categories=["Cs", "Cc", "Zs", "So"]), max_size=4),  # lone surrogates
    st.sampled_from(["", " ", "10Gi", "10 Gi", "1e999", "-1Mi", "0", "GPU-", "MIG-x", "a.b"]),
)


def _huge(digits: int, sign: int) -> int:
    """An integer of ``digits`` digits (Python refuses ``str()`` above 4300)."""
    return sign * (10**digits - 1)


# Never in sampled_from/just: Hypothesis shows those strategies' values with repr().
huge_integers = st.builds(_huge, st.integers(65, 6000), st.sampled_from([1, -1]))
extreme_numbers = st.sampled_from(EXTREME_NUMBERS) | huge_integers
numbers = st.one_of(st.integers(-5, 130), st.integers(), extreme_numbers, st.floats())
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)


def json_values(*, python: bool = False, max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """JSON values; with ``python``, also values JSON cannot hold (bytes, sets, tuples, objects
    with keys that are no strings), as a caller passing Python objects might."""
    leaves = scalars
    if python:
        leaves = st.one_of(scalars, st.binary(max_size=3), st.frozensets(st.integers(), max_size=2))

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        containers = st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4)
        if python:
            odd_keys = st.one_of(st.integers(), st.none(), st.tuples(st.integers()))
            containers |= st.tuples(children, children) | st.dictionaries(
                odd_keys, children, max_size=2
            )
        return containers

    return st.recursive(leaves, extend, max_leaves=max_leaves)


def nest(value: Any, levels: int, *, in_list: bool = False) -> Any:
    """``value`` inside ``levels`` objects (or arrays)."""
    for _ in range(levels):
        value = [value] if in_list else {"a": value}
    return value


huge_texts = st.builds(lambda n, c: c * n, st.integers(0, 300_000), st.sampled_from("x\né"))


def hostile(*, python: bool = False, max_depth: int = 5000) -> st.SearchStrategy[Any]:
    """Values that attack the decoder's resources: up to ``max_depth`` levels deep, tens of
    thousands of members, strings of 300 000 characters, integers of thousands of digits;
    cycles with ``python``. Each is several times the size limit of the opaque config."""
    deep = st.builds(
        nest, json_values(max_leaves=3), st.integers(1, max_depth), in_list=st.booleans()
    )
    wide = st.builds(lambda n, v: {f"k{i}": v for i in range(n)}, st.integers(0, 20_000), scalars)
    long_list = st.builds(lambda n, v: [v] * n, st.integers(0, 40_000), scalars)
    options = [deep, wide, long_list, huge_texts, huge_integers]
    if python:
        options.append(st.builds(_cycle, json_values(max_leaves=2)))
    return st.one_of(options)


def deep_text(levels: int, inner: str, objects: bool) -> str:
    """JSON text nested ``levels`` deep around ``inner`` (built as text: json.dumps recurses)."""
    if objects:
        return '{"a": ' * levels + inner + "}" * levels
    return "[" * levels + inner + "]" * levels


def huge_integer_text(digits: int) -> str:
    """A JSON integer of ``digits`` digits, as text (Python cannot str() one over 4300)."""
    return "-" + "9" * digits


def _cycle(value: Any) -> Any:
    loop: list[Any] = [value]
    loop.append({"self": loop})
    return loop


# ---- valid opaque configs ---------------------------------------------------------------------
quantities = st.one_of(
    st.sampled_from(["1Mi", "512Mi", "10Gi", "1G", "1e9", "1.5Gi", "1048576", "80Gi", "1Ti"]),
    st.builds(lambda n, s: f"{n}{s}", st.integers(1, 1023), st.sampled_from(["Mi", "Gi"])),
    st.integers(2**20, 2**40),  # a JSON number is a quantity too
)
device_keys = st.one_of(
    st.integers(0, 15).map(str),
    st.uuids().map(lambda u: f"GPU-{u}"),
    st.uuids().map(lambda u: f"MIG-{u}"),
)
mps_configs = st.fixed_dictionaries(
    {},
    optional={
        "defaultActiveThreadPercentage": st.integers(0, 100),
        "defaultPinnedDeviceMemoryLimit": quantities,
        "defaultPerDevicePinnedMemoryLimit": st.dictionaries(device_keys, quantities, max_size=6),
        "multiUser": st.booleans(),
    },
)
_time_slicing = st.fixed_dictionaries(
    {},
    optional={"interval": st.sampled_from(["Default", "Short", "Medium", "Long"])},
)
gpu_sharing = st.one_of(
    st.fixed_dictionaries(
        {"strategy": st.just("TimeSlicing")}, optional={"timeSlicingConfig": _time_slicing}
    ),
    st.fixed_dictionaries({"strategy": st.just("MPS")}, optional={"mpsConfig": mps_configs}),
)
mig_sharing = st.one_of(
    st.fixed_dictionaries({"strategy": st.just("TimeSlicing")}),
    st.fixed_dictionaries({"strategy": st.just("MPS")}, optional={"mpsConfig": mps_configs}),
)
gpu_parameters = st.fixed_dictionaries(
    {"apiVersion": st.just(API_VERSION), "kind": st.just("GpuConfig")},
    optional={"sharing": gpu_sharing},
)
mig_parameters = st.fixed_dictionaries(
    {"apiVersion": st.just(API_VERSION), "kind": st.just("MigDeviceConfig")},
    optional={"sharing": mig_sharing},
)
valid_parameters = gpu_parameters | mig_parameters


# ---- mutations --------------------------------------------------------------------------------
MUTATIONS: Final = ("replace", "add-field", "delete", "deepen", "retype", "extreme", "unicode")


def paths(value: Any, path: Path = ()) -> Iterator[Path]:
    """Every path in ``value`` (small values only: recursive), the root first."""
    yield path
    if isinstance(value, dict):
        for key, child in value.items():
            yield from paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from paths(child, (*path, index))


def get(value: Any, path: Path) -> Any:
    for part in path:
        value = value[part]
    return value


def _retyped(value: Any) -> Any:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and abs(value) >= 10**4000:
        return "9" * 4500  # Python refuses str() of its digits
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return int(value) if value.isdigit() else [value]
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, list):
        return dict(enumerate(value)) if value else {}
    return 0


@st.composite
def mutated(
    draw: st.DrawFn,
    values: st.SearchStrategy[Any],
    *,
    python: bool = False,
    max_depth: int = 3000,
) -> tuple[Any, Path, str]:
    """A value of ``values`` with one change: (value, path of the change, kind of change).
    Changes nest at most ``max_depth`` levels deep."""
    value = copy.deepcopy(draw(values))
    path = draw(st.sampled_from(list(paths(value))))
    kind = draw(st.sampled_from(MUTATIONS))
    node = get(value, path)
    new: Any
    if kind == "add-field" and isinstance(node, dict):
        key = draw(texts)
        node[key] = draw(json_values(python=python))
        return value, (*path, key), kind
    if kind == "delete" and path:
        del get(value, path[:-1])[path[-1]]
        return value, path, kind
    replacements: dict[str, Callable[[], Any]] = {
        # Through st.builds, so that Hypothesis shows the value as nest(...) when it reports it.
        "deepen": lambda: draw(
            st.builds(nest, st.just(node), st.integers(1, max_depth), in_list=st.booleans())
        ),
        "retype": lambda: _retyped(node),
        "extreme": lambda: draw(extreme_numbers),
        "unicode": lambda: draw(texts | huge_texts),
    }
    make = replacements.get(
        kind, lambda: draw(json_values(python=python) | hostile(max_depth=max_depth))
    )
    new = make()
    if not path:
        return new, path, kind
    get(value, path[:-1])[path[-1]] = new
    return value, path, kind
