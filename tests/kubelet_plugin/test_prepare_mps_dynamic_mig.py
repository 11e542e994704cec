"""MPS on MIG devices made at prepare (dynamic MIG): the real preparer, MIG lifecycle on the
simulated hgx-h100 and MPS daemon manager running the nvidia-cuda-mps-control test double. The
daemons start only once their MIG devices exist, keyed by the UUIDs those devices got; unprepare
and rollback stop them before the instances are destroyed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_dra.kubelet_plugin.mig import CRASH_AFTER_GPU_INSTANCE
from gpu_dra.kubelet_plugin.tiers.state import (
    DYNAMIC_MIG_STATE_KEY,
    MPS_STATE_KEY,
    handles_from_state,
)
from tests.doubles.mps_helpers import (
    processes_under,
)
from tests.fakes.claim_reader import opaque_config
from tests.kubelet_plugin.nodes import (
    UID_A,
    Crash,
    DynamicMigNode,
    assert_one_daemon_per_mig_device,
    device_var,
    double_daemon_manager,
    env_of,
    failed,
    ok,
)

SLICES = ("gpu-1-mig-1g10gb-19-0", "gpu-1-mig-2g20gb-14-2")


class MpsMigNode(DynamicMigNode):
    """`DynamicMigNode` whose preparer also has an MPS daemon manager (the double)."""

    def __init__(self, root: Path, mps_root: Path) -> None:
        self.mps_root = mps_root
        super().__init__(root)

    def preparer_options(self) -> dict[str, Any]:
        self.mps = double_daemon_manager(self.mps_root)
        return {**super().preparer_options(), "mps": self.mps}

    def running(self) -> list[int]:
        return processes_under(self.mps_root)

    def daemon_dirs(self) -> list[str]:
        return sorted(p.name for p in (self.mps_root / "mps").glob("*"))


@pytest.fixture
def node(tmp_path: Path, mps_root: Path) -> MpsMigNode:
    return MpsMigNode(tmp_path, mps_root)


def mig_mps(**mps_config: Any) -> Any:
    return opaque_config(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "MigDeviceConfig",
            "sharing": {"strategy": "MPS", "mpsConfig": mps_config},
        }
    )


def made_uuids(node: MpsMigNode) -> set[str]:
    """UUIDs of the MIG devices the simulated GPUs hold now."""
    return {
        ci["uuid"]
        for instances in node.all_instances().values()
        for gi in instances
        for ci in gi["computeInstances"]
    }


def test_each_new_mig_device_gets_a_daemon_keyed_by_the_uuid_it_was_made_with(
    node: MpsMigNode,
) -> None:
    config = mig_mps(
        defaultActiveThreadPercentage=30,
        defaultPinnedDeviceMemoryLimit="2Gi",
        defaultPerDevicePinnedMemoryLimit={"0": "1Gi"},
    )
    claim = node.add(UID_A, *SLICES, claim_configs=[config])

    ok(node.prepare(claim))

    env = env_of(node.spec(UID_A))
    uuids = {name: env[f"{UID_A}-{name}"][device_var(name, "UUID")] for name in SLICES}
    assert set(uuids.values()) == made_uuids(node)
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert DYNAMIC_MIG_STATE_KEY in entry.state
    handles = {h.devices: h for h in handles_from_state(entry.state)}
    first = min(uuids.values())  # key "0": the group's sorted MIG UUIDs
    limits = {uuid: "1024M" if uuid == first else "2048M" for uuid in uuids.values()}
    assert_one_daemon_per_mig_device(UID_A, handles, 30.0, limits)
    for name, uuid in uuids.items():
        handle = handles[(uuid,)]
        (device,) = [d for d in node.spec(UID_A)["devices"] if d["name"] == f"{UID_A}-{name}"]
        pipes = [m["hostPath"] for m in device["containerEdits"]["mounts"]]
        assert str(handle.paths.pipe) in pipes
    assert sorted(node.running()) == sorted(h.pid for h in handles.values())

    assert node.unprepare(claim) is None
    assert node.running() == []
    assert node.daemon_dirs() == []
    node.assert_nothing_left(UID_A)


def test_a_bad_per_device_key_fails_after_the_devices_exist_and_everything_is_rolled_back(
    node: MpsMigNode,
) -> None:
    config = mig_mps(defaultPerDevicePinnedMemoryLimit={"5": "1Gi"})
    claim = node.add(UID_A, *SLICES, claim_configs=[config])

    error = failed(node.prepare(claim))

    assert "defaultPerDevicePinnedMemoryLimit[5]" in error
    assert node.running() == []
    assert node.daemon_dirs() == []
    node.assert_nothing_left(UID_A)


def test_a_crash_while_making_the_mig_devices_starts_no_daemon_and_recovery_cleans_up(
    node: MpsMigNode,
) -> None:
    claim = node.add(UID_A, *SLICES, claim_configs=[mig_mps(defaultActiveThreadPercentage=50)])
    node.restart(crash_at=CRASH_AFTER_GPU_INSTANCE)
    with pytest.raises(Crash):
        node.prepare(claim)
    node.crashed()
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert MPS_STATE_KEY not in entry.state  # no daemon before its MIG device existed

    node.recover()

    assert node.running() == []
    assert node.daemon_dirs() == []
    node.assert_nothing_left(UID_A)
