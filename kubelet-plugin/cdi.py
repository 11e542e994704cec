"""Per-claim CDI specs: a pure builder and an atomic writer for ``<cdi_root>``.

One transient spec file per prepared claim, ``<cdi_root>/k8s.gpu.nvidia.com-claim_<uid>.yaml``
with kind ``k8s.gpu.nvidia.com/claim`` and one CDI device ``<claim uid>-<device name>`` per
prepared device; the kubelet passes ``k8s.gpu.nvidia.com/claim=<claim uid>-<device name>``
to the container runtime, which applies the device's ``containerEdits`` (and the spec-level
ones). Names, the vendor and the kind come from :mod:`gpu_dra.driver.naming` (NVIDIA's
formats, derived from the driver name), so they are defined in one place.

Claim UIDs (canonical RFC 4122 UUIDs) and device names (DNS labels) are validated with full
matches (:class:`~gpu_dra.driver.naming.InvalidNameError`, a ``ValueError``) before any path
or name is built from them: a claim UID such as ``../../etc`` never reaches the filesystem.
"""

from __future__ import annotations

import functools
import logging
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final

import yaml

from gpu_dra.driver.naming import (
    DEFAULT_DRIVER_NAME,
    InvalidNameError,
    cdi_device_name,
    cdi_kind,
    cdi_spec_file_name,
    parse_cdi_spec_file_name,
    qualified_cdi_device,
    validate_claim_uid,
)
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.atomic_file import (
    remove_durably,
    remove_temporaries,
    write_atomically,
)

log = logging.getLogger(__name__)

CDI_VERSION: Final = "0.5.0"
"""Lowest CDI spec version with the features used: device names may start with a digit (our
names start with the claim UID) and ``deviceNodes[].hostPath`` (both 0.5.0); mount ``type``
needs 0.4.0; device node ``type``, ``major``, ``minor`` and ``fileMode`` are in every version
(0.3.0, the earliest the CDI library accepts). Understood by containerd 1.7+ / 2.x and CRI-O."""

DEVICE_NODE_TYPES: Final = frozenset({"c", "b", "u", "p"})

# libyaml's emitter (about 6x faster than PyYAML's pure-Python one, same output for these specs);
# PyYAML built without libyaml falls back to the pure-Python SafeDumper.
_SPEC_DUMPER: Final[type[yaml.SafeDumper]] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


# `_dump_spec` writes a spec itself when every key and string is a plain scalar to the emitter:
# these characters (single spaces inside values only), no leading indicator, no ': ' and no ':' at
# the end, read back as a string (`_plain`), on a line the emitter does not fold (`_LINE_WIDTH`).
# Anything else goes through PyYAML.
_PLAIN_TEXT: Final = re.compile(r"[A-Za-z0-9_./=+-](?:[A-Za-z0-9_./=+:, -]*[A-Za-z0-9_./=+,-])?")
_STR_TAG: Final = "tag:yaml.org,2002:str"
_RESOLVER: Final = yaml.resolver.Resolver()
_SIMPLE_KEY_MAX: Final = 128
"""Longest key the emitter writes as a simple key (``key: value``)."""
_LINE_WIDTH: Final = 80
"""The emitter's width: it may fold a plain scalar at a space past this column."""

_DNS_LABEL: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

SPEC_FILE_MODE: Final = 0o644
CDI_ROOT_MODE: Final = 0o755

__all__ = [
    "CDI_VERSION",
    "CdiDevice",
    "ClaimSpecStore",
    "ContainerEdits",
    "DeviceNode",
    "Hook",
    "InvalidNameError",
    "Mount",
    "build_claim_spec",
    "checked_claim_uid",
    "checked_device_name",
    "qualified_device_id",
]


