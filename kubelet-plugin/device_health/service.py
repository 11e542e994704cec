"""The kubelet's DRA device health service, ``DRAResourceHealth`` v1 and v1alpha1.

The kubelet (feature gate ``ResourceHealthStatus``) opens one ``NodeWatchResources`` stream on
the DRA socket of a plugin that advertises the service at registration, and shows the health of
each container's allocated devices in ``status.containerStatuses[].allocatedResourcesStatus``.
Each response is the complete list of this node's published devices (pool = node name): at once,
on every change of the health source, and every ``resend_interval_s`` while the source is alive
(`HealthSource.alive_within`); a device the kubelet hears nothing about for
``timeout_s`` becomes Unknown, so a stuck monitor is not taken for a healthy one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from types import ModuleType
from typing import Any, Final, Protocol

import grpc

from gpu_dra.driver.health import DeviceHealth, HealthStatus
from gpu_dra.kubelet_plugin._generated.dra_health.v1 import api_pb2 as v1
from gpu_dra.kubelet_plugin._generated.dra_health.v1 import api_pb2_grpc as v1_grpc
from gpu_dra.kubelet_plugin._generated.dra_health.v1alpha1 import api_pb2 as v1alpha1
from gpu_dra.kubelet_plugin._generated.dra_health.v1alpha1 import api_pb2_grpc as v1alpha1_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES: Final = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
"""What registration advertises, most preferred first (the kubelet 1.37 takes v1)."""

DEFAULT_RESEND_INTERVAL_S: Final = 10.0
DEFAULT_TIMEOUT_S: Final = 30
"""``health_check_timeout_seconds``: three resend intervals (the kubelet's default is 30)."""


class HealthSource(Protocol):
    """What the service streams (`monitor.HealthMonitor`)."""

    @property
    def version(self) -> int: ...

    def snapshot(self) -> Mapping[str, DeviceHealth]: ...

    async def wait_changed(self, version: int, timeout_s: float) -> None: ...

    def alive_within(self, seconds: float) -> bool: ...


class DeviceHealthService:
    """``NodeWatchResources`` for both API versions over one `HealthSource`; `add_to` registers
    them on the DRA server and `names` are what registration advertises."""

    names: tuple[str, ...] = SERVICE_NAMES

    def __init__(
        self,
        source: HealthSource,
        *,
        pool: str,
        resend_interval_s: float = DEFAULT_RESEND_INTERVAL_S,
        timeout_s: int = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._source = source
        self._pool = pool
        self._resend_interval_s = resend_interval_s
        self._timeout_s = timeout_s
        self._clock = clock

    def add_to(self, server: grpc.aio.Server) -> None:
        v1_grpc.add_DRAResourceHealthServicer_to_server(  # type: ignore[no-untyped-call]
            _Servicer(self, v1), server
        )
        v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(  # type: ignore[no-untyped-call]
            _Servicer(self, v1alpha1), server
        )

    async def reports(self) -> AsyncIterator[Mapping[str, DeviceHealth]]:
        """The snapshots to send: the current one, then one per change or resend tick (ticks
        only while the source is alive)."""
        silent = False
        while True:
            version = self._source.version
            yield self._source.snapshot()
            while True:
                await self._source.wait_changed(version, self._resend_interval_s)
                if self._source.version != version:
                    break
                if self._source.alive_within(self._timeout_s):
                    silent = False
                    break
                if not silent:
                    log.warning(
                        "health monitor silent for over %ds: not repeating device health to "
                        "the kubelet (it will show Unknown)",
                        self._timeout_s,
                    )
                silent = True

    def response(self, api: ModuleType, snapshot: Mapping[str, DeviceHealth]) -> Any:
        """A ``NodeWatchResourcesResponse`` of `api` (v1 or v1alpha1) for `snapshot`."""
        now = int(self._clock())
        response = api.NodeWatchResourcesResponse()
        for name, health in snapshot.items():
            response.devices.add(
                device=api.DeviceIdentifier(pool_name=self._pool, device_name=name),
                health=_STATUS[health.status],
                last_updated_time=now,
                health_check_timeout_seconds=self._timeout_s,
                message=health.message,
            )
        return response


_STATUS: Final = {HealthStatus.HEALTHY: 1, HealthStatus.UNHEALTHY: 2, HealthStatus.UNKNOWN: 0}
"""`HealthStatus` -> the proto enum value (the same in v1 and v1alpha1)."""


class _Servicer:
    """``DRAResourceHealth`` of one API version."""

    def __init__(self, service: DeviceHealthService, api: ModuleType) -> None:
        self._service = service
        self._api = api

    async def NodeWatchResources(  # noqa: N802 (gRPC method name)
        self, request: Any, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[Any]:
        version = self._api.DESCRIPTOR.package
        log.info("kubelet watches device health (%s.DRAResourceHealth)", version)
        try:
            async for snapshot in self._service.reports():
                unhealthy = sorted(n for n, h in snapshot.items() if h.problems)
                log.debug("device health: devices=%d with problems=%s", len(snapshot), unhealthy)
                yield self._service.response(self._api, snapshot)
        finally:
            log.info("device health stream closed (%s.DRAResourceHealth)", version)
