"""What to write instead: rewrites of the selector mistakes people make (pure, from tokens).

`suggest_fix` rewrites, in one expression, every ``device.attributes`` / ``device.capacity``
path that makes one of these mistakes, and the comparison around it: a name used as a domain
(``device.attributes['memory']``), a capacity read as an attribute (or the reverse), a name
published in another domain (``pciBusID`` is ``resource.kubernetes.io``'s), a qualified name
where a domain or a bare name belongs, a capacity compared with a number or by ``>=``
(-> ``compareTo(quantity(...))``), a version compared with a string or a number (-> ``semver``).
`gpu-dra lint` then lints the rewrite (`cli/lint.py`). See docs/cel.md, "Common mistakes".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from gpu_dra.driver.cel import CelError
from gpu_dra.driver.cel.source import LexError, Token, tokens
from gpu_dra.driver.cel.values import Quantity, Semver

Kind = Literal["attributes", "capacity"]
ValueType = Literal["bool", "int", "string", "version", "quantity"]

_COMPARISONS: Final = frozenset({"==", "!=", "<", "<=", ">", ">="})
_FLIPPED: Final = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}
_PLAIN_STRING: Final = re.compile(r"""'([^'\\\n]*)'|"([^"\\\n]*)\"""")
_IDENTIFIER: Final = re.compile(r"[_a-zA-Z][_a-zA-Z0-9]*")
_GIB_BELOW: Final = 1024
"""A memory capacity compared with a number below this is read in GiB (``memory >= 40``: 40 GiB):
every GPU and MIG device has more than 1023 MiB, so the MiB reading would select them all, and
none has 1024 GiB."""
_MIB_BELOW: Final = 2**20
"""From `_GIB_BELOW` to below this the number is read in MiB, as nvidia-smi counts; from here in
bytes."""
_LARGEST_GPU_GIB: Final = 288
"""The most memory a GPU has (B300, 288 GB): a GiB reading above it selects nothing either, so
the suggestion shows both readings."""


@dataclass(frozen=True)
class Names:
    """What the driver publishes: the type of every (domain, name) of each kind."""

    driver: str
    attributes: Mapping[tuple[str, str], ValueType | None]
    """None: a name known but no device of the simulated fleet has it (no type known)."""
    capacity: frozenset[tuple[str, str]]

    def has(self, kind: Kind, domain: str, name: str) -> bool:
        if kind == "capacity":
            return (domain, name) in self.capacity
        return (domain, name) in self.attributes

    @property
    def domains(self) -> frozenset[str]:
        return frozenset(d for d, _ in self.attributes) | frozenset(d for d, _ in self.capacity)

    def places(self, name: str) -> list[tuple[Kind, str]]:
        """Where `name` is published: (kind, domain), the driver's domain first."""
        found: list[tuple[Kind, str]] = [
            ("attributes", d) for d, n in self.attributes if n == name
        ] + [("capacity", d) for d, n in self.capacity if n == name]
        return sorted(found, key=lambda place: (place[1] != self.driver, place[1], place[0]))

    def value_type(self, kind: Kind, domain: str, name: str) -> ValueType | None:
        if kind == "capacity":
            return "quantity"
        return self.attributes.get((domain, name))


@dataclass(frozen=True)
class Fix:
    """`expression` rewritten, and each mistake it corrects, in words."""

    expression: str
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class _Path:
    first: int
    """Token index of ``device``."""
    last: int
    """Token index of the path's last token."""
    kind: Kind
    domain: str
    name: str | None


def suggest_fix(expression: str, names: Names) -> Fix | None:
    """`expression` with the mistakes above corrected, or None when it makes none of them."""
    try:
        found = tokens(expression)
    except LexError:
        return None
    edits: list[tuple[int, int, str]] = []
    reasons: list[str] = []
    for i in range(len(found)):
        path = _path_at(found, i)
        if path is None:
            continue
        kind, domain, name, why = _resolved(path, names)
        reasons.extend(why)
        if name is None:
            continue
        text = _path_text(kind, domain, name)
        start, end = found[path.first].start, found[path.last].end
        compared = _comparison(found, path, text, names.value_type(kind, domain, name), name)
        if compared is not None:
            start, end, text, reason = compared
            reasons.append(reason)
        if text != expression[start:end]:
            edits.append((start, end, text))
    if not edits or not reasons:
        return None
    for start, end, text in sorted(edits, reverse=True):
        expression = expression[:start] + text + expression[end:]
    return Fix(expression, tuple(dict.fromkeys(reasons)))


