"""The plugin's Prometheus metrics count what the kubelet-facing handler really returned."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase, JsonValue
from gpu_dra.kubelet_plugin.dra_service import ClaimCallHandler
from gpu_dra.kubelet_plugin.metrics import ClaimStateCollector, PluginMetrics
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from tests.fakes.claim_preparer import InMemoryClaimPreparer

OK = ClaimRef("ns", "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01", "ok")
BAD = ClaimRef("ns", "1c7b2f4d-9054-4b66-8b1f-3e8d2cac9b12", "bad")
FORGOTTEN = ClaimRef("ns", "2d8c305e-a165-4c77-9c20-4f9e3dbdac23", "forgotten")


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


def test_prepare_counts_each_claim_by_result_and_times_the_call() -> None:
    registry = CollectorRegistry()
    preparer = InMemoryClaimPreparer(prepare_errors={BAD.uid: "boom"}, forget={FORGOTTEN.uid})
    handler = ClaimCallHandler(preparer, metrics=PluginMetrics(registry))

    asyncio.run(handler.prepare([OK, BAD, FORGOTTEN]))

    claims = "gpu_dra_kubelet_plugin_claims_total"
    assert sample(registry, claims, operation="prepare", result="ok") == 1
    # a claim the preparer forgot is reported to the kubelet as an error, and counted as one
    assert sample(registry, claims, operation="prepare", result="error") == 2
    assert sample(registry, claims, operation="unprepare", result="ok") == 0
    duration = "gpu_dra_kubelet_plugin_call_duration_seconds_count"
    assert sample(registry, duration, operation="prepare") == 1
    assert sample(registry, duration, operation="unprepare") == 0


def test_unprepare_counts_errors_and_successes() -> None:
    registry = CollectorRegistry()
    preparer = InMemoryClaimPreparer(unprepare_errors={BAD.uid: "stuck"})
    handler = ClaimCallHandler(preparer, metrics=PluginMetrics(registry))

    asyncio.run(handler.unprepare([OK, BAD]))

    claims = "gpu_dra_kubelet_plugin_claims_total"
    assert sample(registry, claims, operation="unprepare", result="ok") == 1
    assert sample(registry, claims, operation="unprepare", result="error") == 1
    assert (
        sample(
            registry, "gpu_dra_kubelet_plugin_call_duration_seconds_count", operation="unprepare"
        )
        == 1
    )


def test_an_empty_call_is_not_counted() -> None:
    registry = CollectorRegistry()
    handler = ClaimCallHandler(InMemoryClaimPreparer(), metrics=PluginMetrics(registry))

    asyncio.run(handler.prepare([]))

    assert (
        sample(registry, "gpu_dra_kubelet_plugin_call_duration_seconds_count", operation="prepare")
        == 0
    )


def test_claims_whose_mig_or_mps_state_cannot_be_read_are_exported_one_series_each() -> None:
    def entry(claim: ClaimRef, state: dict[str, JsonValue]) -> CheckpointEntry:
        return CheckpointEntry(claim=claim, phase=ClaimPhase.PREPARE_COMPLETED, state=state)

    entries = {
        OK.uid: entry(OK, {"dynamicMig": [], "mpsDaemons": []}),
        BAD.uid: entry(BAD, {"dynamicMig": [{"device": 3}], "mpsDaemons": "x"}),
    }
    registry = CollectorRegistry()
    registry.register(ClaimStateCollector("node-a", lambda: entries))

    series = [
        s.labels for m in registry.collect() for s in m.samples if s.name.endswith("unreadable")
    ]

    assert sorted(s["state"] for s in series) == ["dynamicMig", "mpsDaemons"]
    assert {(s["claim"], s["claim_uid"], s["node"]) for s in series} == {
        ("ns/bad", BAD.uid, "node-a")
    }
    entries.pop(BAD.uid)  # unprepared: its series go
    assert not [s for m in registry.collect() for s in m.samples]
