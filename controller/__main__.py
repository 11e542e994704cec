"""`gpu-dra-controller`: the composition root (settings, then adapters, then the run loop).

The controller's cluster-level duty for now: keep the DeviceClass catalog applied. It applies every
class at start, then again every resync interval (reloading the directory, so a mounted ConfigMap
can change), sooner when a class failed. With `--once` it applies once and exits.

Beside it, every `--inventory-interval` seconds (0: never, nor with `--once`), it reads the
cluster's ResourceSlices, DeviceClasses and ResourceClaims with the list helpers of `gpu-dra
inventory` (in a worker thread) and exports the inventory as gauges (`InventoryMetrics`); a failed
read keeps the last snapshot and counts an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, start_http_server

from gpu_dra.controller.catalog import (
    CatalogError,
    DeviceClass,
    DeviceClassApi,
    KubernetesDeviceClassApi,
    apply_catalog,
    load_catalog,
)
from gpu_dra.controller.metrics import CatalogMetrics, InventoryMetrics
from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.driver.cluster.usage import Inventory, inventory
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.kube import errors
from gpu_dra.kube.client import list_resource_objects, new_api_client

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

    def read() -> Inventory:
        classes = list_resource_objects(api_client, "deviceclasses")
        slices = list_resource_objects(api_client, "resourceslices")
        claims = list_resource_objects(api_client, "resourceclaims")
        return inventory(slices, classes, claims, driver=DEFAULT_DRIVER_NAME)

    return asyncio.run(
        run(
            settings,
            api,
            CatalogMetrics(registry),
            read_inventory=read,
            inventory_metrics=InventoryMetrics(registry),
        )
    )


InventoryReader = Callable[[], Inventory]
"""Reads the cluster and builds its inventory (blocking: run in a worker thread)."""


async def refresh_inventory(read: InventoryReader, metrics: InventoryMetrics) -> bool:
    """One inventory read exported as gauges; on failure the last snapshot stays, counted."""
    try:
        report = await asyncio.to_thread(read)
    except errors.ApiError as error:
        log.warning("inventory read failed, keeping the last snapshot: %s", error)
        metrics.count_error()
        return False
    except Exception:
        log.exception("inventory read failed, keeping the last snapshot")
        metrics.count_error()
        return False
    metrics.update(report.device_counts(), report.class_counts())
    return True


async def inventory_loop(
    interval_s: float, read: InventoryReader, metrics: InventoryMetrics, stop: asyncio.Event
) -> None:
    """`refresh_inventory` now and every `interval_s` seconds until `stop`."""
    while not stop.is_set():
        await refresh_inventory(read, metrics)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


async def run(
    settings: ControllerSettings,
    api: DeviceClassApi,
    metrics: CatalogMetrics,
    *,
    stop: asyncio.Event | None = None,
    read_inventory: InventoryReader | None = None,
    inventory_metrics: InventoryMetrics | None = None,
) -> int:
    """Keep the catalog applied until SIGTERM/SIGINT (or `stop`), exporting the inventory when
    `read_inventory` and `inventory_metrics` are given; the process exit status."""
    stop = stop or _stop_on_signals()
    task: asyncio.Task[None] | None = None
    if (
        read_inventory is not None
        and inventory_metrics is not None
        and settings.inventory_interval_s > 0
        and not settings.once
    ):
        task = asyncio.create_task(
            inventory_loop(settings.inventory_interval_s, read_inventory, inventory_metrics, stop)
        )
    try:
        return await _keep_applied(settings, api, metrics, stop)
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _keep_applied(
    settings: ControllerSettings,
    api: DeviceClassApi,
    metrics: CatalogMetrics,
    stop: asyncio.Event,
) -> int:
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
