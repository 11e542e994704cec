"""The NVIDIA driver's userspace in CDI edits: what NVIDIA's ``nvidia-ctk cdi generate`` injects.

From a driver root as the plugin sees it (`DriverRoot.path`: ``/`` or a mount such as
``/driver-root``) and the driver version (NVML's ``nvmlSystemGetDriverVersion``, passed in: this
module makes no NVML call), `discover_userspace` finds what every GPU container of the node gets,
following ``nvidia-container-toolkit`` v1.20.1 (``pkg/nvcdi``, ``internal/discover``):

* libraries: the directories holding ``lib*.so.<version>`` (the standard library directories of
  the root first, else the root's ``etc/ld.so.cache``, `ldcache`), then every ``*.so.<version>``
  in them and in their ``vdpau`` subdirectories, and the legacy ``libnvidia-nvvm70.so.*``;
  symlinks are resolved inside the root;
* binaries (``nvidia-smi``, ``nvidia-debugdump``, ``nvidia-persistenced``, the MPS control and
  server, ``nvidia-imex``, ``nvidia-imex-ctl``) from the root's usual ``bin`` directories;
* GSP firmware ``nvidia/<version>/gsp*.bin`` (and ``ucodes*.bin``) under the firmware search path;
* IPC sockets of ``nvidia-persistenced`` and the fabric manager (not ``/tmp/nvidia-mps``: MPS
  claims get their own daemon's pipe directory there);
* control device nodes (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``,
  ``/dev/nvidia-modeset``); missing ones are left out with a log line;
* ``nvidia-cdi-hook`` createContainer hooks, in NVIDIA's order and with its arguments:
  ``create-symlinks``, ``enable-cuda-compat``, ``update-ldcache``,
  ``disable-device-node-modification``, ``update-application-profile``; and the environment
  variables ``NVIDIA_CTK_LIBCUDA_DIR`` and ``NVIDIA_VISIBLE_DEVICES=void`` (NVIDIA's legacy
  runtime hook then adds no GPU of its own, whatever the image's ``NVIDIA_VISIBLE_DEVICES``).

Per device: `gpu_device_edits` (``/dev/nvidia<minor>``, the GPU's DRM ``card``/``renderD`` nodes
from sysfs, and the hook that makes their ``/dev/dri/by-path`` links) and
`mig_capability_nodes` (character devices with major/minor, which need not exist anywhere).

Spec paths: a host path is `DriverRoot.host_path` plus the path inside the root, a container path
the path inside the root. ``/dev`` comes from the driver root only if ``<root>/dev`` is a
directory, else from ``/``. `CommonEdits` keeps the node's common edits and recomputes them when
the driver changes. See docs/real-nodes.md, "What a container gets".
"""

from __future__ import annotations

import fnmatch
import logging
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final

from gpu_dra.kubelet_plugin.cdi import ContainerEdits, DeviceNode, Hook, Mount
from gpu_dra.kubelet_plugin.elf import ElfError, read_sonames
from gpu_dra.kubelet_plugin.ldcache import LdCacheError, read_ld_cache

log = logging.getLogger(__name__)

DEFAULT_CDI_HOOK_PATH: Final = "/usr/bin/nvidia-cdi-hook"
"""Where NVIDIA's toolkit packages install ``nvidia-cdi-hook`` on a host."""

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
BIN_DIRS: Final = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
FIRMWARE_PATTERNS: Final = ("gsp*.bin", "ucodes*.bin")
"""In ``nvidia/<version>/`` of each firmware directory."""
FIRMWARE_CLASS_PATH: Final = "module/firmware_class/parameters/path"
"""Under sysfs: a custom firmware directory the kernel searches first (empty when unset)."""
IPC_SOCKETS: Final = ("/nvidia-persistenced/socket", "/nvidia-fabricmanager/socket")
IPC_DIRS: Final = ("/run", "/var/run")
CONTROL_DEVICE_NODES: Final = (
    "/dev/nvidia-modeset",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-uvm",
    "/dev/nvidiactl",
)
MIG_CAPABILITY_NODE_DIR: Final = "/dev/nvidia-caps"
MIG_CAPABILITY_FILE_MODE: Final = 0o444
"""Mode of the GPU- and compute-instance access nodes the NVIDIA driver makes."""
CAPS_DRIVER_NAME: Final = "nvidia-caps"

