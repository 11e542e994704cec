"""Fuzzing the JSON bounds (Hypothesis; profiles in tests/fuzzing.py, docs/development.md).

`json_problem` never raises and what it accepts can be encoded within the limits; `loads` reads
any text like ``json.loads`` does, but never raises anything but ValueError and never returns
nesting deeper than its limit.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpu_dra.driver.jsonbounds import JsonLimits, json_problem, loads
from tests.fuzzing import cases, deep_text, hostile, huge_integer_text, json_values

LIMITS = JsonLimits(max_depth=8, max_bytes=4096)


def depth(value: Any) -> int:
    """Nesting of objects and arrays, without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


@cases(ci=150, full=10_000)
@given(json_values(python=True) | hostile(python=True))
def test_json_problem_never_raises_and_what_it_accepts_fits(value: object) -> None:
    problem = json_problem(value, LIMITS)
    if problem is not None:
        assert problem.reason
        return
    encoded = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    assert depth(json.loads(encoded)) <= LIMITS.max_depth
    # The size is counted without string escapes: the encoding may only be longer by those.
    unescaped = len(encoded.encode()) - encoded.count("\\")
    assert unescaped <= LIMITS.max_bytes + encoded.count("\\") * 5


def with_text_changes(text: str, changes: list[tuple[int, str]]) -> str:
    for position, insert in changes:
        cut = position % (len(text) + 1)
        text = text[:cut] + insert + text[cut + 1 :]
    return text


def encoded(value: Any) -> str | None:
    try:
        return json.dumps(value)
    except ValueError:  # an integer of more than 4300 digits
        return None


small_texts = json_values().map(encoded).filter(lambda t: t is not None)
json_texts = st.one_of(
    small_texts,
    st.builds(deep_text, st.integers(0, 5000), small_texts, st.booleans()),
    st.builds(
        with_text_changes,
        small_texts | st.builds(deep_text, st.integers(0, 300), small_texts, st.booleans()),
        st.lists(
            st.tuples(st.integers(0, 2000), st.sampled_from([*'[]{}",: \\', "[" * 2000])),
            max_size=4,
        ),
    ),
    st.builds(
        lambda n, tail: "[" * n + tail, st.integers(0, 5000), st.sampled_from(["", "]", '"'])
    ),
    st.integers(1, 6000).map(lambda digits: '{"n": ' + huge_integer_text(digits) + "}"),
    st.text(max_size=30),
)


@cases(ci=150, full=10_000)
@given(json_texts)
def test_loads_reads_any_text_like_json_loads_without_recursion_errors(text: str) -> None:
    try:
        value = loads(text, max_depth=50)
    except ValueError:
        return
    assert depth(value) <= 50
    try:
        expected = json.loads(text)
    except (RecursionError, ValueError):
        return  # too deep or a huge integer for json.loads: loads read it with markers
    if depth(expected) <= 50:
        assert json.dumps(value, sort_keys=True) == json.dumps(expected, sort_keys=True)
