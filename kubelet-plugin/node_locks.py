"""File locks that every plugin instance on a node shares: ``flock`` on files in
``<data-dir>/locks/``, so that two instances of a rolling update exclude each other as the
locks inside one process exclude its own calls.

* ``node`` (with ``gate``): every prepare and unprepare holds it shared for the whole claim;
  start-up recovery holds it exclusive, so that it never sees another instance's prepare
  halfway. Taking ``gate`` first gives recovery writer preference: new calls wait while it waits.
* ``claim-<uid>``: one call per claim at a time, node-wide (removed when released).
* ``device-<name>``: the devices a prepare or unprepare works on, taken in name order.
* `blocking` names taken from worker threads: ``mig-<GPU UUID>`` (MIG mode and instances of one
  GPU), ``mps-<daemon id>`` (a shared MPS daemon's users).

Waits poll with ``LOCK_NB`` (a cancelled wait stops at once). See docs/architecture.md, "Two
instances on one node".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

LOCKS_DIR: Final = "locks"
_FIRST_POLL_S: Final = 0.001
_LAST_POLL_S: Final = 0.05
_WAIT_LOG_S: Final = 10.0


class LockTimeoutError(TimeoutError):
    """A lock was still held by another process when the wait ended; the message names it (an
    `OSError`: callers report it as a retryable failure)."""


def _busy(error: OSError) -> bool:
    return error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)


def try_flock(fd: int, operation: int) -> bool:
    """``flock(fd, operation | LOCK_NB)``: whether it was taken (False: someone holds it)."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as error:
        if _busy(error):
            return False
        raise
    return True


def open_lock_file(path: Path) -> int:
    """``path`` opened for locking, created (and its directory) if missing."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        return os.open(path, flags, 0o600)


class HeldLock:
    """An ``flock`` this process holds; `release` drops it (and removes the file if asked)."""

    def __init__(self, fd: int, path: Path, *, remove: bool) -> None:
        self.fd = fd
        self.path = path
        self._remove = remove

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            if self._remove:
                # Still ours (held): nobody else can hold this file, waiters re-check the inode.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        finally:
            os.close(fd)


def _attempt(path: Path, operation: int, remove: bool) -> HeldLock | None:
    """One try: the lock held, or None. A file removed by its last holder meanwhile is retried
    by the caller (``remove``: the path must still name the locked file)."""
    fd = open_lock_file(path)
    try:
        if not try_flock(fd, operation):
            os.close(fd)
            return None
        if remove:
            try:
                current = os.stat(path)
            except FileNotFoundError:
                os.close(fd)
                return None
            mine = os.fstat(fd)
            if (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                return None
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return HeldLock(fd, path, remove=remove)


def acquire_blocking(
    path: Path, *, shared: bool = False, timeout_s: float | None = None, remove: bool = False
) -> HeldLock:
    """Take the lock on ``path`` from a worker thread; `LockTimeoutError` after ``timeout_s``."""
    operation = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = _FIRST_POLL_S
    while True:
        held = _attempt(path, operation, remove)
        if held is not None:
            return held
        if deadline is not None and time.monotonic() >= deadline:
            raise LockTimeoutError(_timeout_message(path, timeout_s))
        time.sleep(delay)
        delay = min(delay * 2, _LAST_POLL_S)


async def acquire(
    path: Path, *, shared: bool = False, timeout_s: float | None = None, remove: bool = False
) -> HeldLock:
    """Take the lock on ``path`` without blocking the event loop; cancellable;
    `LockTimeoutError` after ``timeout_s``. Waits longer than 10 s are logged."""
    operation = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    loop = asyncio.get_running_loop()
    started = loop.time()
    logged = started
    delay = _FIRST_POLL_S
    while True:
        held = _attempt(path, operation, remove)
        if held is not None:
            return held
        now = loop.time()
        if timeout_s is not None and now - started >= timeout_s:
            raise LockTimeoutError(_timeout_message(path, timeout_s))
        if now - logged >= _WAIT_LOG_S:
            logged = now
            log.info("waiting for lock %s held by another plugin instance (%.0fs)", path,
                     now - started)  # fmt: skip
        await asyncio.sleep(delay)
        delay = min(delay * 2, _LAST_POLL_S)


def _timeout_message(path: Path, timeout_s: float | None) -> str:
    return (
        f"lock {path} still held by another process after {timeout_s or 0:.0f}s (another "
        "gpu-dra plugin instance on this node stuck?)"
    )


class NodeLocks:
    """The node-wide locks under ``<data_dir>/locks`` (see the module doc)."""

    def __init__(self, data_dir: Path, *, blocking_timeout_s: float = 60.0) -> None:
        self.directory = data_dir / LOCKS_DIR
        self._blocking_timeout_s = blocking_timeout_s

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.lock"

    @contextlib.asynccontextmanager
    async def operation(self) -> AsyncIterator[None]:
        """Held (shared) around one claim's prepare or unprepare."""
        gate = await acquire(self.path("gate"), shared=True)
        try:
            node = await acquire(self.path("node"), shared=True)
        finally:
            gate.release()
        try:
            yield
        finally:
            node.release()

    @contextlib.asynccontextmanager
    async def exclusive(self, timeout_s: float | None = None) -> AsyncIterator[None]:
        """Held by start-up recovery: no prepare or unprepare of any instance runs meanwhile.
        `LockTimeoutError` when other instances' calls still run after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        gate = await acquire(self.path("gate"), timeout_s=timeout_s)
        try:
            left = None if timeout_s is None else max(timeout_s - (loop.time() - started), 0.0)
            node = await acquire(self.path("node"), timeout_s=left)
            try:
                yield
            finally:
                node.release()
        finally:
            gate.release()

    @contextlib.asynccontextmanager
    async def claim(self, uid: str) -> AsyncIterator[None]:
        """One claim's lock (the claim UID is validated by the caller)."""
        held = await acquire(self.path(f"claim-{uid}"), remove=True)
        try:
            yield
        finally:
            held.release()

    @contextlib.asynccontextmanager
    async def devices(self, names: Sequence[str]) -> AsyncIterator[None]:
        """The locks of ``names`` (device names), taken in name order."""
        held: list[HeldLock] = []
        try:
            for name in sorted(set(names)):
                held.append(await acquire(self.path(f"device-{name}")))
            yield
        finally:
            for lock in reversed(held):
                lock.release()

    @contextlib.contextmanager
    def blocking(self, name: str) -> Iterator[None]:
        """The lock ``name`` from a worker thread (`LockTimeoutError` after the timeout)."""
        held = acquire_blocking(self.path(name), timeout_s=self._blocking_timeout_s)
        try:
            yield
        finally:
            held.release()
