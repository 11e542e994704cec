"""Prometheus metrics of device health (docs/metrics.md#device-health): each published device's
health and current problems, read from the monitor at every scrape, and the NVML events the
monitor handled, counted per GPU (XIDs by number, ignored ones too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_dra.driver.health import HealthStatus, Problem, Recovery
from gpu_dra.driver.nvml.interface import (
    NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
)
from gpu_dra.kubelet_plugin.device_health.monitor import Snapshot

UNKNOWN_GPU: Final = "unknown"
"""The ``gpu`` label of an event whose GPU's UUID NVML could not tell."""


class HealthEventMetrics:
    """``gpu_dra_health_events_total``: NVML events by GPU, kind, XID and what they did."""

    def __init__(self, registry: CollectorRegistry, node: str) -> None:
        self._node = node
        self.events = Counter(
            "gpu_dra_health_events",
            "NVML events the health monitor handled, by GPU UUID, kind (xid, "
            "double-bit-ecc, recovery, other), XID number (xid only) and outcome (the severity "
            "it recorded, or ignored: an XID in --health-ignored-xids).",
            ["node", "gpu", "kind", "xid", "outcome"],
            registry=registry,
        )

    def observe(
        self, gpu: str | None, event_type: int, data: int, found: Problem | Recovery | None
    ) -> None:
        """Count one event of GPU ``gpu`` (None: its UUID could not be read)."""
        if isinstance(found, Recovery):
            kind, xid, outcome = "recovery", "", "recovered"
        else:
            if event_type & NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
                kind, xid = "xid", str(data)
            elif event_type & NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR:
                kind, xid = "double-bit-ecc", ""
            else:
                kind, xid = "other", ""
            outcome = "ignored" if found is None else found.severity.name.lower()
        self.events.labels(
            node=self._node, gpu=gpu or UNKNOWN_GPU, kind=kind, xid=xid, outcome=outcome
        ).inc()


class DeviceHealthCollector(Collector):
    """``gpu_dra_device_health`` (1 per published device, its status as a label) and
    ``gpu_dra_device_problem_since_timestamp_seconds`` (per current problem), from
    ``snapshot()`` at every scrape."""

    def __init__(self, node: str, snapshot: Callable[[], Snapshot]) -> None:
        self._node = node
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        health = GaugeMetricFamily(
            "gpu_dra_device_health",
            "1 per published device, labelled with its health as the kubelet sees it "
            "(Healthy, Unhealthy, Unknown: health not monitored).",
            labels=["node", "device", "status"],
        )
        problems = GaugeMetricFamily(
            "gpu_dra_device_problem_since_timestamp_seconds",
            "When each current problem of a published device began (its taint's timeAdded), "
            "by key (xid, ecc, gpu-lost, mps-daemon, unmonitored), value (the XID number, ...) "
            "and severity (degraded, lost, unmonitored).",
            labels=["node", "device", "key", "value", "severity"],
        )
        for device, state in sorted(self._snapshot().items()):
            health.add_metric([self._node, device, HealthStatus(state.status).value], 1)
            for problem in state.problems:
                labels = [self._node, device, problem.key, problem.value]
                labels.append(problem.severity.name.lower())
                problems.add_metric(labels, problem.since.timestamp())
        yield health
        yield problems
