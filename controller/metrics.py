"""Prometheus metrics of the controller: DeviceClass applies, the inventory gauges and the idle
policy (docs/idle-reclaim.md).

Metrics register on a registry passed in (no process-global default registry), so each process,
and each test, decides where they are exported.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


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


IDLE_ACTIONS = (
    "warned", "cleared", "evicted", "blocked", "would-evict", "would-block", "deferred", "stale",
)  # fmt: skip
"""``action`` of ``gpu_dra_idle_policy_actions_total`` (docs/idle-reclaim.md#metrics)."""


class IdlePolicyCollector(Collector):
    """The idle policy's gauges from its last pass; namespaces absent from it are not exported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[str, int] = {}
        self._stale: dict[str, int] = {}
        self._namespaces: dict[tuple[str, str], int] = {}

    def set_snapshot(
        self,
        idle_claims: Mapping[str, int],
        namespaces: Mapping[tuple[str, str], int],
        stale_claims: Mapping[str, int] | None = None,
    ) -> None:
        with self._lock:
            self._idle = dict(idle_claims)
            self._namespaces = dict(namespaces)
            self._stale = dict(stale_claims or {})

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            idle, namespaces, stale = self._idle, self._namespaces, self._stale
        yield _gauge(
            "gpu_dra_idle_policy_idle_claims",
            "Claims of an opted-in namespace whose every gpu.nvidia.com device has been idle "
            "for the namespace's window, at the idle policy's last pass.",
            ["namespace"],
            (((namespace,), value) for namespace, value in idle.items()),
        )
        yield _gauge(
            "gpu_dra_idle_policy_stale_claims",
            "Claims of an opted-in namespace whose activity report (status.devices Active and "
            "data.sampledAt) is older than the idle policy's bound or names no sample, at its "
            "last pass: their pods are neither warned nor evicted.",
            ["namespace"],
            (((namespace,), value) for namespace, value in stale.items()),
        )
        yield _gauge(
            "gpu_dra_idle_policy_namespaces",
            "1 per namespace labelled gpu.nvidia.com/idle-reclaim, by mode (enabled, dry-run, "
            "invalid: a label or annotation the policy cannot use; it leaves the namespace "
            "alone).",
            ["namespace", "mode"],
            namespaces.items(),
        )


def _gauge(
    name: str,
    documentation: str,
    labels: list[str],
    samples: Iterable[tuple[tuple[str, ...], int]],
) -> GaugeMetricFamily:
    """A gauge family with one sample per (label values, value), sorted by label values."""
    gauge = GaugeMetricFamily(name, documentation, labels=labels)
    for label_values, value in sorted(samples):
        gauge.add_metric(list(label_values), value)
    return gauge


class IdleReclaimMetrics:
    """What the idle policy did (counters) and saw (gauges of its last pass)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.collector = IdlePolicyCollector()
        registry.register(self.collector)
        self.actions = Counter(
            "gpu_dra_idle_policy_actions",
            "Actions of the idle policy on pods, by namespace and action (warned, cleared, "
            "evicted, blocked: an eviction a PodDisruptionBudget refused, would-evict and "
            "would-block: the same in a dry-run namespace, deferred: an eviction put off while "
            "the node's kubelet plugin is not Ready, stale: a pod left alone because a claim's "
            "activity report is stale).",
            ["namespace", "action"],
            registry=registry,
        )
        self.errors = Counter(
            "gpu_dra_idle_policy_errors",
            "API calls of the idle policy that failed, by call (list, pod, event, "
            "list-namespaces).",
            ["call"],
            registry=registry,
        )

    def set_snapshot(
        self,
        idle_claims: Mapping[str, int],
        namespaces: Mapping[tuple[str, str], int],
        stale_claims: Mapping[str, int] | None = None,
    ) -> None:
        self.collector.set_snapshot(idle_claims, namespaces, stale_claims)

    def count_action(self, namespace: str, action: str) -> None:
        self.actions.labels(namespace=namespace, action=action).inc()

    def count_error(self, call: str) -> None:
        self.errors.labels(call=call).inc()
