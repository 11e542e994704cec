"""Errors of CEL selectors: the message is what the user reads, in Kubernetes' words."""

from __future__ import annotations


class CelError(Exception):
    """A selector could not be compiled or evaluated."""


class CelCompileError(CelError):
    """The expression is rejected before evaluation, as the apiserver would reject it.

    Examples: a syntax error (``ERROR: <input>:1:4: Syntax error: ...``), an unknown function, an
    undefined ``device`` field, a non-bool result type, more than 10240 bytes.
    """

    @property
    def first_line(self) -> str:
        """The message's first line, which has the position: the engine adds the source and a
        caret line below it."""
        text = str(self)
        return text.splitlines()[0] if text else "compile error"


class CelRuntimeError(CelError):
    """Evaluation failed (``no such key: productName``). The scheduler treats this as an error
    that aborts allocation, never as "no match"."""
