"""The CEL engine: ``cel-expr-python`` (Google's binding of cel-cpp). The only module that
imports it; everything it needs from the rest of the package goes through `Program` and
`compile_program`. It carries the Kubernetes additions (``quantity``, ``semver``, unknown
domains) on cel-cpp with Kubernetes' results, and keeps common selectors off Python callbacks,
which leak memory in cel-expr-python 0.1.3. See
docs/cel.md#how-the-kubernetes-additions-map-onto-cel-cpp and
docs/cel.md#the-memory-leak-and-what-it-means-here.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Final

from cel_expr_python import cel  # type: ignore[import-untyped]
from cel_expr_python.ext import (  # type: ignore[import-untyped]
    ext_bindings,
    ext_optional,
    ext_strings,
)
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from gpu_dra.driver.cel.device import DraDevice
from gpu_dra.driver.cel.errors import CelCompileError, CelRuntimeError
from gpu_dra.driver.cel.source import (
    default_unknown_domains,
    fold_literal_calls,
    line_column,
    literal_equalities,
    native_comparisons,
    regex_literals,
    root_identifier_offsets,
    typed_device_fields,
)
from gpu_dra.driver.cel.values import (
    INT64_MAX,
    INT64_MIN,
    CelValueError,
    Quantity,
    Semver,
    is_quantity,
    is_semver,
)

ENGINE: Final = "cel-expr-python"

_STATUS_PREFIX: Final = re.compile(r"^[A-Z_]+: ")
_STATUS_SUFFIX: Final = re.compile(r"\s*\[[A-Z_]+\]$")
_NO_SUCH_KEY: Final = re.compile(r'^Key not found in map : "?(.*?)"?$')
_NO_OVERLOAD: Final = re.compile(r"^No matching overloads found : (.*)$")
_ITERATIONS: Final = "Iteration budget exceeded"


class Program:
    """One compiled selector; `evaluate` runs it, never recompiling."""

    def __init__(self, expression: str, compiled: Any, result_type: str, runs: str) -> None:
        self.expression = expression
        self.result_type = result_type  # "bool", "dyn", "string", "int", ... (lower case)
        self.runs = runs  # the rewritten text the engine evaluates
        self._compiled = compiled

    def evaluate(self, device: DraDevice) -> object:
        """The result as a Python value (bool, int, str, ...); raises `CelRuntimeError`."""
        data = _environment().data(device)
        try:
            result = self._compiled.eval(data=data)
        except RuntimeError as error:  # cel-cpp raises only for budget overruns
            raise CelRuntimeError(_runtime_message(str(error))) from error
        if result.type() == cel.Type.ERROR:
            raise CelRuntimeError(_runtime_message(str(result.value())))
        value: object = result.value()
        return value


def compile_program(expression: str) -> Program:
    """Parse and type-check `expression`; raises `CelCompileError` with the engine's message."""
    environment = _environment()
    typed_text = typed_device_fields(expression)
    try:
        checked = environment.compile(expression)
    except CelCompileError:
        if typed_text is not None:  # the typed check words it as the apiserver does
            environment.type_check(expression, typed_text)
        raise
    for offset in root_identifier_offsets(expression, "kubernetes"):
        # The message types are the wrapper's representation, not part of the language.
        line, column = line_column(expression, offset)
        raise CelCompileError(
            f"ERROR: <input>:{line}:{column}: undeclared reference to 'kubernetes'"
        )
    for literal, offset in regex_literals(expression):
        if not _valid_regex(literal):
            # The apiserver validates regex literals when compiling; cel-cpp only when running.
            line, column = line_column(expression, offset)
            raise CelCompileError(f"ERROR: <input>:{line}:{column}: invalid matches argument")
    result_type = str(checked.return_type().name()).lower()
    if typed_text is not None:
        result_type = environment.type_check(expression, typed_text)
    rewritten = literal_equalities(expression, _typed_equality)
    rewritten = native_comparisons(rewritten, _native_comparison)
    rewritten = default_unknown_domains(fold_literal_calls(rewritten, _literal))
    compiled = checked if rewritten == expression else environment.compile(rewritten)
    return Program(expression, compiled, result_type, rewritten)