LIBRARY_MOUNT_OPTIONS: Final = ("ro", "nosuid", "nodev", "rbind", "rprivate")
IPC_MOUNT_OPTIONS: Final = ("nosuid", "nodev", "rbind", "rprivate", "noexec")
DEVICE_PERMISSIONS: Final = "rw"
HOOK_ENV: Final = ("NVIDIA_CTK_DEBUG=false",)
CREATE_CONTAINER: Final = "createContainer"

HOOK_CREATE_SYMLINKS: Final = "create-symlinks"
HOOK_ENABLE_CUDA_COMPAT: Final = "enable-cuda-compat"
HOOK_UPDATE_LDCACHE: Final = "update-ldcache"
HOOK_DISABLE_DEVICE_NODE_MODIFICATION: Final = "disable-device-node-modification"
HOOK_UPDATE_APPLICATION_PROFILE: Final = "update-application-profile"
HOOK_NAMES: Final = (
    HOOK_CREATE_SYMLINKS,
    HOOK_ENABLE_CUDA_COMPAT,
    HOOK_UPDATE_LDCACHE,
    HOOK_DISABLE_DEVICE_NODE_MODIFICATION,
    HOOK_UPDATE_APPLICATION_PROFILE,
)
"""The hooks this module emits; `discover_userspace` can leave any of them out."""
ALL_HOOKS: Final = "all"

_MAX_SYMLINKS: Final = 40
LIBCUDA_DIR_ENV: Final = "NVIDIA_CTK_LIBCUDA_DIR"
VISIBLE_DEVICES_ENV: Final = "NVIDIA_VISIBLE_DEVICES"
VISIBLE_DEVICES_NONE: Final = "void"
"""CUDA images set ``NVIDIA_VISIBLE_DEVICES=all``; where the node's runtime is NVIDIA's
``nvidia-container-runtime`` (the GPU Operator's default), its legacy hook would give such a
container every GPU of the node. ``void`` makes it add none (NVIDIA's CDI specs set it too)."""
HOST_ROOT: Final = PurePosixPath("/")


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
        """The root of ``/dev``: the driver root if ``<root>/dev`` is a directory, else ``/``
        (NVIDIA's rule)."""
        if (self.path / "dev").is_dir():
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
        if links > _MAX_SYMLINKS:
            return None
        target = PurePosixPath(os.readlink(view))
        if target.is_absolute():
            resolved = HOST_ROOT
            pending[:0] = target.parts[1:]
        else:
            pending[:0] = target.parts
    return resolved


@dataclass(frozen=True)
class DriverUserspace:
    """What `discover_userspace` found; `edits()` is the spec's common ``containerEdits``."""

    version: str
    library_dirs: tuple[str, ...]
    """Directories holding the driver's libraries, as container paths."""
    libraries: tuple[Mount, ...]
    binaries: tuple[Mount, ...]
    firmware: tuple[Mount, ...]
    ipc: tuple[Mount, ...]
    control_nodes: tuple[DeviceNode, ...]
    hooks: tuple[Hook, ...]
    env: dict[str, str] = field(default_factory=dict)

    def edits(self) -> ContainerEdits:
        """Device nodes and mounts sorted as NVIDIA's spec sorts them (by depth, then path),
        hooks in the order they run."""
        mounts = (*self.libraries, *self.ipc, *self.firmware, *self.binaries)
        return ContainerEdits(
            env=dict(self.env),
            device_nodes=tuple(sorted(self.control_nodes, key=lambda n: _spec_order(n.path))),
            mounts=tuple(sorted(mounts, key=lambda m: _spec_order(m.container_path))),
            hooks=self.hooks,
        )


