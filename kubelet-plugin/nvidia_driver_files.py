"""The NVIDIA driver's files in its root: libraries, binaries, GSP firmware and IPC sockets.

Following ``nvidia-container-toolkit`` v1.20.1 (``internal/discover``): the directories holding
``lib*.so.<version>`` (the standard library directories of the root first, else its
``etc/ld.so.cache``), every ``*.so.<version>`` in them and their ``vdpau`` subdirectories and the
legacy ``libnvidia-nvvm70.so.*``, with the links NVIDIA's ``create-symlinks`` hook makes; the
driver's binaries from the usual ``bin`` directories; ``nvidia/<version>/gsp*.bin`` under the
firmware search path; the persistenced and fabric manager sockets. See docs/real-nodes.md,
"What a container gets".
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Final

from gpu_dra.kubelet_plugin.cdi import Mount
from gpu_dra.kubelet_plugin.elf import ElfError, is_elf, read_sonames
from gpu_dra.kubelet_plugin.ldcache import LdCacheError, read_ld_cache
from gpu_dra.kubelet_plugin.nvidia_driver_root import (
    DriverRoot,
    DriverUserspaceError,
    glob_in_root,
    is_link,
    mount_in_root,
    regular_file,
    symlink_chain,
)

log = logging.getLogger(__name__)

LD_CACHE: Final = PurePosixPath("/etc/ld.so.cache")
LIBRARY_DIRS: Final = (
    "/",
    "/usr/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu/nvidia/current",
    "/usr/lib/aarch64-linux-gnu/nvidia/current",
    "/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu/nvidia/current",
    "/lib/aarch64-linux-gnu/nvidia/current",
)
"""Searched in the root for ``lib*.so.<version>`` before the ld cache (NVIDIA's order)."""
LEGACY_LIBRARIES: Final = ("libnvidia-nvvm70.so.*",)
BINARIES: Final = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-imex",
    "nvidia-imex-ctl",
)
BIN_DIRS: Final = (
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
    "/usr/local/nvidia/bin",
)
"""Searched in order for each of `BINARIES`; the first ELF executable wins. The last is where
CUDA images and GPU sandboxes keep a driver bundle (``/usr/local/nvidia/{bin,lib64}``)."""
FIRMWARE_PATTERNS: Final = ("gsp*.bin", "ucodes*.bin")
"""In ``nvidia/<version>/`` of each firmware directory."""
FIRMWARE_CLASS_PATH: Final = "module/firmware_class/parameters/path"
"""Under sysfs: a custom firmware directory the kernel searches first (empty when unset)."""
IPC_SOCKETS: Final = ("/nvidia-persistenced/socket", "/nvidia-fabricmanager/socket")
IPC_DIRS: Final = ("/run", "/var/run")
LIBRARY_MOUNT_OPTIONS: Final = ("ro", "nosuid", "nodev", "rbind", "rprivate")
IPC_MOUNT_OPTIONS: Final = ("nosuid", "nodev", "rbind", "rprivate", "noexec")

# ---- libraries ---------------------------------------------------------------------------------


def library_dirs(root: DriverRoot, version: str) -> list[PurePosixPath]:
    """Directories of ``lib*.so.<version>``: found in `LIBRARY_DIRS`, else in the ld cache."""
    pattern = f"lib*.so.{version}"
    found: dict[PurePosixPath, None] = {}
    for directory in LIBRARY_DIRS:
        for candidate in glob_in_root(root, PurePosixPath(directory), pattern):
            target = regular_file(root, candidate)
            if target is not None:
                found[target] = None
    if not found:
        for candidate in _ld_cache_libraries(root):
            if fnmatch.fnmatchcase(candidate.name, pattern):
                target = regular_file(root, candidate)
                if target is not None:
                    found[target] = None
    dirs = list(dict.fromkeys(path.parent for path in found))
    if not dirs:
        raise DriverUserspaceError(
            f"no library of NVIDIA driver {version} ({pattern}) under driver root {root.path}: "
            f"searched {', '.join(LIBRARY_DIRS)} and the libraries of {root.view(LD_CACHE)}; "
            "does the driver root setting point at the installed driver?"
        )
    return dirs


def _ld_cache_libraries(root: DriverRoot) -> list[PurePosixPath]:
    """The 64-bit libraries of the root's ld cache and every link of their symlink chains."""
    path = root.view(LD_CACHE)
    try:
        cache = read_ld_cache(path)
    except FileNotFoundError:
        log.info("no ld cache at %s", path)
        return []
    except (OSError, LdCacheError) as error:
        log.warning("cannot read the driver root's ld cache: %s", error)
        return []
    chains: dict[PurePosixPath, None] = {}
    for value in cache.libraries64():
        chains.update(dict.fromkeys(symlink_chain(root, PurePosixPath(value))))
    return list(chains)


def libraries(root: DriverRoot, version: str, dirs: Sequence[PurePosixPath]) -> list[PurePosixPath]:
    """Every ``*.so.<version>`` in `dirs` and their ``vdpau``, then the legacy libraries; each
    resolved inside the root, once, in search order."""
    found: dict[PurePosixPath, None] = {}
    searches = [(d, f"*.so.{version}") for d in (*dirs, *(d / "vdpau" for d in dirs))]
    searches += [(d, pattern) for pattern in LEGACY_LIBRARIES for d in dirs]
    for directory, pattern in searches:
        for candidate in glob_in_root(root, directory, pattern):
            target = regular_file(root, candidate)
            if target is not None:
                found[target] = None
    return list(found)


