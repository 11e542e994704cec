"""Composition root of `gpu-dra-kubelet-plugin`: settings -> adapters -> serve until SIGTERM.

Order matters: discover the GPUs (`discover`: a node-wide NVML failure, or GPUs of which none can
be read, stop the plugin with exit status 1; a GPU that cannot be read is left out, logged at ERROR
with its NVML return code and exported as ``gpu_dra_gpu_discovery_errors``; see
docs/real-nodes.md, "NVML errors"), refuse a node whose GPUs NVIDIA's device plugin or another DRA
driver already serves (`guard_node`, kubelet-plugin/guard.py), recover from the
checkpoint (roll back half-done prepares, remove orphaned CDI specs), start publishing the node's
ResourceSlices and caching the ResourceClaims, then serve the DRA socket, and only then the
registration socket (PluginServer does both in that order). The MPS daemon manager exists before
recovery, which adopts the daemons of prepared claims and stops those of interrupted prepares
(after recovery, `DaemonSupervisor` checks them every ``--mps-daemon-check-interval``); the
time slicer (nvidia-smi on real GPUs, a recorded fake on simulated nodes) exists before recovery
too, which resets the time-slice intervals of interrupted prepares. With dynamic MIG, recovery also
destroys the MIG instances of partitionable GPUs that no prepared claim owns. Every successful
registration republishes the slices: the kubelet wipes them when it starts. Prepares GET their
claims until the cache has listed them. The gRPC health service (`--healthcheck-port`,
kubelet-plugin/health.py) listens from the start and reports SERVING once recovery is done and both
sockets answer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kubernetes.client import ApiClient
from prometheus_client import CollectorRegistry, start_http_server

from gpu_dra.driver import slices
from gpu_dra.driver.discovery import DiscoveryError, discover_devices
from gpu_dra.driver.model import NodeDevices
from gpu_dra.driver.nvml.interface import (
    NVML_INIT_FLAG_NO_GPUS,
    NVMLError,
    NvmlLibrary,
    PciTopology,
    return_code,
    return_code_name,
)
from gpu_dra.driver.nvml.real import RealNvml
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.sysfs import SysfsPciTopology
from gpu_dra.driver.shares import ShareSelectionError
from gpu_dra.kube.client import new_api_client, read_server_version
from gpu_dra.kube.errors import ApiError
from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.claimcache import CachedClaimReader
from gpu_dra.kubelet_plugin.driver_root import DriverRoot, DriverUserspaceError
from gpu_dra.kubelet_plugin.driver_userspace import CommonEdits
from gpu_dra.kubelet_plugin.guard import (
    GuardApi,
    KubernetesGuardApi,
    NodeCheck,
    NodeConflictError,
    guard,
)
from gpu_dra.kubelet_plugin.health import HealthServer, PluginHealth
from gpu_dra.kubelet_plugin.kubeapi import KubernetesClaimReader, KubernetesPodApi
from gpu_dra.kubelet_plugin.metrics import DiscoveryMetrics, MpsCollector, PluginMetrics
from gpu_dra.kubelet_plugin.mig import (
    SIMULATED_STATE_FILE,
    DynamicMig,
    MigLifecycle,
    SimulatedMigStateFile,
    crash_point_from_env,
)
from gpu_dra.kubelet_plugin.mps import (
    DaemonRunner,
    MpsDaemonManager,
    NvmlComputeMode,
    PlainDirectoryShm,
    PodRunner,
    ProcessRunner,
    ShmMounter,
    TmpfsShmMounter,
)
from gpu_dra.kubelet_plugin.mps.events import KubernetesEventApi, MpsEvents
from gpu_dra.kubelet_plugin.mps.ids import is_shared_daemon
from gpu_dra.kubelet_plugin.mps.memory_limits import ShareMemory
from gpu_dra.kubelet_plugin.mps.memory_limits import detect as detect_memory_limits
from gpu_dra.kubelet_plugin.mps.supervisor import DaemonSupervisor
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare import NodeClaimPreparer
from gpu_dra.kubelet_plugin.server import PluginServer
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.slices.kubeapi import KubernetesSliceApi
from gpu_dra.kubelet_plugin.slices.metrics import SliceMetrics
from gpu_dra.kubelet_plugin.slices.publisher import SlicePublisher
from gpu_dra.kubelet_plugin.timeslicing import (
    RECORD_FILE,
    NvidiaSmiTimeSlicer,
    RecordedTimeSlicer,
    TimeSlicer,
    driver_tool_env,
)

log = logging.getLogger("gpu_dra.kubelet_plugin")


class StartupError(Exception):
    """The plugin cannot start; the message says why (logged, exit status 1)."""


def _nvml(settings: KubeletPluginSettings) -> tuple[NvmlLibrary, PciTopology]:
    """Real NVML, or the simulated profile, whose MIG state lives in
    ``<data-dir>/simulated-nvml.json`` (loaded now, rewritten on every change) so that simulated
    MIG instances outlive the process as real ones do."""
    if settings.simulate:
        settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        state = SimulatedMigStateFile(settings.state_dir / SIMULATED_STATE_FILE, settings.simulate)
        host = SimulatedHost.load(
            settings.simulate, settings.node_name, saved_mig=state.load(), on_mig_change=state.save
        )
        return host.nvml, host.pci
    return RealNvml(settings.driver_root), SysfsPciTopology()


def discover(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    pci: PciTopology,
    metrics: DiscoveryMetrics | None = None,
) -> NodeDevices:
    """The node's GPUs. Raises `StartupError` when NVML cannot be initialised or asked for its
    GPUs, and when it reports GPUs of which none can be read (publishing nothing for them would
    hide them). Each GPU left out is logged at ERROR with the NVML call and return code, and set
    in `metrics`."""
    try:
        devices = discover_devices(nvml, pci, mig_profiles=settings.dynamic_mig_enabled)
    except DiscoveryError as error:
        raise StartupError(f"GPU discovery failed: {error}") from error
    for problem in devices.problems:
        log.error(
            "GPU left out, not published: %s (gpu=%d uuid=%s reason=%s)",
            problem.message,
            problem.index,
            problem.uuid or "-",
            problem.reason,
        )
    if metrics is not None:
        metrics.set_problems(devices.problems)
    if devices.problems and not devices.gpus:
        reasons = sorted({problem.reason for problem in devices.problems})
        raise StartupError(
            f"none of the {len(devices.problems)} GPU(s) NVML reports can be read "
            f"({', '.join(reasons)}; each is logged above); refusing to publish an empty "
            "ResourceSlice for them"
        )
    return devices


def _dynamic_mig(
    settings: KubeletPluginSettings, nvml: NvmlLibrary, inventory: NodeInventory
) -> DynamicMig | None:
    """The MIG lifecycle of the partitionable GPUs (dynamic MIG only), with the test-only crash
    point of ``GPU_DRA_TEST_CRASH_AT`` on simulated nodes."""
    if not settings.dynamic_mig_enabled:
        return None
    crash_point = crash_point_from_env(os.environ, simulated=settings.simulate is not None)
    return DynamicMig(MigLifecycle(nvml, crash_point=crash_point), inventory.partitionable_gpus())


def nvml_driver_version(nvml: NvmlLibrary) -> str:
    """``nvmlSystemGetDriverVersion`` between an init and a shutdown of its own; an NVML error
    is raised with its return code name."""
    try:
        nvml.init_with_flags(NVML_INIT_FLAG_NO_GPUS)
        try:
            return nvml.system_get_driver_version()
        finally:
            nvml.shutdown()
    except NVMLError as error:
        code = return_code(error)
        name = return_code_name(code) if code is not None else type(error).__name__
        raise DriverUserspaceError(f"nvmlSystemGetDriverVersion failed: {name}") from error


def driver_root(settings: KubeletPluginSettings) -> DriverRoot:
    """The driver root as the plugin sees it (`--driver-root`) and as the host does
    (`--nvidia-driver-root`)."""
    return DriverRoot(settings.driver_root, settings.host_driver_root)


async def _common_edits(settings: KubeletPluginSettings, nvml: NvmlLibrary) -> CommonEdits | None:
    """The driver userspace every real GPU container gets (None on simulated nodes), found now
    so that a wrong driver root is logged at start; prepares recompute it when the driver
    changes and fail with the message while it cannot be found."""
    if settings.simulate:
        return None
    common = CommonEdits(
        driver_root(settings),
        functools.partial(nvml_driver_version, nvml),
        hook_path=settings.nvidia_cdi_hook_path,
        disabled_hooks=settings.disable_cdi_hooks,
    )
    try:
        await asyncio.to_thread(common.current)
    except DriverUserspaceError as error:
        log.error("driver userspace not found, GPU claims will fail until it is: %s", error)
    return common


def _share_memory(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    events: MpsEvents | None,
) -> ShareMemory:
    """Which GPUs offered as MPS shares the driver caps per container (`memory_limits.detect`:
    ``--mps-share-memory-limits``, driver, cgroup v2, the hook's version, NVML), logged; each
    share's enforcement is reported as an Event on its claim."""
    hook = settings.nvidia_cdi_hook_path
    uuids = [gpu.uuid for gpu in inventory.mps_shares]
    support = detect_memory_limits(
        nvml,
        uuids,
        mode=settings.mps_share_memory_limits,
        simulated=settings.simulate is not None,
        hook_path=hook,
        driver_root=str(settings.host_driver_root),
        hook_candidates=list(dict.fromkeys([Path(hook), settings.driver_root / hook.lstrip("/")])),
        disabled_hooks=settings.disable_cdi_hooks,
    )
    for uuid in uuids:
        log.info("mps share memory of %s: %s (%s)", uuid, support.enforcement(uuid).value,
                 support.why(uuid))  # fmt: skip
    return ShareMemory(support, None if events is None else events.share_prepared)


def exclusive_daemons(mode: str) -> Callable[[str], bool]:
    """Which daemon ids get EXCLUSIVE_PROCESS on their full GPUs for
    ``--mps-exclusive-compute-mode`` ``mode``: the shared daemons of MPS shares (``shares``),
    every daemon (``all``) or none."""
    if mode == "all":
        return lambda _daemon_id: True
    if mode == "shares":
        return is_shared_daemon
    return lambda _daemon_id: False


POD_START_TIMEOUT_S = 25.0
"""Start-up deadline of a daemon pod (pod sandbox, container, socket), below --call-timeout."""


def _mps(
    settings: KubeletPluginSettings,
    api_client: ApiClient,
    nvml: NvmlLibrary,
    events: MpsEvents | None = None,
) -> MpsDaemonManager | None:
    """The MPS daemon manager, or None (claims asking for MPS then fail with a message).

    The workloads' shm is a tmpfs per daemon on real GPUs when the plugin runs as root (it needs
    CAP_SYS_ADMIN, and the data dir must be mounted with Bidirectional propagation for
    containers to see it); simulated nodes, and a plugin that is not root, use a plain
    directory, so that e2e runs need no mount privileges. Daemons run as host processes or as
    pods of this node (``--mps-daemon-runner``); the compute mode of their full GPUs is set as
    ``--mps-exclusive-compute-mode`` says (`exclusive_daemons`). ``events`` is told what daemon
    supervision repaired.
    """
    binary = settings.resolved_mps_control_binary()
    if binary is None:
        log.warning(
            "MPS control program %r not found on PATH nor under %s/usr/bin: "
            "claims with sharing strategy MPS will fail on this node",
            settings.mps_control_binary,
            settings.driver_root,
        )
        return None
    shm: ShmMounter
    if settings.simulate is None and os.geteuid() == 0:
        shm = TmpfsShmMounter()
    else:
        shm = PlainDirectoryShm()
        if settings.simulate is None:
            log.warning("not root: MPS shm directories are plain directories, not tmpfs mounts")
    pods = PodRunner(
        KubernetesPodApi(api_client),
        namespace=settings.mps_daemon_namespace,
        node_name=settings.node_name,
        image=settings.mps_daemon_image,
        driver_root=Path(settings.host_driver_root),
        priority_class=settings.mps_daemon_priority_class,
        image_pull_secrets=settings.mps_daemon_image_pull_secrets,
    )
    # The other runner still checks and stops the daemons it started before a switch.
    runner: DaemonRunner = ProcessRunner()
    other: DaemonRunner = pods
    start_timeout_s = 10.0
    if settings.mps_daemon_runner == "pod":
        runner, other = pods, runner
        start_timeout_s = POD_START_TIMEOUT_S
    try:
        manager = MpsDaemonManager(
            settings.state_dir,
            binary=binary,
            shm=shm,
            runner=runner,
            start_timeout_s=start_timeout_s,
            # Always there: it also resets what an earlier setting made exclusive.
            compute_mode=NvmlComputeMode(nvml),
            exclusive=exclusive_daemons(settings.mps_exclusive_compute_mode),
            other_runners=[other],
            observer=events,
        )
    except ValueError as error:
        log.error("MPS is unavailable: %s", error)
        return None
    log.info(
        "mps control program=%s shm=%s runner=%s image=%s namespace=%s exclusive_compute_mode=%s",
        binary,
        type(shm).__name__,
        runner.name,
        settings.mps_daemon_image or "-",
        settings.mps_daemon_namespace,
        settings.mps_exclusive_compute_mode,
    )
    return manager


PASCAL_ARCHITECTURE = 4
"""``NVML_DEVICE_ARCH_PASCAL``: simulated GPUs of this architecture or older answer "Not
Supported" to time-slice commands, as the Tesla P4 does (NVIDIA issues #41, #81, #363)."""


def _time_slicer(settings: KubeletPluginSettings, devices: NodeDevices) -> TimeSlicer | None:
    """nvidia-smi on real GPUs (None when it is not found: TimeSlicing claims then fail with a
    message); on simulated nodes the recorded fake, writing `<data-dir>/time-slicing.json`."""
    if settings.simulate:
        unsupported = {g.uuid for g in devices.gpus if g.architecture <= PASCAL_ARCHITECTURE}
        path = settings.state_dir / RECORD_FILE
        log.info("time-slicing simulated: recorded in %s", path)
        return RecordedTimeSlicer(path, not_supported=unsupported)
    binary = settings.resolved_nvidia_smi()
    if binary is None:
        log.warning(
            "nvidia-smi %r not found on PATH nor under %s/usr/bin: claims with sharing strategy "
            "TimeSlicing on full GPUs will fail on this node",
            settings.nvidia_smi,
            settings.driver_root,
        )
        return None
    try:
        env = driver_tool_env(binary, settings.driver_root)
    except FileNotFoundError as error:
        log.warning("%s: claims with sharing strategy TimeSlicing will fail on this node", error)
        return None
    preloaded = f" (LD_PRELOAD={env['LD_PRELOAD']})" if "LD_PRELOAD" in env else ""
    log.info("time-slicing with %s%s", binary, preloaded)
    return NvidiaSmiTimeSlicer(binary, base_env=env)


def slice_layout(
    settings: KubeletPluginSettings, server_version: Callable[[], tuple[str, str]]
) -> slices.SliceLayout:
    """`--slice-layout`, or the layout the apiserver's version accepts (1.34 combined, 1.35+
    split; `server_version` gives ``/version``'s major and minor); split when the version cannot
    be read (logged, naming the flag)."""
    if settings.slice_layout is not None:
        return settings.slice_layout
    try:
        major, minor = server_version()
        layout = slices.layout_for_kubernetes(major, minor)
    except (ApiError, ValueError) as error:
        log.warning("%s; publishing the split layout (set --slice-layout to choose)", error)
        return slices.SliceLayout.SPLIT
    log.info("apiserver version %s.%s: %s slice layout", major, minor, layout.value)
    return layout


def node_inventory(settings: KubeletPluginSettings, devices: NodeDevices) -> NodeInventory:
    """The inventory of what `discover` found, logged; a warning when it publishes nothing."""
    dynamic_mig = settings.dynamic_mig_enabled
    inventory = NodeInventory.from_discovery(
        devices,
        simulated=settings.simulate is not None,
        driver=driver_root(settings),
        mps_shares=settings.mps_shares,
        dynamic_mig=dynamic_mig,
        cdi_hook_path=settings.nvidia_cdi_hook_path,
        disabled_cdi_hooks=settings.disable_cdi_hooks,
    )
    log.info(
        "discovered %d GPU(s) (%d left out) and %d MIG device(s) node=%s simulated=%s "
        "dynamic_mig=%s partitionable GPUs=%d",
        len(devices.gpus),
        len(devices.problems),
        len(devices.mig_devices),
        settings.node_name,
        settings.simulate,
        dynamic_mig,
        len(inventory.counter_sets()),
    )
    if not inventory.published_devices():
        log.warning(
            "no device to publish: %s",
            "NVML reports no GPU"
            if not devices.gpus
            else "every usable GPU is in MIG mode without MIG devices (make MIG devices, or "
            "run with --dynamic-mig)",
        )
    if inventory.mps_shares:
        log.info(
            "offering GPU(s) %s as MPS shares (max share %d%%)",
            ",".join(str(gpu.index) for gpu in inventory.mps_shares),
            settings.mps_share_max_percent,
        )
    return inventory


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


def guard_node(settings: KubeletPluginSettings, api: GuardApi) -> None:
    """Refuse (`StartupError`, after an Event on the Node) a node whose GPUs NVIDIA's device
    plugin or another DRA driver of this name already serves; a check that cannot be made
    refuses too."""
    check = NodeCheck(
        node_name=settings.node_name,
        driver_name=settings.driver_name,
        plugins_dir=settings.kubelet_plugins_dir,
        registry_dir=settings.kubelet_registry_dir,
        device_plugins_dir=settings.device_plugins_dir,
    )
    try:
        guard(
            api,
            check,
            event_namespace=settings.event_namespace,
            allow_device_plugin=settings.allow_nvidia_device_plugin,
        )
    except NodeConflictError as error:
        raise StartupError(f"this node's GPUs are already handed out: {error}") from error
    except ApiError as error:
        raise StartupError(
            f"cannot check whether something else hands out this node's GPUs: {error}"
        ) from error


async def _guarded_api_client(settings: KubeletPluginSettings) -> ApiClient:
    """The API client, once `guard_node` let the plugin start on this node."""
    api_client = new_api_client(settings.kubeconfig)
    await asyncio.to_thread(guard_node, settings, KubernetesGuardApi(api_client))
    return api_client


def _serve_metrics(
    settings: KubeletPluginSettings, registry: CollectorRegistry, checkpoint: Checkpoint
) -> None:
    """Add the MPS gauges (read from the checkpoint) and serve ``/metrics`` on
    ``--metrics-port`` (0: not served)."""
    registry.register(MpsCollector(settings.node_name, checkpoint.all))
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=registry)
        log.info("metrics on :%d/metrics", settings.metrics_port)


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _supervise(
    settings: KubeletPluginSettings, mps: MpsDaemonManager | None, checkpoint: Checkpoint
) -> list[asyncio.Task[None]]:
    """The MPS daemon supervision task (`DaemonSupervisor`), or none without MPS or with
    ``--mps-daemon-check-interval=0``."""
    if mps is None or settings.mps_daemon_check_interval_s <= 0:
        return []
    supervisor = DaemonSupervisor(
        mps, checkpoint.all, interval_s=settings.mps_daemon_check_interval_s
    )
    return [asyncio.create_task(supervisor.run(), name="mps-supervisor")]


