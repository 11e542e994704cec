"""`compile_selector` and `Selector`: the engine-independent face of DRA selector CEL.

Compile once, evaluate many: a `Selector` holds the compiled program and `matches` only
evaluates it. The checks the apiserver makes before the engine sees the text (length in bytes,
``device`` fields) and after type-checking (the result must be bool or dyn) live here.
"""

from __future__ import annotations

from typing import Final

from gpu_dra.driver.cel import engine_cel_expr_python as engine
from gpu_dra.driver.cel.device import DraDevice
from gpu_dra.driver.cel.errors import CelCompileError, CelRuntimeError
from gpu_dra.driver.cel.source import (
    DevicePath,
    bare_device_path_type,
    capacity_literal_comparisons,
    device_footprint,
    line_column,
    undefined_device_fields,
)

# resource.k8s.io/v1 CELSelectorExpressionMaxLength; Go counts bytes.
MAX_EXPRESSION_LENGTH: Final = 10 * 1024
_BOOL_OR_DYN: Final = frozenset({"bool", "dyn"})
# cel-go's names of the result types a selector can produce, for the scheduler's message.
_CEL_TYPE_NAMES: Final[dict[type, str]] = {
    str: "string",
    int: "int",
    float: "double",
    bytes: "bytes",
    dict: "map",
    list: "list",
    type(None): "null_type",
}


class Selector:
    """A compiled DRA device selector."""

    def __init__(self, program: engine.Program) -> None:
        self._program = program
        self.footprint: frozenset[DevicePath] | None = device_footprint(program.expression)
        """The parts of ``device`` the result depends on (None: not known); see `batch`."""

    @property
    def expression(self) -> str:
        return self._program.expression

    def matches(self, device: DraDevice) -> bool:
        """Whether `device` is selected; raises `CelRuntimeError` (``no such key: productName``,
        a non-bool result) where the scheduler would fail allocation."""
        result = self._program.evaluate(device)
        if not isinstance(result, bool):
            kind = _CEL_TYPE_NAMES.get(type(result), type(result).__name__)
            raise CelRuntimeError(f"CEL result of type {kind} could not be converted to bool")
        return result

    def __repr__(self) -> str:
        return f"Selector({self.expression!r})"


def compile_selector(expression: str) -> Selector:
    """Compile a ``DeviceClass`` / ``ResourceClaim`` selector expression.

    Raises `CelCompileError` with the message the apiserver would give, as far as the engine
    can tell: too long, a syntax or type error (``device``'s fields typed as the apiserver types
    them: ``device.attributes['memory'] >= 40000`` compares a domain map with an int), an
    undefined ``device`` field, a result type that is neither bool nor dyn, an invalid regular
    expression literal in ``matches``.
    """
    size = len(expression.encode())
    if size > MAX_EXPRESSION_LENGTH:
        raise CelCompileError(
            f"expression is {size} bytes long, may not be more than {MAX_EXPRESSION_LENGTH}"
        )
    program = engine.compile_program(expression)
    for operator, literal, offset in capacity_literal_comparisons(expression):
        # device.capacity is typed map(string, map(string, Quantity)) in Kubernetes; here the
        # engine sees dyn, so the checker's error is given from the tokens.
        line, column = line_column(expression, offset)
        raise CelCompileError(
            f"ERROR: <input>:{line}:{column}: found no matching overload for "
            f"'_{operator}_' applied to '(kubernetes.Quantity, {literal})'"
        )
    for field, offset in undefined_device_fields(expression):
        line, column = line_column(expression, offset)
        raise CelCompileError(f"ERROR: <input>:{line}:{column}: undefined field '{field}'")
    result_type = bare_device_path_type(expression) or program.result_type
    if result_type not in _BOOL_OR_DYN:
        raise CelCompileError(f"must evaluate to bool or the unknown type, not {result_type}")
    return Selector(program)
