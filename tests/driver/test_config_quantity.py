"""Kubernetes quantities parse to exact values; anything else is refused with the text shown."""

from fractions import Fraction

import pytest

from gpu_dra.driver.config.quantity import QuantityError, parse_quantity, quantity_value


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10Gi", 10 * 1024**3),
        ("1G", 10**9),
        ("500Mi", 500 * 1024**2),
        ("1.5Gi", 1536 * 1024**2),
        ("100M", 10**8),
        ("42", 42),
        ("0", 0),
        ("1e9", 10**9),
        ("1E3", 1000),
        ("2e+2", 200),
        ("1Ki", 1024),
        ("3Ti", 3 * 1024**4),
        ("1Pi", 1024**5),
        ("1Ei", 1024**6),
        ("1k", 1000),
        ("1T", 10**12),
        ("1P", 10**15),
        ("1E", 10**18),
        ("+3Ki", 3072),
        ("-2M", -(2 * 10**6)),
        ("1.", 1),
        (".5Ki", 512),
    ],
)
def test_parse_quantity_gives_the_exact_integer_value(text: str, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100m", Fraction(1, 10)),
        ("250u", Fraction(1, 4000)),
        ("5n", Fraction(1, 200000000)),
        ("1.5", Fraction(3, 2)),
        ("1e-3", Fraction(1, 1000)),
    ],
)
def test_parse_quantity_keeps_fractions_exact(text: str, expected: Fraction) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1Gi", 1073741824), ("1.5", 2), ("100m", 1), ("1e-3", 1), ("-1.5", -2), ("7", 7)],
)
def test_quantity_value_rounds_away_from_zero_like_go(text: str, expected: int) -> None:
    assert quantity_value(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "1 Gi",
        " 1Gi",
        "1gi",
        "1K",
        "10GB",
        "10GiB",
        "1e",
        "e9",
        "1.5.5",
        ".",
        "--1",
        "1Gi2",
    ],
)
def test_parse_quantity_rejects_garbage_and_shows_it(text: str) -> None:
    with pytest.raises(QuantityError, match="is not a Kubernetes quantity") as caught:
        parse_quantity(text)
    assert repr(text) in str(caught.value)
    assert "10Gi" in str(caught.value)  # the message shows what a valid quantity looks like


def test_parse_quantity_rejects_values_beyond_int64() -> None:
    with pytest.raises(QuantityError, match="out of range"):
        parse_quantity("8Ei")
    assert parse_quantity("7Ei") == 7 * 1024**6


def test_parse_quantity_refuses_huge_exponents_without_computing_them() -> None:
    with pytest.raises(QuantityError, match="exponent 999999999"):
        parse_quantity("1e999999999")


def test_parse_quantity_refuses_overlong_text() -> None:
    with pytest.raises(QuantityError, match="too long"):
        parse_quantity("9" * 200)
