"""MPS metrics: daemons running, claims per daemon and caps per claim, from the checkpoint of a
real preparer running the MPS test double; gone with the claims."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, CheckpointLockTimeoutError
from gpu_dra.kubelet_plugin.metrics import MpsCollector
from gpu_dra.kubelet_plugin.mps import shared_daemon_id
from tests.kubelet_plugin.nodes import (
    UID_A,
    UID_B,
    UID_C,
    SharesNode,
    ok,
    wait_dead,
)

GIB = 2**30


@pytest.fixture
def node(tmp_path: Path, mps_root: Path) -> SharesNode:
    return SharesNode(tmp_path, mps_root)


def registry_for(node: SharesNode) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(MpsCollector("node-a", node.checkpoint.all))
    return registry


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, ...], float]:
    """``{label values (sorted by label name): value}`` of one metric."""
    found = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == name:
                found[tuple(v for _, v in sorted(sample.labels.items()))] = sample.value
    return found


def test_shares_and_claim_daemons_are_exported_and_removed_when_gone(node: SharesNode) -> None:
    registry = registry_for(node)
    a = node.add_share(UID_A, "10Gi", "25", name="a", namespace="team-a")
    b = node.add_share(UID_B, "20Gi", "50", name="b", namespace="team-b")
    c = node.add_mps(
        UID_C,
        "gpu-2",
        mps_config={"defaultActiveThreadPercentage": 30, "defaultPinnedDeviceMemoryLimit": "4Gi"},
        name="c",
    )
    for claim in (a, b, c):
        ok(node.prepare(claim)[claim.uid])
    shared = shared_daemon_id(node.uuid_of("gpu-0"))
    [own] = node.handles(UID_C)
    gpu0, gpu2 = node.uuid_of("gpu-0"), node.uuid_of("gpu-2")

    # labels sorted by name: (kind, node) / (daemon, node) / (claim, claim_uid, daemon, gpu, node)
    assert samples(registry, "gpu_dra_mps_daemons") == {
        ("claim", "node-a"): 1,
        ("shared", "node-a"): 1,
    }
    assert samples(registry, "gpu_dra_mps_daemon_claims") == {
        (shared, "node-a"): 2,
        (own.daemon_id, "node-a"): 1,
    }
    assert samples(registry, "gpu_dra_mps_claim_pinned_memory_limit_bytes") == {
        ("team-a/a", UID_A, shared, gpu0, "node-a"): 10 * GIB,
        ("team-b/b", UID_B, shared, gpu0, "node-a"): 20 * GIB,
        ("default/c", UID_C, own.daemon_id, gpu2, "node-a"): 4 * GIB,
    }
    assert samples(registry, "gpu_dra_mps_claim_active_thread_percentage") == {
        ("team-a/a", UID_A, shared, "node-a"): 25,
        ("team-b/b", UID_B, shared, "node-a"): 50,
        ("default/c", UID_C, own.daemon_id, "node-a"): 30,
    }

    node.unprepare(a)
    assert samples(registry, "gpu_dra_mps_daemon_claims")[(shared, "node-a")] == 1
    assert ("team-a/a", UID_A, shared, "node-a") not in samples(
        registry, "gpu_dra_mps_claim_active_thread_percentage"
    )
    node.unprepare(b, c)
    assert samples(registry, "gpu_dra_mps_daemons") == {
        ("claim", "node-a"): 0,
        ("shared", "node-a"): 0,
    }
    for name in (
        "gpu_dra_mps_daemon_claims",
        "gpu_dra_mps_claim_pinned_memory_limit_bytes",
        "gpu_dra_mps_claim_active_thread_percentage",
    ):
        assert samples(registry, name) == {}, name


def test_a_dead_daemon_is_not_counted_as_running(node: SharesNode) -> None:
    registry = registry_for(node)
    claim = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(claim)[UID_A])
    [handle] = node.handles(UID_A)

    os.kill(handle.pid, signal.SIGKILL)
    assert wait_dead(handle.pid)

    assert samples(registry, "gpu_dra_mps_daemons")[("shared", "node-a")] == 0
    assert samples(registry, "gpu_dra_mps_daemon_claims") == {(handle.daemon_id, "node-a"): 1}
    node.unprepare(claim)


def test_a_daemon_restarted_in_place_counts_as_running_for_the_claims_that_joined_before(
    node: SharesNode,
) -> None:
    registry = registry_for(node)
    claim = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(claim)[UID_A])
    [handle] = node.handles(UID_A)
    os.kill(handle.pid, signal.SIGKILL)
    assert wait_dead(handle.pid)

    restarted = node.mps.ensure(handle).handle

    assert node.handles(UID_A) == [handle]  # the record keeps the instance it joined
    assert samples(registry, "gpu_dra_mps_daemons")[("shared", "node-a")] == 1
    node.unprepare(claim)
    assert wait_dead(restarted.pid)
    assert samples(registry, "gpu_dra_mps_daemons")[("shared", "node-a")] == 0


def test_an_unreadable_checkpoint_exports_no_daemons() -> None:
    def locked() -> dict[str, CheckpointEntry]:
        raise CheckpointLockTimeoutError("checkpoint lock held for 10 s")

    registry = CollectorRegistry()
    registry.register(MpsCollector("node-a", locked))

    assert samples(registry, "gpu_dra_mps_daemons") == {
        ("claim", "node-a"): 0,
        ("shared", "node-a"): 0,
    }
    assert samples(registry, "gpu_dra_mps_daemon_claims") == {}
