"""gpu_dra.driver.cel against the conformance table (tests/cel_conformance.py): every case's
outcome and message fragment are what the Kubernetes apiserver and scheduler give (checked by
e2e/test_cel_conformance.py), except the recorded, documented differences."""

from __future__ import annotations

from collections import Counter

import pytest

from gpu_dra.driver.cel import CelCompileError, CelRuntimeError, compile_selector, to_cel_device
from tests.cel_conformance import CASES, COMPILE, MATCH, NO_MATCH, RUNTIME, Case, devices


def python_outcome(case: Case) -> tuple[str, str]:
    driver, published = devices()[case.device]
    try:
        selector = compile_selector(case.expression)
    except CelCompileError as error:
        return COMPILE, str(error)
    try:
        matched = selector.matches(to_cel_device(driver, published))
    except CelRuntimeError as error:
        return RUNTIME, str(error)
    return (MATCH if matched else NO_MATCH), ""


@pytest.mark.parametrize("case", CASES, ids=[f"{i:02d}" for i in range(len(CASES))])
def test_python_layer_gives_the_cluster_outcome(case: Case) -> None:
    expected = case.python or (case.expected, case.message)
    got = python_outcome(case)
    assert got[0] == expected[0], f"{case.expression[:120]!r}: {got}"
    assert expected[1] in got[1], got


def test_the_table_covers_every_outcome_and_every_device() -> None:
    assert len(CASES) >= 60
    outcomes = Counter(case.expected for case in CASES)
    assert set(outcomes) == {MATCH, NO_MATCH, RUNTIME, COMPILE}
    assert min(outcomes.values()) >= 8
    assert {case.device for case in CASES} == set(devices())
    assert len({(case.expression, case.device) for case in CASES}) == len(CASES)


def test_every_device_error_case_names_the_message() -> None:
    for case in CASES:
        if case.expected in (RUNTIME, COMPILE):
            assert case.message, case.expression