class _Environment:
    """The engine environment: declarations, protobuf types, function implementations."""

    def __init__(self) -> None:
        pool = descriptor_pool.DescriptorPool()
        pool.Add(_type_descriptors())
        self.quantity_class: Any = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("kubernetes.Quantity")
        )
        self.semver_class: Any = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("kubernetes.Semver")
        )
        # The extensions of the Kubernetes DRA environment that cel-cpp has: ext.Strings,
        # ext.Bindings (cel.bind), optional types. Not ext.Math: Kubernetes does not load it.
        self._env = self._new_env(pool, {"device": cel.Type.DYN})
        # For the type check of `type_check`: device's fields as variables of Kubernetes' types
        # (an attribute is `any` there: dyn here; the `any` variant only words the messages).
        self._typed = {
            name: self._new_env(pool, _typed_device_variables(value))
            for name, value in (("dyn", cel.Type.DYN), ("any", cel.Type("google.protobuf.Any")))
        }

    def _new_env(self, pool: Any, variables: dict[str, Any]) -> Any:
        return cel.NewEnv(
            pool,
            variables=variables,
            functions=self._functions(),
            extensions=[
                ext_strings.ExtStrings(),
                ext_bindings.ExtBindings(),
                ext_optional.ExtOptional(),
            ],
        )

    def compile(self, expression: str) -> Any:
        try:
            return self._env.compile(expression)
        except RuntimeError as error:
            raise CelCompileError(_compile_message(str(error), expression)) from error

    def type_check(self, expression: str, typed_text: str) -> str:
        """Type-check `expression` (given as `typed_text`, see `source.typed_device_fields`)
        with ``device``'s fields typed as the apiserver types them: ``driver`` string,
        ``attributes`` map(string, map(string, any)), ``capacity`` map(string, map(string,
        kubernetes.Quantity)). Returns the result type in cel-go's words; raises
        `CelCompileError` with the apiserver's wording and `expression` in the excerpt."""
        try:
            checked = self._typed["dyn"].compile(typed_text)
        except RuntimeError as error:
            message = str(error).replace("map(string, dyn)", "map(string, any)")
            try:
                self._typed["any"].compile(typed_text)
            except RuntimeError as worded:
                message = str(worded)
            excerpt = dict(zip(typed_text.splitlines(), expression.splitlines(), strict=False))
            lines = [
                f" | {excerpt[line[3:]]}" if line[:3] == " | " and line[3:] in excerpt else line
                for line in _compile_message(message, expression).splitlines()
            ]
            raise CelCompileError("\n".join(lines)) from error
        name = _cel_go_type_name(str(checked.return_type().name()))
        return name.replace("map(string, dyn)", "map(string, any)")

    def data(self, device: DraDevice) -> dict[str, object]:
        """The activation data for `device`, converted once. (Not an ``Activation``: a reused
        one grew by 64 bytes per evaluation even without callbacks.)"""
        cached: dict[str, object] | None = device.engine_cache.get(ENGINE)
        if cached is None:
            cached = {"device": self._device_data(device)}
            device.engine_cache[ENGINE] = cached
        return cached

    # ---- values ---------------------------------------------------------------------------
    def _device_data(self, device: DraDevice) -> dict[str, object]:
        return {
            "driver": device.driver,
            "attributes": {
                domain: {key: self._attribute(value) for key, value in values.items()}
                for domain, values in device.attributes.items()
            },
            "capacity": {
                domain: {key: self.quantity_message(value) for key, value in values.items()}
                for domain, values in device.capacity.items()
            },
            "allowMultipleAllocations": device.allow_multiple_allocations,
        }

    def _attribute(self, value: object) -> object:
        return self.semver_message(value) if isinstance(value, Semver) else value

    def quantity_message(self, quantity: Quantity) -> Any:
        value = quantity.value
        whole, nano = _nano_key(value)
        return self.quantity_class(
            num=f"{value.numerator}/{value.denominator}", whole=whole, nano=nano
        )

    def semver_message(self, version: Semver) -> Any:
        return self.semver_class(
            major=version.major, minor=version.minor, patch=version.patch, pre=".".join(version.pre)
        )

    def value(self, message: Any) -> Quantity | Semver:
        if isinstance(message, self.quantity_class):
            return Quantity(_fraction(message.num))
        pre = tuple(message.pre.split(".")) if message.pre else ()
        return Semver(message.major, message.minor, message.patch, pre)

    # ---- functions ------------------------------------------------------------------------
    def _functions(self) -> list[Any]:
        q, s = cel.Type("kubernetes.Quantity"), cel.Type("kubernetes.Semver")
        string, boolean, integer = cel.Type.STRING, cel.Type.BOOL, cel.Type.INT

        def overload(
            name: str,
            result: Any,
            parameters: list[Any],
            impl: Callable[..., object] | None,
            member: bool = True,
        ) -> Any:
            if impl is None:  # declared for the checker; the other kind's impl serves it
                return cel.Overload(name, result, parameters, is_member=member)
            return cel.Overload(name, result, parameters, is_member=member, impl=impl)

        def q_of(message: Any) -> Quantity:
            return Quantity(_fraction(message.num))

        def compared(message: Any, other: Any) -> int:
            return self.value(message).compare(self.value(other))  # type: ignore[arg-type]

        def member(name: str, result: Any, impl: Callable[[Any], object]) -> Any:
            return cel.FunctionDecl(name, [overload(f"quantity_{name}", result, [q], impl)])

        def semver_part(name: str, part: Callable[[Semver], int]) -> Any:
            def impl(message: Any) -> int:
                return part(self.value(message))  # type: ignore[arg-type]

            return cel.FunctionDecl(name, [overload(f"semver_{name}", integer, [s], impl)])

        def shared(name: str, result: Any, impl: Callable[[Any, Any], object]) -> Any:
            return cel.FunctionDecl(
                name,
                [
                    overload(f"quantity_{name}", result, [q, q], impl),
                    overload(f"semver_{name}", result, [s, s], None),
                ],
            )

        def arithmetic(name: str, op: Callable[[Quantity, Quantity | int], Quantity]) -> Any:
            def with_quantity(message: Any, other: Any) -> Any:
                return self.quantity_message(op(q_of(message), q_of(other)))

            def with_int(message: Any, other: int) -> Any:
                return self.quantity_message(op(q_of(message), other))

            return cel.FunctionDecl(
                name,
                [
                    overload(f"quantity_{name}_quantity", q, [q, q], with_quantity),
                    overload(f"quantity_{name}_int", q, [q, integer], with_int),
                ],
            )

        return [
            cel.FunctionDecl(
                "quantity",
                [
                    overload(
                        "string_to_quantity",
                        q,
                        [string],
                        lambda text: self.quantity_message(_parse_quantity(text)),
                        member=False,
                    )
                ],
            ),
            cel.FunctionDecl(
                "isQuantity",
                [overload("is_quantity_string", boolean, [string], is_quantity, member=False)],
            ),
            cel.FunctionDecl(
                "semver",
                [
                    overload(
                        "string_to_semver",
                        s,
                        [string],
                        lambda text: self.semver_message(_parse_semver(text, False)),
                        member=False,
                    ),
                    overload(
                        "string_bool_to_semver",
                        s,
                        [string, boolean],
                        lambda text, normalize: self.semver_message(_parse_semver(text, normalize)),
                        member=False,
                    ),
                ],
            ),
            cel.FunctionDecl(
                "isSemver",
                [
                    overload("is_semver_string", boolean, [string], is_semver, member=False),
                    overload(
                        "is_semver_string_bool", boolean, [string, boolean], is_semver, member=False
                    ),
                ],
            ),
            shared("compareTo", integer, compared),
            shared("isGreaterThan", boolean, lambda a, b: compared(a, b) > 0),
            shared("isLessThan", boolean, lambda a, b: compared(a, b) < 0),
            # A global function in Kubernetes (sign(q)), unlike the other quantity functions.
            cel.FunctionDecl(
                "sign",
                [overload("quantity_sign", integer, [q], lambda m: q_of(m).sign(), member=False)],
            ),
            member("isInteger", boolean, lambda m: q_of(m).is_integer()),
            member("asInteger", integer, lambda m: q_of(m).as_integer()),
            member("asApproximateFloat", cel.Type.DOUBLE, lambda m: q_of(m).as_approximate_float()),
            arithmetic("add", Quantity.add),
            arithmetic("sub", Quantity.sub),
            semver_part("major", lambda v: v.major),
            semver_part("minor", lambda v: v.minor),
            semver_part("patch", lambda v: v.patch),
        ]


