"""Prometheus metrics of the slice publisher: writes by verb, reconciles, failed reconciles.

Registered on a registry passed in; the kubelet plugin exports them on ``--metrics-port``
(docs/config.md).
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter

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
