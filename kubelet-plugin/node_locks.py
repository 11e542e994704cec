"""File locks every plugin instance on a node shares (``flock`` in ``<data-dir>/locks/``), so
that the two instances of a rolling update exclude each other as one process's locks do.

* ``node`` (after ``gate``, which gives a waiting recovery writer preference): held shared by
  every prepare and unprepare, exclusive by start-up recovery;
* ``claim-<stripe>`` (256 stripes by claim UID) and ``device-<name>`` (in name order);
* `blocking` ones from worker threads: ``mig-<GPU UUID>``, ``mps-<daemon id>``.
Waits poll with ``LOCK_NB`` (cancellable). Node, claim and device files stay open and a process
holds each once for all its calls. See docs/architecture.md, "Two instances on one node".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
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
    """An ``flock`` this process holds on its own open file; `release` drops it."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _attempt(path: Path, operation: int) -> HeldLock | None:
    """One try on a fresh open file: the lock held, or None."""
    fd = open_lock_file(path)
    try:
        if try_flock(fd, operation):
            return HeldLock(fd, path)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def acquire_blocking(
    path: Path, *, shared: bool = False, timeout_s: float | None = None
) -> HeldLock:
    """Take the lock on ``path`` from a worker thread; `LockTimeoutError` after ``timeout_s``."""
    operation = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = _FIRST_POLL_S
    while True:
        held = _attempt(path, operation)
        if held is not None:
            return held
        if deadline is not None and time.monotonic() >= deadline:
            raise LockTimeoutError(_timeout_message(path, timeout_s))
        time.sleep(delay)
        delay = min(delay * 2, _LAST_POLL_S)


async def poll(path: Path, attempt: Callable[[], bool], timeout_s: float | None = None) -> None:
    """Call ``attempt`` (one ``LOCK_NB`` try on ``path``) until it succeeds, without blocking
    the event loop; cancellable; `LockTimeoutError` after ``timeout_s``. Waits longer than
    10 s are logged."""
    if attempt():
        return
    loop = asyncio.get_running_loop()
    started = logged = loop.time()
    delay = _FIRST_POLL_S
    while True:
        await asyncio.sleep(delay)
        delay = min(delay * 2, _LAST_POLL_S)
        if attempt():
            return
        now = loop.time()
        if timeout_s is not None and now - started >= timeout_s:
            raise LockTimeoutError(_timeout_message(path, timeout_s))
        if now - logged >= _WAIT_LOG_S:
            logged = now
            log.info("waiting for lock %s held by another plugin instance (%.0fs)", path,
                     now - started)  # fmt: skip


async def acquire(path: Path, *, shared: bool = False, timeout_s: float | None = None) -> HeldLock:
    """Take the lock on ``path`` on a fresh open file, polling (see `poll`)."""
    operation = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    held: list[HeldLock] = []

    def attempt() -> bool:
        taken = _attempt(path, operation)
        if taken is not None:
            held.append(taken)
        return taken is not None

    await poll(path, attempt, timeout_s)
    return held[0]


def _timeout_message(path: Path, timeout_s: float | None) -> str:
    return (
        f"lock {path} still held by another process after {timeout_s or 0:.0f}s (another "
        "gpu-dra plugin instance on this node stuck?)"
    )


class _Shared:
    """A lock file this process keeps open and holds while any of its users needs it
    (``users``): joining a hold this process has costs no system call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_lock_file(path)
        self.users = 0

    async def enter(self, operation: int) -> None:
        if self.users == 0:
            await poll(self.path, lambda: try_flock(self.fd, operation))
        self.users += 1

    def leave(self) -> None:
        self.users -= 1
        if self.users == 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


def _close_all(files: dict[str, _Shared]) -> None:
    for held in files.values():
        os.close(held.fd)
    files.clear()


class NodeLocks:
    """The node-wide locks under ``<data_dir>/locks`` (see the module doc).

    The asynchronous locks are for one event loop. The node and claim locks keep their files
    open and are held once per process however many calls share them (a claim lock stands for a
    stripe of claims: calls of this process never wait for one another's claims; the caller
    serializes one claim's calls). A device lock has one holder per process: the caller
    serializes the calls for one device, as the preparer's asyncio locks do."""

    CLAIM_STRIPES: Final = 256

    def __init__(self, data_dir: Path, *, blocking_timeout_s: float = 60.0) -> None:
        self.directory = data_dir / LOCKS_DIR
        self._blocking_timeout_s = blocking_timeout_s
        self._open: dict[str, _Shared] = {}
        weakref.finalize(self, _close_all, self._open)

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.lock"

    def _file(self, name: str) -> _Shared:
        found = self._open.get(name)
        if found is None:
            found = self._open[name] = _Shared(self.path(name))
        return found

    def close(self) -> None:
        """Close the kept lock files (releasing what they hold)."""
        _close_all(self._open)

    @contextlib.asynccontextmanager
    async def operation(self) -> AsyncIterator[None]:
        """Held (shared) around one claim's prepare or unprepare. Each call passes the gate,
        so that a waiting recovery stops new calls, even while this process holds the node."""
        gate = self._file("gate")
        await poll(gate.path, lambda: try_flock(gate.fd, fcntl.LOCK_SH))
        node = self._file("node")
        try:
            await node.enter(fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate.fd, fcntl.LOCK_UN)
        try:
            yield
        finally:
            node.leave()

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
        """The lock of ``uid``'s stripe of claims (one of `CLAIM_STRIPES`)."""
        stripe = int.from_bytes(hashlib.sha256(uid.encode()).digest()[:4]) % self.CLAIM_STRIPES
        held = self._file(f"claim-{stripe:02x}")
        await held.enter(fcntl.LOCK_EX)
        try:
            yield
        finally:
            held.leave()

    @contextlib.asynccontextmanager
    async def devices(self, names: Sequence[str]) -> AsyncIterator[None]:
        """The locks of ``names`` (device names), taken in name order."""
        held: list[_Shared] = []
        try:
            for name in sorted(set(names)):
                device = self._file(f"device-{name}")
                await device.enter(fcntl.LOCK_EX)
                held.append(device)
            yield
        finally:
            for device in reversed(held):
                device.leave()

    @contextlib.contextmanager
    def blocking(self, name: str) -> Iterator[None]:
        """The lock ``name`` from a worker thread (`LockTimeoutError` after the timeout); the
        caller excludes its own threads."""
        held = acquire_blocking(self.path(name), timeout_s=self._blocking_timeout_s)
        try:
            yield
        finally:
            held.release()
