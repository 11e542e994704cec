"""Blocking work run in a worker thread that a cancelled caller still waits for.

`in_thread_to_completion` is `asyncio.to_thread` whose cancellation waits for the thread, so
that a caller's claim and device locks are held until the work has finished or rolled back.
See docs/architecture.md, "Prepare and unprepare".
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


async def in_thread_to_completion(func: Callable[..., _T], /, *args: object) -> _T:
    """`asyncio.to_thread`, except that cancellation waits for the thread to finish.

    The thread cannot be stopped: returning early would release the caller's claim and device
    locks while it still writes, letting an unprepare (or another claim's prepare) of the same
    devices run beside a half-done prepare and leak its CDI spec and checkpoint entry.
    """
    # The executor's future itself, not a task around `asyncio.to_thread`: the same work in the
    # same context (a copy of the caller's), with two fewer event loop steps per call.
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, func, *args)
    work = loop.run_in_executor(None, call)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait({work})
        if not work.cancelled():
            work.exception()  # the caller is gone; the work rolled itself back if it failed
        raise
