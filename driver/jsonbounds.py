"""Bounds on untrusted JSON: nesting depth, encoded size, JSON types only.

`json_problem` walks a value (as ``json.loads`` returns it, or any Python object) without
recursion and stops at the first problem, so it costs at most about ``max_bytes`` steps and never
raises: a value nested thousands of levels deep, a cycle, a float NaN, a lone surrogate or a
non-JSON object each become a `JsonProblem` with the path where it was found. A value it accepts
can be encoded (``json.dumps``), compared and copied without hitting Python's recursion limit.
`loads` parses JSON text of any nesting and any integer size without RecursionError: what lies
deeper than its limit, and integers Python cannot read, become marker strings in the result
(with ``strict=True`` they, and NaN/Infinity, are a `JsonBoundsError` that says which).
Limits of the opaque config: ``docs/config.md`` (Limits).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

PathPart = str | int
"""An object key (str) or an array index (int)."""

MAX_INTEGER_DIGITS: Final = 64
"""JSON integers with more digits than this are refused (Python's ``str(int)`` stops at 4300)."""
_INTEGER_LIMIT: Final = 10**MAX_INTEGER_DIGITS

MAX_DOCUMENT_DEPTH: Final = 100
"""`loads`: objects and arrays nested deeper than this are replaced by `TOO_DEEP`. A ResourceClaim
list puts opaque parameters at level 10, a valid config needs 4 more levels."""
TOO_DEEP: Final = "<not read: nested too deeply>"
"""What `loads` puts where an object or array was nested deeper than its limit."""
TOO_LONG: Final = "<not read: integer with too many digits>"
"""What `loads` puts where an integer had more digits than Python reads (4300 by default)."""

# What `loads` scans: JSON strings (escapes included), opening and closing brackets.
_STRING: Final = r'"(?:[^"\\]++|\\.)*+"'
_STRINGS: Final = re.compile(_STRING, re.DOTALL)
_NOT_BRACKETS: Final = re.compile(r"[^\[\]{}]++")
_INNERMOST_PAIRS: Final = re.compile(r"[\[{][\]}]")
_TOKENS: Final = re.compile(_STRING + r"|([\[{])|([\]}])", re.DOTALL)

# How a path is shown: keys cut to this many characters, at most this many parts.
_KEY_CHARS: Final = 40
_PATH_PARTS: Final = 8
_PLAIN_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


class JsonBoundsError(ValueError):
    """`loads` with ``strict=True``: valid JSON text beyond the bounds (nested too deeply, an
    integer Python does not read, NaN or Infinity); the message says which."""


@dataclass(frozen=True)
class JsonLimits:
    """``max_depth``: objects and arrays nested in each other (the value itself is level 1);
    ``max_bytes``: the compact UTF-8 JSON encoding (``separators=(",", ":")``), counted without
    string escapes, so a little below the real encoding for strings with control characters."""

    max_depth: int
    max_bytes: int


@dataclass(frozen=True)
class JsonProblem:
    """Why a value is refused and where: ``path`` from the value's root (empty: the root)."""

    path: tuple[PathPart, ...]
    reason: str


def json_problem(value: object, limits: JsonLimits) -> JsonProblem | None:
    """The first problem of ``value`` in document order against ``limits``, or None."""
    budget = limits.max_bytes
    # (value, path, depth of the container holding it + 1); popped in document order.
    stack: list[tuple[object, tuple[PathPart, ...], int]] = [(value, (), 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, Mapping | list | tuple):
            if depth > limits.max_depth:
                return JsonProblem(path, _too_deep(limits.max_depth))
            budget -= 2 + max(len(item) - 1, 0)  # brackets and commas
            if budget < 0:
                return JsonProblem(path, _too_large(limits.max_bytes))
            children: list[tuple[object, tuple[PathPart, ...], int]] = []
            if isinstance(item, Mapping):
                for key, child in item.items():
                    if not isinstance(key, str):
                        return JsonProblem(path, f"object keys must be strings, got {_kind(key)}")
                    cost = _string_cost(key, budget)
                    if cost is None:
                        return JsonProblem((*path, key), _NOT_UNICODE)
                    budget -= cost + 1  # the colon
                    if budget < 0:
                        return JsonProblem((*path, key), _too_large(limits.max_bytes))
                    children.append((child, (*path, key), depth + 1))
            else:
                children = [(child, (*path, i), depth + 1) for i, child in enumerate(item)]
            stack.extend(reversed(children))
            continue
        cost_or_problem = _scalar_cost(item, budget)
        if isinstance(cost_or_problem, str):
            return JsonProblem(path, cost_or_problem)
        budget -= cost_or_problem
        if budget < 0:
            return JsonProblem(path, _too_large(limits.max_bytes))
    return None


def loads(
    text: str | bytes, *, max_depth: int = MAX_DOCUMENT_DEPTH, strict: bool = False
) -> object:
    """``json.loads(text)``, bounded: nesting below ``max_depth`` levels becomes `TOO_DEEP` and
    integers Python refuses to convert become `TOO_LONG`, so a valid document always parses
    and the result can be copied and compared safely. With ``strict``, those are a
    `JsonBoundsError` instead, and so are NaN and Infinity (which ``json.loads`` reads but no JSON
    encoder writes): for a document that must be read whole or not at all. Invalid JSON raises
    ``ValueError`` (``json.JSONDecodeError``, ``UnicodeDecodeError``), as ``json.loads`` does;
    never RecursionError while ``max_depth`` stays well below Python's recursion limit (1000).
    A large shallow document costs up to three plain ``json.loads``."""
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8")
    if _deeper_than(text, max_depth):
        clipped = _clipped(text, max_depth)
        if strict:
            json.loads(clipped, parse_int=_read_int, parse_constant=_refuse_constant)  # invalid?
            raise JsonBoundsError(
                f"nested too deeply: more than {max_depth} levels of objects and arrays"
            )
        text = clipped
    if strict:
        return json.loads(text, parse_int=_strict_int, parse_constant=_refuse_constant)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer of more digits than Python converts: read it as a marker
        return json.loads(text, parse_int=_read_int)


def _deeper_than(text: str, max_depth: int) -> bool:
    """Whether brackets outside strings nest deeper than ``max_depth`` (or do not balance):
    drop the strings and all but the brackets, then remove innermost pairs level by level."""
    if text.count("[") + text.count("{") <= max_depth:  # a small document: no need to look
        return False
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets = _INNERMOST_PAIRS.sub("", brackets)
    return bool(brackets)


def _clipped(text: str, max_depth: int) -> str:
    """``text`` with every array or object below ``max_depth`` levels replaced by `TOO_DEEP`."""
    spans: list[tuple[int, int]] = []
    depth = 0
    clip_start = -1
    for token in _TOKENS.finditer(text):
        if token.lastindex == 1:  # [ or {
            depth += 1
            if depth == max_depth + 1:
                clip_start = token.start()
        elif token.lastindex == 2:  # ] or }
            if depth == max_depth + 1:
                spans.append((clip_start, token.end()))
            depth -= 1
    if depth > max_depth:
        raise json.JSONDecodeError("unterminated array or object", text, clip_start)
    marker = json.dumps(TOO_DEEP)
    parts: list[str] = []
    end = 0
    for start, stop in spans:
        parts += (text[end:start], marker)
        end = stop
    parts.append(text[end:])
    return "".join(parts)


def _read_int(digits: str) -> int | str:
    limit = sys.get_int_max_str_digits()
    if limit and len(digits.lstrip("-")) > limit:
        return TOO_LONG
    return int(digits)


def _strict_int(digits: str) -> int:
    value = _read_int(digits)
    if isinstance(value, str):
        limit = sys.get_int_max_str_digits()
        raise JsonBoundsError(f"an integer with more than {limit} digits")
    return value


def _refuse_constant(name: str) -> float:
    raise JsonBoundsError(f"{name} is not a JSON number")


def render_path(root: str, path: tuple[PathPart, ...]) -> str:
    """``root.key[0].other`` for messages: odd keys quoted, long keys and long paths shortened."""
    shown = path if len(path) <= _PATH_PARTS else path[: _PATH_PARTS - 1]
    text = root
    for part in shown:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += path_key(part, brackets=False)
    text = text.removeprefix(".")
    if len(shown) < len(path):
        text += f"...(+{len(path) - len(shown)} more)"
    return text


def path_key(key: str, *, brackets: bool) -> str:
    """An object key as a path part: ``.key`` (``[key]`` with ``brackets``) when it is short and
    plain (letters, digits, ``-``, ``_``), else quoted and shortened: ``['a.b']``, ``['x\\n']``.
    Keeps paths on one line and short, whatever the key holds."""
    if _PLAIN_KEY.fullmatch(key) and len(key) <= _KEY_CHARS:
        return f"[{key}]" if brackets else f".{key}"
    return f"[{short_key(key)!r}]"


def short_key(key: str) -> str:
    """``key`` cut to 40 characters (37 and ``...``) for a path in a message."""
    return key if len(key) <= _KEY_CHARS else key[: _KEY_CHARS - 3] + "..."


def describe(value: object) -> str:
    """Any value for a message, shortly and safely: strings and numbers shown (shortened),
    others by JSON type (``an object``, ``an array``, ``null``) or Python type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, int):
        if not -_INTEGER_LIMIT < value < _INTEGER_LIMIT:
            return f"an integer with more than {MAX_INTEGER_DIGITS} digits"
        return f"number {value}"
    if isinstance(value, float):
        return f"number {value}"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    return type(value).__name__


def _scalar_cost(item: object, budget: int) -> int | str:
    """The encoded size of a JSON scalar, or why ``item`` is none (a reason)."""
    if item is None:
        return 4
    if isinstance(item, bool):
        return 4 if item else 5
    if isinstance(item, int):
        if not -_INTEGER_LIMIT < item < _INTEGER_LIMIT:
            return f"integer with more than {MAX_INTEGER_DIGITS} digits"
        return len(str(item))
    if isinstance(item, float):
        if not math.isfinite(item):
            return f"{item} is not a JSON number"
        return len(repr(item))
    if isinstance(item, str):
        cost = _string_cost(item, budget)
        return _NOT_UNICODE if cost is None else cost
    return f"expected a JSON value, got {_kind(item)}"


def _string_cost(text: str, budget: int) -> int | None:
    """Quotes plus UTF-8 bytes (a lower bound where that is over ``budget``, so that a huge
    string is not encoded); None if it cannot be encoded (a lone surrogate)."""
    if len(text) + 2 > budget:  # every character is at least one byte
        return len(text) + 2
    try:
        return len(text.encode("utf-8")) + 2
    except UnicodeEncodeError:
        return None


_NOT_UNICODE: Final = "string is not valid Unicode (it holds a lone surrogate)"


def _too_deep(max_depth: int) -> str:
    return f"nested too deeply: at most {max_depth} levels of objects and arrays are allowed"


def _too_large(max_bytes: int) -> str:
    return f"too large: at most {max_bytes} bytes of JSON are allowed"


def _kind(value: object) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return type(value).__name__