def discover_userspace(
    root: DriverRoot,
    version: str,
    *,
    hook_path: str = DEFAULT_CDI_HOOK_PATH,
    disabled_hooks: Collection[str] = (),
    kernel_release: str | None = None,
) -> DriverUserspace:
    """The common edits for driver `version` installed in `root`.

    `hook_path` is the host path of ``nvidia-cdi-hook`` (``nvidia-ctk`` works too: its hooks are
    ``nvidia-ctk hook <name>``); `disabled_hooks` names hooks to leave out (``all`` for every one).
    `kernel_release` (default: this kernel's) picks the firmware directories.
    Raises `DriverUserspaceError` when the root has no ``lib*.so.<version>``.
    """
    if not version or "*" in version or "/" in version:
        raise DriverUserspaceError(f"invalid driver version {version!r}")
    if not PurePosixPath(hook_path).is_absolute():
        raise ValueError(f"nvidia-cdi-hook path {hook_path!r} must be absolute")
    dirs = _library_dirs(root, version)
    libraries = _libraries(root, version, dirs)
    hooks = _HookMaker(hook_path, disabled_hooks)
    made = [
        hooks.make(HOOK_CREATE_SYMLINKS, _library_links(root, libraries)),
        hooks.make(HOOK_ENABLE_CUDA_COMPAT, [f"--host-driver-version={version}"]),
        hooks.make(HOOK_UPDATE_LDCACHE, _ldcache_folders(libraries), needs_args=True),
        hooks.make(HOOK_DISABLE_DEVICE_NODE_MODIFICATION, []),
        hooks.make(HOOK_UPDATE_APPLICATION_PROFILE, []),
    ]
    return DriverUserspace(
        version=version,
        library_dirs=tuple(str(d) for d in dirs),
        libraries=tuple(_mount(root, path, LIBRARY_MOUNT_OPTIONS) for path in libraries),
        binaries=_binaries(root),
        firmware=_firmware(root, version, kernel_release or os.uname().release),
        ipc=_ipc(root),
        control_nodes=tuple(_char_devices(root.dev_root(), CONTROL_DEVICE_NODES, "control")),
        hooks=tuple(hook for hook in made if hook is not None),
        env={
            LIBCUDA_DIR_ENV: ":".join(str(d) for d in dirs),
            VISIBLE_DEVICES_ENV: VISIBLE_DEVICES_NONE,
        },
    )


def gpu_device_edits(
    root: DriverRoot,
    minor: int,
    pci_bus_id: str,
    *,
    with_drm: bool = True,
    hook_path: str = DEFAULT_CDI_HOOK_PATH,
    disabled_hooks: Collection[str] = (),
) -> ContainerEdits:
    """The device nodes of one GPU: ``/dev/nvidia<minor>`` and (`with_drm`) its DRM nodes, those
    named in ``<sysfs>/bus/pci/devices/<pci_bus_id>/drm/``; nodes that do not exist under the
    ``/dev`` root are left out with a log line. With DRM nodes, a ``create-symlinks`` hook
    recreates the ``/dev/dri/by-path/pci-<bus id>-{card,render}`` links that point at them."""
    dev = root.dev_root()
    paths = [f"/dev/nvidia{minor}"]
    if with_drm:
        try:
            entries = sorted(os.listdir(root.sysfs / "bus/pci/devices" / pci_bus_id / "drm"))
        except OSError:
            entries = []
        paths.extend(f"/dev/dri/{name}" for name in entries)
    nodes = _char_devices(dev, paths, f"GPU {pci_bus_id}")
    links = _by_path_links(dev, pci_bus_id, {n.path for n in nodes}) if with_drm else []
    hook = _HookMaker(hook_path, disabled_hooks).make(HOOK_CREATE_SYMLINKS, links)
    return ContainerEdits(
        device_nodes=tuple(sorted(nodes, key=lambda n: _spec_order(n.path))),
        hooks=() if hook is None else (hook,),
    )


