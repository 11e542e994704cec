"""The plugin instances running on this node: ``<data-dir>/instances/``.

Each process registers under a token (`PluginInstance.token`: instance id or ``host``, plus a
random suffix) and holds an exclusive ``flock`` on ``<token>.lock`` for its lifetime: it is
alive exactly while that lock cannot be taken (`InstanceRegistry.alive`), however it ended.
``<token>.json`` records instance id, pid, start sequence, sockets and readiness. Checkpoint
entries name their writer's token, so recovery rolls back only dead instances' prepares; the
newest ready instance publishes the slices; the start-up guard accepts a live instance's
sockets. See docs/architecture.md, "Two instances on one node".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.atomic_file import temporary_target, write_atomically
from gpu_dra.kubelet_plugin.node_locks import (
    NodeLocks,
    acquire_blocking,
    open_lock_file,
    try_flock,
)

log = logging.getLogger(__name__)

INSTANCES_DIR: Final = "instances"
SEQUENCE_FILE: Final = "sequence"
HOST_INSTANCE: Final = "host"
"""Token prefix of an instance without an instance id (fixed socket names, host process)."""
INSTANCE_ID = re.compile(r"^[a-zA-Z0-9]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?$")
_TOKEN = re.compile(r"^[a-zA-Z0-9][-_.a-zA-Z0-9]*$")


def check_instance_id(instance_id: str) -> str:
    """``instance_id`` if it fits a file and socket name (``[-_.a-zA-Z0-9]``); ValueError."""
    if len(instance_id) > 128 or not INSTANCE_ID.match(instance_id):
        raise ValueError(
            f"instance id {instance_id!r} may only hold [-_.a-zA-Z0-9] (at most 128 characters)"
        )
    return instance_id


@dataclass(frozen=True)
class InstanceInfo:
    """What ``<token>.json`` says about one instance."""

    token: str
    instance_id: str
    pid: int
    sequence: int
    """Start order on this node: a later instance has a larger one."""
    sockets: tuple[str, ...]
    """Its DRA and registration sockets."""
    ready: bool
    """Its start-up recovery is done."""

    def to_json(self) -> dict[str, object]:
        return {
            "instanceID": self.instance_id,
            "pid": self.pid,
            "sequence": self.sequence,
            "sockets": list(self.sockets),
            "ready": self.ready,
        }

    @classmethod
    def from_json(cls, token: str, raw: object) -> InstanceInfo:
        """ValueError for anything but what `to_json` writes."""
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        instance_id, pid = raw.get("instanceID"), raw.get("pid")
        sequence, sockets, ready = raw.get("sequence"), raw.get("sockets"), raw.get("ready")
        if not isinstance(instance_id, str) or not isinstance(ready, bool):
            raise ValueError("instanceID or ready missing")
        if not isinstance(pid, int) or not isinstance(sequence, int):
            raise ValueError("pid or sequence missing")
        if not isinstance(sockets, list) or not all(isinstance(s, str) for s in sockets):
            raise ValueError("sockets is not a list of paths")
        return cls(token, instance_id, pid, sequence, tuple(sockets), ready)


class InstanceRegistry:
    """The instances of one data dir (see the module doc). Blocking file I/O."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.directory = data_dir / INSTANCES_DIR

    def lock_path(self, token: str) -> Path:
        return self.directory / f"{token}.lock"

    def info_path(self, token: str) -> Path:
        return self.directory / f"{token}.json"

    def register(self, instance_id: str, sockets: Sequence[Path] = ()) -> PluginInstance:
        """This process as a new instance (the lock held until `PluginInstance.close`)."""
        prefix = check_instance_id(instance_id) if instance_id else HOST_INSTANCE
        self.directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        token = f"{prefix}-{secrets.token_hex(4)}"
        # Locked before it gets its name: a visible lock file is always held by a live owner.
        temporary = self.directory / f".{token}.lock.tmp"
        fd = open_lock_file(temporary)
        try:
            if not try_flock(fd, fcntl.LOCK_EX):
                raise RuntimeError(f"{temporary} is locked by another process")
            crash_points.reached(crash_points.INSTANCE_BEFORE_LOCK_RENAME)
            os.rename(temporary, self.lock_path(token))
            info = InstanceInfo(
                token, instance_id, os.getpid(), self._next_sequence(), tuple(map(str, sockets)),
                ready=False,
            )  # fmt: skip
            self.write_info(info)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            with contextlib.suppress(OSError):
                os.unlink(self.lock_path(token))
            os.close(fd)
            raise
        log.info("registered plugin instance token=%s sequence=%d", token, info.sequence)
        return PluginInstance(self, info, fd)

    def alive(self, token: str) -> bool:
        """Whether the instance ``token`` runs: its lock file exists and is held. A probe takes
        the lock shared, so two probes never see each other as the owner."""
        if not _TOKEN.match(token):
            return False
        try:
            fd = os.open(self.lock_path(token), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            return not try_flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)

    def instances(self) -> list[InstanceInfo]:
        """Every registered instance with a readable ``.json``, alive or not, by sequence."""
        found = []
        try:
            names = sorted(p.name for p in self.directory.iterdir())
        except FileNotFoundError:
            return []
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            token = name.removesuffix(".json")
            info = self._read(token)
            if info is not None:
                found.append(info)
        return sorted(found, key=lambda i: i.sequence)

    def live(self) -> list[InstanceInfo]:
        """The instances that run now, by sequence."""
        return [info for info in self.instances() if self.alive(info.token)]

    def remove_dead(self) -> list[InstanceInfo]:
        """Forget the instances that no longer run (their files); returns what they recorded
        (their sockets may be left behind)."""
        removed = []
        try:
            names = sorted(p.name for p in self.directory.iterdir())
        except FileNotFoundError:
            return []
        tokens = {n.removesuffix(".json") for n in names if n.endswith(".json")}
        tokens |= {n.removesuffix(".lock") for n in names if n.endswith(".lock")}
        for token in sorted(t for t in tokens if _TOKEN.match(t)):
            info = self._read(token)
            lock_path = self.lock_path(token)
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = -1
            try:
                if fd >= 0 and not try_flock(fd, fcntl.LOCK_EX):
                    continue  # alive (or being probed right now: next time)
                if fd >= 0:
                    os.unlink(lock_path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.info_path(token))
            finally:
                if fd >= 0:
                    os.close(fd)
            log.info("forgot dead plugin instance token=%s", token)
            if info is not None:
                removed.append(info)
        self._remove_dead_temporaries(names)
        return removed

    def _remove_dead_temporaries(self, names: Sequence[str]) -> None:
        """The files an instance that died while registering or writing its ``.json`` left:
        ``.<token>.lock.tmp`` that nobody holds locked (its lock, before the rename) and
        ``.<token>.json.<random>.tmp`` of an instance that no longer runs (a live one's may be
        a write under way)."""
        for name in names:
            path = self.directory / name
            if name.startswith(".") and name.endswith(".lock.tmp"):
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    if not try_flock(fd, fcntl.LOCK_EX):
                        continue  # an instance registering right now
                    path.unlink(missing_ok=True)
                finally:
                    os.close(fd)
            else:
                target = temporary_target(name)
                if target is None or not target.endswith(".json"):
                    continue
                if self.alive(target.removesuffix(".json")):
                    continue
                path.unlink(missing_ok=True)
            log.info("removed a file of an interrupted registration path=%s", path)

    def _next_sequence(self) -> int:
        held = acquire_blocking(self.directory / SEQUENCE_FILE, timeout_s=10.0)
        try:
            raw = os.pread(held.fd, 64, 0).decode("ascii", errors="replace").strip()
            value = (int(raw) if raw.isdigit() else 0) + 1
            data = f"{value}\n".encode()
            os.ftruncate(held.fd, 0)
            os.pwrite(held.fd, data, 0)
            return value
        finally:
            held.release()

    def _read(self, token: str) -> InstanceInfo | None:
        try:
            raw = json.loads(self.info_path(token).read_text(encoding="utf-8"))
            return InstanceInfo.from_json(token, raw)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            log.warning("plugin instance file of token=%s unreadable: %s", token, error)
            return None

    def write_info(self, info: InstanceInfo) -> None:
        data = json.dumps(info.to_json(), sort_keys=True).encode() + b"\n"
        write_atomically(
            self.info_path(info.token),
            data,
            mode=0o640,
            crash_point=crash_points.INSTANCE_INFO_BEFORE_RENAME,
        )