def _path_at(found: Sequence[Token], i: int) -> _Path | None:
    """``device.<kind>['D']`` optionally followed by ``.x`` (not a call) or ``['x']``."""

    def text(j: int) -> str:
        return found[j].text if j < len(found) else ""

    token = found[i]
    if token.kind != "ident" or token.text != "device" or (i and found[i - 1].text == "."):
        return None
    if text(i + 1) != "." or text(i + 2) not in ("attributes", "capacity"):
        return None
    kind: Kind = "attributes" if text(i + 2) == "attributes" else "capacity"
    if text(i + 3) == "[" and text(i + 5) == "]" and i + 4 < len(found):
        domain, end = _plain(found[i + 4]), i + 5
    elif text(i + 3) == "." and i + 4 < len(found) and found[i + 4].kind == "ident":
        domain, end = found[i + 4].text, i + 4  # device.attributes.memory: a domain without dots
        if text(i + 5) == "(":
            return None  # a method of the map: device.attributes.exists(...)
    else:
        return None
    if domain is None:
        return None
    if (
        text(end + 1) == "."
        and end + 2 < len(found)
        and found[end + 2].kind == "ident"
        and text(end + 3) != "("
    ):
        return _Path(i, end + 2, kind, domain, found[end + 2].text)
    if text(end + 1) == "[" and text(end + 3) == "]" and end + 2 < len(found):
        name = _plain(found[end + 2])
        if name is not None:
            return _Path(i, end + 3, kind, domain, name)
    return _Path(i, end, kind, domain, None)


def _resolved(path: _Path, names: Names) -> tuple[Kind, str, str | None, list[str]]:
    """Where the path should point: (kind, domain, name, reasons); name None: leave it."""
    kind, domain, name = path.kind, path.domain, path.name
    if name is None:
        if domain in names.domains:
            return kind, domain, None, []
        if "/" in domain:  # device.attributes['resource.kubernetes.io/pciBusID']
            qualified_domain, bare = domain.split("/", 1)
            if names.has(kind, qualified_domain, bare):
                return (
                    kind,
                    qualified_domain,
                    bare,
                    [
                        f"'{domain}' is a qualified name, not a domain: device.{kind} is keyed "
                        f"by domain, then by the bare name"
                    ],
                )
            return kind, domain, None, []
        places = _preferring(names.places(domain), kind)
        if not places:
            return kind, domain, None, []
        new_kind, new_domain = places[0]
        return (
            new_kind,
            new_domain,
            domain,
            [
                f"'{domain}' is not a domain: device.{kind} is keyed by domain "
                f"({_sorted_domains(names)}); {domain} is {_what(new_kind)} in {new_domain}"
            ],
        )
    if domain not in names.domains or names.has(kind, domain, name):
        return kind, domain, name, []
    if "/" in name:  # device.attributes['gpu.nvidia.com']['resource.kubernetes.io/pciBusID']
        qualified_domain, bare = name.split("/", 1)
        if names.has(kind, qualified_domain, bare):
            return (
                kind,
                qualified_domain,
                bare,
                [f"'{name}' is a qualified name: its domain is {qualified_domain}"],
            )
        return kind, domain, None, []
    places = _preferring(names.places(name), kind, domain)
    if not places:
        return kind, domain, None, []
    new_kind, new_domain = places[0]
    if new_kind != kind and new_domain == domain:
        reason = f"{name} is {_what(new_kind)}, not {_what(kind)}"
    elif new_kind == kind:
        reason = (
            f"{name} is published qualified, as {new_domain}/{name}: "
            f"it is in domain {new_domain}, not {domain}"
        )
    else:
        reason = f"{name} is {_what(new_kind)} in domain {new_domain}"
    return new_kind, new_domain, name, [reason]


def _preferring(
    places: list[tuple[Kind, str]], kind: Kind, domain: str | None = None
) -> list[tuple[Kind, str]]:
    """`places` with those of `domain`, then those of `kind`, first."""
    return sorted(places, key=lambda place: (place[1] != domain, place[0] != kind))


def _comparison(
    found: Sequence[Token], path: _Path, text: str, value: ValueType | None, name: str
) -> tuple[int, int, str, str] | None:
    """``path <op> literal`` (or ``literal <op> path``) made to type-check for a quantity or a
    version: (start, end, replacement, reason), or None."""
    if value not in ("quantity", "version"):
        return None
    after, before = path.last + 1, path.first - 1
    if after < len(found) and found[after].text in _COMPARISONS:
        operator = found[after].text
        literal = _literal_at(found, after + 1)
        if literal is None:
            return None
        source, last = literal
        if last + 1 < len(found) and found[last + 1].text in (".", "[", "("):
            return None
        start, end = found[path.first].start, found[last].end
    elif before >= 1 and found[before].text in _COMPARISONS:
        operator = _FLIPPED[found[before].text]
        literal = _start_literal_before(found, before - 1)
        if literal is None:
            return None
        source, first = literal
        start, end = found[first].start, found[path.last].end
    else:
        return None
    if value == "quantity":
        return _quantity_comparison(text, operator, source, name, (start, end))
    return _version_comparison(text, operator, source, name, (start, end))


