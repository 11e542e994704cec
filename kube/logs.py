"""The log levels `gpu-dra-controller` and `gpu-dra-kubelet-plugin` accept (``--log-level``).

See docs/config.md.
"""

from __future__ import annotations

from typing import Final

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")


def parse_log_level(text: str) -> str:
    """`text` upper-cased if it names one of `LOG_LEVELS`; ValueError otherwise."""
    level = text.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level
