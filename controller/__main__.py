"""`gpu-dra-controller`: the composition root (settings, then adapters, then the run loop).

Keeps the DeviceClass catalog applied: at start, then every resync interval (reloading the
directory), sooner when a class failed; with `--once` once, then exit. Every
`--inventory-interval` it exports the cluster's inventory as gauges (`InventoryMetrics`; a failed
read keeps the last snapshot). With `--leader-election-enabled` only the Lease holder applies the
catalog; every replica serves `/metrics`, `/healthz`, `/readyz` and reads the inventory. With
`--idle-reclaim` the leader also runs the idle policy (`idle_reclaim`, docs/idle-reclaim.md).
See docs/deployment.md#controller-deployment and docs/config.md#gpu-dra-controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence

from kubernetes.client import ApiClient
from prometheus_client import CollectorRegistry

from gpu_dra.controller.catalog import (
    CatalogError,
    DeviceClass,
    DeviceClassApi,
    KubernetesDeviceClassApi,
    apply_catalog,
    load_catalog,
)
from gpu_dra.controller.health import ControllerHealth, serve_http
from gpu_dra.controller.idle_reclaim import (
    IdleReclaimer,
    KubernetesIdleReclaimApi,
    idle_reclaim_loop,
)
from gpu_dra.controller.leader import ElectionConfig, KubernetesLeaseApi, LeaderElector
from gpu_dra.controller.metrics import (
    CatalogMetrics,
    IdleReclaimMetrics,
    InventoryMetrics,
    LeaderMetrics,
)
from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.controller.share_memory import KubernetesShareQuotaApi, ShareMemoryQuota
from gpu_dra.controller.webhook import WebhookSetupError, serving
from gpu_dra.controller.webhook_certificate import (
    CertificateKeeper,
    CertificateSetupError,
    KubernetesSecretApi,
    KubernetesWebhookConfigurationApi,
    dns_names,
)
from gpu_dra.driver.cluster.usage import Inventory, inventory
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.kube import errors
from gpu_dra.kube.client import list_resource_objects, new_api_client

log = logging.getLogger("gpu_dra.controller")

EXIT_OK = 0
EXIT_APPLY_FAILED = 1
EXIT_BAD_SETUP = 2

CATALOG_CHECK = "catalog"
"""Readiness condition: the last catalog apply of this replica (while it leads) succeeded."""
APISERVER_CHECK = "apiserver"
"""Readiness condition: the apiserver answered the last leader election call."""


def main(argv: Sequence[str] | None = None) -> int:
    settings = ControllerSettings.from_args(
        sys.argv[1:] if argv is None else argv, environ=os.environ
    )
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.info("starting gpu-dra-controller: %s", settings.log_fields())
    registry = CollectorRegistry()
    health = ControllerHealth()
    if settings.metrics_port:
        serve_http(settings.metrics_port, registry, health)
    try:
        api_client = new_api_client(settings.kubeconfig)
    except errors.ClientConfigError as error:
        log.error("%s", error)
        return EXIT_BAD_SETUP
    api = KubernetesDeviceClassApi(api_client, field_manager=settings.field_manager)
    leader_metrics = LeaderMetrics(registry)
    elector = None
    if settings.leader_election_enabled and not settings.once:
        elector = _elector(settings, api_client, health, leader_metrics)
    else:
        leader_metrics.set_leading(True)

    def read() -> Inventory:
        classes = list_resource_objects(api_client, "deviceclasses")
        slices = list_resource_objects(api_client, "resourceslices")
        claims = list_resource_objects(api_client, "resourceclaims")
        return inventory(slices, classes, claims, driver=DEFAULT_DRIVER_NAME)

    reclaimer = None
    if settings.idle_reclaim:
        reclaimer = IdleReclaimer(
            KubernetesIdleReclaimApi(api_client),
            IdleReclaimMetrics(registry),
            driver=DEFAULT_DRIVER_NAME,
            instance=settings.leader_election_identity_or_host,
            default_window_s=settings.idle_reclaim_default_window_s,
            default_grace_s=settings.idle_reclaim_default_grace_s,
            plugin_selector=settings.idle_reclaim_plugin_selector,
            max_sample_age_s=settings.idle_reclaim_max_sample_age_s,
        )

    def keep_applied() -> Coroutine[None, None, int]:
        return run(
            settings,
            api,
            CatalogMetrics(registry),
            read_inventory=read,
            inventory_metrics=InventoryMetrics(registry),
            health=health,
            elector=elector,
            reclaimer=reclaimer,
        )

    keeper = _certificate_keeper(settings, api_client)
    share_quota = _share_quota(settings, api_client)

    async def start() -> int:
        if keeper is None:
            return await serving(
                settings, keep_applied, driver=DEFAULT_DRIVER_NAME, share_quota=share_quota
            )
        try:
            await keeper.start()
        except CertificateSetupError as error:
            log.error("cannot set up the webhook certificate: %s", error)
            return EXIT_BAD_SETUP

        async def keep_applied_and_certificate() -> int:
            stop = asyncio.Event()
            task = asyncio.create_task(keeper.keep(stop), name="webhook-certificate")
            try:
                return await keep_applied()
            finally:
                stop.set()
                await asyncio.gather(task, return_exceptions=True)

        return await serving(
            settings,
            keep_applied_and_certificate,
            driver=DEFAULT_DRIVER_NAME,
            share_quota=share_quota,
        )

    # The admission webhook is served beside the run loop (every replica) until it returns.
    try:
        return asyncio.run(start())
    except WebhookSetupError as error:
        log.error("%s", error)
        return EXIT_BAD_SETUP


def _share_quota(settings: ControllerSettings, api_client: ApiClient) -> ShareMemoryQuota | None:
    """With --share-memory-quota, the check of the webhook's share-memory endpoint; which classes
    serve shares comes from the catalog (reloaded now and then)."""
    if not (settings.webhook_port and settings.share_memory_quota):
        return None
    return ShareMemoryQuota(
        KubernetesShareQuotaApi(
            api_client, ledger_namespace=settings.share_memory_ledger_namespace
        ),
        lambda: list(load_catalog(settings.deviceclasses_dir)),
        driver=DEFAULT_DRIVER_NAME,
    )


def _certificate_keeper(
    settings: ControllerSettings, api_client: ApiClient
) -> CertificateKeeper | None:
    """With --webhook-tls-secret, the keeper of the webhook's self-signed certificate."""
    if not (settings.webhook_port and settings.webhook_tls_secret):
        return None
    return CertificateKeeper(
        KubernetesSecretApi(
            api_client,
            settings.webhook_tls_secret,
            labels={"app.kubernetes.io/managed-by": "gpu-dra-controller"},
        ),
        KubernetesWebhookConfigurationApi(
            api_client, settings.webhook_configuration, field_manager=settings.field_manager
        ),
        names=dns_names(settings.webhook_service),
        cert_file=settings.webhook_tls_cert_file,
        key_file=settings.webhook_tls_private_key_file,
    )


