"""Wiring of utilization per claim into the kubelet plugin: the collectors on the metrics
registry and, unless ``--utilization-interval`` is 0, the sampling thread (on a simulated node
fed by ``<data-dir>/simulated-utilization.json``). See docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry

from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.utilization.claims import (
    ClaimDevice,
    PodRef,
    claim_devices,
    pods_from_claim,
)
from gpu_dra.kubelet_plugin.utilization.metrics import ClaimUtilizationCollector, SampleMetrics
from gpu_dra.kubelet_plugin.utilization.monitor import UtilizationMonitor
from gpu_dra.kubelet_plugin.utilization.sampler import UtilizationSampler
from gpu_dra.kubelet_plugin.utilization.simulated_file import (
    SIMULATED_UTILIZATION_FILE,
    SimulatedUtilizationFile,
)

ClaimLookup = Callable[[str, str], Mapping[str, object] | None]
"""(namespace, name) -> the claim as cached, or None (`CachedClaimReader.cached`)."""


def start_utilization(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    *,
    entries: Callable[[], Mapping[str, CheckpointEntry]],
    claims: ClaimLookup,
    registry: CollectorRegistry,
) -> UtilizationMonitor | None:
    """Register the collectors; start sampling (None when the interval is 0)."""

    def pods(namespace: str, name: str) -> tuple[PodRef, ...]:
        return pods_from_claim(claims(namespace, name))

    def devices() -> list[ClaimDevice]:
        return claim_devices(entries(), inventory, pods)

    monitor = None
    if settings.utilization_interval_s > 0:
        metrics = SampleMetrics(registry, settings.node_name)
        simulated = (
            SimulatedUtilizationFile(settings.state_dir / SIMULATED_UTILIZATION_FILE, nvml)
            if isinstance(nvml, SimulatedNvml)
            else None
        )
        monitor = UtilizationMonitor(
            UtilizationSampler(nvml),
            devices,
            interval_s=settings.utilization_interval_s,
            idle_threshold_percent=settings.utilization_idle_threshold,
            before_sample=None if simulated is None else simulated.apply,
            on_sample=metrics.observe,
        )
    registry.register(ClaimUtilizationCollector(settings.node_name, devices, monitor))
    if monitor is not None:
        monitor.start()
    return monitor