async def serve(settings: KubeletPluginSettings, health: PluginHealth) -> None:
    nvml, pci = _nvml(settings)
    registry = CollectorRegistry()
    discovery_metrics = DiscoveryMetrics(registry, settings.node_name)
    devices = await asyncio.to_thread(discover, settings, nvml, pci, discovery_metrics)
    inventory = node_inventory(settings, devices)
    # Discovery only reads; nothing is written (checkpoint, CDI specs, MIG) before the guard.
    api_client = await _guarded_api_client(settings)
    settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    checkpoint = Checkpoint(settings.state_dir)
    loaded = await asyncio.to_thread(checkpoint.load)
    if loaded.discarded_boot_id:
        log.info(
            "node rebooted: discarded checkpoint of boot %s with %d claim(s)",
            loaded.discarded_boot_id,
            len(loaded.discarded_claims),
        )
    common_edits = await _common_edits(settings, nvml)
    claim_api = KubernetesClaimReader(api_client)
    claims = CachedClaimReader(claim_api)
    mps_events = MpsEvents(
        KubernetesEventApi(api_client), claim_api, checkpoint.all, node_name=settings.node_name
    )
    mps = _mps(settings, api_client, nvml, mps_events)
    preparer = NodeClaimPreparer(
        driver_name=settings.driver_name,
        node_name=settings.node_name,
        inventory=inventory,
        claims=claims,
        uncached_claims=claim_api,
        checkpoint=checkpoint,
        cdi=ClaimSpecStore(settings.cdi_root, driver_name=settings.driver_name),
        claims_dir=settings.state_dir / "claims",
        mps=mps,
        time_slicer=_time_slicer(settings, devices),
        mps_share_max_percent=settings.mps_share_max_percent,
        dynamic_mig=_dynamic_mig(settings, nvml, inventory),
        common_edits=None if common_edits is None else common_edits.current,
        mps_share_memory=_share_memory(settings, nvml, inventory, mps_events),
    )
    await preparer.recover()
    health.mark_recovered()

    _serve_metrics(settings, registry, checkpoint)
    publisher = SlicePublisher(
        KubernetesSliceApi(api_client),
        driver=settings.driver_name,
        node_name=settings.node_name,
        metrics=SliceMetrics(registry),
    )
    layout = slices.SliceLayout.SPLIT
    if inventory.counter_sets():
        layout = await asyncio.to_thread(
            slice_layout, settings, functools.partial(read_server_version, api_client)
        )
    publisher.set_desired(inventory.desired_pool(settings.driver_name, settings.node_name, layout))
    publishing = asyncio.create_task(publisher.run(), name="publisher")
    supervising = _supervise(settings, mps, checkpoint)

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
    )
    stop = _stop_on_signals()
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
        publisher.stop()
        for task in supervising:
            task.cancel()
        await asyncio.gather(publishing, *supervising, return_exceptions=True)
        await asyncio.to_thread(claims.close)
        api_client.close()  # type: ignore[no-untyped-call]


def main(argv: Sequence[str] | None = None) -> int:
    settings = KubeletPluginSettings.parse(argv)
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
