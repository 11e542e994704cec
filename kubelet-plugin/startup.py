"""What the kubelet plugin's composition root (`__main__.py`) builds at start-up.

GPU discovery (`discover`: `StartupError` when NVML fails node-wide or no reported GPU can be
read), the node inventory, the guard against another owner of the node's GPUs (`guard_node`),
the instance registration (`register_instance`), the driver userspace edits, the MPS daemon
manager, the time slicer, the dynamic MIG lifecycle and the ResourceSlice publishing turn. Each
helper logs what it found; a missing optional part (MPS, nvidia-smi) is logged and None, so that
only the claims asking for it fail. See docs/architecture.md, "Start-up of the kubelet plugin".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

from kubernetes.client import ApiClient
from prometheus_client import CollectorRegistry

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
from gpu_dra.kube.client import new_api_client, read_server_version
from gpu_dra.kube.errors import ApiError
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.guard import (
    GuardApi,
    KubernetesGuardApi,
    NodeCheck,
    NodeConflictError,
    guard,
)
from gpu_dra.kubelet_plugin.kubeapi import KubernetesPodApi
from gpu_dra.kubelet_plugin.metrics import DiscoveryMetrics
from gpu_dra.kubelet_plugin.mig import SIMULATED_STATE_FILE, MigLifecycle, SimulatedMigStateFile
from gpu_dra.kubelet_plugin.mig.claims import DynamicMig
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
from gpu_dra.kubelet_plugin.mps.events import MpsEvents
from gpu_dra.kubelet_plugin.mps.ids import is_shared_daemon
from gpu_dra.kubelet_plugin.mps.memory_limits import (
    MemoryLimitSupport,
    ShareMemory,
    watchdog_note,
)
from gpu_dra.kubelet_plugin.mps.memory_limits import detect as detect_memory_limits
from gpu_dra.kubelet_plugin.mps.shared_daemons import SharedDaemons
from gpu_dra.kubelet_plugin.mps.supervisor import DaemonSupervisor
from gpu_dra.kubelet_plugin.mps.warm_daemons import WarmDaemons
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.node_locks import NodeLocks
from gpu_dra.kubelet_plugin.nvidia_driver_root import DriverRoot, DriverUserspaceError
from gpu_dra.kubelet_plugin.nvidia_userspace import CommonEdits
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry, PluginInstance
from gpu_dra.kubelet_plugin.plugin_sockets import (
    MAX_SOCKET_PATH_BYTES,
    remove_stale_sockets,
    socket_paths,
)
from gpu_dra.kubelet_plugin.publishing import PublisherTurn
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.slices.kubeapi import KubernetesSliceApi
from gpu_dra.kubelet_plugin.slices.metrics import SliceMetrics
from gpu_dra.kubelet_plugin.slices.publisher import SlicePublisher
from gpu_dra.kubelet_plugin.tiers.capped_shares import offer_capped
from gpu_dra.kubelet_plugin.time_slicer import (
    RECORD_FILE,
    NvidiaSmiTimeSlicer,
    RecordedTimeSlicer,
    TimeSlicer,
    driver_tool_env,
)

log = logging.getLogger("gpu_dra.kubelet_plugin")


class StartupError(Exception):
    """The plugin cannot start; the message says why (logged, exit status 1)."""


def node_nvml(settings: KubeletPluginSettings) -> tuple[NvmlLibrary, PciTopology]:
    """Real NVML, or the simulated profile (`node_nvml_and_state`)."""
    nvml, pci, _ = node_nvml_and_state(settings)
    return nvml, pci


def node_nvml_and_state(
    settings: KubeletPluginSettings,
) -> tuple[NvmlLibrary, PciTopology, SimulatedMigStateFile | None]:
    """Real NVML, or the simulated profile, whose MIG state lives in
    ``<data-dir>/simulated-nvml.json`` (loaded now, rewritten on every change, shared with
    another instance on the node) so that simulated MIG instances outlive the process as real
    ones do; that file is returned too."""
    if settings.simulate:
        settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        state = SimulatedMigStateFile(settings.state_dir / SIMULATED_STATE_FILE, settings.simulate)
        host = SimulatedHost.load(
            settings.simulate, settings.node_name, saved_mig=state.load(), on_mig_change=state.save
        )
        state.attach(host.nvml)
        return host.nvml, host.pci, state
    return RealNvml(settings.driver_root), SysfsPciTopology(), None


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


def dynamic_mig(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    locks: NodeLocks | None = None,
    simulated: SimulatedMigStateFile | None = None,
) -> DynamicMig | None:
    """The MIG lifecycle of the partitionable GPUs (dynamic MIG only) under the node-wide GPU
    locks (on simulated nodes the GPU state is refreshed from the shared file before each
    use)."""
    if not settings.dynamic_mig_enabled:
        return None
    lifecycle = MigLifecycle(
        nvml,
        locks=locks,
        refresh=None if simulated is None else simulated.refresh,
    )
    return DynamicMig(lifecycle, inventory.partitionable_gpus())


def arm_test_crash_point(settings: KubeletPluginSettings) -> None:
    """Arm the test-only fault injection point ``GPU_DRA_TEST_CRASH_AT`` names (simulated nodes
    only, `crash_points`); `StartupError` for a name that is no such point."""
    try:
        crash_points.arm_from_env(os.environ, simulated=settings.simulate is not None)
    except ValueError as error:
        raise StartupError(str(error)) from error


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


async def common_edits(settings: KubeletPluginSettings, nvml: NvmlLibrary) -> CommonEdits | None:
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


POD_START_TIMEOUT_S = 25.0
"""Start-up deadline of a daemon pod (pod sandbox, container, socket), below --call-timeout."""


def share_memory(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    events: MpsEvents | None,
) -> ShareMemory:
    """Which GPUs offered as MPS shares the driver caps per container (`memory_limits.detect`:
    ``--mps-share-memory-limits``, driver, cgroup v2, the hook's version, NVML; never a MIG
    device), logged; each share's enforcement is reported as an Event on its claim, naming the
    memory watchdog where the driver does not cap."""
    hook = settings.nvidia_cdi_hook_path
    uuids = [gpu.uuid for gpu in inventory.mps_shares]
    mig = [device.uuid for device in inventory.mig_mps_shares]
    support = detect_memory_limits(
        nvml,
        uuids,
        mode=settings.mps_share_memory_limits,
        simulated=settings.simulate is not None,
        hook_path=hook,
        driver_root=str(settings.host_driver_root),
        hook_candidates=list(dict.fromkeys([Path(hook), settings.driver_root / hook.lstrip("/")])),
        disabled_hooks=settings.disable_cdi_hooks,
    ).without_mig(mig)
    for uuid in [*uuids, *mig]:
        log.info("mps share memory of %s: %s (%s)", uuid, support.enforcement(uuid).value,
                 support.why(uuid))  # fmt: skip
    return ShareMemory(
        support,
        None if events is None else events.share_prepared,
        watchdog_note(settings.mps_memory_watchdog, settings.mps_memory_watchdog_interval_s),
    )


def capped_shares(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    events: MpsEvents | None,
) -> tuple[NodeInventory, ShareMemory]:
    """The inventory with only the GPUs of ``--capped-shares`` whose driver caps a container's
    memory (`memory_limits.detect`, as for MPS shares: driver, cgroup v2, the hook's version,
    NVML); each GPU left out is logged with why, and stays a plain whole GPU."""
    if not inventory.capped_shares:
        return inventory, ShareMemory(MemoryLimitSupport(), None)
    hook = settings.nvidia_cdi_hook_path
    support = detect_memory_limits(
        nvml,
        [gpu.uuid for gpu in inventory.capped_shares],
        mode="auto",
        simulated=settings.simulate is not None,
        hook_path=hook,
        driver_root=str(settings.host_driver_root),
        hook_candidates=list(dict.fromkeys([Path(hook), settings.driver_root / hook.lstrip("/")])),
        disabled_hooks=settings.disable_cdi_hooks,
    )
    capped = offer_capped(inventory, support)
    return capped, ShareMemory(support, None if events is None else events.capped_share_prepared)


def exclusive_daemons(mode: str) -> Callable[[str], bool]:
    """Which daemon ids get EXCLUSIVE_PROCESS on their full GPUs for
    ``--mps-exclusive-compute-mode`` ``mode``: the shared daemons of MPS shares (``shares``),
    every daemon (``all``) or none."""
    if mode == "all":
        return lambda _daemon_id: True
    if mode == "shares":
        return is_shared_daemon
    return lambda _daemon_id: False


def mps_manager(
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


def time_slicer(settings: KubeletPluginSettings, devices: NodeDevices) -> TimeSlicer | None:
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


def _log_mig_policy(
    settings: KubeletPluginSettings, devices: NodeDevices, inventory: NodeInventory
) -> None:
    """What `--dynamic-mig-profiles` publishes per MIG-capable GPU (a GPU it offers nothing on
    stays a plain GPU: a warning, as that is rarely meant)."""
    policy = settings.dynamic_mig_profiles
    published = inventory.published_devices()
    for mig_gpu in devices.mig_profiles:
        offered = policy.offered(mig_gpu.gpu, mig_gpu.profiles)
        if not offered and mig_gpu.profiles:
            log.warning(
                "--dynamic-mig-profiles=%s offers none of the MIG profiles of GPU %d (%s: %s); "
                "it is not partitioned",
                policy,
                mig_gpu.gpu.index,
                mig_gpu.gpu.product_name,
                ",".join(profile.name for profile in mig_gpu.profiles),
            )
            continue
        log.info(
            "dynamic MIG profiles of GPU %d (%s): %s",
            mig_gpu.gpu.index,
            mig_gpu.gpu.product_name,
            ",".join(profile.name for profile in offered),
        )
    log.info("publishing %d devices (--dynamic-mig-profiles=%s)", len(published), policy)


def node_inventory(settings: KubeletPluginSettings, devices: NodeDevices) -> NodeInventory:
    """The inventory of what `discover` found, logged; a warning when it publishes nothing."""
    dynamic_mig = settings.dynamic_mig_enabled
    inventory = NodeInventory.from_discovery(
        devices,
        simulated=settings.simulate is not None,
        driver=driver_root(settings),
        mps_shares=settings.mps_shares,
        capped_shares=settings.capped_shares,
        mps_shares_on_mig=settings.mps_shares_on_mig,
        mps_shares_on_dynamic_mig=settings.mps_shares_on_dynamic_mig,
        dynamic_mig=dynamic_mig,
        mig_policy=settings.dynamic_mig_profiles,
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
    if dynamic_mig:
        _log_mig_policy(settings, devices, inventory)
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
    if inventory.mig_mps_shares:
        log.info(
            "offering MIG device(s) %s as MPS shares (one daemon each, max share %d%%)",
            ",".join(mig.uuid for mig in inventory.mig_mps_shares),
            settings.mps_share_max_percent,
        )
    elif not settings.mps_shares_on_mig.empty:
        log.warning(
            "--mps-shares-on-mig offers no MIG device of this node: no published static MIG "
            "device matches it (the MIG devices of GPUs that --dynamic-mig partitions are "
            "not: offer their partitions with --mps-shares-on-dynamic-mig)"
        )
    if inventory.partition_shares:
        log.info(
            "offering %d dynamic MIG partition(s) of profile(s) %s as MPS shares (one daemon "
            "per MIG device made, max share %d%%)",
            len(inventory.partition_shares),
            ",".join(sorted({p.profile_name for p in inventory.partition_shares})),
            settings.mps_share_max_percent,
        )
    elif not settings.mps_shares_on_dynamic_mig.empty:
        log.warning(
            "--mps-shares-on-dynamic-mig offers no partition of this node: dynamic MIG "
            "publishes no partition of the profiles it names"
        )
    return inventory


def guard_node(settings: KubeletPluginSettings, api: GuardApi) -> None:
    """Refuse (`StartupError`, after an Event on the Node) a node whose GPUs NVIDIA's device
    plugin or another DRA driver of this name already serves (another running gpu-dra instance
    of this data dir is a rolling update, not a conflict); a check that cannot be made refuses
    too."""
    live = InstanceRegistry(settings.state_dir).live()
    check = NodeCheck(
        node_name=settings.node_name,
        driver_name=settings.driver_name,
        plugins_dir=settings.kubelet_plugins_dir,
        registry_dir=settings.kubelet_registry_dir,
        device_plugins_dir=settings.device_plugins_dir,
        gpu_dra_sockets=frozenset(Path(path) for info in live for path in info.sockets),
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


async def guarded_api_client(settings: KubeletPluginSettings) -> ApiClient:
    """The API client, once `guard_node` let the plugin start on this node."""
    api_client = new_api_client(settings.kubeconfig)
    await asyncio.to_thread(guard_node, settings, KubernetesGuardApi(api_client))
    return api_client


def register_instance(settings: KubeletPluginSettings) -> PluginInstance:
    """This process as a plugin instance of the data dir, after forgetting dead instances and
    removing their sockets (and any other socket of this driver nobody serves)."""
    registry = InstanceRegistry(settings.state_dir)
    dead = registry.remove_dead()
    instance_id = settings.instance_id or None
    sockets = socket_paths(
        settings.driver_name,
        settings.kubelet_plugins_dir,
        settings.kubelet_registry_dir,
        instance_id,
    )
    for path in sockets:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise StartupError(
                f"socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes: use a "
                "shorter --kubelet-plugins-dir (or --instance-id)"
            )
    instance = registry.register(settings.instance_id, sockets)
    live = {Path(path) for info in registry.live() for path in info.sockets}
    candidates = {Path(path) for info in dead for path in info.sockets}
    socket_dir = settings.kubelet_plugins_dir.absolute() / settings.driver_name
    registry_dir = settings.kubelet_registry_dir.absolute()
    with contextlib.suppress(OSError):
        candidates.update(socket_dir.glob("dra*.sock"))
    with contextlib.suppress(OSError):
        candidates.update(registry_dir.glob(f"{settings.driver_name}-*reg.sock"))
    remove_stale_sockets(candidates, keep=live)
    return instance


HEALTH_MPS_INTERVAL_S = 10.0
"""Between two read-only checks of the MPS share daemons for the health monitor when
supervision is off (``--mps-daemon-check-interval=0``)."""


def mps_supervisor(
    settings: KubeletPluginSettings,
    mps: MpsDaemonManager | None,
    checkpoint: Checkpoint,
    instance: PluginInstance,
    inventory: NodeInventory,
) -> DaemonSupervisor | None:
    """The one checker of the MPS daemons of prepared claims (`DaemonSupervisor`), or None
    without MPS, or with supervision off and no health monitor watching MPS shares. It repairs
    (restart in place, settings restored) only with ``--mps-daemon-check-interval`` > 0 and
    while this instance is the newest ready one (the one that publishes), each repair under
    the daemon's node-wide ``mps-<id>`` lock; otherwise it only reads, for the health monitor
    (docs/mps.md, "Daemon supervision")."""
    interval = settings.mps_daemon_check_interval_s
    shared = inventory.shared_devices or inventory.partition_shares
    watched = settings.health_monitor_enabled and bool(shared)
    if mps is None or (interval <= 0 and not watched):
        return None
    locks = instance.locks

    def repair() -> bool:
        return interval > 0 and instance.newest_ready()

    return DaemonSupervisor(
        mps,
        checkpoint.all,
        interval_s=interval if interval > 0 else HEALTH_MPS_INTERVAL_S,
        repair=repair,
        lock=lambda daemon_id: locks.blocking(f"mps-{daemon_id}"),
    )


WARM_FIRST_PASS_WAIT_S = 30.0
"""How long start-up waits for the first pass of the warm daemons before it serves: the first
share after a plugin start then finds its daemon running; a slower start goes on behind."""


def mps_warmer(
    settings: KubeletPluginSettings,
    mps: MpsDaemonManager | None,
    shared: SharedDaemons | None,
    instance: PluginInstance,
    inventory: NodeInventory,
) -> WarmDaemons | None:
    """The keeper of the warm shared daemons (`WarmDaemons`), or None without MPS or GPUs (or
    static MIG devices) offered as shares. It acts only while this instance is the newest ready
    one (the one that publishes and repairs), every ``--mps-daemon-check-interval`` (10 s when
    that is 0); with ``--mps-share-daemon-warm=off`` it only stops warm daemons an earlier
    plugin left."""
    if mps is None or shared is None or not inventory.shared_devices:
        return None
    interval = settings.mps_daemon_check_interval_s
    return WarmDaemons(
        shared,
        mps,
        inventory.shared_devices,
        policy=settings.mps_share_daemon_warm,
        interval_s=interval if interval > 0 else HEALTH_MPS_INTERVAL_S,
        repair=instance.newest_ready,
    )


async def publisher_turn(
    settings: KubeletPluginSettings,
    api_client: ApiClient,
    inventory: NodeInventory,
    registry: CollectorRegistry,
    instance: PluginInstance,
) -> tuple[PublisherTurn, slices.SliceLayout]:
    """Publishing of the node's pool (in the layout the apiserver takes, read only when there
    are counter sets), while this instance is the newest ready one; the layout."""
    slice_metrics = SliceMetrics(registry)
    layout = slices.SliceLayout.SPLIT
    if inventory.counter_sets():
        layout = await asyncio.to_thread(
            slice_layout, settings, functools.partial(read_server_version, api_client)
        )
    pool = inventory.desired_pool(settings.driver_name, settings.node_name, layout)

    def new_publisher() -> SlicePublisher:
        return SlicePublisher(
            KubernetesSliceApi(api_client),
            driver=settings.driver_name,
            node_name=settings.node_name,
            metrics=slice_metrics,
        )

    turn = PublisherTurn(new_publisher, instance.newest_ready)
    turn.set_desired(pool)
    return turn, layout
