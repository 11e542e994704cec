"""Composition root of `gpu-dra-kubelet-plugin`: settings -> adapters -> serve until SIGTERM.

Order matters: discover the GPUs, refuse a node whose GPUs something else hands out, register
this instance, load the checkpoint and recover (MPS manager, time slicer and MIG lifecycle exist
before recovery, which uses them), mark the instance ready, publish the ResourceSlices (while the
newest ready instance), start the MPS daemon supervision and the device health monitor, then
serve the DRA socket and only then the registration socket. The gRPC health service listens from
the start and reports SERVING once recovery is done and both sockets answer. A `StartupError` is
exit status 1. The parts are built in `startup/`. See docs/architecture.md, "Start-up of the
kubelet plugin".
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Sequence

from kubernetes.client import ApiClient
from prometheus_client import CollectorRegistry, start_http_server

from gpu_dra.driver.health import HealthRecordError
from gpu_dra.driver.model import NodeDevices
from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.shares import ShareSelectionError
from gpu_dra.kube.events import KubernetesEventApi
from gpu_dra.kubelet_plugin import health_command, startup
from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.claim_status.runtime import ClaimStatusRuntime, start_claim_status
from gpu_dra.kubelet_plugin.claimcache import CachedClaimReader
from gpu_dra.kubelet_plugin.device_health.runtime import (
    HealthRuntime,
    RecordedHealth,
    close_health,
    health_services,
    recorded_health,
    start_health,
)
from gpu_dra.kubelet_plugin.fault_injection import (
    boot_id_from_env,
    nvml_faults_from_env,
    prepare_delay_from_env,
)
from gpu_dra.kubelet_plugin.health import HealthServer, PluginHealth
from gpu_dra.kubelet_plugin.kubeapi import KubernetesClaimReader, KubernetesEvictionApi
from gpu_dra.kubelet_plugin.metrics import (
    DiscoveryMetrics,
    PluginMetrics,
    register_checkpoint_collectors,
)
from gpu_dra.kubelet_plugin.mig import SimulatedMigStateFile
from gpu_dra.kubelet_plugin.mps.events import MpsEvents
from gpu_dra.kubelet_plugin.mps.memory_watchdog import MemoryWatchdog, start_memory_watchdog
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_instances import PluginInstance
from gpu_dra.kubelet_plugin.plugin_sockets import PluginServer
from gpu_dra.kubelet_plugin.prepare import NodeClaimPreparer
from gpu_dra.kubelet_plugin.publishing import PublisherTurn
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup import (
    StartupError,
    discovery,
    memory_caps,
    mps_daemons,
    node_guard,
    slice_publishing,
    userspace,
)
from gpu_dra.kubelet_plugin.tiers.assembly import node_tiers
from gpu_dra.kubelet_plugin.utilization.monitor import UtilizationMonitor
from gpu_dra.kubelet_plugin.utilization.runtime import start_utilization

log = logging.getLogger("gpu_dra.kubelet_plugin")


async def run(settings: KubeletPluginSettings) -> None:
    """Serve the gRPC health service (`--healthcheck-port`, NOT_SERVING until the sockets are
    served) for as long as the plugin starts, runs and stops."""
    health = PluginHealth()
    health_server = None
    if settings.healthcheck_port >= 0:
        health_server = HealthServer(health, settings.healthcheck_port)
        await health_server.start()
    try:
        await serve(settings, health)
    finally:
        await health.stopping()
        if health_server is not None:
            await health_server.stop()


async def serve(settings: KubeletPluginSettings, health: PluginHealth) -> None:
    startup.arm_test_crash_point(settings)
    nvml, pci, simulated_mig = discovery.node_nvml_and_state(settings)
    registry = CollectorRegistry()
    discovery_metrics = DiscoveryMetrics(registry, settings.node_name)
    devices = await asyncio.to_thread(discovery.discover, settings, nvml, pci, discovery_metrics)
    inventory = discovery.node_inventory(settings, devices)
    if isinstance(nvml, SimulatedNvml):  # tests only: NVML calls that fail from now on
        for call, gpu, code in nvml_faults_from_env(os.environ, simulated=True):
            nvml.set_fault(call, code, gpu=gpu)
    # Discovery only reads; nothing is written (checkpoint, CDI specs, MIG) before the guard.
    api_client = await node_guard.guarded_api_client(settings, health)
    settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    instance = await asyncio.to_thread(node_guard.register_instance, settings)
    try:
        await _serve_instance(
            settings, health=health, instance=instance, api_client=api_client, nvml=nvml,
            devices=devices, inventory=inventory, registry=registry, simulated_mig=simulated_mig,
        )  # fmt: skip
    finally:
        instance.close()


async def _load_checkpoint(settings: KubeletPluginSettings) -> Checkpoint:
    """The checkpoint of the data dir, loaded (one of another boot discarded, and logged). The
    boot ID is the kernel's, or on simulated nodes the test-only ``GPU_DRA_TEST_BOOT_ID``."""
    simulated = settings.simulate is not None
    checkpoint = Checkpoint(
        settings.state_dir, boot_id=boot_id_from_env(os.environ, simulated=simulated)
    )
    loaded = await asyncio.to_thread(checkpoint.load)
    if loaded.discarded_boot_id:
        log.info(
            "node rebooted: discarded checkpoint of boot %s with %d claim(s)",
            loaded.discarded_boot_id,
            len(loaded.discarded_claims),
        )
    return checkpoint


