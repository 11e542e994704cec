"""``--mps-share-daemon-warm``: whether the shared MPS daemon of a GPU offered as shares runs
before its first share and after its last one.

``always`` (the default): started ahead at plugin start and again right after the last share
left; ``idle:<duration>`` (``idle:10m``, ``idle:90s``, ``idle:1h``): the same, but stopped once
it served no share for that long; ``off``: started by the first share, stopped with the last.
Pure parsing; the daemons are `mps.warm_daemons`'. See docs/mps.md, "Warm daemons".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

_DURATION: Final = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class WarmPolicyError(ValueError):
    """A ``--mps-share-daemon-warm`` value that is none of the forms; the message says which."""


@dataclass(frozen=True)
class WarmPolicy:
    """What `WarmPolicy.parse` read."""

    warm: bool
    """Start the daemon ahead of its first share (at plugin start, after the last share)."""
    idle_s: float | None = None
    """Stop a warm daemon that served no share for this long; None: never."""

    @classmethod
    def parse(cls, text: str) -> WarmPolicy:
        value = text.strip().lower()
        if value == "always":
            return ALWAYS
        if value == "off":
            return OFF
        if value.startswith("idle:"):
            match = _DURATION.fullmatch(value.removeprefix("idle:"))
            if match is None:
                raise WarmPolicyError(
                    f"idle time {text.strip()[5:]!r} is no duration like 90s, 10m or 1h"
                )
            seconds = float(match.group(1)) * _UNITS[match.group(2)]
            if seconds <= 0:
                raise WarmPolicyError(f"idle time {text.strip()[5:]!r} must be above 0")
            return cls(warm=True, idle_s=seconds)
        raise WarmPolicyError(f"must be always, idle:<duration> or off, got {text!r}")

    def __str__(self) -> str:
        if not self.warm:
            return "off"
        return "always" if self.idle_s is None else f"idle:{self.idle_s:g}s"


ALWAYS: Final = WarmPolicy(warm=True)
OFF: Final = WarmPolicy(warm=False)
DEFAULT: Final = ALWAYS
"""``--mps-share-daemon-warm`` when not given."""