@dataclass(frozen=True)
class DeviceNode:
    """A device node to create in the container (``path``), from ``host_path`` if it differs.

    Without `type` and `major` the runtime reads them from the host path, which must then
    exist; with them (``c``/``b``/``u`` and a major) the node is made from these numbers alone.
    """

    path: str
    host_path: str | None = None
    permissions: str | None = None
    """cgroup access, a combination of ``r``, ``w`` and ``m``; runtime default if unset."""
    type: str | None = None
    """``c`` (character), ``b`` (block), ``u`` (unbuffered character) or ``p`` (FIFO)."""
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None
    """Permission bits of the node in the container (e.g. ``0o444``)."""


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    options: tuple[str, ...] = ()
    type: str | None = None


@dataclass(frozen=True)
class Hook:
    """An OCI hook, e.g. ``createContainer`` running ``nvidia-cdi-hook``."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout_s: int | None = None


@dataclass(frozen=True)
class ContainerEdits:
    """Changes the runtime applies to the container. ``env`` keeps its insertion order."""

    env: Mapping[str, str] = field(default_factory=dict)
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()

    def is_empty(self) -> bool:
        return not (self.env or self.device_nodes or self.mounts or self.hooks)


@dataclass(frozen=True)
class CdiDevice:
    """The edits for one prepared device of a claim; ``device_name`` is the DRA device name."""

    device_name: str
    edits: ContainerEdits


def checked_claim_uid(claim_uid: str) -> str:
    """``claim_uid`` if it is a canonical (lower-case) RFC 4122 UUID string."""
    try:
        canonical = str(uuid.UUID(claim_uid))
    except ValueError:
        canonical = None
    if canonical != claim_uid:
        raise InvalidNameError(f"claim UID {claim_uid!r} is not a lower-case RFC 4122 UUID")
    return validate_claim_uid(claim_uid)


def checked_device_name(device_name: str) -> str:
    """``device_name`` if it is a DNS label (the whole string, no trailing newline)."""
    if not _DNS_LABEL.fullmatch(device_name):
        raise InvalidNameError(f"device name {device_name!r} is not a DNS label")
    return device_name


def qualified_device_id(
    claim_uid: str, device_name: str, driver_name: str = DEFAULT_DRIVER_NAME
) -> str:
    """``k8s.gpu.nvidia.com/claim=<claim uid>-<device name>``: the ID returned to the kubelet."""
    return qualified_cdi_device(
        checked_claim_uid(claim_uid), checked_device_name(device_name), driver_name
    )


def build_claim_spec(
    claim_uid: str,
    devices: Sequence[CdiDevice],
    *,
    common_edits: ContainerEdits | None = None,
    driver_name: str = DEFAULT_DRIVER_NAME,
) -> dict[str, Any]:
    """The CDI spec of one claim as a JSON/YAML-ready dict; validates every name and path."""
    checked_claim_uid(claim_uid)
    if not devices:
        raise ValueError(f"claim {claim_uid}: a CDI spec needs at least one device")
    names = [cdi_device_name(claim_uid, checked_device_name(d.device_name)) for d in devices]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"claim {claim_uid}: duplicate CDI devices {duplicates}")
    spec: dict[str, Any] = {"cdiVersion": CDI_VERSION, "kind": cdi_kind(driver_name)}
    spec_devices: list[dict[str, Any]] = []
    for name, device in zip(names, devices, strict=True):
        if device.edits.is_empty():
            # The CDI library rejects devices without edits ("empty device edits").
            raise ValueError(f"CDI device {name} has no container edits")
        spec_devices.append({"name": name, "containerEdits": _edits(device.edits, name)})
    spec["devices"] = spec_devices
    if common_edits is not None and not common_edits.is_empty():
        spec["containerEdits"] = _edits(common_edits, "common edits")
    return spec


def _edits(edits: ContainerEdits, where: str) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if edits.env:
        result["env"] = [_env_entry(k, v, where) for k, v in edits.env.items()]
    if edits.device_nodes:
        result["deviceNodes"] = [_device_node(n, where) for n in edits.device_nodes]
    if edits.mounts:
        result["mounts"] = [_mount(m, where) for m in edits.mounts]
    if edits.hooks:
        result["hooks"] = [_hook(h, where) for h in edits.hooks]
    return result


def _env_entry(key: str, value: str, where: str) -> str:
    if not key or "=" in key or "\0" in key or "\0" in value:
        raise ValueError(f"{where}: invalid environment variable name {key!r}")
    return f"{key}={value}"


def _absolute(path: str, what: str, where: str) -> str:
    if not PurePosixPath(path).is_absolute() or "\0" in path:
        raise ValueError(f"{where}: {what} {path!r} must be an absolute path")
    return path


def _device_node(node: DeviceNode, where: str) -> dict[str, Any]:
    result: dict[str, Any] = {"path": _absolute(node.path, "device node path", where)}
    if node.host_path is not None:
        result["hostPath"] = _absolute(node.host_path, "device node host path", where)
    if node.type is not None:
        if node.type not in DEVICE_NODE_TYPES:
            raise ValueError(f"{where}: device node type {node.type!r} is not one of c, b, u, p")
        result["type"] = node.type
    for key, number in (("major", node.major), ("minor", node.minor)):
        if number is not None:
            if isinstance(number, bool) or not 0 <= number < 2**32:
                raise ValueError(f"{where}: device node {key} {number!r} is not a device number")
            result[key] = number
    if (node.major is not None or node.minor is not None) and node.type in (None, "p"):
        raise ValueError(f"{where}: device node {node.path}: major/minor need type c, b or u")
    if node.file_mode is not None:
        if isinstance(node.file_mode, bool) or not 0 <= node.file_mode <= 0o7777:
            raise ValueError(f"{where}: device node file mode {node.file_mode!r} not in 0..0o7777")
        result["fileMode"] = node.file_mode
    if node.permissions is not None:
        if not node.permissions or set(node.permissions) - set("rwm"):
            raise ValueError(f"{where}: device node permissions {node.permissions!r} not in rwm")
        result["permissions"] = node.permissions
    return result


def _mount(mount: Mount, where: str) -> dict[str, Any]:
    result: dict[str, Any] = {
        "hostPath": _absolute(mount.host_path, "mount host path", where),
        "containerPath": _absolute(mount.container_path, "mount container path", where),
    }
    if mount.options:
        result["options"] = list(mount.options)
    if mount.type is not None:
        result["type"] = mount.type
    return result


def _hook(hook: Hook, where: str) -> dict[str, Any]:
    result: dict[str, Any] = {
        "hookName": hook.hook_name,
        "path": _absolute(hook.path, "hook path", where),
    }
    if hook.args:
        result["args"] = list(hook.args)
    if hook.env:
        result["env"] = list(hook.env)
    if hook.timeout_s is not None:
        if hook.timeout_s <= 0:
            raise ValueError(f"{where}: hook timeout must be positive, got {hook.timeout_s}")
        result["timeout"] = hook.timeout_s
    return result


class ClaimSpecStore:
    """Writes, removes and lists this driver's per-claim spec files in ``cdi_root``.

    Methods do blocking file I/O (fsync); call them through ``asyncio.to_thread`` from
    async code.
    """

    def __init__(self, cdi_root: Path, *, driver_name: str = DEFAULT_DRIVER_NAME) -> None:
        self.cdi_root = cdi_root
        self.driver_name = driver_name
        cdi_kind(driver_name)  # validates the driver name once, up front

    def path_for(self, claim_uid: str) -> Path:
        """``<cdi_root>/k8s.gpu.nvidia.com-claim_<uid>.yaml``; rejects a non-UUID UID."""
        return self.cdi_root / cdi_spec_file_name(checked_claim_uid(claim_uid), self.driver_name)

    def write(
        self,
        claim_uid: str,
        devices: Sequence[CdiDevice],
        *,
        common_edits: ContainerEdits | None = None,
    ) -> Path:
        """Atomically create or replace the claim's spec file; returns its path."""
        spec = build_claim_spec(
            claim_uid, devices, common_edits=common_edits, driver_name=self.driver_name
        )
        path = self.path_for(claim_uid)
        data = _dump_spec(spec)
        self.cdi_root.mkdir(mode=CDI_ROOT_MODE, parents=True, exist_ok=True)
        write_atomically(
            path, data.encode(), mode=SPEC_FILE_MODE, crash_point=crash_points.CDI_BEFORE_RENAME
        )
        log.debug("cdi spec written claim_uid=%s path=%s devices=%d", claim_uid, path, len(devices))
        return path

    def make_mounts_read_only(self, claim_uid: str, host_paths: Collection[str]) -> list[str]:
        """Mount the ``host_paths`` read-only in the claim's spec: each mount of them (per device
        or common) with option ``rw`` gets ``ro`` instead, and the spec is rewritten atomically
        when one changed. The container paths changed, by device (``<device>: <path>``); none
        when there is no spec or nothing to change. Containers created from then on get the
        new mounts; running ones keep theirs."""
        path = self.path_for(claim_uid)
        try:
            spec = _load_spec(path.read_text())
        except FileNotFoundError:
            return []
        changed: list[str] = []
        for where, mount in _spec_mounts(spec):
            if mount.get("hostPath") not in host_paths:
                continue
            options = mount.get("options")
            if isinstance(options, list) and "rw" in options:
                mount["options"] = ["ro" if o == "rw" else o for o in options]
                changed.append(f"{where}: {mount.get('containerPath')}")
        if changed:
            data = _dump_spec(spec)
            write_atomically(path, data.encode(), mode=SPEC_FILE_MODE)
            log.info("cdi spec mounts made read-only claim_uid=%s %s", claim_uid, changed)
        return changed

    def mounted_host_paths(self, claim_uid: str) -> list[str]:
        """The host paths the claim's spec mounts (per device or common), in spec order; none
        when there is no spec."""
        try:
            spec = _load_spec(self.path_for(claim_uid).read_text())
        except FileNotFoundError:
            return []
        return [
            host_path
            for _, mount in _spec_mounts(spec)
            if isinstance(host_path := mount.get("hostPath"), str)
        ]

    def remove(self, claim_uid: str) -> bool:
        """Delete the claim's spec file; ``False`` if there was none (idempotent)."""
        path = self.path_for(claim_uid)
        removed = remove_durably(path)
        if removed:
            log.debug("cdi spec removed claim_uid=%s path=%s", claim_uid, path)
        return removed

    def remove_temporaries(self) -> list[str]:
        """Remove the temporary files of spec writes that died before their rename (only this
        driver's spec names); returns their names. At start-up, before any write."""
        return remove_temporaries(self.cdi_root, self._is_spec_name)

    def _is_spec_name(self, name: str) -> bool:
        try:
            parse_cdi_spec_file_name(name, self.driver_name)
        except InvalidNameError:
            return False
        return True

    def claim_uids(self) -> list[str]:
        """UIDs of the claims that have a spec file of this driver (for orphan cleanup)."""
        try:
            names = [p.name for p in self.cdi_root.iterdir() if p.is_file()]
        except FileNotFoundError:
            return []
        uids: list[str] = []
        for name in names:
            try:
                uids.append(checked_claim_uid(parse_cdi_spec_file_name(name, self.driver_name)))
            except InvalidNameError:
                continue  # another vendor's spec, a temporary file, ...
        return sorted(uids)


