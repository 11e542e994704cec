"""The workloads' ``/dev/shm`` of one daemon: the `ShmMounter` seam.

MPS clients exchange page-locked host memory through ``/dev/shm``; every workload of a daemon
gets the daemon's ``shm`` directory there. In production it is a tmpfs of its own
(`TmpfsShmMounter`, NVIDIA's options ``rw,nosuid,nodev,noexec,relatime,size=<MemTotal/2>``), so
it is bounded and vanishes on unmount. `PlainDirectoryShm` mounts nothing (tests, simulated
nodes); the directory then lives on the data dir's filesystem.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Final, Protocol

from gpu_dra.kubelet_plugin.mps.daemon_model import MpsError

FALLBACK_SIZE: Final = "65536k"
MOUNTINFO: Final = Path("/proc/self/mountinfo")


class ShmMounter(Protocol):
    def mount(self, path: Path) -> bool:
        """Make ``path`` (an existing directory) the shm; True if it is now a mount."""
        ...

    def unmount(self, path: Path) -> None:
        """Undo `mount`; nothing to do when ``path`` is not mounted."""
        ...


class PlainDirectoryShm:
    """No mount: the shm is a plain directory."""

    def mount(self, path: Path) -> bool:
        return False

    def unmount(self, path: Path) -> None:
        return None


def half_of_memory(meminfo: Path = Path("/proc/meminfo")) -> str:
    """``MemTotal / 2`` as a tmpfs size (``<N>k``); `FALLBACK_SIZE` when unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) // 2}k"
    except (OSError, ValueError, IndexError):
        pass
    return FALLBACK_SIZE


def is_mount_point(path: Path, mountinfo: Path = MOUNTINFO) -> bool:
    """Whether ``path`` is a mount point (``/proc/self/mountinfo`` field 5, octal-escaped).

    Symlinks in ``path`` are resolved first: mountinfo holds the mount point the kernel
    resolved (a data dir reached through a link, e.g. a linked ``/var/lib/kubelet``, is listed
    under its target)."""
    target = os.path.realpath(path)
    for char, escaped in (("\\", "\\134"), (" ", "\\040"), ("\t", "\\011"), ("\n", "\\012")):
        target = target.replace(char, escaped)
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return False
    return any(len(f := line.split()) > 4 and f[4] == target for line in lines)


class TmpfsShmMounter:
    """A tmpfs per daemon, with ``mount(8)``/``umount(8)``; needs CAP_SYS_ADMIN."""

    def __init__(self, size: str | None = None) -> None:
        self.size = size or half_of_memory()

    def mount(self, path: Path) -> bool:
        options = f"rw,nosuid,nodev,noexec,relatime,size={self.size}"
        self._run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], path)
        return True

    def unmount(self, path: Path) -> None:
        if is_mount_point(path):
            self._run(["umount", str(path)], path)

    @staticmethod
    def _run(argv: list[str], path: Path) -> None:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise MpsError(f"{argv[0]} of MPS shm {path} failed: {error}") from error
        if done.returncode != 0:
            raise MpsError(f"{' '.join(argv)} failed: {done.stderr.strip()[:300]}")