def mig_capability_nodes(root: DriverRoot, minors: Iterable[int]) -> tuple[DeviceNode, ...]:
    """``/dev/nvidia-caps/nvidia-cap<minor>`` as character devices (major of ``nvidia-caps``
    from the driver's ``/proc/devices``), so that they need not exist on the host or in the
    plugin's ``/dev``. Raises `DriverUserspaceError` when no ``nvidia-caps`` major is listed."""
    dev = root.dev_root()
    major = nvidia_caps_major(root.proc_roots())
    nodes = []
    for minor in minors:
        path = PurePosixPath(f"{MIG_CAPABILITY_NODE_DIR}/nvidia-cap{minor}")
        nodes.append(
            DeviceNode(
                path=str(path),
                host_path=None if dev.host_path == HOST_ROOT else dev.host(path),
                type="c",
                major=major,
                minor=minor,
                file_mode=MIG_CAPABILITY_FILE_MODE,
                permissions=DEVICE_PERMISSIONS,
            )
        )
    return tuple(nodes)


def nvidia_caps_major(proc_roots: Sequence[Path]) -> int:
    """The character major of ``nvidia-caps`` in the first ``<proc>/devices`` listing it."""
    looked = []
    for proc in proc_roots:
        devices = proc / "devices"
        looked.append(str(devices))
        try:
            text = devices.read_text()
        except OSError:
            continue
        major = _char_major(text, CAPS_DRIVER_NAME)
        if major is not None:
            return major
    raise DriverUserspaceError(
        f"no character device major for {CAPS_DRIVER_NAME} in {', '.join(looked)}: is the "
        "NVIDIA driver loaded with MIG support and its procfs visible to the plugin?"
    )


def _char_major(text: str, name: str) -> int | None:
    in_chars = False
    for line in text.splitlines():
        if line.strip().endswith(":"):
            in_chars = line.strip() == "Character devices:"
            continue
        parts = line.split()
        if in_chars and len(parts) == 2 and parts[1] == name and parts[0].isdigit():
            return int(parts[0])
    return None


# ---- libraries -----------------------------------------------------------------------------------


def _library_dirs(root: DriverRoot, version: str) -> list[PurePosixPath]:
    """Directories of ``lib*.so.<version>``: found in `LIBRARY_DIRS`, else in the ld cache."""
    pattern = f"lib*.so.{version}"
    found: dict[PurePosixPath, None] = {}
    for directory in LIBRARY_DIRS:
        for candidate in _glob(root, PurePosixPath(directory), pattern):
            target = _regular_file(root, candidate)
            if target is not None:
                found[target] = None
    if not found:
        for candidate in _ld_cache_libraries(root):
            if fnmatch.fnmatchcase(candidate.name, pattern):
                target = _regular_file(root, candidate)
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
        chains.update(dict.fromkeys(_symlink_chain(root, PurePosixPath(value))))
    return list(chains)


def _symlink_chain(root: DriverRoot, start: PurePosixPath) -> list[PurePosixPath]:
    """`start`, then each target its final component links to (inside the root)."""
    chain: list[PurePosixPath] = []
    current = start
    while current not in chain and len(chain) <= _MAX_SYMLINKS:
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


def _libraries(
    root: DriverRoot, version: str, dirs: Sequence[PurePosixPath]
) -> list[PurePosixPath]:
    """Every ``*.so.<version>`` in `dirs` and their ``vdpau``, then the legacy libraries; each
    resolved inside the root, once, in search order."""
    found: dict[PurePosixPath, None] = {}
    searches = [(d, f"*.so.{version}") for d in (*dirs, *(d / "vdpau" for d in dirs))]
    searches += [(d, pattern) for pattern in LEGACY_LIBRARIES for d in dirs]
    for directory, pattern in searches:
        for candidate in _glob(root, directory, pattern):
            target = _regular_file(root, candidate)
            if target is not None:
                found[target] = None
    return list(found)


def _library_links(root: DriverRoot, libraries: Sequence[PurePosixPath]) -> list[str]:
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
    if soname != name and _is_link(root, path.parent / soname):
        links.append(f"{name}::{path.parent / soname}")
    so_link = _so_link(soname)
    if so_link and so_link != soname and _is_link(root, path.parent / so_link):
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


def _ldcache_folders(libraries: Sequence[PurePosixPath]) -> list[str]:
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


