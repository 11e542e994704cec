"""The kubelet plugin's two Unix sockets and their start/stop order.

Start: serve the DRAPlugin services (v1 and v1beta1) on the DRA socket, check that it accepts
connections, and only then create the registration socket. Stop: remove the registration socket
first, then stop the DRA service and remove its socket. With an instance id the names are the
instance's own (`socket_paths`); `remove_stale_sockets` removes sockets nobody serves. Optional
services on the DRA socket (``extra_services``, e.g. device health) are advertised at
registration after the DRAPlugin versions. Signal handling is the caller's job: call
:meth:`PluginServer.stop` on SIGTERM. See docs/architecture.md#processes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import os
import re
import socket
import stat
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Protocol

import grpc

from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2_grpc as reg_grpc
from gpu_dra.kubelet_plugin.dra_service import (
    DEFAULT_CALL_TIMEOUT_S,
    ClaimCallHandler,
    add_dra_services,
)
from gpu_dra.kubelet_plugin.metrics import PluginMetrics
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimPreparer
from gpu_dra.kubelet_plugin.registration import (
    SUPPORTED_SERVICES,
    RegisteredCallback,
    RegistrationServicer,
)

log = logging.getLogger(__name__)

DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")

SOCKET_DIR_MODE = 0o750
SOCKET_MODE = 0o600
MAX_SOCKET_PATH_BYTES = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_INSTANCE_ID = re.compile(r"^[a-zA-Z0-9]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?$")
_UID_HASH_BYTES = 8
_DRIVER_UID_HASH_BYTES = 16


def registration_socket_name(registry_dir: Path, driver_name: str, instance_id: str) -> str:
    """The registration socket of one instance, named as k8s.io/dynamic-resource-allocation's
    ``RollingUpdate`` names it: ``<driver>-<id>-reg.sock``, else (a path too long for a Unix
    socket) ``<driver>-<base64url(sha256(id)[:8])>-reg.sock``, else
    ``dra-<base64url(sha256(driver NUL id)[:16])>-reg.sock``."""
    uid_hash = hashlib.sha256(instance_id.encode()).digest()[:_UID_HASH_BYTES]
    both = hashlib.sha256(f"{driver_name}\0{instance_id}".encode()).digest()
    candidates = (
        f"{driver_name}-{instance_id}-reg.sock",
        f"{driver_name}-{_b64(uid_hash)}-reg.sock",
        f"dra-{_b64(both[:_DRIVER_UID_HASH_BYTES])}-reg.sock",
    )
    for name in candidates:
        if len(os.fsencode(registry_dir / name)) <= MAX_SOCKET_PATH_BYTES:
            return name
    return candidates[-1]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def socket_paths(
    driver_name: str, plugins_dir: Path, registry_dir: Path, instance_id: str | None
) -> tuple[Path, Path]:
    """The DRA and registration sockets of an instance (no id: the fixed names)."""
    socket_dir = plugins_dir.absolute() / driver_name
    registry = registry_dir.absolute()
    if not instance_id:
        return socket_dir / "dra.sock", registry / f"{driver_name}-reg.sock"
    return (
        socket_dir / f"dra-{instance_id}.sock",
        registry / registration_socket_name(registry, driver_name, instance_id),
    )


def served(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def remove_stale_sockets(candidates: Iterable[Path], keep: Collection[Path] = ()) -> list[Path]:
    """Remove those of ``candidates`` that are Unix sockets nobody serves (left by a plugin
    instance that was killed), except ``keep`` (sockets of instances that run, which may not
    listen yet); returns what was removed."""
    removed = []
    for path in sorted(set(candidates)):
        if path in keep:
            continue
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                continue
        except FileNotFoundError:
            continue
        if served(path):
            log.info("socket of another process kept path=%s", path)
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
            log.info("removed stale socket of a dead plugin instance path=%s", path)
    return removed


class ExtraService(Protocol):
    """A further gRPC service on the DRA socket, e.g. ``health.DeviceHealthService``."""

    @property
    def names(self) -> tuple[str, ...]:
        """``<proto package>.<service>`` names advertised at registration."""
        ...

    def add_to(self, server: grpc.aio.Server) -> None: ...


class PluginServer:
    """Serves the DRA and registration sockets of one driver instance.

    ``instance_id`` (e.g. the pod UID) gives this instance its own socket names,
    ``dra-<id>.sock`` and ``<driver>-<id>-reg.sock`` (`socket_paths`), so that a new instance
    can register before the old one stops (seamless upgrades, kubelet 1.33+).
    """

    def __init__(
        self,
        *,
        driver_name: str,
        preparer: ClaimPreparer,
        plugins_dir: Path = DEFAULT_PLUGINS_DIR,
        registry_dir: Path = DEFAULT_REGISTRY_DIR,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        on_registered: RegisteredCallback | None = None,
        instance_id: str | None = None,
        readiness_timeout_s: float = 10.0,
        metrics: PluginMetrics | None = None,
        extra_services: Sequence[ExtraService] = (),
    ) -> None:
        if len(driver_name) > 253 or not _DNS_SUBDOMAIN.match(driver_name):
            raise ValueError(f"driver name {driver_name!r} is not a DNS subdomain")
        if instance_id is not None and not _INSTANCE_ID.match(instance_id):
            raise ValueError(f"instance id {instance_id!r} may only hold [-_.a-zA-Z0-9]")
        self.driver_name = driver_name
        self.socket_dir = plugins_dir.absolute() / driver_name
        self.registry_dir = registry_dir.absolute()
        self.dra_socket, self.registration_socket = socket_paths(
            driver_name, plugins_dir, registry_dir, instance_id
        )
        for path in (self.dra_socket, self.registration_socket):
            if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
                raise ValueError(f"socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes")
        self._handler = ClaimCallHandler(preparer, call_timeout_s=call_timeout_s, metrics=metrics)
        self._readiness_timeout_s = readiness_timeout_s
        self._extra_services = tuple(extra_services)
        extra_names = [name for service in self._extra_services for name in service.names]
        self.registration = RegistrationServicer(
            driver_name=driver_name,
            endpoint=str(self.dra_socket),
            supported_versions=(*SUPPORTED_SERVICES, *extra_names),
            on_registered=on_registered,
        )
        self._dra_server: grpc.aio.Server | None = None
        self._registration_server: grpc.aio.Server | None = None
        self._bound: dict[Path, tuple[int, int]] = {}

    @property
    def registered(self) -> asyncio.Event:
        """Set while the kubelet's last registration report was a success."""
        return self.registration.registered

    async def start(self) -> None:
        """Serve the DRA socket, wait until it accepts connections, then register."""
        if self._dra_server is not None:
            raise RuntimeError("PluginServer already started")
        try:
            self.socket_dir.mkdir(mode=SOCKET_DIR_MODE, parents=True, exist_ok=True)
            self.socket_dir.chmod(SOCKET_DIR_MODE)
            self.registry_dir.mkdir(mode=SOCKET_DIR_MODE, parents=True, exist_ok=True)

            self._dra_server = grpc.aio.server()
            add_dra_services(self._dra_server, self._handler)
            for service in self._extra_services:
                service.add_to(self._dra_server)
            await self._serve(self._dra_server, self.dra_socket)
            await self._wait_connectable(self.dra_socket)
            log.info("dra service serving driver=%s socket=%s", self.driver_name, self.dra_socket)

            self._registration_server = grpc.aio.server()
            reg_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
                self.registration, self._registration_server
            )
            await self._serve(self._registration_server, self.registration_socket)
            log.info(
                "registration socket serving driver=%s socket=%s",
                self.driver_name,
                self.registration_socket,
            )
        except BaseException:
            await self.stop(grace_s=0)
            raise

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Deregister (remove the registration socket) first, then stop the DRA service.

        ``grace_s`` lets in-flight calls finish; ``None`` waits for them without limit.
        Safe to call more than once and after a failed :meth:`start`.
        """
        registration_server, self._registration_server = self._registration_server, None
        dra_server, self._dra_server = self._dra_server, None
        self._remove_socket(self.registration_socket)
        if registration_server is not None:
            await registration_server.stop(grace_s)
        await self.registration.close()
        if dra_server is not None:
            await dra_server.stop(grace_s)
        self._remove_socket(self.dra_socket)
        log.info("plugin sockets closed driver=%s", self.driver_name)

    async def __aenter__(self) -> PluginServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _serve(self, server: grpc.aio.Server, path: Path) -> None:
        _remove_stale_socket(path)
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        self._bound[path] = _restrict_socket(path)

    async def _wait_connectable(self, path: Path) -> None:
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), self._readiness_timeout_s)
            except TimeoutError as err:
                raise RuntimeError(
                    f"DRA socket {path} accepts no connections after "
                    f"{self._readiness_timeout_s:.0f}s; not registering"
                ) from err

    def _remove_socket(self, path: Path) -> None:
        """Remove a socket this instance bound, unless another process replaced it since."""
        identity = self._bound.pop(path, None)
        if identity is None:
            return
        try:
            info = path.lstat()
        except FileNotFoundError:
            return
        if (info.st_dev, info.st_ino) != identity:
            log.warning("socket was replaced by another process, left in place path=%s", path)
            return
        path.unlink(missing_ok=True)


def _restrict_socket(path: Path) -> tuple[int, int]:
    """Make a freshly bound socket owner-only; return its identity (device, inode)."""
    path.chmod(SOCKET_MODE)
    info = path.lstat()
    return info.st_dev, info.st_ino


def _remove_stale_socket(path: Path) -> None:
    """Remove a socket file left behind by an earlier run; refuse to remove anything else."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise FileExistsError(f"{path} exists and is not a socket; remove it or pick another path")
    path.unlink(missing_ok=True)
    log.info("removed stale socket path=%s", path)
