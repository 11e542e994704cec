"""The tier interface's shared pieces: `PrepareRun` (what a prepare recorded and made so far)
and `Planned` (the plans made so far)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin.checkpoint import Checkpoint, ClaimPhase, JsonValue
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.tiers.protocol import ClaimRequest, Planned, PrepareRun, Tier, TierPlan
from tests.kubelet_plugin.nodes import hgx_h100_inventory

CLAIM = ClaimRef("default", "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01", "claim-a")


def run_on(
    tmp_path: Path, inventory: NodeInventory, state: dict[str, JsonValue] | None = None
) -> PrepareRun:
    checkpoint = Checkpoint(tmp_path, boot_id=lambda: "boot-1")
    checkpoint.load()
    return PrepareRun(CLAIM, ClaimRecords(checkpoint), inventory, state or {})


def test_append_records_at_once_and_keeps_the_list_for_completed(tmp_path: Path) -> None:
    run = run_on(tmp_path, hgx_h100_inventory(), {"intent": {"gpu": 1}})

    run.append("made", {"id": "a"})
    run.append("made", {"id": "b"})

    entry = run.records.get(CLAIM.uid)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_STARTED
    assert entry.state == {"intent": {"gpu": 1}, "made": [{"id": "a"}, {"id": "b"}]}
    assert run.completed == {"made": [{"id": "a"}, {"id": "b"}]}


def test_a_device_made_for_the_claim_stands_in_for_the_published_one(tmp_path: Path) -> None:
    inventory = hgx_h100_inventory()
    run = run_on(tmp_path, inventory)
    gpu_0, gpu_1 = inventory.by_name("gpu-0"), inventory.by_name("gpu-1")
    assert gpu_0 is not None
    assert gpu_1 is not None

    assert run.device("gpu-0") is gpu_0
    run.made["gpu-0"] = gpu_1  # type: ignore[assignment]  # any device will do here
    assert run.device("gpu-0") is gpu_1


@dataclass(frozen=True)
class _Daemon:
    daemon_id: str
    device_names: tuple[str, ...]
    uuids: tuple[str, ...]


class _SharePlan(TierPlan):
    @property
    def shared_devices(self) -> frozenset[str]:
        return frozenset({"gpu-0", "gpu-1"})


class _DaemonPlan(TierPlan):
    @property
    def mps_daemons(self) -> tuple[_Daemon, ...]:
        return (_Daemon("mps-a", ("gpu-2",), ("GPU-2",)),)


class _PlainPlan(TierPlan):
    pass


class _Tier(Tier):
    def plan(self, request: ClaimRequest, planned: Planned) -> TierPlan:
        return _PlainPlan()


def test_planned_gathers_the_facts_of_every_plan_so_far_and_finds_a_plan_by_tier() -> None:
    planned = Planned()
    share_tier, daemon_tier, plain_tier = _Tier(), _Tier(), _Tier()
    shares, daemons, plain = _SharePlan(), _DaemonPlan(), _PlainPlan()
    assert planned.shared_devices == frozenset()
    assert planned.mps_daemons == ()

    planned.add(share_tier, shares)
    planned.add(daemon_tier, daemons)
    planned.add(plain_tier, plain)

    assert planned.shared_devices == {"gpu-0", "gpu-1"}
    assert planned.mps_daemons == (_Daemon("mps-a", ("gpu-2",), ("GPU-2",)),)
    assert planned.of_tier(daemon_tier) is daemons
    assert planned.of_tier(plain_tier) is plain


def test_a_plan_changes_the_node_unless_it_says_it_does_not() -> None:
    # The default keeps the PrepareStarted record: a new tier must show it may skip it.
    assert _PlainPlan().changes_node


def test_a_run_without_a_started_record_refuses_to_record(tmp_path: Path) -> None:
    # A plan that records what it made although no plan said it changes the node is a bug:
    # it fails the prepare (rolled back) instead of recording behind the preparer's back.
    checkpoint = Checkpoint(tmp_path, boot_id=lambda: "boot-1")
    checkpoint.load()
    run = PrepareRun(CLAIM, ClaimRecords(checkpoint), hgx_h100_inventory(), {}, recorded=False)

    with pytest.raises(AssertionError, match=r"TierPlan\.changes_node"):
        run.append("made", {"id": "a"})

    assert checkpoint.get(CLAIM.uid) is None
