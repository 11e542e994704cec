"""Lexical checks and rewrites of selector source text (pure; no engine involved).

Kubernetes rules a CEL engine with ``device`` declared as a plain map does not know: the fields
``device`` has (`undefined_device_fields`) and unknown domains reading as empty maps
(`default_unknown_domains`); and rewrites that keep selectors off Python callbacks
(`fold_literal_calls`, `native_comparisons`), plus the part of ``device`` a selector reads
(`device_footprint`). The scan works on tokens, so string literals and comments are never
touched; aliases are not followed. See docs/cel.md#semantics-implemented and
docs/cel.md#differences-from-kubernetes-known-deliberate-or-engine-limits.
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


def root_identifier_offsets(expression: str, name: str) -> list[int]:
    """Offsets of `name` used as a root identifier (not after a ``.``)."""
    try:
        found = tokens(expression)
    except LexError:
        return []
    return [
        token.start
        for i, token in enumerate(found)
        if token.kind == "ident" and token.text == name and (i == 0 or found[i - 1].text != ".")
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
    for i in range(len(found)):
        literal = _literal_call(found, i)
        if literal is None:
            continue
        function, text, normalize, close = literal
        replacement = fold(function, text, normalize)
        if replacement is not None:
            edits.append((found[i].start, found[close].end, replacement))
    return _apply(expression, edits)


def _literal_call(found: list[Token], i: int) -> tuple[str, str, bool | None, int] | None:
    """``quantity('lit')`` / ``semver('lit'[, bool])`` starting at token `i`, as (function,
    literal, normalize, index of the closing parenthesis)."""
    token = found[i]
    if token.kind != "ident" or token.text not in _FOLDABLE or i + 3 >= len(found):
        return None
    if (i > 0 and found[i - 1].text == ".") or found[i + 1].text != "(":
        return None
    literal = _SIMPLE_STRING.fullmatch(found[i + 2].text)
    if literal is None:
        return None
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
        return None
    text = literal[1] if literal[1] is not None else literal[2]
    return token.text, text, normalize, close


def _receiver_root(found: list[Token], end: int) -> int | None:
    """Index of the root identifier of the plain path ending at token `end`, or None."""
    k = end
    while k >= 0:
        if found[k].kind == "ident":
            if k > 0 and found[k - 1].text == "?":
                return None  # optional selection x.?f: not a plain path
            if k > 1 and found[k - 1].text == ".":
                k -= 2
                continue
            return k
        if found[k].text != "]":
            return None
        depth = 0
        while k >= 0:
            depth += {"]": 1, "[": -1}.get(found[k].text, 0) if found[k].kind == "punct" else 0
            if depth == 0:
                break
            k -= 1
        k -= 1
    return None


def _apply(expression: str, edits: list[tuple[int, int, str]]) -> str:
    """Apply non-overlapping (start, end, text) edits; an edit overlapping an earlier one is
    dropped."""
    kept: list[tuple[int, int, str]] = []
    for edit in sorted(edits):
        if not kept or edit[0] >= kept[-1][1]:
            kept.append(edit)
    for start, end, replacement in reversed(kept):
        expression = expression[:start] + replacement + expression[end:]
    return expression


# (receiver source, method, function, literal text, normalize) -> replacement source, or None
ComparisonRewriter = Callable[[str, str, str, str, bool | None], str | None]
_COMPARISONS: Final = frozenset({"compareTo", "isGreaterThan", "isLessThan"})


def native_comparisons(expression: str, rewrite: ComparisonRewriter) -> str:
    """`expression` with each ``<path>.compareTo|isGreaterThan|isLessThan(quantity|semver('lit'))``
    replaced by ``rewrite(path, method, function, lit, normalize)`` where that gives text. A path
    is an identifier followed by field selections and indexes (``device.capacity['d'].memory``,
    ``g.driverVersion``); receivers that involve calls are left alone."""
    try:
        found = tokens(expression)
    except LexError:
        return expression
    edits: list[tuple[int, int, str]] = []
    for i, token in enumerate(found):
        if token.kind != "ident" or token.text not in _COMPARISONS or found[i - 1].text != ".":
            continue
        literal = _literal_call(found, i + 2) if i + 2 < len(found) else None
        if i < 2 or found[i + 1].text != "(" or literal is None:
            continue
        function, text, normalize, close = literal
        root = _receiver_root(found, i - 2)
        if root is None or close + 1 >= len(found) or found[close + 1].text != ")":
            continue
        receiver = expression[found[root].start : found[i - 1].start]
        replacement = rewrite(receiver, token.text, function, text, normalize)
        if replacement is not None:
            edits.append((found[root].start, found[close + 1].end, replacement))
    return _apply(expression, edits)


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


# A path into ``device`` that a selector reads: ("driver",), ("allowMultipleAllocations",),
# (field, domain) for a whole domain map, (field, domain, id) for one entry; field is
# "attributes" or "capacity".
DevicePath = tuple[str, ...]
_SCALAR_FIELDS: Final = frozenset({"driver", "allowMultipleAllocations"})


def device_footprint(expression: str) -> frozenset[DevicePath] | None:
    """Every part of ``device`` that `expression` can read, or None when that cannot be told
    from the text: a selector's result is a function of these paths' values (entry present or
    not, and its value), so devices that agree on them get the same result.

    Conservative: None unless every root ``device`` is one of ``device.driver``,
    ``device.allowMultipleAllocations``, ``device.attributes[D]`` / ``device.capacity[D]``
    with a plain string literal ``D`` (the whole domain map), or those followed by ``.x`` (not a
    call) / ``['x']`` (one entry). Anything else (``device.attributes.exists(...)``,
    ``'d' in device.attributes``, ``device`` rebound as a variable, escapes in literals) gives None.
    """
    try:
        found = tokens(expression)
    except LexError:
        return None
    paths: set[DevicePath] = set()
    for i, token in enumerate(found):
        if token.kind != "ident" or token.text != "device" or (i and found[i - 1].text == "."):
            continue
        path = _footprint_at(found, i)
        if path is None:
            return None
        paths.add(path)
    return frozenset(paths)


def _footprint_at(found: list[Token], i: int) -> DevicePath | None:
    def text(j: int) -> str:
        return found[j].text if j < len(found) else ""

    if text(i + 1) != "." or i + 2 >= len(found) or found[i + 2].kind != "ident":
        return None
    field = found[i + 2].text
    if field in _SCALAR_FIELDS:
        return (field,)
    if field not in _DEFAULTED_FIELDS or text(i + 3) != "[" or text(i + 5) != "]":
        return None
    domain = _plain_string(found[i + 4])
    if domain is None:
        return None
    member = text(i + 6) == "." and i + 7 < len(found) and found[i + 7].kind == "ident"
    if member and text(i + 8) != "(":  # .x, not a method call on the domain map
        return (field, domain, found[i + 7].text)
    if text(i + 6) == "[" and i + 7 < len(found) and text(i + 8) == "]":
        entry = _plain_string(found[i + 7])
        if entry is not None:
            return (field, domain, entry)
    return (field, domain)


def _plain_string(token: Token) -> str | None:
    """The value of a quoted literal without prefix or escapes (``'gpu.nvidia.com'``)."""
    text = token.text
    if token.kind != "string" or text[0] not in "'\"" or "\\" in text or text[:3] in ("'''", '"""'):
        return None
    return text[1:-1]


