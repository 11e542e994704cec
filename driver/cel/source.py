"""Lexical checks and rewrites of selector source text (pure; no engine involved).

Three rewrites and checks; the first two are Kubernetes rules that a CEL engine with ``device``
declared as a plain map does not know:

1. ``device`` has exactly the fields ``driver``, ``attributes``, ``capacity`` and
   ``allowMultipleAllocations``; any other (``device.vendor``) is a compile error
   ``undefined field 'vendor'`` (`undefined_device_fields`).
2. An unknown domain reads as an empty map: ``device.attributes["other.com"].size() == 0`` is
   true, ``has(device.attributes["other.com"].x)`` false (`default_unknown_domains` rewrites
   ``device.attributes[K]`` to ``device.attributes[?K].orValue(dyn({}))``; same for capacity).

3. Calls with a literal argument, ``quantity('40Gi')`` and ``semver('8.0.0'[, true])``, can be
   replaced by a constant the engine builds without calling back into Python
   (`fold_literal_calls`); a literal that does not parse is left alone (a runtime error stays one).

The scan works on tokens, so string literals and comments are never touched. Aliases are not
followed: in ``cel.bind(a, device.attributes, a["other.com"])`` an unknown domain stays an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

DEVICE_FIELDS: Final = frozenset({"driver", "attributes", "capacity", "allowMultipleAllocations"})
_DEFAULTED_FIELDS: Final = frozenset({"attributes", "capacity"})
_EMPTY_MAP: Final = ".orValue(dyn({}))"

_STRING_START: Final = re.compile(r"([rR][bB]?|[bB][rR]?)?('''|\"\"\"|'|\")")
_IDENT: Final = re.compile(r"[_a-zA-Z][_a-zA-Z0-9]*")
_NUMBER: Final = re.compile(r"(?:0x[0-9a-fA-F]+|[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)[uU]?")
_SPACE: Final = re.compile(r"(?:\s+|//[^\n]*)+")


@dataclass(frozen=True)
class Token:
    kind: str  # "ident", "string", "number" or "punct"
    text: str
    start: int
    end: int


class LexError(ValueError):
    """The text does not tokenize (an unterminated string); the engine will say why."""


def tokens(expression: str) -> list[Token]:
    """CEL tokens of `expression`, without whitespace and comments."""
    found: list[Token] = []
    position = 0
    while position < len(expression):
        space = _SPACE.match(expression, position)
        if space:
            position = space.end()
            continue
        string = _STRING_START.match(expression, position)
        if string:
            raw = "r" in (string[1] or "").lower()
            end = (_raw_string_end if raw else _string_end)(expression, string.end(), string[2])
            found.append(Token("string", expression[position:end], position, end))
            position = end
            continue
        for kind, pattern in (("ident", _IDENT), ("number", _NUMBER)):
            match = pattern.match(expression, position)
            if match:
                found.append(Token(kind, match.group(), position, match.end()))
                position = match.end()
                break
        else:
            two = expression[position : position + 2]
            text = two if two in ("==", "!=", "<=", ">=", "&&", "||") else expression[position]
            found.append(Token("punct", text, position, position + len(text)))
            position += len(text)
    return found


def undefined_device_fields(expression: str) -> list[tuple[str, int]]:
    """``(field, offset of its dot)`` of each ``device.<field>`` the DRA ``device`` type lacks
    (cel-go reports the position of the ``.``)."""
    try:
        found = tokens(expression)
    except LexError:
        return []
    return [
        (found[i + 2].text, found[i + 1].start)
        for i in _device_field_indexes(found)
        if found[i + 2].text not in DEVICE_FIELDS
    ]


def default_unknown_domains(expression: str) -> str:
    """`expression` with every ``device.attributes[K]`` / ``device.capacity[K]`` (and the field
    form ``device.attributes.K.x``) reading an unknown domain as an empty map."""
    try:
        found = tokens(expression)
    except LexError:
        return expression
    edits: list[tuple[int, int, str]] = []  # (start, end, replacement), non-overlapping
    for i in _device_field_indexes(found):
        if found[i + 2].text not in _DEFAULTED_FIELDS or i + 3 >= len(found):
            continue
        after = found[i + 3]
        if after.text == "[" and i + 4 < len(found) and found[i + 4].text != "?":
            close = _matching_bracket(found, i + 3)
            if close is not None:
                edits.append((after.end, after.end, "?"))
                edits.append((found[close].end, found[close].end, _EMPTY_MAP))
        elif (
            after.text == "."
            and i + 5 < len(found)
            and found[i + 4].kind == "ident"
            and found[i + 5].text in (".", "[")
        ):
            domain = found[i + 4]
            edits.append((after.start, domain.end, f'[?"{domain.text}"]{_EMPTY_MAP}'))
    for start, end, replacement in sorted(edits, reverse=True):
        expression = expression[:start] + replacement + expression[end:]
    return expression


# (function, argument text, normalize flag or None) -> replacement source text, or None to keep
LiteralFolder = Callable[[str, str, bool | None], str | None]
_FOLDABLE: Final = frozenset({"quantity", "semver"})
_SIMPLE_STRING: Final = re.compile(r"'([^'\\\n]*)'|" + r'"([^"\\\n]*)"')


def fold_literal_calls(expression: str, fold: LiteralFolder) -> str:
    """`expression` with each ``quantity('lit')`` / ``semver('lit'[, true|false])`` replaced by
    ``fold(name, lit, normalize)`` where that gives text. Only plain quoted literals without
    escapes are folded."""
    try:
        found = tokens(expression)
    except LexError:
        return expression
    edits: list[tuple[int, int, str]] = []
    for i, token in enumerate(found[:-3]):
        if token.text not in _FOLDABLE or token.kind != "ident":
            continue
        if (i > 0 and found[i - 1].text == ".") or found[i + 1].text != "(":
            continue
        literal = _SIMPLE_STRING.fullmatch(found[i + 2].text)
        if literal is None:
            continue
        normalize: bool | None = None
        close = i + 3
        if (
            token.text == "semver"
            and found[close].text == ","
            and close + 2 < len(found)
            and found[close + 1].text in ("true", "false")
        ):
            normalize = found[close + 1].text == "true"
            close += 2
        if found[close].text != ")":
            continue
        text = literal[1] if literal[1] is not None else literal[2]
        replacement = fold(token.text, text, normalize)
        if replacement is not None:
            edits.append((token.start, found[close].end, replacement))
    for start, end, replacement in sorted(edits, reverse=True):
        expression = expression[:start] + replacement + expression[end:]
    return expression


def line_column(expression: str, offset: int) -> tuple[int, int]:
    """1-based line and column of `offset`, as CEL error messages count them."""
    line = expression.count("\n", 0, offset) + 1
    return line, offset - (expression.rfind("\n", 0, offset) + 1) + 1


def _device_field_indexes(found: list[Token]) -> list[int]:
    """Indexes of root ``device`` tokens followed by ``.`` and an identifier."""
    return [
        i
        for i in range(len(found) - 2)
        if found[i].kind == "ident"
        and found[i].text == "device"
        and (i == 0 or found[i - 1].text != ".")
        and found[i + 1].text == "."
        and found[i + 2].kind == "ident"
    ]


def _matching_bracket(found: list[Token], open_index: int) -> int | None:
    depth = 0
    pairs = {"[": 1, "(": 1, "{": 1, "]": -1, ")": -1, "}": -1}
    for j in range(open_index, len(found)):
        depth += pairs.get(found[j].text, 0) if found[j].kind == "punct" else 0
        if depth == 0:
            return j if found[j].text == "]" else None
    return None


def _string_end(expression: str, position: int, quote: str) -> int:
    """End offset of a string body starting at `position` (escapes honoured)."""
    while position < len(expression):
        if expression.startswith(quote, position):
            return position + len(quote)
        if expression[position] == "\\":
            position += 1
        elif expression[position] == "\n" and len(quote) == 1:
            break
        position += 1
    raise LexError("unterminated string literal")


def _raw_string_end(expression: str, position: int, quote: str) -> int:
    end = expression.find(quote, position)
    if end < 0 or (len(quote) == 1 and "\n" in expression[position:end]):
        raise LexError("unterminated string literal")
    return end + len(quote)