@functools.cache
def _environment() -> _Environment:
    """Built once per process (about a millisecond); immutable afterwards."""
    return _Environment()


@functools.lru_cache(maxsize=1024)
def _valid_regex(literal: str) -> bool:
    """Whether the string literal (source text) is a regular expression RE2 accepts: the engine
    runs ``''.matches(literal)`` once."""
    environment = _environment()
    program = environment.compile(f"''.matches({literal})")
    result = program.eval(data={})
    return bool(result.type() != cel.Type.ERROR)


def _literal(function: str, text: str, normalize: bool | None) -> str | None:
    """Source text of the constant ``quantity(text)`` / ``semver(text, normalize)`` stands for."""
    try:
        if function == "quantity":
            value = _parse_quantity(text).value
            whole, nano = _nano_key(value)
            return (
                f'kubernetes.Quantity{{num: "{value.numerator}/{value.denominator}", '
                f"whole: {whole}, nano: {nano}}}"
            )
        version = _parse_semver(text, bool(normalize))
    except CelValueError:
        return None
    return (
        f"kubernetes.Semver{{major: {version.major}, minor: {version.minor}, "
        f'patch: {version.patch}, pre: "{".".join(version.pre)}"}}'
    )


def _native_comparison(
    receiver: str, method: str, function: str, text: str, normalize: bool | None
) -> str | None:
    """``receiver.method(function(text))`` as CEL over the message fields, or None to keep the
    call (literal invalid, or a pre-release version: precedence of pre-release identifiers is
    left to Python)."""
    r = f"({receiver})"
    keys: tuple[tuple[str, int], ...]
    try:
        if function == "quantity":
            whole, nano = _nano_key(_parse_quantity(text).value)
            if whole < INT64_MIN + 1:
                return None
            keys = (("whole", whole), ("nano", nano))
            tail = "0"
        else:
            version = _parse_semver(text, bool(normalize))
            if version.pre:
                return None
            keys = (("major", version.major), ("minor", version.minor), ("patch", version.patch))
            tail = f'({r}.pre != "" ? -1 : 0)'  # 1.0.0-rc.1 < 1.0.0
    except CelValueError:
        return None
    compared = tail
    for field, key in reversed(keys):
        compared = f"({r}.{field} != {key} ? ({r}.{field} > {key} ? 1 : -1) : {compared})"
    return {
        "compareTo": compared,
        "isGreaterThan": f"({compared} == 1)",
        "isLessThan": f"({compared} == -1)",
    }[method]


