"""`ClaimRecords`: the checkpoint's claim entries, changed through `update` and its phase
mutations only."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_dra.kubelet_plugin.checkpoint import Checkpoint, CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords, completed, removed, started
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice

CLAIM_A = ClaimRef("default", "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01", "claim-a")
CLAIM_B = ClaimRef("team", "5d2c9f71-3e8a-4b6d-8c1f-6a4e2b0d9c02", "claim-b")
DEVICE = PreparedDevice(("gpu",), "node-a", "gpu-0", (f"k8s.gpu.nvidia.com/claim={CLAIM_A.uid}",))


def records(tmp_path: Path) -> ClaimRecords:
    checkpoint = Checkpoint(tmp_path, boot_id=lambda: "boot-1")
    checkpoint.load()
    return ClaimRecords(checkpoint)


def test_a_claim_goes_through_started_completed_and_removed(tmp_path: Path) -> None:
    claims = records(tmp_path)
    state = {"timeSliceApplied": {"GPU-1": 2}}

    claims.update(CLAIM_A.uid, started(CLAIM_A, state))
    state["changed"] = "later"  # the mutation took a copy

    assert claims.get(CLAIM_A.uid) == CheckpointEntry(
        CLAIM_A, ClaimPhase.PREPARE_STARTED, state={"timeSliceApplied": {"GPU-1": 2}}
    )
    kept = claims.update(CLAIM_A.uid, completed(CLAIM_A, [DEVICE], {"mpsShares": {}}))
    assert kept == CheckpointEntry(
        CLAIM_A, ClaimPhase.PREPARE_COMPLETED, (DEVICE,), {"mpsShares": {}}
    )
    assert records(tmp_path).get(CLAIM_A.uid) == kept  # on disk, as a new process reads it
    assert claims.update(CLAIM_A.uid, removed) is None
    assert records(tmp_path).all() == {}


def test_others_are_every_entry_but_the_claims_own(tmp_path: Path) -> None:
    claims = records(tmp_path)
    claims.update(CLAIM_A.uid, started(CLAIM_A, {}))
    claims.update(CLAIM_B.uid, completed(CLAIM_B, [], {}))

    assert set(claims.others(CLAIM_A.uid)) == {CLAIM_B.uid}
    assert set(claims.others(CLAIM_B.uid)) == {CLAIM_A.uid}
    assert set(claims.all()) == {CLAIM_A.uid, CLAIM_B.uid}


def test_every_entry_written_names_the_instance_that_wrote_it(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path, boot_id=lambda: "boot-1")
    checkpoint.load()
    first = ClaimRecords(checkpoint, owner="pod-a-1234")
    second = ClaimRecords(checkpoint, owner="pod-b-5678")

    first.update(CLAIM_A.uid, started(CLAIM_A, {}))
    assert records(tmp_path).get(CLAIM_A.uid).owner == "pod-a-1234"  # type: ignore[union-attr]
    second.update(CLAIM_A.uid, completed(CLAIM_A, [DEVICE], {}))
    assert records(tmp_path).get(CLAIM_A.uid).owner == "pod-b-5678"  # type: ignore[union-attr]
    # A record without an owner (no instance token) leaves the field out.
    records(tmp_path).update(CLAIM_B.uid, started(CLAIM_B, {}))
    assert records(tmp_path).get(CLAIM_B.uid).owner is None  # type: ignore[union-attr]
    raw = json.loads((tmp_path / "gpu-dra-checkpoint.json").read_text())
    assert raw["claims"][CLAIM_A.uid]["owner"] == "pod-b-5678"
    assert "owner" not in raw["claims"][CLAIM_B.uid]
    assert second.update(CLAIM_A.uid, removed) is None