# (path source, operator, literal source) -> replacement source
EqualityRewriter = Callable[[str, str, str], str]
_OPERAND_LEFT_EDGE: Final = frozenset({"(", "[", ",", "&&", "||", "?", ":"})
_OPERAND_RIGHT_EDGE: Final = frozenset({")", "]", ",", "&&", "||", "?", ":"})
_LITERAL_WORDS: Final = frozenset({"true", "false", "null"})


def literal_equalities(expression: str, rewrite: EqualityRewriter) -> str:
    """`expression` with each ``<path> == <literal>`` / ``<path> != <literal>`` (a plain path
    such as ``device.attributes['d'].v``, one string, number, bool or null token) replaced by
    ``rewrite(path, operator, literal)``, where nothing binds tighter to the two operands."""
    try:
        found = tokens(expression)
    except LexError:
        return expression
    edits: list[tuple[int, int, str]] = []
    for k, token in enumerate(found):
        if token.kind != "punct" or token.text not in ("==", "!=") or k == 0:
            continue
        if k + 1 >= len(found):
            continue
        literal = found[k + 1]
        if literal.kind not in ("string", "number") and literal.text not in _LITERAL_WORDS:
            continue
        if k + 2 < len(found) and found[k + 2].text not in _OPERAND_RIGHT_EDGE:
            continue
        root = _receiver_root(found, k - 1)
        if root is None or (root > 0 and found[root - 1].text not in _OPERAND_LEFT_EDGE):
            continue
        path = expression[found[root].start : found[k - 1].end]
        edits.append((found[root].start, literal.end, rewrite(path, token.text, literal.text)))
    return _apply(expression, edits)