def _elector(
    settings: ControllerSettings,
    api_client: ApiClient,
    health: ControllerHealth,
    metrics: LeaderMetrics,
) -> LeaderElector:
    config = ElectionConfig(
        lease_name=settings.leader_election_lease_lock_name,
        namespace=settings.leader_election_lease_lock_namespace,
        identity=settings.leader_election_identity_or_host,
        lease_duration_s=settings.leader_election_lease_duration_s,
        renew_deadline_s=settings.leader_election_renew_deadline_s,
        retry_period_s=settings.leader_election_retry_period_s,
    )
    leases = KubernetesLeaseApi(
        api_client,
        namespace=config.namespace,
        name=config.lease_name,
        request_timeout_s=config.renew_deadline_s,
    )
    return LeaderElector(
        leases,
        config,
        on_api=lambda ok, reason: health.set(APISERVER_CHECK, ok, reason),
        on_leading=metrics.set_leading,
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
    health: ControllerHealth | None = None,
    elector: LeaderElector | None = None,
    reclaimer: IdleReclaimer | None = None,
) -> int:
    """Keep the catalog applied until SIGTERM/SIGINT (or `stop`), exporting the inventory when
    `read_inventory` and `inventory_metrics` are given, running the idle policy's passes when
    `reclaimer` is given; the process exit status. With `elector` (not with `--once`), the
    catalog and the idle policy only while it holds the Lease."""
    stop = stop or _stop_on_signals()
    health = health or ControllerHealth()
    tasks = [asyncio.create_task(health.heartbeat(stop), name="heartbeat")]
    if (
        read_inventory is not None
        and inventory_metrics is not None
        and settings.inventory_interval_s > 0
        and not settings.once
    ):
        tasks.append(
            asyncio.create_task(
                inventory_loop(
                    settings.inventory_interval_s, read_inventory, inventory_metrics, stop
                )
            )
        )

    async def leader_duties() -> int:
        idle = None
        if reclaimer is not None and not settings.once:
            idle = asyncio.create_task(
                idle_reclaim_loop(reclaimer, settings.idle_reclaim_interval_s, stop),
                name="idle-reclaim",
            )
        try:
            return await _keep_applied(settings, api, metrics, stop, health)
        finally:
            if idle is not None:
                idle.cancel()
                await asyncio.gather(idle, return_exceptions=True)

    try:
        if elector is None or settings.once:
            return await leader_duties()

        async def lead() -> int:
            try:
                return await leader_duties()
            finally:
                health.forget(CATALOG_CHECK)  # the next leader's apply counts now

        status = await elector.run(lead, stop)
        if status is None:
            log.info("stopping gpu-dra-controller")
        return EXIT_OK if status is None else status
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _keep_applied(
    settings: ControllerSettings,
    api: DeviceClassApi,
    metrics: CatalogMetrics,
    stop: asyncio.Event,
    health: ControllerHealth,
) -> int:
    try:
        catalog = load_catalog(settings.deviceclasses_dir)
    except CatalogError as error:
        log.error("cannot load the DeviceClass catalog: %s", error)
        health.set(CATALOG_CHECK, False, f"cannot load the catalog: {error}")
        return EXIT_BAD_SETUP
    while True:
        result = await apply_catalog(api, catalog, metrics)
        health.set(
            CATALOG_CHECK,
            result.ok,
            "; ".join(f"DeviceClass {name}: {message}" for name, message in result.failed),
        )
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
