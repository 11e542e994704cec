"""`gpu-dra-controller`: the composition root (settings, then adapters, then the run loop).

The controller's cluster-level duty for now: keep the DeviceClass catalog applied. It applies every
class at start, then again every resync interval (reloading the directory, so a mounted ConfigMap
can change), sooner when a class failed. With `--once` it applies once and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, start_http_server

from gpu_dra.controller import errors
from gpu_dra.controller.catalog import (
    CatalogError,
    DeviceClass,
    DeviceClassApi,
    KubernetesDeviceClassApi,
    apply_catalog,
    load_catalog,
)
from gpu_dra.controller.kubeapi import new_api_client
from gpu_dra.controller.metrics import CatalogMetrics
from gpu_dra.controller.settings import ControllerSettings

log = logging.getLogger("gpu_dra.controller")

EXIT_OK = 0
EXIT_APPLY_FAILED = 1
EXIT_BAD_SETUP = 2


def main(argv: Sequence[str] | None = None) -> int:
    settings = ControllerSettings.from_args(
        sys.argv[1:] if argv is None else argv, environ=os.environ
    )
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.info("starting gpu-dra-controller: %s", settings.log_fields())
    registry = CollectorRegistry()
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=registry)
    try:
        api_client = new_api_client(settings.kubeconfig)
    except errors.ClientConfigError as error:
        log.error("%s", error)
        return EXIT_BAD_SETUP
    api = KubernetesDeviceClassApi(api_client, field_manager=settings.field_manager)
    return asyncio.run(run(settings, api, CatalogMetrics(registry)))


async def run(
    settings: ControllerSettings,
    api: DeviceClassApi,
    metrics: CatalogMetrics,
    *,
    stop: asyncio.Event | None = None,
) -> int:
    """Keep the catalog applied until SIGTERM/SIGINT (or `stop`); the process exit status."""
    stop = stop or _stop_on_signals()
    try:
        catalog = load_catalog(settings.deviceclasses_dir)
    except CatalogError as error:
        log.error("cannot load the DeviceClass catalog: %s", error)
        return EXIT_BAD_SETUP
    while True:
        result = await apply_catalog(api, catalog, metrics)
        if settings.once:
            return EXIT_OK if result.ok else EXIT_APPLY_FAILED
        wait_s = settings.resync_interval_s if result.ok else settings.retry_interval_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=wait_s)
        if stop.is_set():
            log.info("stopping gpu-dra-controller")
            return EXIT_OK
        catalog = _reloaded(settings, catalog)


def _reloaded(
    settings: ControllerSettings, previous: tuple[DeviceClass, ...]
) -> tuple[DeviceClass, ...]:
    try:
        return load_catalog(settings.deviceclasses_dir)
    except CatalogError as error:
        log.error("cannot reload the DeviceClass catalog, keeping the last one: %s", error)
        return previous


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signum, stop.set)
    return stop


if __name__ == "__main__":
    sys.exit(main())