def _binaries(root: DriverRoot) -> tuple[Mount, ...]:
    mounts = []
    for name in BINARIES:
        for directory in BIN_DIRS:
            candidate = PurePosixPath(directory) / name
            target = _regular_file(root, candidate)
            if target is not None and os.stat(root.view(target)).st_mode & 0o111:
                mounts.append(_mount(root, candidate, LIBRARY_MOUNT_OPTIONS, target))
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


def _firmware(root: DriverRoot, version: str, kernel_release: str) -> tuple[Mount, ...]:
    mounts: dict[PurePosixPath, Mount] = {}
    for pattern in FIRMWARE_PATTERNS:
        for directory in _firmware_dirs(root, kernel_release):
            for candidate in _glob(root, directory / "nvidia" / version, pattern):
                target = _regular_file(root, candidate)
                if target is not None and candidate not in mounts:
                    mounts[candidate] = _mount(root, candidate, LIBRARY_MOUNT_OPTIONS, target)
    if not mounts:
        log.info("no GSP firmware of driver %s under %s", version, root.path)
    return tuple(mounts.values())


def _ipc(root: DriverRoot) -> tuple[Mount, ...]:
    mounts = []
    for socket in IPC_SOCKETS:
        for directory in IPC_DIRS:
            candidate = PurePosixPath(directory + socket)
            target = root.resolve(candidate)
            if target is not None and not root.view(target).is_dir():
                mounts.append(_mount(root, candidate, IPC_MOUNT_OPTIONS, target))
                break
    return tuple(mounts)


# ---- device nodes --------------------------------------------------------------------------------


def _char_devices(dev: DriverRoot, paths: Iterable[str], what: str) -> list[DeviceNode]:
    """Nodes of `paths` that are character devices under `dev` (not followed through symlinks,
    as NVIDIA checks them); the others are logged and left out."""
    nodes = []
    for path in paths:
        inside = PurePosixPath(path)
        view = dev.view(inside)
        try:
            is_char = stat.S_ISCHR(os.lstat(view).st_mode)
        except OSError:
            is_char = False
        if not is_char:
            log.info("%s device node %s not found (as a character device): left out", what, view)
            continue
        nodes.append(
            DeviceNode(
                path=path,
                host_path=None if dev.host_path == HOST_ROOT else dev.host(inside),
                permissions=DEVICE_PERMISSIONS,
            )
        )
    return nodes


def _by_path_links(dev: DriverRoot, pci_bus_id: str, selected: Collection[str]) -> list[str]:
    links = []
    for kind in ("card", "render"):
        link = PurePosixPath(f"/dev/dri/by-path/pci-{pci_bus_id}-{kind}")
        try:
            target = os.readlink(dev.view(link))
        except OSError:
            continue
        node = os.path.normpath(target if target.startswith("/") else link.parent / target)
        if node in selected:
            links.append(f"{target}::{link}")
    return links


# ---- helpers -----------------------------------------------------------------------------------


class _HookMaker:
    """NVIDIA's hook shapes: ``<hook> [hook] <name> <args>``, ``createContainer``, debug off."""

    def __init__(self, hook_path: str, disabled: Collection[str]) -> None:
        self.path = hook_path
        base = PurePosixPath(hook_path).name
        self.fixed = (base, "hook") if base == "nvidia-ctk" else (base,)
        self.disabled = frozenset(disabled)

    def make(self, name: str, args: Sequence[str], *, needs_args: bool = False) -> Hook | None:
        if name in self.disabled or ALL_HOOKS in self.disabled:
            return None
        if not args and (needs_args or name == HOOK_CREATE_SYMLINKS):
            return None
        if name == HOOK_CREATE_SYMLINKS:
            args = [part for link in args for part in ("--link", link)]
        elif name == HOOK_UPDATE_LDCACHE:
            args = [part for folder in args for part in ("--folder", folder)]
        return Hook(
            hook_name=CREATE_CONTAINER,
            path=self.path,
            args=(*self.fixed, name, *args),
            env=HOOK_ENV,
        )