def _typed_equality(path: str, operator: str, literal: str) -> str:
    """``path == literal`` where a quantity or semver compared with a string, number, bool or
    null is an error (``no such overload``), as Kubernetes' types make it; cel-cpp's
    heterogeneous equality would say false. (``!=`` is true in both.)"""
    if operator == "!=" or path.replace(" ", "") in (
        "device.driver",
        "device.allowMultipleAllocations",
    ):
        # != of the same pair is true in Kubernetes (observed), as in cel-cpp; device.driver
        # and allowMultipleAllocations are a string and a bool: nothing to check.
        return f"{path} {operator} {literal}"
    p = f"({path})"
    return (
        f"(type{p} in [kubernetes.Semver, kubernetes.Quantity] ? "
        f"dyn{p} < dyn({literal}) : {p} {operator} {literal})"
    )


def _nano_key(value: Fraction) -> tuple[int, int]:
    """(whole, nano): `value` rounded up to nano units (as resource.Quantity stores it), split so
    that comparing the pairs compares the values."""
    whole, nano = divmod(math.ceil(value * 1_000_000_000), 1_000_000_000)
    # Sums can leave int64. Literals cannot (the parser stops at 2**63 - 1), so saturated keys
    # still order correctly against every literal: above the largest, below the smallest.
    if whole > INT64_MAX:
        return INT64_MAX, 1_000_000_000
    if whole < INT64_MIN:
        return INT64_MIN, 0
    return whole, nano


# Literals such as quantity('40Gi') are evaluated once per device; parse each text once.
@functools.lru_cache(maxsize=4096)
def _fraction(num: str) -> Fraction:
    return Fraction(num)


