"""The claim status writer as the plugin runs it: its entries built from the checkpoint, the
inventory, the health monitor's snapshot and the utilization monitor's activity
(`start_claim_status`; None when ``--claim-status=false``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kubernetes import client as k8s
from prometheus_client import CollectorRegistry

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry
from gpu_dra.kubelet_plugin.claim_status.content import Activity, DeviceStatus, claim_status
from gpu_dra.kubelet_plugin.claim_status.writer import (
    ClaimStatusApi,
    ClaimStatusWriter,
    KubernetesClaimStatusApi,
)
from gpu_dra.kubelet_plugin.device_health.monitor import Snapshot
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.tiers.state import time_slices_from_state
from gpu_dra.kubelet_plugin.time_slicer import TimeSlicingStateError
from gpu_dra.kubelet_plugin.utilization.claims import claim_devices
from gpu_dra.kubelet_plugin.utilization.monitor import UtilizationMonitor

log = logging.getLogger(__name__)


@dataclass
class ClaimStatusRuntime:
    writer: ClaimStatusWriter
    task: asyncio.Task[None]

    async def close(self) -> None:
        self.writer.stop()
        await asyncio.gather(self.task, return_exceptions=True)


def status_builder(
    settings: KubeletPluginSettings,
    inventory: NodeInventory,
    health: Callable[[], Snapshot] | None,
    utilization: UtilizationMonitor | None,
) -> Callable[[CheckpointEntry], list[DeviceStatus]]:
    """`claim_status` of one entry with the node's current facts."""

    def build(entry: CheckpointEntry) -> list[DeviceStatus]:
        devices = claim_devices({entry.claim.uid: entry}, inventory, lambda ns, name: ())
        activity: dict[str, Activity] | None = None
        if utilization is not None:
            activity = {}
            latest = utilization.latest
            for device in devices if latest is not None else ():
                last = utilization.last_active(device.key)
                if last is not None and latest is not None:
                    activity[device.device] = Activity(
                        last, latest.at, settings.claim_status_idle_after_s
                    )
        try:
            time_slices: Mapping[str, int] = time_slices_from_state(entry.state)
        except TimeSlicingStateError:
            time_slices = {}
        return claim_status(
            entry,
            inventory,
            devices,
            driver=settings.driver_name,
            node=settings.node_name,
            health=None if health is None else health(),
            activity=activity,
            time_slices=time_slices,
        )

    return build


def start_claim_status(
    settings: KubeletPluginSettings,
    api_client: k8s.ApiClient | None,
    inventory: NodeInventory,
    *,
    entries: Callable[[], Mapping[str, CheckpointEntry]],
    health: Callable[[], Snapshot] | None,
    utilization: UtilizationMonitor | None,
    registry: CollectorRegistry,
    is_turn: Callable[[], bool],
    api: ClaimStatusApi | None = None,
) -> ClaimStatusRuntime | None:
    """Start the writer in the running event loop; None when off."""
    if not settings.claim_status:
        log.info("claim status off (--claim-status=false)")
        return None
    if api is None:
        if api_client is None:
            return None
        api = KubernetesClaimStatusApi(api_client)
    writer = ClaimStatusWriter(
        api,
        entries,
        status_builder(settings, inventory, health, utilization),
        registry=registry,
        is_turn=is_turn,
        min_interval_s=settings.claim_status_min_interval_s,
    )
    task = asyncio.create_task(writer.run(), name="claim-status")
    log.info("claim status on: status.devices of prepared claims, at most every %gs per claim",
             settings.claim_status_min_interval_s)  # fmt: skip
    return ClaimStatusRuntime(writer, task)
