"""The Kubernetes CEL value types a DRA selector sees: `Quantity` and `Semver`.

Engine-neutral and pure. Semantics follow the apiserver's CEL libraries (resource-api.md §8.4):

- `Quantity`: a ``resource.Quantity`` as an exact number (parsed by `config.quantity`), compared
  and tested for equality by value (``1Gi == 1024Mi``).
- `Semver`: a semantic version as blang/semver parses it: strict ``X.Y.Z[-pre][+build]`` without
  leading zeroes; build metadata is ignored for precedence and equality. ``normalize=True``
  (``semver(s, true)``) first strips a leading ``v``, pads missing minor/patch with ``0`` and drops
  leading zeroes (``v1.02`` -> ``1.2.0``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from gpu_dra.driver.config.quantity import QuantityError, parse_quantity

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

_IDENTIFIER: Final = re.compile(r"[0-9A-Za-z-]+")
_NUMERIC: Final = re.compile(r"[0-9]+")


class CelValueError(ValueError):
    """A quantity or version literal or operation is invalid; the message says which and why."""


@dataclass(frozen=True)
class Quantity:
    """A Kubernetes quantity; `value` is exact (``Fraction``)."""

    value: Fraction

    @classmethod
    def parse(cls, text: str) -> Quantity:
        """``quantity(text)``; raises `CelValueError` for anything that is not a quantity."""
        try:
            return cls(parse_quantity(text))
        except QuantityError as error:
            raise CelValueError(str(error)) from error

    def compare(self, other: Quantity) -> int:
        """-1, 0 or 1, as Go's ``Quantity.Cmp``."""
        return (self.value > other.value) - (self.value < other.value)

    def sign(self) -> int:
        return (self.value > 0) - (self.value < 0)

    def is_integer(self) -> bool:
        """True when the value is a whole number within int64 (Go ``AsInt64`` succeeds)."""
        return self.value.denominator == 1 and INT64_MIN <= self.value <= INT64_MAX

    def as_integer(self) -> int:
        """The value as int64; raises `CelValueError` when it is fractional or out of range."""
        if not self.is_integer():
            raise CelValueError(f"cannot convert value to integer: {self}")
        return int(self.value)

    def as_approximate_float(self) -> float:
        return float(self.value)

    def add(self, other: Quantity | int) -> Quantity:
        return Quantity(self.value + (other.value if isinstance(other, Quantity) else other))

    def sub(self, other: Quantity | int) -> Quantity:
        return Quantity(self.value - (other.value if isinstance(other, Quantity) else other))

    def __str__(self) -> str:
        if self.value.denominator == 1:
            return str(self.value.numerator)
        return str(float(self.value))


@dataclass(frozen=True)
class Semver:
    """A semantic version; `pre` holds the pre-release identifiers (build metadata is dropped)."""

    major: int
    minor: int
    patch: int
    pre: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, normalize: bool = False) -> Semver:
        """``semver(text[, normalize])``; raises `CelValueError` if `text` is not a version."""
        return _parse_semver(_normalized(text) if normalize else text)

    def compare(self, other: Semver) -> int:
        """-1, 0 or 1 by semver precedence (a pre-release sorts before its release)."""
        mine, theirs = (self.major, self.minor, self.patch), (other.major, other.minor, other.patch)
        if mine != theirs:
            return (mine > theirs) - (mine < theirs)
        if self.pre == other.pre:
            return 0
        if not self.pre or not other.pre:
            return 1 if not self.pre else -1
        for left, right in zip(self.pre, other.pre, strict=False):
            if left != right:
                return _compare_identifier(left, right)
        return (len(self.pre) > len(other.pre)) - (len(self.pre) < len(other.pre))

    def __str__(self) -> str:
        core = f"{self.major}.{self.minor}.{self.patch}"
        return f"{core}-{'.'.join(self.pre)}" if self.pre else core


def is_quantity(text: str) -> bool:
    try:
        Quantity.parse(text)
    except CelValueError:
        return False
    return True


def is_semver(text: str, normalize: bool = False) -> bool:
    try:
        Semver.parse(text, normalize)
    except CelValueError:
        return False
    return True


def _parse_semver(text: str) -> Semver:
    shown = repr(text if len(text) <= 70 else text[:67] + "...")
    core, plus, build = text.partition("+")
    core, dash, pre = core.partition("-")
    parts = core.split(".")
    if len(parts) != 3:
        raise CelValueError(
            f"{shown} is not a semantic version: No Major.Minor.Patch elements found"
        )
    numbers = []
    for what, part in zip(("major", "minor", "patch"), parts, strict=True):
        if not _NUMERIC.fullmatch(part):
            raise CelValueError(f"{shown} is not a semantic version: {what} {part!r} not a number")
        if len(part) > 1 and part[0] == "0":
            raise CelValueError(f"{shown} is not a semantic version: {what} has leading zeroes")
        number = int(part)
        if number > INT64_MAX:
            raise CelValueError(f"{shown} is not a semantic version: {what} out of range")
        numbers.append(number)
    identifiers = tuple(pre.split(".")) if dash else ()
    for identifier in identifiers:
        if not _IDENTIFIER.fullmatch(identifier):
            raise CelValueError(f"{shown}: invalid pre-release identifier {identifier!r}")
        if _NUMERIC.fullmatch(identifier) and len(identifier) > 1 and identifier[0] == "0":
            raise CelValueError(f"{shown}: pre-release {identifier!r} has leading zeroes")
    if plus and not all(_IDENTIFIER.fullmatch(part) for part in build.split(".")):
        raise CelValueError(f"{shown}: invalid build metadata {build!r}")
    return Semver(numbers[0], numbers[1], numbers[2], identifiers)


def _normalized(text: str) -> str:
    """``v1.02`` -> ``1.2.0``: strip ``v``, pad to three parts, drop leading zeroes."""
    text = text.removeprefix("v")
    core_end = min((i for i in (text.find("-"), text.find("+")) if i >= 0), default=len(text))
    core, rest = text[:core_end], text[core_end:]
    parts = core.split(".")
    if 0 < len(parts) < 3:
        parts += ["0"] * (3 - len(parts))
    parts = [part.lstrip("0") or "0" if part.isdigit() else part for part in parts]
    return ".".join(parts) + rest


def _compare_identifier(left: str, right: str) -> int:
    left_numeric, right_numeric = left.isdigit(), right.isdigit()
    if left_numeric and right_numeric:
        a, b = int(left), int(right)
        return (a > b) - (a < b)
    if left_numeric != right_numeric:
        return -1 if left_numeric else 1
    return (left > right) - (left < right)