@functools.lru_cache(maxsize=1024)
def _parse_quantity(text: str) -> Quantity:
    return Quantity.parse(text)


@functools.lru_cache(maxsize=1024)
def _parse_semver(text: str, normalize: bool) -> Semver:
    return Semver.parse(text, normalize)


def _type_descriptors() -> descriptor_pb2.FileDescriptorProto:
    fields = descriptor_pb2.FieldDescriptorProto
    optional = fields.LABEL_OPTIONAL
    file = descriptor_pb2.FileDescriptorProto(
        name="gpu_dra_cel_types.proto", package="kubernetes", syntax="proto3"
    )
    quantity = file.message_type.add(name="Quantity")
    quantity.field.add(name="num", number=1, type=fields.TYPE_STRING, label=optional)
    quantity.field.add(name="whole", number=2, type=fields.TYPE_INT64, label=optional)
    quantity.field.add(name="nano", number=3, type=fields.TYPE_INT64, label=optional)
    semver = file.message_type.add(name="Semver")
    for number, name in enumerate(("major", "minor", "patch"), start=1):
        semver.field.add(name=name, number=number, type=fields.TYPE_INT64, label=optional)
    semver.field.add(name="pre", number=4, type=fields.TYPE_STRING, label=fields.LABEL_OPTIONAL)
    return file


def _typed_device_variables(attribute: Any) -> dict[str, Any]:
    string, mapping = cel.Type.STRING, cel.Type.Map
    return {
        "device": cel.Type.DYN,  # where `device` is not renamed: has(device.driver)
        "device_driver": string,
        "device_attributes": mapping(string, mapping(string, attribute)),
        "device_capacity": mapping(string, mapping(string, cel.Type("kubernetes.Quantity"))),
        "device_allowMultipleAllocations": cel.Type.BOOL,
    }


_TYPE_WORD: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def _cel_go_type_name(name: str) -> str:
    """cel-cpp's ``MAP<STRING, DYN>`` as cel-go writes it: ``map(string, dyn)``."""
    name = name.replace("<", "(").replace(">", ")")
    return _TYPE_WORD.sub(lambda m: m[0] if "." in m[0] else m[0].lower(), name)


_NO_MATCHING_OVERLOAD: Final = re.compile(
    r"^(ERROR: <input>:(\d+):(\d+): found no matching overload for '([^']+)' applied to )"
    r"'\((.*)\)'$"
)


def _compile_message(text: str, expression: str) -> str:
    """``INVALID_ARGUMENT: ERROR: <input>:1:4: ... [INVALID_ARGUMENT]`` -> ``ERROR: <input>:...``,
    a member call's signature written as cel-go writes it: ``'target.(argument, ...)'``."""
    lines = _STATUS_SUFFIX.sub("", _STATUS_PREFIX.sub("", text.strip())).split("\n")
    match = _NO_MATCHING_OVERLOAD.match(lines[0])
    if match:
        line, column, name = int(match[2]), int(match[3]), match[4]
        source = expression.split("\n")[line - 1] if line <= expression.count("\n") + 1 else ""
        before = source[: column - 1].rstrip()
        arguments = _top_level_split(match[5])
        if before.endswith(f".{name}") and len(arguments) >= 1:
            signature = f"{arguments[0]}.({', '.join(arguments[1:])})"
            lines[0] = f"{match[1]}'{signature}'"
    return "\n".join(lines)


def _top_level_split(text: str) -> list[str]:
    """``map(string, int), int`` -> ``['map(string, int)', 'int']``."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index].strip())
            start = index + 1
    parts.append(text[start:].strip())
    return [part for part in parts if part]


def _runtime_message(text: str) -> str:
    """cel-cpp's runtime message in cel-go's words where they differ."""
    text = _STATUS_PREFIX.sub("", text.strip())
    if match := _NO_SUCH_KEY.match(text):
        return f"no such key: {match[1]}"
    if match := _NO_OVERLOAD.match(text):
        return f"no such overload: {match[1]}"
    if text == "divide by zero":
        return "division by zero"
    if _ITERATIONS in text:
        return "operation cancelled: iteration budget of 10000 exceeded"
    return text
