"""MPS at start-up: the daemon manager (None when the control program is not found or MPS is
unavailable, so that only the claims asking for MPS fail), the one supervisor of the daemons of
prepared claims and the keeper of the warm shared daemons. See docs/mps.md and
docs/architecture.md, "Start-up of the kubelet plugin".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from kubernetes.client import ApiClient

from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.kubeapi import KubernetesPodApi
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
from gpu_dra.kubelet_plugin.mps.shared_daemons import SharedDaemons
from gpu_dra.kubelet_plugin.mps.supervisor import DaemonSupervisor
from gpu_dra.kubelet_plugin.mps.warm_daemons import WarmDaemons
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_instances import PluginInstance
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings

log = logging.getLogger("gpu_dra.kubelet_plugin")


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
