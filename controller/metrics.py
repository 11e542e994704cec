"""Prometheus metrics of the ResourceSlice publisher and of the controller.

Metrics register on a registry passed in (no process-global default registry), so each process,
and each test, decides where they are exported.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

WriteVerb = Literal["create", "update", "delete"]
WRITE_VERBS: tuple[WriteVerb, ...] = ("create", "update", "delete")


class SliceMetrics:
    """Counters of the slice writes made and the reconciles that failed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.writes = Counter(
            "gpu_dra_resourceslice_writes",
            "ResourceSlice writes that the apiserver accepted, by verb.",
            ["verb"],
            registry=registry,
        )
        self.reconciles = Counter(
            "gpu_dra_resourceslice_reconciles",
            "Pool reconciles that finished, with or without writes.",
            registry=registry,
        )
        self.reconcile_errors = Counter(
            "gpu_dra_resourceslice_reconcile_errors",
            "Pool reconcile attempts that failed, by reason (conflict, api, internal).",
            ["reason"],
            registry=registry,
        )
        for verb in WRITE_VERBS:
            self.writes.labels(verb=verb)

    def count_write(self, verb: WriteVerb) -> None:
        self.writes.labels(verb=verb).inc()

    def count_error(self, reason: str) -> None:
        self.reconcile_errors.labels(reason=reason).inc()


class CatalogMetrics:
    """Counter of DeviceClass applies, by result."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.applies = Counter(
            "gpu_dra_deviceclass_applies",
            "DeviceClass applies from the catalog, by result (applied, failed).",
            ["result"],
            registry=registry,
        )
        for result in ("applied", "failed"):
            self.applies.labels(result=result)


class LeaderMetrics:
    """``gpu_dra_controller_leader``: 1 while this replica does the leader's duties."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.leader = Gauge(
            "gpu_dra_controller_leader",
            "1 while this controller replica holds the leader election Lease and applies the "
            "catalog (always 1 without leader election), else 0.",
            registry=registry,
        )

    def set_leading(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)


DeviceCounts = Mapping[tuple[str, str, str], int]
"""(node, type, state) -> devices."""
ClassCounts = Mapping[tuple[str, str], int]
"""(deviceclass, state) -> devices."""


class InventoryCollector(Collector):
    """Yields the last inventory snapshot as gauges; label sets absent from it are not exported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: dict[tuple[str, str, str], int] = {}
        self._classes: dict[tuple[str, str], int] = {}

    def set_snapshot(self, devices: DeviceCounts, classes: ClassCounts) -> None:
        with self._lock:
            self._devices = dict(devices)
            self._classes = dict(classes)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            devices, classes = self._devices, self._classes
        device_gauge = GaugeMetricFamily(
            "gpu_dra_devices",
            "Devices of the driver per node, type attribute and allocation state "
            "(free, allocated, shared, blocked, admin), from the last inventory read.",
            labels=["node", "type", "state"],
        )
        for (node, kind, state), value in sorted(devices.items()):
            device_gauge.add_metric([node, kind, state], value)
        yield device_gauge
        class_gauge = GaugeMetricFamily(
            "gpu_dra_deviceclass_devices",
            "Devices each DeviceClass's selectors match (total), how many can be allocated "
            "now (free) and how many are out of shared counters (blocked), "
            "from the last inventory read.",
            labels=["deviceclass", "state"],
        )
        for (name, state), value in sorted(classes.items()):
            class_gauge.add_metric([name, state], value)
        yield class_gauge


class InventoryMetrics:
    """The inventory gauges (a snapshot replaced as a whole) and the failed-read counter."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.collector = InventoryCollector()
        registry.register(self.collector)
        self.errors = Counter(
            "gpu_dra_inventory_errors",
            "Inventory reads that failed (the gauges keep the last snapshot).",
            registry=registry,
        )

    def update(self, devices: DeviceCounts, classes: ClassCounts) -> None:
        self.collector.set_snapshot(devices, classes)

    def count_error(self) -> None:
        self.errors.inc()
