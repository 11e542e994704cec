"""Crash-safe replacement and removal of small files (checkpoint, CDI specs).

A reader sees either the old or the new content, never a mix: the data goes to a temporary
file in the same directory, is fsynced, renamed over the target, and the directory is
fsynced so that the rename itself survives a power loss. Temporary files start with ``.``
and end with ``.tmp``, which CDI spec scanners (``*.yaml``/``*.json``) ignore.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data``; on any failure the old file is left untouched."""
    directory = path.parent
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    fsync_directory(directory)


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
