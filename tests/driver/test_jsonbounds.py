"""Bounds on untrusted JSON: `json_problem` finds depth, size and type problems without recursion;
`loads` parses any valid JSON text without RecursionError (``strict``: or says why it will not)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpu_dra.driver.jsonbounds import (
    TOO_DEEP,
    TOO_LONG,
    JsonBoundsError,
    JsonLimits,
    JsonProblem,
    describe,
    json_problem,
    loads,
    path_key,
    render_path,
)

LIMITS = JsonLimits(max_depth=4, max_bytes=100)


def nested(levels: int, leaf: Any = None) -> Any:
    value = leaf
    for _ in range(levels):
        value = {"a": value}
    return value


def test_json_values_within_the_limits_have_no_problem() -> None:
    value = {"a": [1, 2.5, True, None, "x"], "b": {"c": {"d": []}}}
    assert json_problem(value, LIMITS) is None
    assert json_problem("plain", LIMITS) is None


def test_depth_is_counted_in_objects_and_arrays_the_value_itself_being_level_one() -> None:
    assert json_problem(nested(4, leaf=1), LIMITS) is None
    assert json_problem(nested(5), LIMITS) == JsonProblem(
        ("a", "a", "a", "a"),
        "nested too deeply: at most 4 levels of objects and arrays are allowed",
    )


def test_nesting_far_beyond_the_recursion_limit_is_a_problem_not_a_recursion_error() -> None:
    problem = json_problem(nested(100_000), JsonLimits(max_depth=32, max_bytes=1 << 20))
    assert problem is not None
    assert len(problem.path) == 32


def test_a_cycle_is_too_deep() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    problem = json_problem(cycle, LIMITS)
    assert problem is not None
    assert "nested too deeply" in problem.reason


def test_size_counts_the_compact_encoding() -> None:
    value = {"key": "x" * 10, "n": [1, 22]}
    size = len(json.dumps(value, separators=(",", ":")).encode())
    assert json_problem(value, JsonLimits(max_depth=4, max_bytes=size)) is None
    problem = json_problem(value, JsonLimits(max_depth=4, max_bytes=size - 1))
    assert problem is not None
    assert problem.reason == f"too large: at most {size - 1} bytes of JSON are allowed"


def test_a_huge_string_is_refused_where_it_is_without_encoding_it() -> None:
    problem = json_problem({"a": {"b": "x" * 10_000_000}}, LIMITS)
    assert problem == JsonProblem(("a", "b"), "too large: at most 100 bytes of JSON are allowed")


@pytest.mark.parametrize(
    ("value", "path", "reason"),
    [
        ({"a": float("nan")}, ("a",), "nan is not a JSON number"),
        ({"a": [float("-inf")]}, ("a", 0), "-inf is not a JSON number"),
        ({"a": 10**64}, ("a",), "integer with more than 64 digits"),
        ({"a": -(10**5000)}, ("a",), "integer with more than 64 digits"),
        ({"a": b"x"}, ("a",), "expected a JSON value, got bytes"),
        ({"a": {1, 2}}, ("a",), "expected a JSON value, got set"),
        ({"a": {1: 2}}, ("a",), "object keys must be strings, got a number"),
        ({"a": "\ud800"}, ("a",), "string is not valid Unicode (it holds a lone surrogate)"),
        ({"\udfff": 1}, ("\udfff",), "string is not valid Unicode (it holds a lone surrogate)"),
    ],
    ids=["nan", "inf", "int64", "int5000", "bytes", "set", "int-key", "surrogate", "surr-key"],
)
def test_what_json_cannot_hold_is_a_problem_at_its_path(
    value: object, path: tuple[str | int, ...], reason: str
) -> None:
    assert json_problem(value, LIMITS) == JsonProblem(path, reason)


def test_the_largest_accepted_integer_has_64_digits() -> None:
    assert json_problem(10**64 - 1, JsonLimits(max_depth=1, max_bytes=100)) is None


def test_paths_stay_short_and_on_one_line() -> None:
    assert (
        render_path("parameters", ("sharing", "mpsConfig", 0)) == "parameters.sharing.mpsConfig[0]"
    )
    assert render_path("", ("a", "b")) == "a.b"
    assert render_path("p", ("a.b", "x\ny")) == "p['a.b']['x\\ny']"
    long_key = "k" * 100
    assert render_path("p", (long_key,)) == f"p['{'k' * 37}...']"
    deep = render_path("p", ("a",) * 40)
    assert deep == "p.a.a.a.a.a.a.a...(+33 more)"
    assert path_key("GPU-1", brackets=True) == "[GPU-1]"


def test_describe_never_converts_a_huge_integer() -> None:
    assert describe(10**5000) == "an integer with more than 64 digits"
    assert describe(5) == "number 5"
    assert describe("x" * 50) == repr("x" * 37 + "...")
    assert describe({}) == "an object"
    assert describe(()) == "an array"
    assert describe(None) == "null"


# ---- loads ------------------------------------------------------------------------------------
def test_loads_reads_what_json_loads_reads() -> None:
    text = '{"a": [1, 2.5, true, null, "x[{"], "b": {"c": "\\"]}"}}'
    assert loads(text) == json.loads(text)
    assert loads(text.encode()) == json.loads(text)


def test_loads_replaces_what_is_nested_too_deeply_with_a_marker() -> None:
    text = json.dumps({"keep": [[1]], "deep": nested(3, leaf=[1])})
    assert loads(text, max_depth=3) == {"keep": [[1]], "deep": {"a": {"a": TOO_DEEP}}}


def test_loads_never_raises_recursion_error_for_deep_valid_json() -> None:
    text = "[" * 200_000 + "]" * 200_000
    value = loads(text)
    depth = 0
    while isinstance(value, list):
        value = value[0] if value else None
        depth += 1
    assert depth == 100
    assert value == TOO_DEEP


def test_loads_reads_integers_python_refuses_as_a_marker() -> None:
    text = '{"n": ' + "7" * 5000 + ', "m": -' + "7" * 5000 + ', "ok": 12}'
    assert loads(text) == {"n": TOO_LONG, "m": TOO_LONG, "ok": 12}


@pytest.mark.parametrize("text", ["[" * 5000, '{"a": ' + "[" * 3000, "[1,", '{"a" 1}', "\xff"])
def test_loads_refuses_invalid_json_with_value_error(text: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - json.JSONDecodeError, as json.loads raises
        loads(text)


def test_loads_refuses_invalid_utf8_with_value_error() -> None:
    with pytest.raises(UnicodeDecodeError):
        loads(b'{"a": "\xff"}')


# ---- loads(strict=True) -----------------------------------------------------------------------
def test_strict_loads_reads_what_json_loads_reads_within_the_bounds() -> None:
    text = '{"a": [1, 2.5, true, null, "x[{NaN"], "b": {"c": "\\"]}"}}'
    assert loads(text, strict=True) == json.loads(text)
    assert loads(json.dumps(nested(100)), strict=True) == nested(100)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (json.dumps(nested(101)), "nested too deeply: more than 100 levels of objects and arrays"),
        ("[" * 200_000 + "]" * 200_000, "nested too deeply: more than 100 levels"),
        ('{"n": ' + "9" * 5000 + "}", "an integer with more than 4300 digits"),
        ('{"n": -' + "9" * 5000 + "}", "an integer with more than 4300 digits"),
        ('{"x": NaN}', "NaN is not a JSON number"),
        ("[-Infinity]", "-Infinity is not a JSON number"),
    ],
    ids=["depth-101", "depth-200000", "huge-integer", "huge-negative", "nan", "infinity"],
)
def test_strict_loads_refuses_valid_json_beyond_the_bounds_saying_why(
    text: str, reason: str
) -> None:
    with pytest.raises(JsonBoundsError) as error:
        loads(text, strict=True)
    assert str(error.value).startswith(reason)


@pytest.mark.parametrize("text", ["[" * 5000, "[" * 200 + "]" * 199 + "}", '{"a": 1,}'])
def test_strict_loads_calls_invalid_json_invalid_however_deep(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        loads(text, strict=True)