def _load_spec(text: str) -> Any:
    """A spec parsed with libyaml where PyYAML has it (a real node's spec, the driver's
    userspace, is long, and every prepare of a prepared claim reads it)."""
    if yaml.__with_libyaml__:
        return yaml.load(text, Loader=yaml.CSafeLoader)
    return yaml.safe_load(text)


def _spec_mounts(spec: object) -> list[tuple[str, dict[str, Any]]]:
    """The mounts of a parsed spec, each with where it is (``common`` or its device's name);
    parts that are not of the spec's shape are skipped."""
    edits = [("common", spec.get("containerEdits"))] if isinstance(spec, dict) else []
    devices = spec.get("devices") if isinstance(spec, dict) else None
    for device in devices if isinstance(devices, list) else []:
        if isinstance(device, dict):
            edits.append((str(device.get("name")), device.get("containerEdits")))
    found = []
    for where, container_edits in edits:
        mounts = container_edits.get("mounts") if isinstance(container_edits, dict) else None
        for mount in mounts if isinstance(mounts, list) else []:
            if isinstance(mount, dict):
                found.append((where, mount))
    return found


def _dump_spec(spec: dict[str, Any]) -> str:
    """``yaml.dump(spec, Dumper=_SPEC_DUMPER, sort_keys=False, default_flow_style=False)``, the
    same text: written here when the spec holds only block mappings and sequences of plain
    strings and integers (what `build_claim_spec` makes, bar unusual characters), which skips
    PyYAML's representer (most of the dump's time); dumped by PyYAML otherwise."""
    lines: list[str] = []
    if _write_mapping(spec, "", "", lines, set()):
        return "\n".join(lines) + "\n"
    return yaml.dump(spec, Dumper=_SPEC_DUMPER, sort_keys=False, default_flow_style=False)


