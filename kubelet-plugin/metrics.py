"""Prometheus metrics of the kubelet plugin's DRA calls.

Registered on a registry passed in (no process-global default), exported by `__main__` on
`--metrics-port` together with the slice publisher's metrics.
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram

Operation = Literal["prepare", "unprepare"]
OPERATIONS: tuple[Operation, ...] = ("prepare", "unprepare")

# Prepare targets are milliseconds; the kubelet gives up at 45 s.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 45)


class PluginMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.call_duration = Histogram(
            "gpu_dra_kubelet_plugin_call_duration_seconds",
            "Duration of NodePrepareResources / NodeUnprepareResources calls, by operation.",
            ["operation"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.claims = Counter(
            "gpu_dra_kubelet_plugin_claims",
            "Claims handled, by operation and result (ok, error).",
            ["operation", "result"],
            registry=registry,
        )
        for operation in OPERATIONS:
            self.call_duration.labels(operation=operation)
            for result in ("ok", "error"):
                self.claims.labels(operation=operation, result=result)

    def observe_call(self, operation: Operation, seconds: float) -> None:
        self.call_duration.labels(operation=operation).observe(seconds)

    def count_claim(self, operation: Operation, ok: bool) -> None:
        self.claims.labels(operation=operation, result="ok" if ok else "error").inc()
