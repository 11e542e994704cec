"""driver.cel.values and the quantity/semver CEL functions: Kubernetes' Quantity and Semver."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from gpu_dra.driver.cel import (
    CelRuntimeError,
    CelValueError,
    Quantity,
    Semver,
    compile_selector,
    to_cel_device,
)


def evaluate(expression: str) -> bool:
    return compile_selector(expression).matches(to_cel_device("gpu.nvidia.com", {"name": "d"}))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.2.3", Semver(1, 2, 3)),
        ("0.0.0", Semver(0, 0, 0)),
        ("1.0.0-rc.1", Semver(1, 0, 0, ("rc", "1"))),
        ("1.0.0-alpha-2+build.5", Semver(1, 0, 0, ("alpha-2",))),
        ("580.95.5+x", Semver(580, 95, 5)),
    ],
)
def test_semver_parses_strict_versions(text, expected):
    assert Semver.parse(text) == expected


@pytest.mark.parametrize(
    "text",
    ["1.2", "1", "v1.2.3", "01.2.3", "1.2.03", "1.2.3-", "1.2.3-01", "1.2.3-a..b", "a.b.c", ""],
)
def test_semver_rejects_what_blang_semver_rejects(text):
    with pytest.raises(CelValueError):
        Semver.parse(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("v1.2", "1.2.0"), ("1", "1.0.0"), ("v01.02.003", "1.2.3"), ("1.2-rc.1", "1.2.0-rc.1")],
)
def test_semver_normalize_pads_and_strips(text, expected):
    assert str(Semver.parse(text, normalize=True)) == expected


def test_semver_precedence_follows_the_spec():
    ordered = [
        "1.0.0-alpha",
        "1.0.0-alpha.1",
        "1.0.0-alpha.beta",
        "1.0.0-beta",
        "1.0.0-beta.2",
        "1.0.0-beta.11",
        "1.0.0-rc.1",
        "1.0.0",
        "1.0.1",
        "1.1.0",
        "2.0.0",
    ]
    versions = [Semver.parse(text) for text in ordered]
    for left, right in itertools.pairwise(versions):
        assert left.compare(right) == -1
        assert right.compare(left) == 1
    assert Semver.parse("1.0.0+a").compare(Semver.parse("1.0.0+b")) == 0


def test_quantity_reuses_the_config_parser_and_compares_by_value():
    assert Quantity.parse("1Gi") == Quantity.parse("1024Mi")
    assert Quantity.parse("1.5").value == Fraction(3, 2)
    assert Quantity.parse("500m").compare(Quantity.parse("1")) == -1
    with pytest.raises(CelValueError, match="not a Kubernetes quantity"):
        Quantity.parse("200K")


@pytest.mark.parametrize(
    "expression",
    [
        "quantity('1Gi') == quantity('1024Mi')",
        "quantity('1Gi').add(quantity('1Gi')) == quantity('2Gi')",
        "quantity('1Gi').add(1) == quantity('1073741825')",
        "quantity('1Gi').sub(quantity('1Mi')).isLessThan(quantity('1Gi'))",
        "sign(quantity('1').sub(2)) == -1",
        "sign(quantity('0')) == 0",
        "quantity('1.5').isInteger() == false && quantity('2k').isInteger()",
        "quantity('1.5').asApproximateFloat() == 1.5",
        "quantity('1k').asInteger() == 1000",
        "quantity('100m').compareTo(quantity('0.1')) == 0",
        "isQuantity('10Gi') && !isQuantity('200K') && !isQuantity('')",
        "semver('1.2.3') == semver('1.2.3+build5')",
        "semver('v1.2', true) == semver('1.2.0')",
        "semver('1.0.0-rc.1').isLessThan(semver('1.0.0'))",
        "semver('1.10.0').isGreaterThan(semver('1.9.0'))",
        "semver('2.0.0').compareTo(semver('10.0.0')) == -1",
        "cel.bind(v, semver('1.2.3'), v.major() == 1 && v.minor() == 2 && v.patch() == 3)",
        "isSemver('1.2.3') && !isSemver('1.2') && isSemver('1.2', true)",
        "cel.bind(q, '40' + 'Gi', quantity(q) == quantity('40Gi'))",
    ],
)
def test_kubernetes_library_function(expression):
    assert evaluate(expression) is True


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("quantity('1.5').asInteger() == 1", "cannot convert value to integer"),
        ("quantity('4Ei').add(quantity('4Ei')).asInteger() > 0", "cannot convert value to integer"),
        ("semver('1.2') == semver('1.2.0')", "not a semantic version"),
        ("sign(quantity('x' + 'y')) == 0", "not a Kubernetes quantity"),
    ],
)
def test_kubernetes_library_runtime_errors(expression, message):
    with pytest.raises(CelRuntimeError, match=message):
        evaluate(expression)


def test_nano_and_micro_suffixes():
    assert evaluate(
        "quantity('1500000n') == quantity('1500u') && quantity('1500u') == quantity('1.5m')"
    )