async def _health_record(
    settings: KubeletPluginSettings, inventory: NodeInventory
) -> RecordedHealth | None:
    """The health record (None with the monitor off); an unusable one stops the plugin."""
    if not settings.health_monitor_enabled:
        return None
    try:
        return await asyncio.to_thread(recorded_health, settings, inventory)
    except HealthRecordError as error:
        raise StartupError(str(error)) from error


async def _serve_instance(
    settings: KubeletPluginSettings,
    *,
    health: PluginHealth,
    instance: PluginInstance,
    api_client: ApiClient,
    nvml: NvmlLibrary,
    devices: NodeDevices,
    inventory: NodeInventory,
    registry: CollectorRegistry,
    simulated_mig: SimulatedMigStateFile | None,
) -> None:
    checkpoint = await _load_checkpoint(settings)
    common_edits = await userspace.common_edits(settings, nvml)
    claim_api = KubernetesClaimReader(api_client)
    claims = CachedClaimReader(claim_api)
    mps_events = MpsEvents(
        KubernetesEventApi(api_client), claim_api, checkpoint.all, node_name=settings.node_name
    )
    mps = mps_daemons.mps_manager(settings, api_client, nvml, mps_events)
    inventory, capped_memory = memory_caps.capped_shares(settings, nvml, inventory, mps_events)
    share_memory = memory_caps.share_memory(settings, nvml, inventory, mps_events)
    records = ClaimRecords(checkpoint, owner=instance.token)
    cdi = ClaimSpecStore(settings.cdi_root, driver_name=settings.driver_name)
    tiers = node_tiers(
        records,
        inventory,
        node_name=settings.node_name,
        cdi=cdi,
        instance=instance,
        mps=mps,
        time_slicer=userspace.time_slicer(settings, devices),
        dynamic_mig=discovery.dynamic_mig(settings, nvml, inventory, instance.locks, simulated_mig),
        mps_share_max_percent=settings.mps_share_max_percent,
        mps_share_memory=share_memory,
        mps_share_warm=settings.mps_share_daemon_warm,
        capped_share_memory=capped_memory,
    )
    preparer = NodeClaimPreparer(
        driver_name=settings.driver_name,
        node_name=settings.node_name,
        inventory=inventory,
        claims=claims,
        uncached_claims=claim_api,
        records=records,
        cdi=cdi,
        claims_dir=settings.state_dir / "claims",
        tiers=tiers,
        common_edits=None if common_edits is None else common_edits.current,
        instance=instance,
        test_prepare_delay_s=prepare_delay_from_env(
            os.environ, simulated=settings.simulate is not None
        ),
    )
    try:
        await preparer.recover()
    except TimeoutError as error:  # another instance's calls never finished
        raise StartupError(f"start-up recovery: {error}") from error
    await asyncio.to_thread(instance.mark_ready)
    health.mark_recovered()

    register_checkpoint_collectors(registry, settings.node_name, checkpoint.all)
    utilization = start_utilization(
        settings, nvml, inventory, entries=checkpoint.all, claims=claims.cached, registry=registry
    )
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=registry)
        log.info("metrics on :%d/metrics", settings.metrics_port)
    # A GPU the health record says is faulty, or whose MIG sweep failed, is published tainted
    # from the first slice on.
    recorded = await _health_record(settings, inventory)
    taints = slice_publishing.node_taints(
        settings,
        inventory,
        {} if recorded is None else recorded.taints,
        tiers.dynamic_mig.unswept(),
    )
    # The newest ready instance publishes: two versions never write the pool in turn.
    publisher, _ = await slice_publishing.publisher_turn(
        settings, api_client, inventory, registry, instance, taints=taints
    )
    publishing = asyncio.create_task(publisher.run(), name="publisher-turn")
    # One checker of the MPS daemons: it repairs them while this instance publishes, and the
    # health monitor takes its verdicts (docs/mps.md, "Daemon supervision").
    supervisor = mps_daemons.mps_supervisor(settings, mps, checkpoint, instance, inventory)
    supervising = (
        [] if supervisor is None else [asyncio.create_task(supervisor.run(), name="mps-supervisor")]
    )
    # GPUs whose MIG sweep failed stay tainted until a sweep succeeds (docs/mig.md).
    supervising.append(asyncio.create_task(slice_publishing.sweep_until_clean(
        preparer, taints, inventory, settings.driver_name, tiers.dynamic_mig.unswept()
    ), name="mig-sweep"))  # fmt: skip
    if supervisor is not None and tiers.shared_daemons is not None:
        # A share joining a live daemon leaves the settings check to the supervisor.
        tiers.shared_daemons.set_checker(supervisor)
    # The shared daemons of MPS shares start ahead of their first share (docs/mps.md, "Warm
    # daemons"); the first pass is waited for, so the first share finds its daemon running.
    warmer = mps_daemons.mps_warmer(settings, mps, tiers.shared_daemons, instance, inventory)
    if warmer is not None:
        supervising.append(asyncio.create_task(warmer.run(), name="mps-warm-daemons"))
        try:
            await asyncio.wait_for(warmer.first_pass.wait(), mps_daemons.WARM_FIRST_PASS_WAIT_S)
        except TimeoutError:
            log.warning("mps warm daemons not all started after %gs, serving meanwhile",
                        mps_daemons.WARM_FIRST_PASS_WAIT_S)  # fmt: skip
    # Shares the driver does not cap: checked from NVML; only the publishing instance acts.
    watchdog = start_memory_watchdog(
        settings, nvml, inventory, share_memory.support, entries=checkpoint.all,
        claims=claims.cached, registry=registry, is_turn=instance.newest_ready,
        events=mps_events, evictions=KubernetesEvictionApi(api_client),
    )  # fmt: skip
    device_health = start_health(
        settings,
        nvml,
        inventory,
        supervisor=supervisor,
        republish=functools.partial(taints.set, slice_publishing.HEALTH),
        entries=checkpoint.all,
        recorded=recorded,
        events=KubernetesEventApi(api_client),
        registry=registry,
    )
    # What each prepared claim holds, in its status.devices (docs/architecture.md#claim-status).
    claim_status = start_claim_status(
        settings, api_client, inventory, entries=checkpoint.all,
        health=None if device_health is None else device_health.monitor.snapshot,
        utilization=utilization, registry=registry, is_turn=instance.newest_ready,
    )  # fmt: skip
    try:
        await _serve_sockets(
            settings, health=health, preparer=preparer, registry=registry, claims=claims,
            publisher=publisher, publishing=publishing, device_health=device_health,
            api_client=api_client, supervising=supervising,
        )  # fmt: skip
    finally:
        await _close_reporters(claim_status, utilization, watchdog)


