"""The NVIDIA driver's userspace in CDI edits: what NVIDIA's ``nvidia-ctk cdi generate`` injects.

`discover_userspace` finds, in a `DriverRoot` and for the driver version NVML reports (passed
in), what every GPU container of the node gets: the driver's files (`nvidia_driver_files`), the
control device nodes, ``nvidia-cdi-hook`` createContainer hooks in NVIDIA's order with its arguments
(``create-symlinks``, ``enable-cuda-compat``, ``update-ldcache``,
``disable-device-node-modification``, ``update-application-profile``) and
``NVIDIA_CTK_LIBCUDA_DIR``, ``NVIDIA_VISIBLE_DEVICES=void``. Per device: `gpu_device_edits` and
`mig_capability_nodes`. `CommonEdits` keeps the node's common edits current as the driver
changes. See docs/real-nodes.md, "What a container gets".
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final

from gpu_dra.kubelet_plugin.cdi import ContainerEdits, DeviceNode, Hook, Mount
from gpu_dra.kubelet_plugin.nvidia_driver_files import (
    LD_CACHE,
    LIBRARY_MOUNT_OPTIONS,
    binaries,
    firmware,
    ipc,
    ldcache_folders,
    libraries,
    library_dirs,
    library_links,
)
from gpu_dra.kubelet_plugin.nvidia_driver_root import (
    HOST_ROOT,
    DriverRoot,
    DriverUserspaceError,
    mount_in_root,
)

log = logging.getLogger(__name__)

DEFAULT_CDI_HOOK_PATH: Final = "/usr/bin/nvidia-cdi-hook"
"""Where NVIDIA's toolkit packages install ``nvidia-cdi-hook`` on a host."""

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

LIBCUDA_DIR_ENV: Final = "NVIDIA_CTK_LIBCUDA_DIR"
VISIBLE_DEVICES_ENV: Final = "NVIDIA_VISIBLE_DEVICES"
VISIBLE_DEVICES_NONE: Final = "void"
"""CUDA images set ``NVIDIA_VISIBLE_DEVICES=all``; where the node's runtime is NVIDIA's
``nvidia-container-runtime`` (the GPU Operator's default), its legacy hook would give such a
container every GPU of the node. ``void`` makes it add none (NVIDIA's CDI specs set it too)."""


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
    dirs = library_dirs(root, version)
    found = libraries(root, version, dirs)
    hooks = _HookMaker(hook_path, disabled_hooks)
    made = [
        hooks.make(HOOK_CREATE_SYMLINKS, library_links(root, found)),
        hooks.make(HOOK_ENABLE_CUDA_COMPAT, [f"--host-driver-version={version}"]),
        hooks.make(HOOK_UPDATE_LDCACHE, ldcache_folders(found), needs_args=True),
        hooks.make(HOOK_DISABLE_DEVICE_NODE_MODIFICATION, []),
        hooks.make(HOOK_UPDATE_APPLICATION_PROFILE, []),
    ]
    return DriverUserspace(
        version=version,
        library_dirs=tuple(str(d) for d in dirs),
        libraries=tuple(mount_in_root(root, path, LIBRARY_MOUNT_OPTIONS) for path in found),
        binaries=binaries(root),
        firmware=firmware(root, version, kernel_release or os.uname().release),
        ipc=ipc(root),
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


# ---- hooks -------------------------------------------------------------------------------------


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
