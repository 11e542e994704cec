"""Daemon supervision with two plugin instances on one node and prepare's check of prepared
claims after restarts in place (docs/mps.md, "Daemon supervision"): only the instance that
repairs restarts a daemon, a repair waits for the daemon's node-wide ``mps-<id>`` lock (held by
a join, release, start or stop of either instance), and a claim whose daemon was restarted in
place is still prepared - its record names the instance it joined, `MpsControl.dead` judges
the current one."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin.mps.supervisor import DaemonSupervisor
from gpu_dra.kubelet_plugin.node_locks import NodeLocks
from tests.kubelet_plugin.nodes import (
    UID_A,
    UID_B,
    MpsNode,
    SharesNode,
    ok,
    shares_inventory,
    wait_dead,
)


@pytest.fixture
def node(tmp_path: Path, mps_root: Path) -> SharesNode:
    return SharesNode(tmp_path, mps_root)


def supervisor(node: MpsNode, *, repairs: bool, locks: NodeLocks | None = None) -> DaemonSupervisor:
    if locks is None:
        return DaemonSupervisor(node.mps, node.checkpoint.all, interval_s=1, repair=lambda: repairs)
    return DaemonSupervisor(
        node.mps,
        node.checkpoint.all,
        interval_s=1,
        repair=lambda: repairs,
        lock=lambda daemon_id: locks.blocking(f"mps-{daemon_id}"),
    )


def test_only_the_repairing_instance_restarts_a_dead_daemon_the_other_reports_it(
    node: SharesNode,
) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    [handle] = node.handles(UID_A)
    publishing = supervisor(node, repairs=True)
    watching = supervisor(node, repairs=False)  # the other instance of a rolling update
    os.kill(handle.pid, signal.SIGKILL)
    assert wait_dead(handle.pid)

    assert watching.check() == []
    assert watching.check() == []
    assert node.running() == []  # the watcher restarted nothing ...
    uuid = node.uuid_of("gpu-0")
    assert list(watching.dead_shared_daemons()) == [uuid]  # ... but reports it (twice in a row)

    [repair] = publishing.check()
    assert repair.restarted is not None
    assert node.running() == [repair.handle.pid]
    assert publishing.dead_shared_daemons() == {}
    watching.check()
    assert watching.dead_shared_daemons() == {}  # it sees the restarted daemon
    node.unprepare(a)
    assert node.running() == []


def test_a_repair_waits_for_the_daemons_node_lock_held_by_the_other_instance(
    node: SharesNode,
) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    [handle] = node.handles(UID_A)
    ours = NodeLocks(node.root)
    theirs = NodeLocks(node.root)  # the other instance: its own open files
    publishing = supervisor(node, repairs=True, locks=ours)
    node.mps.client.run(handle.paths.pipe, "quit")
    assert wait_dead(handle.pid)

    passes: list[object] = []
    with theirs.blocking(f"mps-{handle.daemon_id}"):  # e.g. its unprepare stopping the daemon
        worker = threading.Thread(target=lambda: passes.append(publishing.check()))
        worker.start()
        time.sleep(0.5)
        assert node.running() == []  # no restart while the other instance holds the lock
        assert passes == []
    worker.join(10)
    [[repair]] = passes
    assert node.running() == [repair.handle.pid]  # it runs once the lock is free
    node.unprepare(a)
    assert node.running() == []


def test_a_repair_after_the_other_instance_stopped_the_daemon_restarts_nothing(
    node: SharesNode,
) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    entries = dict(node.checkpoint.all())  # read before the other instance's unprepare
    locks = NodeLocks(node.root)
    publishing = DaemonSupervisor(
        node.mps,
        lambda: entries,
        interval_s=1,
        lock=lambda daemon_id: locks.blocking(f"mps-{daemon_id}"),
    )
    node.unprepare(a)  # stops the daemon under the same lock

    assert publishing.check() == []
    assert node.running() == []
    assert node.daemon_dirs() == []
    assert publishing.down() == {}


def test_a_per_claim_daemon_restarted_in_place_keeps_its_claim_prepared(
    tmp_path: Path, mps_root: Path
) -> None:
    node = MpsNode(tmp_path, shares_inventory(), mps_root)
    claim = node.add_mps(UID_B, "gpu-2")
    ok(node.prepare(claim)[UID_B])
    [recorded] = node.handles(UID_B)
    spec = node.spec(UID_B)
    os.kill(recorded.pid, signal.SIGKILL)
    assert wait_dead(recorded.pid)
    [repair] = supervisor(node, repairs=True).check()
    restarted = repair.handle.pid

    # The kubelet prepares the claim again (a second pod): the record still names the dead
    # instance, the current one runs - nothing is unprepared or started.
    ok(node.prepare(claim)[UID_B])
    assert node.handles(UID_B) == [recorded]
    assert node.running() == [restarted]
    assert node.spec(UID_B) == spec
    node.unprepare(claim)
    assert node.running() == []
    assert node.daemon_dirs() == []
