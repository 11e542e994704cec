"""Kubernetes resource quantities (``10Gi``, ``1G``, ``500m``, ``1e9``) as exact numbers.

Grammar (k8s.io/apimachinery ``resource.Quantity``)::

    quantity  ::= [+-] number [suffix]
    number    ::= digits | digits "." [digits] | "." digits
    suffix    ::= Ki | Mi | Gi | Ti | Pi | Ei          (powers of 1024)
                | m | k | M | G | T | P | E            (powers of 1000; none = 1)
                | (e | E) [+-] digits                  (power of ten)

`parse_quantity` returns the exact value as a `Fraction`; `quantity_value` rounds it up to an
integer the way Go's ``Quantity.Value()`` does, which is what byte counts and limits use.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -3, "u": -2, "m": -1, "": 0, "k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}

_PATTERN = re.compile(
    r"(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<exponent>[eE][+-]?[0-9]+)|(?P<suffix>[KMGTPE]i|[numkMGTPE])?)"
)

# Go keeps quantities within int64 when they are read as integers; so do we. The digit and
# exponent caps keep hostile input ("1e999999999") from costing time before that check.
MAX_VALUE = 2**63 - 1
_MAX_DIGITS = 64
_MAX_EXPONENT = 64

SUFFIXES = "Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|e<n>"


class QuantityError(ValueError):
    """The text is not a Kubernetes quantity; the message says why and shows the text."""


def parse_quantity(text: str) -> Fraction:
    """The exact value of the quantity ``text`` (``"1.5Gi"`` -> ``Fraction(1610612736)``).

    Raises `QuantityError` for anything that is not a quantity, including surrounding spaces
    and values whose magnitude exceeds ``2**63 - 1``.
    """
    shown = _show(text)
    if len(text) > _MAX_DIGITS + 8:
        raise QuantityError(f"quantity {shown} is too long")
    match = _PATTERN.fullmatch(text)
    if match is None:
        raise QuantityError(
            f"{shown} is not a Kubernetes quantity: use a number with an optional suffix "
            f"{SUFFIXES}, e.g. 10Gi, 500Mi, 1.5Gi, 1G, 1e9"
        )
    whole, _, fraction = match["number"].partition(".")
    value = Fraction(int((whole + fraction) or "0"), 10 ** len(fraction))
    if match["exponent"] is not None:
        exponent = int(match["exponent"][1:])
        if abs(exponent) > _MAX_EXPONENT:
            raise QuantityError(f"quantity {shown} is out of range: exponent {exponent} too large")
        value *= Fraction(10) ** exponent
    else:
        suffix = match["suffix"] or ""
        if suffix in _BINARY:
            value *= 1024 ** _BINARY[suffix]
        else:
            value *= Fraction(1000) ** _DECIMAL[suffix]
    if match["sign"] == "-":
        value = -value
    if abs(value) > MAX_VALUE:
        raise QuantityError(f"quantity {shown} is out of range: at most {MAX_VALUE}")
    return value


def quantity_value(text: str) -> int:
    """The quantity ``text`` as an integer, rounded away from zero (Go ``Quantity.Value()``).

    ``"1Gi"`` -> ``1073741824``, ``"1.5"`` -> ``2``, ``"100m"`` -> ``1``, ``"-1.5"`` -> ``-2``.
    """
    value = parse_quantity(text)
    return math.ceil(value) if value >= 0 else math.floor(value)


def _show(text: str) -> str:
    """``text`` quoted for a message, shortened if long."""
    return repr(text if len(text) <= 40 else text[:37] + "...")
