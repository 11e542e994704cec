"""Where the NVIDIA driver is installed, as the plugin sees it and as the host sees it.

`DriverRoot` maps a path inside the driver root (``/`` or a mount such as ``/driver-root``) to
where the plugin reads it and to the host path a CDI spec carries; symlinks are followed inside
the root, never on the plugin's own filesystem (`resolve_in_root`). The helpers here find files
in the root and make the mounts of what they find. See docs/real-nodes.md, "Host driver root
and the plugin's view of it".
"""

from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from gpu_dra.kubelet_plugin.cdi import Mount

HOST_ROOT: Final = PurePosixPath("/")
MAX_SYMLINKS: Final = 40


class DriverUserspaceError(OSError):
    """The driver's userspace cannot be found (no library of the driver version, no version,
    no ``nvidia-caps`` major); a prepare that needs it fails with this message and is retried."""


@dataclass(frozen=True)
class DriverRoot:
    """Where the NVIDIA driver is installed, as the plugin sees it and as the host sees it.

    `path` is read by the plugin (``/`` when it runs on the host or mounts the host's root
    there, ``/driver-root`` in NVIDIA's DaemonSet); `host_path` is what CDI specs carry (``/``
    for a host-installed driver, ``/run/nvidia/driver`` with the GPU Operator). `sysfs` and
    `proc` are the plugin's own (tests point them at temporary directories).
    """

    path: Path = Path("/")
    host_path: PurePosixPath = HOST_ROOT
    sysfs: Path = Path("/sys")
    proc: Path = Path("/proc")

    def __post_init__(self) -> None:
        if not self.host_path.is_absolute():
            raise ValueError(f"host driver root {self.host_path} must be an absolute path")

    def view(self, inside: PurePosixPath) -> Path:
        """Where the plugin finds the root's `inside` (an absolute path in the root)."""
        return self.path / inside.relative_to("/")

    def host(self, inside: PurePosixPath) -> str:
        """The host path of the root's `inside`."""
        return str(self.host_path / inside.relative_to("/"))

    def resolve(self, inside: PurePosixPath) -> PurePosixPath | None:
        """`inside` with every symlink followed inside the root (an absolute target means the
        root's path, as a process chrooted there sees it); None if it does not exist."""
        return resolve_in_root(self.path, inside)

    def dev_root(self) -> DriverRoot:
        """The root of ``/dev``: the driver root if ``<root>/dev/nvidiactl`` exists, else ``/``.

        NVIDIA's rule looks only for a ``<root>/dev`` directory; a driver bundle can carry an
        empty one (seen on a real node: docs/real-nodes.md, "On a real GPU"), and every device
        node would then be missing."""
        if os.path.lexists(self.path / "dev" / "nvidiactl"):
            return self
        return DriverRoot(Path("/"), HOST_ROOT, self.sysfs, self.proc)

    def proc_roots(self) -> tuple[Path, ...]:
        """The driver's procfs: ``<root>/proc`` first, then the plugin's."""
        return tuple(dict.fromkeys((self.path / "proc", self.proc)))


HOST_INSTALLED_DRIVER: Final = DriverRoot()
"""The driver installed on the host, the plugin running there: ``/`` seen as ``/``."""


def resolve_in_root(root: Path, inside: PurePosixPath) -> PurePosixPath | None:
    """`inside` (absolute) resolved component by component within `root`; None when missing,
    not absolute, or a symlink loop."""
    if not inside.is_absolute():
        return None
    pending = list(inside.parts[1:])
    resolved = HOST_ROOT
    links = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            resolved = resolved.parent
            continue
        candidate = resolved / part
        view = root / candidate.relative_to("/")
        try:
            mode = os.lstat(view).st_mode
        except OSError:
            return None
        if not stat.S_ISLNK(mode):
            resolved = candidate
            continue
        links += 1
        if links > MAX_SYMLINKS:
            return None
        target = PurePosixPath(os.readlink(view))
        if target.is_absolute():
            resolved = HOST_ROOT
            pending[:0] = target.parts[1:]
        else:
            pending[:0] = target.parts
    return resolved


def symlink_chain(root: DriverRoot, start: PurePosixPath) -> list[PurePosixPath]:
    """`start`, then each target its final component links to (inside the root)."""
    chain: list[PurePosixPath] = []
    current = start
    while current not in chain and len(chain) <= MAX_SYMLINKS:
        parent = root.resolve(current.parent)
        if parent is None:
            break
        current = parent / current.name
        view = root.view(current)
        try:
            mode = os.lstat(view).st_mode
        except OSError:
            break
        chain.append(current)
        if not stat.S_ISLNK(mode):
            break
        target = PurePosixPath(os.readlink(view))
        current = PurePosixPath(
            os.path.normpath(target if target.is_absolute() else current.parent / target)
        )
    return chain


def glob_in_root(root: DriverRoot, directory: PurePosixPath, pattern: str) -> list[PurePosixPath]:
    """Names in the root's `directory` (resolved inside the root) matching `pattern`, sorted,
    as paths under `directory` as given."""
    resolved = root.resolve(directory)
    if resolved is None:
        return []
    try:
        names = os.listdir(root.view(resolved))
    except OSError:
        return []
    return [directory / name for name in sorted(names) if fnmatch.fnmatchcase(name, pattern)]


def regular_file(root: DriverRoot, candidate: PurePosixPath) -> PurePosixPath | None:
    """`candidate` resolved inside the root if that is a file (not a directory)."""
    target = root.resolve(candidate)
    if target is None or root.view(target).is_dir():
        return None
    return target


def is_link(root: DriverRoot, inside: PurePosixPath) -> bool:
    return root.view(inside).is_symlink()


def mount_in_root(
    root: DriverRoot,
    inside: PurePosixPath,
    options: tuple[str, ...],
    resolved: PurePosixPath | None = None,
) -> Mount:
    """`inside` at its own path in the container, from the host path of its resolved target (a
    symlink inside a root mounted elsewhere must not be followed on the host)."""
    return Mount(
        host_path=root.host(resolved or inside),
        container_path=str(inside),
        options=options,
    )
