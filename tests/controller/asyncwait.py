"""`until`: wait in an asyncio test for a condition, with a limit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(what: str, probe: Callable[[], object], limit_s: float = 5.0) -> float:
    """Wait for `probe()` to be true; the seconds it took. AssertionError after `limit_s`."""
    started = time.monotonic()
    while not probe():
        if time.monotonic() - started > limit_s:
            raise AssertionError(f"timed out after {limit_s:g}s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - started
