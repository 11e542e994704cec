"""Crash-safe replacement and removal of small files (checkpoint, CDI specs).

A reader sees either the old or the new content, never a mix: the data goes to a temporary
file in the same directory and is renamed over the target. A durable write (the default) also
fsyncs the file before the rename and the directory after it, so that the new content survives
a power loss. ``durable=False`` leaves that to the kernel's writeback, for files whose content
is discarded after a reboot anyway (the checkpoint: docs/architecture.md, "Durable for the
boot"); it swaps the files (``renameat2`` with ``RENAME_EXCHANGE``) and removes the old one,
because ext4 starts writing back a file renamed over another at the rename, which the write
would then wait for, and falls back to the rename where the swap is not available. Temporary
files are named ``.<target>.<random>.tmp``, which CDI spec scanners (``*.yaml``/``*.json``)
ignore; a writer that dies before its rename, or after a swap before the removal, leaves one,
which `remove_temporaries` removes at start-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

from gpu_dra.kubelet_plugin import crash_points

log = logging.getLogger(__name__)

TEMPORARY_SUFFIX: Final = ".tmp"
_AT_FDCWD: Final = -100  # <fcntl.h>
_RENAME_EXCHANGE: Final = 2  # <linux/fs.h>
_NO_EXCHANGE: Final = frozenset({errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
"""What ``renameat2`` answers when it cannot swap (no target yet, a file system or kernel
without ``RENAME_EXCHANGE``): rename instead."""


def _load_renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it (glibc before 2.28)
        return None
    function.argtypes = (
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    )
    function.restype = ctypes.c_int
    renameat2: Callable[[int, bytes, int, bytes, int], int] = function
    return renameat2


_renameat2 = _load_renameat2()


def exchange(first: str | Path, second: str | Path) -> bool:
    """Swap the two files atomically; False, and nothing changed, when this kernel, C library
    or file system cannot, or when ``second`` does not exist."""
    if _renameat2 is None:
        return False
    first_name, second_name = os.fsencode(first), os.fsencode(second)
    if _renameat2(_AT_FDCWD, first_name, _AT_FDCWD, second_name, _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in _NO_EXCHANGE:
        return False
    raise OSError(error, os.strerror(error), os.fsdecode(second))


def write_atomically(
    path: Path,
    data: bytes,
    *,
    mode: int = 0o600,
    crash_point: str | None = None,
    durable: bool = True,
) -> None:
    """Replace ``path`` with ``data``; on any failure the old file is left untouched.
    ``crash_point``: the `crash_points` name reached between the temporary file and the
    rename (tests). ``durable``: fsync the file and its directory (see the module docstring)."""
    directory = path.parent
    fd, temporary = tempfile.mkstemp(
        dir=directory, prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX
    )
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        if crash_point is not None:
            crash_points.reached(crash_point)
        swapped = not durable and exchange(temporary, path)
        if not swapped:
            os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    if swapped:
        _remove_old_content(temporary)
    if durable:
        fsync_directory(directory)


def _remove_old_content(temporary: str) -> None:
    """Remove what a swap left under the temporary name: the target's old content. The write
    is done whatever happens here; a file left is removed at the next start."""
    try:
        os.unlink(temporary)
    except OSError as error:
        log.warning("old content of a replaced file left path=%s: %s", temporary, error)


def remove_durably(path: Path) -> bool:
    """Remove ``path`` and persist the removal; ``False`` if it did not exist."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_directory(path.parent)
    return True


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_target(name: str) -> str | None:
    """The file name whose `write_atomically` made the temporary file ``name``; None when
    ``name`` is not such a temporary file."""
    if not (name.startswith(".") and name.endswith(TEMPORARY_SUFFIX)):
        return None
    target, dot, random = name[1 : -len(TEMPORARY_SUFFIX)].rpartition(".")
    return target if dot and target and random else None


def remove_temporaries(
    directory: Path, accept: Callable[[str], bool] = lambda _: True
) -> list[str]:
    """Remove the temporary files that writers which died before their rename left in
    ``directory`` (not below it), those whose target name ``accept`` takes; returns their names.
    A write under way there fails at its rename: call it at start-up, before this process
    writes into ``directory``."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    removed = []
    for entry in entries:
        target = temporary_target(entry.name)
        if target is None or not accept(target) or not entry.is_file(follow_symlinks=False):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(entry.name)
            log.info("removed temporary file of an interrupted write path=%s", entry.path)
    if removed:
        fsync_directory(directory)
    return sorted(removed)