@functools.lru_cache(maxsize=4096)
def _plain(text: str) -> bool:
    """Whether the emitter writes ``text`` as a plain scalar in block context (on a short line)."""
    if (
        _PLAIN_TEXT.fullmatch(text) is None
        or text == "-"
        or text.startswith(("- ", "---", "..."))
        or "  " in text
        or ": " in text
    ):
        return False
    tag: str = _RESOLVER.resolve(yaml.ScalarNode, text, (True, False))  # type: ignore[no-untyped-call]
    return tag == _STR_TAG


def _scalar_line(head: str, value: object) -> str | None:
    """``head`` followed by ``value`` as the emitter writes them on one line; None when it would
    write ``value`` otherwise (quoted, folded) or it is not a string or integer."""
    if type(value) is int:
        return f"{head} {value}"
    if type(value) is not str or not _plain(value):
        return None
    line = f"{head} {value}"
    return line if " " not in value or len(line) <= _LINE_WIDTH else None


def _write_mapping(
    mapping: object, first: str, indent: str, lines: list[str], seen: set[int]
) -> bool:
    """Append the block mapping's lines (the first starts with ``first``, the others with
    ``indent``); False for what `_dump_spec` leaves to PyYAML: an empty or repeated (the
    emitter would write an alias) container, an odd key or value."""
    if type(mapping) is not dict or not mapping or id(mapping) in seen:
        return False
    seen.add(id(mapping))
    prefix = first
    for key, value in mapping.items():
        if type(key) is not str or len(key) > _SIMPLE_KEY_MAX or " " in key or not _plain(key):
            return False
        head = f"{prefix}{key}:"
        prefix = indent
        line = _scalar_line(head, value)
        if line is not None:
            lines.append(line)
            continue
        lines.append(head)
        if type(value) is list:  # a sequence in a mapping is not indented further
            if not _write_sequence(value, indent, lines, seen):
                return False
        elif not _write_mapping(value, f"{indent}  ", f"{indent}  ", lines, seen):
            return False
    return True


def _write_sequence(items: list[Any], indent: str, lines: list[str], seen: set[int]) -> bool:
    if not items or id(items) in seen:
        return False
    seen.add(id(items))
    for item in items:
        line = _scalar_line(f"{indent}-", item)
        if line is not None:
            lines.append(line)
        elif not _write_mapping(item, f"{indent}- ", f"{indent}  ", lines, seen):
            return False
    return True


def merged_edits(first: ContainerEdits, second: ContainerEdits) -> ContainerEdits:
    """``first`` then ``second``: environments combined (``second`` wins a name), the rest
    concatenated."""
    return ContainerEdits(
        env={**first.env, **second.env},
        device_nodes=first.device_nodes + second.device_nodes,
        mounts=first.mounts + second.mounts,
        hooks=first.hooks + second.hooks,
    )
