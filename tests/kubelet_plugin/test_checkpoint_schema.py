"""Checkpoint schemas across plugin versions. Upgrade: every file a released schema left on a node
loads, is recovered (interrupted prepares rolled back, prepared claims kept) and rewritten in
place. Downgrade: what this plugin writes, the released schema-1 reader reads, except while an
unprepare is under way (then it refuses the file as newer). The files and who wrote them:
tests/kubelet_plugin/checkpoints/README.md; the rules: docs/architecture.md, "The checkpoint"."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpu_dra.kubelet_plugin.cdi import CdiDevice, ContainerEdits
from gpu_dra.kubelet_plugin.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointEntry,
    ClaimPhase,
)
from gpu_dra.kubelet_plugin.checkpoint_format import parse_document
from gpu_dra.kubelet_plugin.claim_records import (
    ClaimRecords,
    completed,
    started,
    unprepare_started,
)
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice, PrepareResult
from tests.fakes.claim_reader import allocation_result, resource_claim
from tests.kubelet_plugin.nodes import (
    NODE,
    UID_A,
    UID_B,
    UID_C,
    DynamicMigNode,
    Node,
    ok,
)

FIXTURES = Path(__file__).parent / "checkpoints"
RELEASED_V1 = ("v1-compact.json", "v1-indented.json")


def device(uid: str, name: str) -> PreparedDevice:
    return PreparedDevice(("gpu",), NODE, name, (f"k8s.gpu.nvidia.com/claim={uid}-{name}",))


RELEASED_CLAIMS = {
    UID_A: CheckpointEntry(
        claim=ClaimRef("default", UID_A, "claim-a"),
        phase=ClaimPhase.PREPARE_COMPLETED,
        devices=(device(UID_A, "gpu-0"),),
    ),
    UID_B: CheckpointEntry(
        claim=ClaimRef("default", UID_B, "claim-b"),
        phase=ClaimPhase.PREPARE_COMPLETED,
        devices=(device(UID_B, "gpu-1"), device(UID_B, "gpu-2")),
        state={"adminAccessDevices": ["gpu-2"]},
    ),
    UID_C: CheckpointEntry(
        claim=ClaimRef("default", UID_C, "claim-c"), phase=ClaimPhase.PREPARE_STARTED
    ),
}
"""What the released schema-1 files hold (README.md)."""


def released_v1_reader() -> ModuleType:
    """`checkpoint_format` as the plugins of schema 1 shipped it."""
    name = "released_checkpoint_format_v1"
    spec = importlib.util.spec_from_file_location(name, FIXTURES / "checkpoint_format_v1.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def read_as_schema_1(text: str) -> dict[str, tuple[str, tuple[str, ...], dict[str, Any]]]:
    """``{uid: (phase, device names, state)}`` as a plugin of schema 1 reads ``text``."""
    document = released_v1_reader().parse_document(json.loads(text))
    return {
        uid: (e.phase.value, tuple(d.device_name for d in e.devices), dict(e.state))
        for uid, e in document.entries.items()
    }


def read_as_this_plugin(text: str) -> dict[str, tuple[str, tuple[str, ...], dict[str, Any]]]:
    document = parse_document(json.loads(text))
    return {
        uid: (e.phase.value, tuple(d.device_name for d in e.devices), dict(e.state))
        for uid, e in document.entries.items()
    }


@pytest.fixture
def node(tmp_path: Path, inventory: NodeInventory) -> Node:
    return Node(tmp_path, inventory)


# ---- upgrade -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RELEASED_V1)
def test_every_released_schema_1_file_loads_with_its_claims(tmp_path: Path, name: str) -> None:
    shutil.copy(FIXTURES / name, tmp_path / "gpu-dra-checkpoint.json")
    checkpoint = Checkpoint(tmp_path, boot_id=lambda: "boot-1")

    loaded = checkpoint.load()

    assert loaded.discarded_boot_id is None
    assert checkpoint.all() == RELEASED_CLAIMS


@pytest.mark.parametrize("name", RELEASED_V1)
def test_a_released_file_is_rewritten_in_place_as_schema_1(tmp_path: Path, name: str) -> None:
    shutil.copy(FIXTURES / name, tmp_path / "gpu-dra-checkpoint.json")
    checkpoint = Checkpoint(tmp_path, boot_id=lambda: "boot-1")
    checkpoint.load()
    extra = CheckpointEntry(ClaimRef("default", UID_C, "c"), ClaimPhase.PREPARE_COMPLETED)

    checkpoint.update(UID_C, lambda _: extra)

    written = json.loads((tmp_path / "gpu-dra-checkpoint.json").read_text())
    released = json.loads((FIXTURES / name).read_text())
    assert written["version"] == 1
    assert {u: c for u, c in written["claims"].items() if u != UID_C} == {
        u: c for u, c in released["claims"].items() if u != UID_C
    }


@pytest.mark.parametrize("name", RELEASED_V1)
def test_upgrade_over_a_released_node_rolls_back_keeps_and_unprepares(
    node: Node, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copy(FIXTURES / name, node.checkpoint.path)
    left = {UID_A: ["gpu-0"], UID_B: ["gpu-1", "gpu-2"], UID_C: ["gpu-3"]}
    for uid, names in left.items():  # the files the released plugin left
        edits = ContainerEdits(env={"RELEASED": "1"})
        node.cdi.write(uid, [CdiDevice(name, edits) for name in names])
        (node.claims_dir / uid).mkdir(parents=True)
    a = node.add_gpus(UID_A, "claim-a", "gpu-0")

    node.restart()
    node.recover()

    assert node.checkpoint.all() == {u: e for u, e in RELEASED_CLAIMS.items() if u != UID_C}
    node.assert_nothing_left(UID_C)  # the interrupted prepare was rolled back
    assert ok(node.prepare(a)[UID_A]) == RELEASED_CLAIMS[UID_A].devices
    assert node.cdi.writes == []
    during: list[dict[str, Any]] = []
    real_remove = node.cdi.remove

    def remove(claim_uid: str) -> bool:
        during.append(json.loads(node.checkpoint.path.read_text()))
        return real_remove(claim_uid)

    monkeypatch.setattr(node.cdi, "remove", remove)
    assert node.unprepare(a) == {UID_A: None}

    assert during[0]["version"] == 2
    assert during[0]["claims"][UID_A]["phase"] == "UnprepareStarted"
    node.assert_nothing_left(UID_A)
    assert json.loads(node.checkpoint.path.read_text())["version"] == 1


def test_upgrade_over_a_released_dynamic_mig_node_keeps_and_then_destroys_its_devices(
    tmp_path: Path,
) -> None:
    node = DynamicMigNode(tmp_path)
    for part in ("data", "cdi"):
        shutil.rmtree(tmp_path / part)
        shutil.copytree(FIXTURES / "v1-dynamic-mig" / part, tmp_path / part)
    claim = node.add(UID_A, "gpu-1-mig-1g10gb-19-0", "gpu-1-mig-2g20gb-14-2")

    node.restart()
    node.recover()

    assert node.layout(1) == [(19, 0, (0,)), (14, 2, (0,))]
    recorded = node.checkpoint.get(UID_A)
    assert recorded is not None
    assert ok(node.prepare(claim)) == recorded.devices
    assert node.layout(1) == [(19, 0, (0,)), (14, 2, (0,))]
    assert node.unprepare(claim) is None
    node.assert_nothing_left(UID_A)


# ---- downgrade -----------------------------------------------------------------------------------


def test_a_schema_1_plugin_reads_what_this_plugin_writes_outside_an_unprepare(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = node.add_gpus(UID_A, "claim-a", "gpu-0")
    b = node.add(
        resource_claim(
            UID_B,
            "claim-b",
            results=[allocation_result("gpu-1"), allocation_result("gpu-2", admin_access=True)],
        )
    )
    c = node.add_gpus(UID_C, "claim-c", "gpu-3")
    ok(node.prepare(a, b)[UID_A])
    # C's prepare is under way: its PrepareStarted entry (with devices) is on disk. A whole GPU
    # gets one when its prepare follows an interrupted one (here a schema-1 plugin's).
    node.checkpoint.put(CheckpointEntry(claim=c, phase=ClaimPhase.PREPARE_STARTED))
    started, go_on = threading.Event(), threading.Event()
    seen: list[str] = []
    real_write = node.cdi.write

    def write(claim_uid: str, devices: Sequence[CdiDevice], **kwargs: Any) -> Path:
        seen.append(node.checkpoint.path.read_text())
        started.set()
        assert go_on.wait(10)
        return real_write(claim_uid, devices, **kwargs)

    monkeypatch.setattr(node.cdi, "write", write)

    async def prepare_c() -> Mapping[str, PrepareResult]:
        preparing = asyncio.create_task(node.preparer.prepare([c]))
        assert await asyncio.to_thread(started.wait, 5)
        go_on.set()
        return await preparing

    ok(asyncio.run(prepare_c())[UID_C])

    (text,) = seen
    now = node.checkpoint.path.read_text()
    assert [json.loads(t)["version"] for t in (text, now)] == [1, 1]
    assert read_as_schema_1(text) == read_as_this_plugin(text)
    assert read_as_schema_1(text)[UID_C] == ("PrepareStarted", ("gpu-3",), {})
    assert read_as_schema_1(now) == read_as_this_plugin(now)
    assert set(read_as_schema_1(now)) == {UID_A, UID_B, UID_C}


def test_a_schema_1_plugin_refuses_the_file_while_an_unprepare_is_under_way(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    ok(node.prepare(claim)[UID_A])
    seen: list[str] = []
    real_remove = node.cdi.remove

    def remove(claim_uid: str) -> bool:
        seen.append(node.checkpoint.path.read_text())
        raise OSError(5, "Input/output error")  # the unprepare stops here, for now

    monkeypatch.setattr(node.cdi, "remove", remove)
    assert node.unprepare(claim)[UID_A] is not None

    old = released_v1_reader()
    for text in (seen[0], node.checkpoint.path.read_text()):
        with pytest.raises(old.CheckpointVersionError, match="schema version 2 was written by a"):
            old.parse_document(json.loads(text))
    monkeypatch.setattr(node.cdi, "remove", real_remove)
    assert node.unprepare(claim) == {UID_A: None}  # finished: schema 1 again
    assert read_as_schema_1(node.checkpoint.path.read_text()) == {}


def test_owners_stay_schema_1_and_a_schema_1_plugin_keeps_them_on_entries_it_does_not_write(
    tmp_path: Path,
) -> None:
    # `owner` (the plugin instance that wrote an entry) is an added optional field, not a new
    # schema: it never raises the version, and the released reader takes it as unknown.
    checkpoint = Checkpoint(tmp_path, boot_id=lambda: "boot-1")
    checkpoint.load()
    records = ClaimRecords(checkpoint, owner="pod-a-1f2e")
    a, b = ClaimRef("default", UID_A, "a"), ClaimRef("default", UID_B, "b")
    records.update(UID_A, completed(a, (device(UID_A, "gpu-0"),), {}))
    records.update(UID_B, started(b, {}, (device(UID_B, "gpu-1"),)))
    text = (tmp_path / "gpu-dra-checkpoint.json").read_text()
    assert json.loads(text)["version"] == 1
    assert {e["owner"] for e in json.loads(text)["claims"].values()} == {"pod-a-1f2e"}

    old = released_v1_reader()
    document = old.parse_document(json.loads(text))
    assert read_as_schema_1(text) == read_as_this_plugin(text)
    # The schema-1 plugin prepares B anew: its own entry has no owner; A keeps its owner.
    rewritten = document.copy()
    rewritten.entries[UID_B] = old.CheckpointEntry(
        b, old.ClaimPhase.PREPARE_COMPLETED, devices=(device(UID_B, "gpu-1"),)
    )
    back = parse_document(json.loads(old.encode_document(rewritten, "boot-1")))
    assert (back.entries[UID_A].owner, back.entries[UID_B].owner) == ("pod-a-1f2e", None)

    records.update(UID_A, unprepare_started)
    written = json.loads((tmp_path / "gpu-dra-checkpoint.json").read_text())
    assert written["version"] == 2
    assert written["claims"][UID_A]["owner"] == "pod-a-1f2e"


# ---- schema 2 ------------------------------------------------------------------------------------


def test_unprepare_started_is_written_as_schema_2_and_read_back(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path, boot_id=lambda: "boot-1")
    checkpoint.load()
    entry = CheckpointEntry(
        ClaimRef("default", UID_A, "a"),
        ClaimPhase.UNPREPARE_STARTED,
        devices=(device(UID_A, "gpu-0"),),
        state={"timeSlices": {"GPU-x": 2}},
    )

    checkpoint.put(entry)

    document = json.loads((tmp_path / "gpu-dra-checkpoint.json").read_text())
    assert (document["version"], document["claims"][UID_A]["phase"]) == (2, "UnprepareStarted")
    restarted = Checkpoint(tmp_path, boot_id=lambda: "boot-1")
    restarted.load()
    assert restarted.get(UID_A) == entry


def test_a_schema_1_file_with_a_phase_of_schema_2_is_refused_as_corrupt(tmp_path: Path) -> None:
    claim = {"namespace": "default", "name": "a", "phase": "UnprepareStarted"}
    (tmp_path / "gpu-dra-checkpoint.json").write_text(
        json.dumps({"version": 1, "nodeBootID": "boot-1", "claims": {UID_A: claim}})
    )

    with pytest.raises(CheckpointCorruptError, match="does not exist in schema version 1"):
        Checkpoint(tmp_path, boot_id=lambda: "boot-1").load()