class PluginInstance:
    """This process's registration: its token, the node's shared locks, and who else runs."""

    def __init__(self, registry: InstanceRegistry, info: InstanceInfo, fd: int) -> None:
        self.registry = registry
        self.info = info
        self.locks = NodeLocks(registry.data_dir)
        self._fd = fd

    @property
    def token(self) -> str:
        return self.info.token

    def owner_alive(self, owner: str | None) -> bool:
        """Whether the instance ``owner`` (a checkpoint entry's) runs: this one, or a live
        other. None (an entry of a plugin before instance tokens) counts as dead."""
        if owner is None:
            return False
        return owner == self.token or self.registry.alive(owner)

    def mark_ready(self) -> None:
        """Record that start-up recovery is done (this instance may publish slices now)."""
        self.info = replace(self.info, ready=True)
        self.registry.write_info(self.info)

    def newest_ready(self) -> bool:
        """Whether this is the live, ready instance that started last (the one to publish)."""
        if not self.info.ready:
            return False
        ready = [i for i in self.registry.live() if i.ready]
        return bool(ready) and ready[-1].token == self.token

    def close(self) -> None:
        """Unregister (files removed, lock released); what it recorded is no one's any more."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.registry.info_path(self.token))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.registry.lock_path(self.token))
        os.close(fd)
        self.locks.close()
        log.info("unregistered plugin instance token=%s", self.token)
