"""Errors of the opaque config API, worded for the user who wrote the claim.

A `ConfigError` ends up as a pod event (`FailedPrepareDynamicResources`), so every problem is one
line that names where it is (claim, config entry, field) and what to change.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

# A problem's text is cut here so that one bad value cannot flood an event.
MAX_PROBLEM_CHARS = 300
# A message lists this many problems, then says how many more there are.
MAX_PROBLEMS_SHOWN = 10


class DomainError(Exception):
    """Base of errors the driver core raises about user input or device state.

    ``retryable`` says whether trying again unchanged can succeed (a device busy) or the user must
    change something first (a bad config).
    """

    retryable: ClassVar[bool] = False


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with one config entry.

    ``config`` locates the entry (``spec.devices.config[1]``, ``config[0] (FromClass)``),
    ``field`` the JSON path inside it (``parameters.sharing.strategy``); either may be empty.
    """

    reason: str
    config: str = ""
    field: str = ""

    def __str__(self) -> str:
        text = ": ".join(part for part in (self.config, self.field, self.reason) if part)
        if len(text) > MAX_PROBLEM_CHARS:
            return text[: MAX_PROBLEM_CHARS - 3] + "..."
        return text

    def located(self, config: str) -> ConfigProblem:
        """The same problem, attributed to the config entry ``config``."""
        return ConfigProblem(reason=self.reason, config=config, field=self.field)


class ConfigError(DomainError):
    """The opaque configuration of a claim cannot be used; the user has to fix the claim or class.

    ``claim`` is the claim's ``namespace/name`` (empty when unknown), ``problems`` every problem
    found, in order. The message is one line: ``resource claim <ns/name>: <problem>; <problem>``,
    with at most `MAX_PROBLEMS_SHOWN` problems and then ``(N more problems)``.
    """

    retryable: ClassVar[bool] = False

    def __init__(self, problems: Iterable[ConfigProblem], claim: str = "") -> None:
        self.problems = tuple(problems)
        if not self.problems:
            raise ValueError("ConfigError needs at least one problem")
        self.claim = claim
        super().__init__(self._message())

    def _message(self) -> str:
        details = "; ".join(str(problem) for problem in self.problems[:MAX_PROBLEMS_SHOWN])
        hidden = len(self.problems) - MAX_PROBLEMS_SHOWN
        if hidden > 0:
            details += f"; ({hidden} more problem{'s' if hidden > 1 else ''})"
        prefix = f"resource claim {self.claim}: " if self.claim else ""
        return f"{prefix}{details}"