async def _close_reporters(
    claim_status: ClaimStatusRuntime | None,
    utilization: UtilizationMonitor | None,
    watchdog: MemoryWatchdog | None,
) -> None:
    """Stop what reports on the prepared claims: status writer, sampler, memory watchdog."""
    if claim_status is not None:
        await claim_status.close()
    if utilization is not None:
        await asyncio.to_thread(utilization.close)
    if watchdog is not None:
        await asyncio.to_thread(watchdog.close)


async def _serve_sockets(
    settings: KubeletPluginSettings,
    *,
    health: PluginHealth,
    preparer: NodeClaimPreparer,
    registry: CollectorRegistry,
    claims: CachedClaimReader,
    publisher: PublisherTurn,
    publishing: asyncio.Task[None],
    device_health: HealthRuntime | None,
    api_client: ApiClient,
    supervising: Sequence[asyncio.Task[None]] = (),
) -> None:
    """Serve the DRA and registration sockets until SIGTERM or SIGINT (or a publisher bug),
    then stop in order: sockets, health monitor, publisher and MPS supervision, claim cache,
    API client."""

    async def registered() -> None:
        publisher.republish()

    server = PluginServer(
        driver_name=settings.driver_name,
        preparer=preparer,
        metrics=PluginMetrics(registry),
        plugins_dir=settings.kubelet_plugins_dir,
        registry_dir=settings.kubelet_registry_dir,
        call_timeout_s=settings.call_timeout_s,
        on_registered=registered,
        extra_services=health_services(device_health),
        instance_id=settings.instance_id or None,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    claims.start()
    try:
        await server.start()
        health.attach(server)
        log.info("serving dra=%s registration=%s", server.dra_socket, server.registration_socket)
        done, _ = await asyncio.wait(
            {publishing, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
        )
        if publishing in done:
            publishing.result()  # the publisher only ends on a bug: surface it
    finally:
        log.info("shutting down")
        await health.stopping()
        await server.stop()
        await close_health(device_health)
        publisher.stop()
        for task in supervising:
            task.cancel()
        await asyncio.gather(publishing, *supervising, return_exceptions=True)
        await asyncio.to_thread(claims.close)
        api_client.close()  # type: ignore[no-untyped-call]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [health_command.COMMAND]:
        return health_command.clear_health(args[1:])
    settings = KubeletPluginSettings.parse(args)
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(run(settings))
    except ShareSelectionError as error:
        log.error("cannot start: %s", error)
        return 2
    except StartupError as error:
        log.error("cannot start: %s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