def regex_literals(expression: str) -> list[tuple[str, int]]:
    """``(literal source, offset)`` of each string literal passed to ``.matches(...)``: the
    apiserver validates those regular expressions at compile time."""
    try:
        found = tokens(expression)
    except LexError:
        return []
    return [
        (found[i + 2].text, found[i + 2].start)
        for i in range(1, len(found) - 3)
        if found[i].text == "matches"
        and found[i - 1].text == "."
        and found[i + 1].text == "("
        and found[i + 2].kind == "string"
        and found[i + 3].text == ")"
    ]


_COMPARISON_OPERATORS: Final = frozenset({"==", "!=", "<", "<=", ">", ">="})


def capacity_literal_comparisons(expression: str) -> list[tuple[str, str, int]]:
    """``(operator, CEL type of the literal, offset of the operator)`` for each
    ``device.capacity[D].x <op> <literal>`` (or the literal first): capacities are typed
    ``Quantity`` in the Kubernetes environment, so comparing one with a string, number, bool or
    null literal does not type-check there."""
    try:
        found = tokens(expression)
    except LexError:
        return []
    comparisons = []
    for i in _device_field_indexes(found):
        path = _footprint_at(found, i)
        if found[i + 2].text != "capacity" or path is None or len(path) != 3:
            continue
        end = i + 8 if found[i + 6].text == "." else i + 9  # after .x / ['x']
        if end < len(found) and found[end].text in ("(", "."):
            continue  # a method call on the quantity, or a field of one
        before, after = i - 1, end
        for operator, literal in ((after, after + 1), (before, before - 1)):
            if 0 <= literal < len(found) and found[operator].text in _COMPARISON_OPERATORS:
                kind = _literal_type(found[literal])
                if kind is not None:
                    comparisons.append((found[operator].text, kind, found[operator].start))
    return comparisons


def _literal_type(token: Token) -> str | None:
    if token.kind == "string":
        return "bytes" if token.text[0] in "bB" or token.text[:2].lower() == "rb" else "string"
    if token.kind == "number":
        if token.text[-1] in "uU":
            return "uint"
        return "double" if any(c in token.text for c in ".eE") and "x" not in token.text else "int"
    return {"true": "bool", "false": "bool", "null": "null_type"}.get(token.text)


def bare_device_path_type(expression: str) -> str | None:
    """The Kubernetes type of `expression` when it is nothing but ``device.driver`` (string) or
    ``device.capacity[D].x`` (kubernetes.Quantity), in optional parentheses: types the engine
    cannot see (it has ``device`` as dyn) but the apiserver rejects as a selector's result."""
    try:
        found = tokens(expression)
    except LexError:
        return None
    while len(found) > 2 and found[0].text == "(" and _closing_paren(found) == len(found) - 1:
        found = found[1:-1]
    if not found or found[0].text != "device":
        return None
    path = _footprint_at(found, 0)
    if path == ("driver",) and len(found) == 3:
        return "string"
    if path and path[0] == "capacity" and len(path) == 3 and len(found) in (8, 9):
        return "kubernetes.Quantity"
    return None


def _closing_paren(found: list[Token]) -> int | None:
    depth = 0
    for j, token in enumerate(found):
        if token.kind == "punct" and token.text in "([{":
            depth += 1
        elif token.kind == "punct" and token.text in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return None


_MACROS_BINDING: Final = frozenset({"all", "exists", "exists_one", "map", "filter", "bind"})


def typed_device_fields(expression: str) -> str | None:
    """`expression` with each ``device.<field>`` written ``device_<field>`` (same length, so
    positions in messages stay right), for a type check in which those are variables of the
    types Kubernetes declares; ``has(device.<field>)`` is left alone. None when nothing is
    renamed, the text does not tokenize or ``device`` is bound by a macro (``x.all(device, ...)``,
    ``cel.bind(device, ...)``): then the renamed text would not mean the same."""
    try:
        found = tokens(expression)
    except LexError:
        return None
    for i, token in enumerate(found):
        if (
            token.kind == "ident"
            and token.text == "device"
            and i >= 2
            and found[i - 1].text == "("
            and found[i - 2].text in _MACROS_BINDING
            and i + 1 < len(found)
            and found[i + 1].text == ","
        ):
            return None
    edits = [
        (found[i + 1].start, found[i + 1].end, "_")
        for i in _device_field_indexes(found)
        if found[i + 2].text in DEVICE_FIELDS
        and found[i + 1].end == found[i + 2].start
        and found[i].end == found[i + 1].start
        and not (i >= 2 and found[i - 1].text == "(" and found[i - 2].text == "has")
    ]
    return _apply(expression, edits) if edits else None