def _literal_at(found: Sequence[Token], k: int) -> tuple[Token | str, int] | None:
    """A number or string token, or ``quantity('x')`` / ``semver('x')``: (the token or the
    call's argument, index of its last token)."""
    if k >= len(found):
        return None
    token = found[k]
    if token.kind in ("number", "string"):
        return token, k
    if (
        token.text in ("quantity", "semver")
        and k + 3 < len(found)
        and found[k + 1].text == "("
        and found[k + 3].text == ")"
    ):
        argument = _plain(found[k + 2])
        if argument is not None:
            return f"{token.text}:{argument}", k + 3
    return None


def _start_literal_before(found: Sequence[Token], k: int) -> tuple[Token | str, int] | None:
    if k < 0:
        return None
    if found[k].kind in ("number", "string"):
        if k > 0 and found[k - 1].text in (".", "-"):
            return None
        return found[k], k
    if found[k].text == ")" and k >= 3 and found[k - 2].kind == "string":
        literal = _literal_at(found, k - 3)
        if literal is not None:
            return literal[0], k - 3
    return None


def _quantity_comparison(
    path: str, operator: str, literal: Token | str, name: str, span: tuple[int, int]
) -> tuple[int, int, str, str] | None:
    start, end = span
    if isinstance(literal, str):
        function, _, text = literal.partition(":")
        if function != "quantity" or operator in ("==", "!="):
            return None  # already a quantity: == works; compareTo is the ordering
        reason = "a quantity has no < > <= >=: compare with compareTo"
    elif literal.kind == "number":
        number = literal.text.rstrip("uU")
        if "x" in number.lower():
            return None
        value = float(number)
        if "memory" in name.lower() and value < _GIB_BELOW:
            text = f"{number}Gi"
            reason = (
                f"{name} is a quantity (bytes), not a number: {number} read as GiB is "
                f"quantity('{text}'); as MiB, quantity('{number}Mi'), it is less memory than "
                "any GPU or MIG device has"
            )
            if value > _LARGEST_GPU_GIB:
                reason = (
                    f"{name} is a quantity (bytes), not a number, and {number} is ambiguous: "
                    f"as GiB, quantity('{text}'), more memory than any GPU has "
                    f"({_LARGEST_GPU_GIB} GB at most); as MiB, quantity('{number}Mi'), less than "
                    "any has: write the unit you mean"
                )
        elif "memory" in name.lower() and value < _MIB_BELOW:
            text = f"{number}Mi"
            reason = (
                f"{name} is a quantity (bytes), not a number: {number} read as MiB, "
                f"as nvidia-smi counts, is quantity('{text}')"
            )
        else:
            text = number
            reason = f"{name} is a quantity, not a number: compare with quantity('{text}')"
    else:
        text = _plain(literal) or ""
        reason = f"{name} is a quantity, not a string: compare with quantity('{text}')"
    try:
        Quantity.parse(text)
    except (CelError, ValueError):
        return None
    if operator in ("==", "!="):
        return start, end, f"{path} {operator} quantity('{text}')", reason
    return start, end, f"{path}.compareTo(quantity('{text}')) {operator} 0", reason


def _version_comparison(
    path: str, operator: str, literal: Token | str, name: str, span: tuple[int, int]
) -> tuple[int, int, str, str] | None:
    start, end = span
    if isinstance(literal, str):
        function, _, text = literal.partition(":")
        if function != "semver" or operator in ("==", "!="):
            return None
        reason = "a version has no < > <= >=: compare with compareTo"
    else:
        text = literal.text.rstrip("uU") if literal.kind == "number" else _plain(literal) or ""
        try:
            text = str(Semver.parse(text, True))
        except (CelError, ValueError):
            return None
        word = "number" if literal.kind == "number" else "string"
        reason = f"{name} is a version, not a {word}: compare with semver('{text}')"
    if operator in ("==", "!="):
        return start, end, f"{path} {operator} semver('{text}')", reason
    return start, end, f"{path}.compareTo(semver('{text}')) {operator} 0", reason


def _path_text(kind: Kind, domain: str, name: str) -> str:
    member = f".{name}" if _IDENTIFIER.fullmatch(name) else f"['{name}']"
    return f"device.{kind}['{domain}']{member}"


def _plain(token: Token) -> str | None:
    if token.kind != "string":
        return None
    match = _PLAIN_STRING.fullmatch(token.text)
    if match is None:
        return None
    return match[1] if match[1] is not None else match[2]


def _what(kind: Kind) -> str:
    return "a capacity (a quantity)" if kind == "capacity" else "an attribute"


def _sorted_domains(names: Names) -> str:
    return ", ".join(sorted(names.domains))