def hook_name(hook: Hook) -> str:
    """The ``nvidia-cdi-hook`` subcommand a hook runs (``create-symlinks``, ...)."""
    fixed = 2 if hook.args[:2] == ("nvidia-ctk", "hook") else 1
    return hook.args[fixed] if len(hook.args) > fixed else ""


def _glob(root: DriverRoot, directory: PurePosixPath, pattern: str) -> list[PurePosixPath]:
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


def _regular_file(root: DriverRoot, candidate: PurePosixPath) -> PurePosixPath | None:
    """`candidate` resolved inside the root if that is a file (not a directory)."""
    target = root.resolve(candidate)
    if target is None or root.view(target).is_dir():
        return None
    return target


def _is_link(root: DriverRoot, inside: PurePosixPath) -> bool:
    return root.view(inside).is_symlink()


def _mount(
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


def _spec_order(path: str) -> tuple[int, str]:
    normalized = os.path.normpath(path)
    return (normalized.count("/"), normalized)


# ---- the node's common edits, kept current -----------------------------------------------------


_StatKey = tuple[int, int, int, int] | None


def _stat_key(path: Path) -> _StatKey:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class CommonEdits:
    """The node's common edits, computed once and again when the driver changes.

    `current()` stats the root's ``etc/ld.so.cache`` and the library directories (a few
    microseconds) and recomputes only when one of them changed (an upgrade runs ``ldconfig``
    and replaces libraries); the driver version then comes from `version` (the composition root
    asks NVML). Thread-safe: prepares run in worker threads.
    """

    def __init__(
        self,
        root: DriverRoot,
        version: Callable[[], str],
        *,
        hook_path: str = DEFAULT_CDI_HOOK_PATH,
        disabled_hooks: Collection[str] = (),
        kernel_release: str | None = None,
    ) -> None:
        self.root = root
        self._version = version
        self._hook_path = hook_path
        self._disabled_hooks = frozenset(disabled_hooks)
        self._kernel_release = kernel_release
        self._lock = threading.Lock()
        self._fingerprint: tuple[_StatKey, ...] | None = None
        self._userspace: DriverUserspace | None = None
        self._edits: ContainerEdits | None = None

    @property
    def userspace(self) -> DriverUserspace | None:
        """What the last computation found; None before the first."""
        return self._userspace

    def current(self) -> ContainerEdits:
        """The common edits for the driver installed now; `DriverUserspaceError` if they cannot
        be found (the version cannot be read, or the root has no library of it)."""
        with self._lock:
            dirs = () if self._userspace is None else self._userspace.library_dirs
            fingerprint = self._fingerprint_of(dirs)
            if self._edits is not None and fingerprint == self._fingerprint:
                return self._edits
            try:
                version = self._version()
            except Exception as error:  # the version source's own error type (NVML's)
                raise DriverUserspaceError(f"cannot read the driver version: {error}") from error
            userspace = discover_userspace(
                self.root,
                version,
                hook_path=self._hook_path,
                disabled_hooks=self._disabled_hooks,
                kernel_release=self._kernel_release,
            )
            previous = self._userspace
            self._userspace = userspace
            self._edits = userspace.edits()
            self._fingerprint = self._fingerprint_of(userspace.library_dirs)
            log.info(
                "driver userspace %s: driver %s under %s (host %s): %d libraries in %s, "
                "%d binaries, %d firmware files, %d IPC sockets, %d control nodes, hooks %s",
                "found" if previous is None else "changed, recomputed",
                version,
                self.root.path,
                self.root.host_path,
                len(userspace.libraries),
                ":".join(userspace.library_dirs),
                len(userspace.binaries),
                len(userspace.firmware),
                len(userspace.ipc),
                len(userspace.control_nodes),
                ",".join(hook_name(h) for h in userspace.hooks) or "-",
            )
            return self._edits

    def _fingerprint_of(self, dirs: Sequence[str]) -> tuple[_StatKey, ...]:
        paths = [self.root.view(LD_CACHE)]
        paths += [self.root.view(PurePosixPath(d)) for d in dirs]
        return tuple(_stat_key(p) for p in paths)
