"""The node's GPUs at start-up: real NVML or the simulated profile (whose MIG state a file keeps),
discovery (`discover`: `StartupError` when NVML fails node-wide or no reported GPU can be read),
the node inventory (logged: what is published, offered as shares, and a warning when nothing is)
and the dynamic MIG lifecycle. See docs/architecture.md, "Start-up of the kubelet plugin".
"""

from __future__ import annotations

import logging

from gpu_dra.driver.discovery import DiscoveryError, discover_devices
from gpu_dra.driver.model import NodeDevices
from gpu_dra.driver.nvml.interface import NvmlLibrary, PciTopology
from gpu_dra.driver.nvml.real import RealNvml
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.sysfs import SysfsPciTopology
from gpu_dra.kubelet_plugin.metrics import DiscoveryMetrics
from gpu_dra.kubelet_plugin.mig import SIMULATED_STATE_FILE, MigLifecycle, SimulatedMigStateFile
from gpu_dra.kubelet_plugin.mig.claims import DynamicMig
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.node_locks import NodeLocks
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.simulated_facts import SIMULATED_FACTS_DIR, SharedFactFiles
from gpu_dra.kubelet_plugin.startup import StartupError
from gpu_dra.kubelet_plugin.startup.userspace import driver_root

log = logging.getLogger("gpu_dra.kubelet_plugin")


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
        share_replicas=settings.mps_share_replicas,
        dynamic_mig=dynamic_mig,
        mig_policy=settings.dynamic_mig_profiles,
        cdi_hook_path=settings.nvidia_cdi_hook_path,
        disabled_cdi_hooks=settings.disable_cdi_hooks,
        fact_files=(
            None
            if settings.simulate is None
            else SharedFactFiles(settings.state_dir / SIMULATED_FACTS_DIR)
        ),
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
            "offering GPU(s) %s as MPS shares (max share %d%%, an unnamed amount is 1/%d)",
            ",".join(str(gpu.index) for gpu in inventory.mps_shares),
            settings.mps_share_max_percent,
            settings.mps_share_replicas,
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
