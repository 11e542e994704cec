"""Unprepare is crash-safe: `UnprepareStarted` is on disk before anything is torn down, so an
unprepare that failed or died part-way (after the MPS daemon stopped, after the CDI spec went,
during the MIG destroy) is finished by the next prepare, unprepare or start-up, and never taken
for a prepared claim (issue 12)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpu_dra.kubelet_plugin.checkpoint import ClaimPhase
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from tests.kubelet_plugin.nodes import (
    UID_A,
    Crash,
    DynamicMigNode,
    MpsNode,
    ok,
    wait_dead,
)


def phase(node: Any, uid: str) -> ClaimPhase | None:
    entry = node.checkpoint.get(uid)
    return None if entry is None else entry.phase


def test_a_prepare_after_an_unprepare_that_failed_past_the_daemon_stop_prepares_again(
    tmp_path: Path, inventory: NodeInventory, mps_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = MpsNode(tmp_path, inventory, mps_root)
    claim = node.add_mps(UID_A, "gpu-0")
    devices = ok(node.prepare(claim)[UID_A])
    [old] = node.handles(UID_A)

    def disk_error(claim_uid: str) -> bool:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(node.cdi, "remove", disk_error)
    assert "Input/output error" in (node.unprepare(claim)[UID_A] or "")
    assert wait_dead(old.pid)  # the daemon was stopped before the CDI spec could go
    assert phase(node, UID_A) is ClaimPhase.UNPREPARE_STARTED
    monkeypatch.undo()

    # The kubelet prepares the claim again (say, the pod came back): not the dead daemon's
    # mounts, but a claim prepared anew.
    assert ok(node.prepare(claim)[UID_A]) == devices

    [new] = node.handles(UID_A)
    assert new.pid != old.pid
    assert node.running() == [new.pid]
    assert phase(node, UID_A) is ClaimPhase.PREPARE_COMPLETED
    assert node.cdi.path_for(UID_A).exists()
    assert node.unprepare(claim) == {UID_A: None}
    node.assert_nothing_left(UID_A)
    assert node.running() == []


def test_an_unprepare_that_failed_past_the_cdi_spec_is_finished_by_the_next_prepare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = DynamicMigNode(tmp_path)
    claim = node.add(UID_A, "gpu-6-mig-2g20gb-14-4")
    ok(node.prepare(claim))
    nvml = node.host.nvml

    def busy(compute_instance: object) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)

    monkeypatch.setattr(nvml, "compute_instance_destroy", busy)
    assert "processes still use it" in (node.unprepare(claim) or "")
    assert not node.cdi.path_for(UID_A).exists()
    assert phase(node, UID_A) is ClaimPhase.UNPREPARE_STARTED
    monkeypatch.undo()

    # Not "prepared" without a CDI spec: the unprepare is finished, the claim prepared anew.
    ok(node.prepare(claim))

    assert node.cdi.path_for(UID_A).exists()
    assert node.layout(6) == [(14, 4, (0,))]
    assert phase(node, UID_A) is ClaimPhase.PREPARE_COMPLETED
    assert node.unprepare(claim) is None
    node.assert_nothing_left(UID_A)


def test_an_unprepare_that_died_part_way_is_finished_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = DynamicMigNode(tmp_path)
    claim = node.add(UID_A, "gpu-3-mig-3g40gb-9-0")
    ok(node.prepare(claim))

    def die(*args: object, **kwargs: object) -> bool:
        raise Crash("killed while destroying the MIG device")

    monkeypatch.setattr(node.lifecycle, "destroy", die)
    with pytest.raises(Crash):
        node.unprepare(claim)
    monkeypatch.undo()
    assert not node.cdi.path_for(UID_A).exists()
    assert node.layout(3) == [(9, 0, (0,))]

    node.restart()
    node.recover()

    node.assert_nothing_left(UID_A)