def library_links(root: DriverRoot, libraries: Sequence[PurePosixPath]) -> list[str]:
    """The ``<target>::<link>`` arguments of NVIDIA's ``create-symlinks`` hook for libraries."""
    links: dict[str, None] = {}
    for path in libraries:
        links.update(dict.fromkeys(_well_known_links(path)))
        links.update(dict.fromkeys(_soname_links(root, path)))
    return list(links)


def _well_known_links(path: PurePosixPath) -> list[str]:
    """Links applications expect that the driver's packages do not always make."""
    name = path.name
    if fnmatch.fnmatchcase(name, "libcuda.so.*.*"):
        return [f"libcuda.so.1::{path.parent / 'libcuda.so'}"]
    if fnmatch.fnmatchcase(name, "libGLX_nvidia.so.*.*"):
        return [f"{name}::{path.parent / 'libGLX_indirect.so.0'}"]
    if fnmatch.fnmatchcase(name, "libnvidia-opticalflow.so.*.*"):
        return [f"libnvidia-opticalflow.so.1::{path.parent / 'libnvidia-opticalflow.so'}"]
    return []


def _soname_links(root: DriverRoot, path: PurePosixPath) -> list[str]:
    """``soname -> file`` and ``.so -> soname``, each only if the root has that link too."""
    name = path.name
    if not fnmatch.fnmatchcase(name, "*.*.*"):
        return []
    try:
        sonames = read_sonames(root.view(path))
    except (OSError, ElfError) as error:
        log.warning("no soname links for %s: %s", path, error)
        return []
    if len(sonames) > 1:
        log.warning("no soname links for %s: several sonames %s", path, list(sonames))
        return []
    soname = sonames[0] if sonames else name
    links = []
    if soname != name and is_link(root, path.parent / soname):
        links.append(f"{name}::{path.parent / soname}")
    so_link = _so_link(soname)
    if so_link and so_link != soname and is_link(root, path.parent / so_link):
        links.append(f"{soname}::{path.parent / so_link}")
    return links


def _so_link(name: str) -> str:
    """``libfoo.so.1.2`` -> ``libfoo.so``; empty if the name has no ``.so`` suffix part."""
    while True:
        stem, dot, extension = name.rpartition(".")
        if not dot or not stem:
            return ""
        if extension == "so":
            return name
        name = stem


def ldcache_folders(libraries: Sequence[PurePosixPath]) -> list[str]:
    """Directories of the libraries (names ``lib?*.so[.*]``), once each, in order."""
    folders: dict[str, None] = {}
    for path in libraries:
        if _is_library_name(path.name):
            folders[str(path.parent)] = None
    return list(folders)


def _is_library_name(name: str) -> bool:
    if not fnmatch.fnmatchcase(name, "lib?*.so*"):
        return False
    tail = name.rsplit(".so", maxsplit=1)[-1]
    return tail == "" or tail.startswith(".")


# ---- binaries, firmware, IPC -----------------------------------------------------------------


def binaries(root: DriverRoot) -> tuple[Mount, ...]:
    mounts = []
    for name in BINARIES:
        for directory in BIN_DIRS:
            candidate = PurePosixPath(directory) / name
            target = regular_file(root, candidate)
            if target is None or not os.stat(root.view(target)).st_mode & 0o111:
                continue
            if not is_elf(root.view(target)):
                # e.g. a wrapper script that execs the real program from a path no container has
                log.info("driver binary %s is not an ELF program: skipped", root.view(target))
                continue
            mounts.append(mount_in_root(root, candidate, LIBRARY_MOUNT_OPTIONS, target))
            break
        else:
            log.info("driver binary %s not found in %s of %s", name, ", ".join(BIN_DIRS), root.path)
    return tuple(mounts)


def _firmware_dirs(root: DriverRoot, kernel_release: str) -> list[PurePosixPath]:
    dirs = []
    try:
        custom = (root.sysfs / FIRMWARE_CLASS_PATH).read_text().strip()
    except OSError:
        custom = ""
    if custom.startswith("/"):
        dirs.append(PurePosixPath(custom))
    dirs += [
        PurePosixPath("/lib/firmware/updates") / kernel_release,
        PurePosixPath("/lib/firmware/updates"),
        PurePosixPath("/lib/firmware") / kernel_release,
        PurePosixPath("/lib/firmware"),
    ]
    return list(dict.fromkeys(dirs))


def firmware(root: DriverRoot, version: str, kernel_release: str) -> tuple[Mount, ...]:
    mounts: dict[PurePosixPath, Mount] = {}
    for pattern in FIRMWARE_PATTERNS:
        for directory in _firmware_dirs(root, kernel_release):
            for candidate in glob_in_root(root, directory / "nvidia" / version, pattern):
                target = regular_file(root, candidate)
                if target is not None and candidate not in mounts:
                    mounts[candidate] = mount_in_root(
                        root, candidate, LIBRARY_MOUNT_OPTIONS, target
                    )
    if not mounts:
        log.info("no GSP firmware of driver %s under %s", version, root.path)
    return tuple(mounts.values())


def ipc(root: DriverRoot) -> tuple[Mount, ...]:
    mounts = []
    for socket in IPC_SOCKETS:
        for directory in IPC_DIRS:
            candidate = PurePosixPath(directory + socket)
            target = root.resolve(candidate)
            if target is not None and not root.view(target).is_dir():
                mounts.append(mount_in_root(root, candidate, IPC_MOUNT_OPTIONS, target))
                break
    return tuple(mounts)
