"""``pluginregistration.Registration`` servicer: how the kubelet discovers this plugin.

The kubelet's plugin watcher finds ``<registry_dir>/<driver>-reg.sock``, calls ``GetInfo``,
registers the plugin and reports the outcome with ``NotifyRegistrationStatus``. The kubelet
also calls ``GetInfo`` periodically and registers again after restarts, so a plugin can see
many successful registrations in its lifetime. Each one is announced through the
``registered`` event and the optional ``on_registered`` callback, because the kubelet wipes
the node's ResourceSlices at start-up and the driver must publish them again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2 as reg
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"
"""``PluginInfo.type`` of a DRA driver."""

SUPPORTED_SERVICES: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
"""Served DRA services, most preferred first (the kubelet takes the first it supports)."""

RegisteredCallback = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class RegistrationOutcome:
    """What the kubelet last reported through ``NotifyRegistrationStatus``."""

    registered: bool
    error: str


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """Answers the kubelet's plugin watcher and records the registration status.

    ``registered`` is set while the kubelet's last report was a success and cleared on a
    failure report. ``on_registered`` runs in the background after every successful report
    (calls may overlap if the kubelet registers again quickly, so it must be idempotent);
    its failures are logged, never reported to the kubelet.
    """

    def __init__(
        self,
        *,
        driver_name: str,
        endpoint: str,
        supported_versions: Sequence[str] = SUPPORTED_SERVICES,
        on_registered: RegisteredCallback | None = None,
    ) -> None:
        self._driver_name = driver_name
        self._endpoint = endpoint
        self._supported_versions = tuple(supported_versions)
        self._on_registered = on_registered
        self._callbacks: set[asyncio.Task[None]] = set()
        self.registered = asyncio.Event()
        self.last_outcome: RegistrationOutcome | None = None
        self.registration_count = 0

    async def GetInfo(  # noqa: N802 (gRPC method name)
        self, request: reg.InfoRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> reg.PluginInfo:
        log.debug("registration GetInfo driver=%s endpoint=%s", self._driver_name, self._endpoint)
        return reg.PluginInfo(
            type=DRA_PLUGIN_TYPE,
            name=self._driver_name,
            endpoint=self._endpoint,
            supported_versions=self._supported_versions,
        )

    async def NotifyRegistrationStatus(  # noqa: N802 (gRPC method name)
        self,
        request: reg.RegistrationStatus,
        context: grpc.aio.ServicerContext[object, object],
    ) -> reg.RegistrationStatusResponse:
        self.last_outcome = RegistrationOutcome(request.plugin_registered, request.error)
        if not request.plugin_registered:
            self.registered.clear()
            log.error(
                "kubelet registration failed driver=%s error=%r", self._driver_name, request.error
            )
            # Like the reference Go library: a failed registration is answered with an error.
            await context.abort(
                grpc.StatusCode.UNKNOWN,
                f"registration of DRA driver {self._driver_name} failed: {request.error}",
            )
        self.registration_count += 1
        self.registered.set()
        log.info(
            "kubelet registration succeeded driver=%s count=%d",
            self._driver_name,
            self.registration_count,
        )
        if self._on_registered is not None:
            task = asyncio.create_task(self._run_callback(self._on_registered))
            self._callbacks.add(task)
            task.add_done_callback(self._callbacks.discard)
        return reg.RegistrationStatusResponse()

    async def _run_callback(self, callback: RegisteredCallback) -> None:
        try:
            await callback()
        except Exception:
            log.exception("on_registered callback failed driver=%s", self._driver_name)

    async def close(self) -> None:
        """Cancel callbacks still running (called when the server stops)."""
        tasks = list(self._callbacks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
