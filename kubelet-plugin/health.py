"""The kubelet plugin's gRPC health service (``grpc.health.v1.Health``) on ``--healthcheck-port``.

Each ``Check`` answers from a fresh self-call, as NVIDIA's plugin does: ``SERVING`` only when
start-up recovery has finished, the registration socket answers ``GetInfo`` and the DRA socket
answers an empty ``NodePrepareResources`` (v1), within the caller's deadline; otherwise
``NOT_SERVING``, with the reason logged when the status changes. Services: ``""`` and
``liveness`` (NVIDIA's names), and ``readiness``, which also needs the kubelet's last
registration report to be a success. While the start-up guard waits for the node (NVIDIA's device
plugin or another DRA driver still serves it), and for `STARTUP_GRACE_S` after, liveness is
``SERVING`` (the process is alive and checking; a restart would change nothing) and readiness is
``NOT_SERVING``. Any other name is ``NOT_FOUND``. ``List`` reports the three;
``Watch`` is not implemented (kubelet probes call ``Check``). See docs/deployment.md, "Probes".
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2 as dra_v1
from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2 as reg
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

LIVENESS = "liveness"
READINESS = "readiness"
SERVICES: tuple[str, ...] = ("", LIVENESS, READINESS)
"""The service names `Check` knows: "" and "liveness" (NVIDIA's chart probes "liveness")."""

DEFAULT_SELF_CALL_TIMEOUT_S = 5.0
"""Longest the self-calls of one check may take together when the prober set no shorter
deadline."""
STARTUP_GRACE_S = 600.0
"""After a wait for the node, how long liveness stays SERVING while start-up goes on: what the
chart's startup probe allows a start-up (120 x 5 s), which the wait used up."""
DEADLINE_MARGIN_S = 0.2
"""Time kept back from the prober's deadline to answer it."""

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServedSockets(Protocol):
    """What the health check needs of `PluginServer`: its socket paths and registration state."""

    @property
    def dra_socket(self) -> object: ...

    @property
    def registration_socket(self) -> object: ...

    @property
    def registered(self) -> asyncio.Event: ...


@dataclass(frozen=True)
class Verdict:
    serving: bool
    reason: str
    """Why not serving ("" when serving)."""


class PluginHealth:
    """The plugin's health, computed on demand by calling its own sockets."""

    def __init__(self, *, self_call_timeout_s: float = DEFAULT_SELF_CALL_TIMEOUT_S) -> None:
        self._timeout_s = self_call_timeout_s
        self._recovered = False
        self._stopping = False
        self._server: ServedSockets | None = None
        self._last: dict[str, Verdict] = {}
        self._waiting_for_node: str | None = None
        self._grace_until: float | None = None

    def mark_recovered(self) -> None:
        """Start-up recovery (checkpoint roll-backs, orphan clean-up) has finished."""
        self._recovered = True

    def waiting_for_node(self, reason: str) -> None:
        """The start-up guard waits: something else serves the node (`reason`)."""
        self._waiting_for_node = reason

    def node_taken(self) -> None:
        """The start-up guard passed; after a wait, liveness stays SERVING for
        `STARTUP_GRACE_S` while start-up goes on."""
        if self._waiting_for_node is not None:
            self._grace_until = time.monotonic() + STARTUP_GRACE_S
        self._waiting_for_node = None

    def attach(self, server: ServedSockets) -> None:
        """The plugin's sockets are served; checks call them from now on."""
        self._server = server

    async def stopping(self) -> None:
        """The plugin is shutting down: every check is NOT_SERVING from now on."""
        self._stopping = True

    async def check(self, service: str, timeout_s: float | None = None) -> Verdict:
        """The verdict for `service` (one of `SERVICES`), calling the sockets within
        `timeout_s` (default and cap: the self-call timeout)."""
        if service not in SERVICES:
            raise KeyError(service)
        verdict = await self._verdict(service, _budget(timeout_s, self._timeout_s))
        self._log_change(service, verdict)
        return verdict

    async def _verdict(self, service: str, budget_s: float) -> Verdict:
        if self._stopping:
            return Verdict(False, "the plugin is shutting down")
        if self._waiting_for_node is not None:
            if service == READINESS:
                return Verdict(False, f"waiting for the node: {self._waiting_for_node}")
            return Verdict(True, "")
        server = self._server
        if not self._recovered or server is None:
            if service != READINESS and self._in_grace():
                return Verdict(True, "")
            if not self._recovered:
                return Verdict(False, "start-up recovery has not finished")
            return Verdict(False, "the DRA and registration sockets are not served yet")
        # A fresh connection per check, as the kubelet makes: a removed or replaced socket file
        # fails the check even while an older connection would still work. One deadline covers
        # both calls.
        where = f"registration socket {server.registration_socket}"
        try:
            async with asyncio.timeout(budget_s):
                async with grpc.aio.insecure_channel(f"unix:{server.registration_socket}") as ch:
                    registration = reg_grpc.RegistrationStub(ch)  # type: ignore[no-untyped-call]
                    await registration.GetInfo(reg.InfoRequest())
                where = f"DRA socket {server.dra_socket}"
                async with grpc.aio.insecure_channel(f"unix:{server.dra_socket}") as ch:
                    dra = dra_v1_grpc.DRAPluginStub(ch)  # type: ignore[no-untyped-call]
                    await dra.NodePrepareResources(dra_v1.NodePrepareResourcesRequest())
        except (grpc.aio.AioRpcError, TimeoutError) as error:
            return Verdict(False, f"{where}: {_describe(error)}")
        if service == READINESS and not server.registered.is_set():
            return Verdict(False, "the kubelet has not (or not successfully) registered the plugin")
        return Verdict(True, "")

    def _in_grace(self) -> bool:
        return self._grace_until is not None and time.monotonic() < self._grace_until

    def _log_change(self, service: str, verdict: Verdict) -> None:
        if self._last.get(service) == verdict:
            return
        self._last[service] = verdict
        name = service or '""'
        if verdict.serving:
            log.info("health service=%s SERVING", name)
        else:
            log.warning("health service=%s NOT_SERVING: %s", name, verdict.reason)


def _budget(requested_s: float | None, cap_s: float) -> float:
    if requested_s is None:
        return cap_s
    return max(0.05, min(cap_s, requested_s - DEADLINE_MARGIN_S))


def _describe(error: grpc.aio.AioRpcError | TimeoutError) -> str:
    if isinstance(error, TimeoutError):
        return "no answer in time"
    return f"{error.code().name}: {error.details()}"


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # no stub
    """``grpc.health.v1.Health`` backed by `PluginHealth`."""

    def __init__(self, health: PluginHealth) -> None:
        self._health = health

    async def Check(  # noqa: N802 (gRPC method name)
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in SERVICES:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown service {request.service!r}; known: "
                + ", ".join(repr(s) for s in SERVICES),
            )
        remaining: float | None = context.time_remaining()
        verdict = await self._health.check(request.service, remaining)
        return health_pb2.HealthCheckResponse(status=SERVING if verdict.serving else NOT_SERVING)

    async def List(  # noqa: N802 (gRPC method name)
        self,
        request: health_pb2.HealthListRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> health_pb2.HealthListResponse:
        remaining: float | None = context.time_remaining()
        response = health_pb2.HealthListResponse()
        for service in SERVICES:
            verdict = await self._health.check(service, remaining)
            response.statuses[service].status = SERVING if verdict.serving else NOT_SERVING
        return response


class HealthServer:
    """The health service on a TCP port of every address (``[::]``, IPv4 included)."""

    def __init__(self, health: PluginHealth, port: int) -> None:
        if port < 0:
            raise ValueError(f"health port must be 0 (any free port) or more, got {port}")
        self._health = health
        self._requested_port = port
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None
        """The bound port once started (the kernel's pick when 0 was requested)."""

    async def start(self) -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(self._health), server)
        port = server.add_insecure_port(f"[::]:{self._requested_port}")
        if port == 0:
            raise OSError(f"cannot listen on health port {self._requested_port}")
        await server.start()
        self._server, self.port = server, port
        log.info("gRPC health service (grpc.health.v1) on :%d", port)

    async def stop(self, grace_s: float = 1.0) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
