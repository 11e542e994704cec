"""MPS shares of dynamic MIG partitions (``--mps-shares-on-dynamic-mig``): the first share of a
partition makes its MIG device, later shares join it and its one shared daemon (keyed by the
MIG UUID), and the device goes with the last claim recording its placement. The real preparer,
MIG lifecycle on the simulated hgx-h100 (state kept across restarts) and the MPS daemon manager
running the nvidia-cuda-mps-control test double.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.model import MigPartition
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.shares import PartitionShareSelection, ShareSelectionError
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.memory_limits import MemoryLimitSupport
from gpu_dra.kubelet_plugin.mps import shared_daemon_id
from gpu_dra.kubelet_plugin.mps.memory_watchdog import unenforced_devices
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.tiers.state import (
    SHARES_STATE_KEY,
    handles_from_state,
    intents_from_state,
)
from gpu_dra.kubelet_plugin.utilization.claims import claim_devices
from tests.doubles import nvidia_cuda_mps_control as double
from tests.doubles.mps_helpers import processes_under
from tests.fakes.claim_reader import allocation_result, resource_claim
from tests.kubelet_plugin.nodes import (
    MIG_MPS_CLASS_CONFIG,
    UID_A,
    UID_B,
    UID_C,
    Crash,
    DynamicMigNode,
    device_env,
    double_daemon_manager,
    failed,
    ok,
    wait_dead,
)

SLICE = "gpu-1-mig-1g10gb-19-0"
OVERLAPPING = "gpu-1-mig-2g20gb-14-0"  # memory slices 0..1: over SLICE's 0
NOT_SHARED = "gpu-1-mig-2g20gb-14-2"


class PartitionSharesNode(DynamicMigNode):
    """`DynamicMigNode` whose 1g.10gb partitions are offered as MPS shares, with the MPS daemon
    manager (the double)."""

    inventory_options: Mapping[str, Any] = {
        "mps_shares_on_dynamic_mig": PartitionShareSelection(profiles=("1g.10gb",))
    }

    def __init__(self, root: Path, mps_root: Path) -> None:
        self.mps_root = mps_root
        super().__init__(root)

    def restart(self, *, crash_at: str | None = None, dynamic: bool = True) -> None:
        super().restart(crash_at=crash_at, dynamic=dynamic)
        crash_points.arm(self.crash if crash_at is not None else None)  # every tier's points

    def preparer_options(self) -> dict[str, Any]:
        self.mps = double_daemon_manager(self.mps_root)
        return {**super().preparer_options(), "mps": self.mps, "mps_share_max_percent": 100}

    def add_share(
        self,
        uid: str,
        memory: str,
        compute: str,
        device: str = SLICE,
        configs: tuple[dict[str, Any], ...] = (MIG_MPS_CLASS_CONFIG,),
    ) -> ClaimRef:
        result = allocation_result(
            device,
            request="share",
            share_id=f"{uid[:8]}-0000-4000-8000-000000000000",
            consumed_capacity={"memory": memory, "compute": compute},
        )
        name = f"share-{uid[:4]}"
        self.api.add(resource_claim(uid, name, results=[result], class_configs=list(configs)))
        return ClaimRef("default", uid, name)

    def running(self) -> list[int]:
        return processes_under(self.mps_root)

    def daemon_dirs(self) -> list[str]:
        return sorted(p.name for p in (self.mps_root / "mps").glob("*"))

    def env(self, uid: str) -> dict[str, str]:
        [device] = self.spec(uid)["devices"]
        return device_env(device)

    def mig_uuids(self) -> list[str]:
        """UUIDs of the MIG devices the simulated GPUs hold now."""
        return sorted(
            ci["uuid"]
            for instances in self.all_instances().values()
            for gi in instances
            for ci in gi["computeInstances"]
        )

    def recorded_uuid(self, uid: str) -> str | None:
        entry = self.checkpoint.get(uid)
        assert entry is not None
        [intent] = intents_from_state(entry.state)
        return intent.uuid


def two_shares(node: PartitionSharesNode) -> tuple[ClaimRef, ClaimRef, str]:
    """Claims A and B, each a share (2Gi, 25 %) of `SLICE`, prepared; the MIG device's UUID."""
    a = node.add_share(UID_A, "2Gi", "25")
    b = node.add_share(UID_B, "2Gi", "25")
    ok(node.prepare(a))
    ok(node.prepare(b))
    [made] = node.mig_uuids()
    return a, b, made


@pytest.fixture
def node(tmp_path: Path, mps_root: Path) -> Iterator[PartitionSharesNode]:
    yield PartitionSharesNode(tmp_path, mps_root)
    crash_points.arm(None)


def test_offered_partitions_are_published_with_share_capacities_and_keep_their_counters(
    node: PartitionSharesNode,
) -> None:
    partition = node.inventory.by_name(SLICE)
    assert isinstance(partition, MigPartition)
    assert node.inventory.shared_gpu(SLICE) == partition
    assert node.inventory.shared_gpu(NOT_SHARED) is None
    published = {d["name"]: d for d in node.inventory.published_devices()}
    offered = published[SLICE]
    memory = f"{partition.profile.memory_bytes // 2**20}Mi"
    assert offered["allowMultipleAllocations"] is True
    assert offered["capacity"]["memory"]["value"] == memory
    # An amount a share does not name is 1/4 of the partition (--mps-share-replicas).
    quarter = f"{partition.profile.memory_bytes // 2**20 // 4}Mi"
    assert offered["capacity"]["memory"]["requestPolicy"]["default"] == quarter
    assert offered["capacity"]["compute"]["requestPolicy"]["default"] == "25"
    # The scheduler still charges its GPU's counters (once, while any share holds it).
    counters = offered["consumesCounters"][0]["counters"]
    assert counters["memory-slice-0"] == {"value": "1"}
    assert "allowMultipleAllocations" not in published[NOT_SHARED]
    assert "multiprocessors" in published[NOT_SHARED]["capacity"]


def test_two_shares_of_a_partition_share_its_mig_device_and_daemon_until_the_last_goes(
    node: PartitionSharesNode,
) -> None:
    a = node.add_share(UID_A, "2Gi", "25")
    b = node.add_share(UID_B, "4Gi", "50")

    ok(node.prepare(a))
    [made] = node.mig_uuids()
    ok(node.prepare(b))

    assert node.mig_uuids() == [made]  # joined, not made again
    assert node.recorded_uuid(UID_A) == node.recorded_uuid(UID_B) == made
    handles = {}
    for uid, limit, percent in ((UID_A, "2048M", "25"), (UID_B, "4096M", "50")):
        env = node.env(uid)
        assert env["GPU_DRA_GPU_1_MIG_1G10GB_19_0_UUID"] == made
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{made}={limit}"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == percent
        assert "NVIDIA_GPU_MEMORY_LIMIT" not in env  # the driver caps no MIG device
        entry = node.checkpoint.get(uid)
        assert entry is not None
        share = entry.state[SHARES_STATE_KEY][SLICE]  # type: ignore[index]
        assert share["uuid"] == made  # type: ignore[index]
        assert share["memoryEnforcement"] == "mps-client"  # type: ignore[index]
        [handles[uid]] = handles_from_state(entry.state)
    assert handles[UID_A] == handles[UID_B]
    handle = handles[UID_A]
    assert handle.daemon_id == shared_daemon_id(made)
    assert double.read_state(handle.paths.pipe)["visibleDevices"] == [made]
    assert node.running() == [handle.pid]

    assert node.unprepare(a) is None
    assert node.mig_uuids() == [made]  # b still holds a share of it
    assert node.running() == [handle.pid]
    assert node.unprepare(b) is None
    assert wait_dead(handle.pid)
    assert node.daemon_dirs() == []
    for uid in (UID_A, UID_B):
        node.assert_nothing_left(uid)  # MIG device destroyed, MIG mode off


def test_the_memory_watchdog_reads_a_partition_share_on_the_mig_device_made(
    node: PartitionSharesNode,
) -> None:
    """The driver caps no MIG device, so the watchdog checks partition shares after the fact:
    it reads each from the MIG device the claim's record names, with the share's size."""
    share = node.add_share(UID_A, "2Gi", "25")
    ok(node.prepare(share))
    [made] = node.mig_uuids()

    [device] = claim_devices(node.checkpoint.all(), node.inventory, lambda ns, name: ())

    assert (device.device, device.tier, device.uuid) == (SLICE, "mps-share", made)
    assert (device.share_memory_bytes, device.share_compute_percent) == (2 * 2**30, 25)
    assert device.share_memory_enforcement == "mps-client"
    assert unenforced_devices(node.inventory, MemoryLimitSupport()) == [
        "the MIG devices made from 1g.10gb partitions"
    ]
    assert node.unprepare(share) is None
    node.assert_nothing_left(UID_A)


def test_all_of_a_shared_partition_through_the_class_is_a_share_of_all_of_it(
    node: PartitionSharesNode,
) -> None:
    """Offered partitions are share-only: all of its memory and compute through the class is a
    share, served by the shared daemon of the MIG device made for it."""
    partition = node.inventory.by_name(SLICE)
    assert isinstance(partition, MigPartition)
    whole = node.add_share(UID_A, f"{partition.profile.memory_bytes // 2**20}Mi", "100")

    ok(node.prepare(whole))

    [made] = node.mig_uuids()
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.state[SHARES_STATE_KEY][SLICE]["computePercent"] == 100  # type: ignore[index]
    [handle] = handles_from_state(entry.state)
    assert handle.daemon_id == shared_daemon_id(made)
    assert node.unprepare(whole) is None
    assert wait_dead(handle.pid)
    node.assert_nothing_left(UID_A)


def test_a_partition_allocated_whole_before_share_only_holds_its_device_as_any_mig_device(
    node: PartitionSharesNode,
) -> None:
    """All of it without a share's config (a mig.nvidia.com claim placed on the offered
    partition before the MIG classes stopped selecting offered devices): not a share."""
    partition = node.inventory.by_name(SLICE)
    assert isinstance(partition, MigPartition)
    memory = f"{partition.profile.memory_bytes // 2**20}Mi"
    whole = node.add_share(UID_A, memory, "100", configs=())

    ok(node.prepare(whole))

    assert len(node.mig_uuids()) == 1
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert SHARES_STATE_KEY not in entry.state
    assert handles_from_state(entry.state) == []
    assert node.unprepare(whole) is None
    node.assert_nothing_left(UID_A)


def test_two_claims_of_a_partition_not_offered_as_shares_never_share_its_device(
    node: PartitionSharesNode,
) -> None:
    first = node.add(UID_A, NOT_SHARED, name="first")
    second = node.add(UID_B, NOT_SHARED, name="second")
    ok(node.prepare(first))
    [made] = node.mig_uuids()

    error = failed(node.prepare(second))

    assert "is already prepared for claim default/first" in error
    assert node.mig_uuids() == [made]  # the first claim's device is untouched
    assert node.checkpoint.get(UID_B) is None
    assert node.unprepare(first) is None
    node.assert_nothing_left(UID_A)


def test_a_crash_in_a_joining_share_is_rolled_back_without_touching_the_first_shares(
    node: PartitionSharesNode,
) -> None:
    a = node.add_share(UID_A, "2Gi", "25")
    b = node.add_share(UID_B, "2Gi", "25")
    ok(node.prepare(a))
    [made] = node.mig_uuids()
    [handle] = handles_from_state(node.checkpoint.get(UID_A).state)  # type: ignore[union-attr]

    node.restart(crash_at=crash_points.MPS_SHARE_AFTER_JOIN)
    with pytest.raises(Crash):
        node.prepare(b)
    node.crashed()
    node.recover()

    assert node.checkpoint.get(UID_B) is None  # rolled back
    assert node.mig_uuids() == [made]  # a's device stays
    assert node.running() == [handle.pid]  # and so does its daemon
    ok(node.prepare(b))  # the kubelet's retry joins
    assert node.recorded_uuid(UID_B) == made
    assert node.unprepare(a) is None
    assert node.unprepare(b) is None
    assert wait_dead(handle.pid)
    node.assert_nothing_left(UID_B)


@pytest.mark.parametrize(
    "point", [crash_points.MIG_AFTER_RECORD, crash_points.PREPARE_AFTER_CDI_SPEC]
)
def test_a_crash_in_the_first_share_after_making_the_device_leaves_nothing(
    node: PartitionSharesNode, point: str
) -> None:
    a = node.add_share(UID_A, "2Gi", "25")
    node.restart(crash_at=point)
    with pytest.raises(Crash):
        node.prepare(a)
    node.crashed()
    node.recover()

    assert node.running() == []
    node.assert_nothing_left(UID_A)
    ok(node.prepare(a))  # the retry makes it again
    assert node.unprepare(a) is None
    node.assert_nothing_left(UID_A)


def test_the_start_up_sweep_keeps_a_shared_device_while_a_share_records_it(
    node: PartitionSharesNode,
) -> None:
    a, b, made = two_shares(node)
    assert node.unprepare(a) is None

    node.restart()
    node.recover()

    assert node.mig_uuids() == [made]
    ok(node.prepare(b))  # still prepared: nothing lost
    assert node.unprepare(b) is None
    node.assert_nothing_left(UID_B)


def test_a_shared_device_destroyed_behind_the_plugin_is_made_again_and_rejoined(
    node: PartitionSharesNode,
) -> None:
    a, b, old = two_shares(node)
    partition = node.inventory.by_name(SLICE)
    assert isinstance(partition, MigPartition)
    [old_handle] = handles_from_state(node.checkpoint.get(UID_A).state)  # type: ignore[union-attr]
    node.mps.stop(old_handle)  # an administrator's nvidia-smi mig -dci -dgi would need it gone
    assert node.lifecycle.destroy(partition.parent, partition.gi_profile_id, 0)

    ok(node.prepare(a))  # the kubelet's next prepare call finds it gone: prepared again
    [new] = node.mig_uuids()
    assert new != old
    assert node.recorded_uuid(UID_A) == new
    assert node.recorded_uuid(UID_B) == old  # b has not been asked yet

    ok(node.prepare(b))  # b finds its device gone (same placement, other UUID) and rejoins
    assert node.recorded_uuid(UID_B) == new
    assert node.env(UID_B)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{new}=2048M"
    assert node.mig_uuids() == [new]
    assert len(node.running()) == 1
    assert node.unprepare(a) is None
    assert node.unprepare(b) is None
    node.assert_nothing_left(UID_B)
    assert node.daemon_dirs() == []


def test_three_shares_and_an_overlapping_placement_refused_by_the_plugin_too(
    node: PartitionSharesNode,
) -> None:
    """The scheduler's counters keep an overlapping placement off a partition held by shares
    (e2e); if one got through (a stale slice), NVML refuses it and the shares keep theirs."""
    claims = [node.add_share(uid, "1Gi", "10") for uid in (UID_A, UID_B, UID_C)]
    for claim in claims:
        ok(node.prepare(claim))
    [made] = node.mig_uuids()
    other = node.add("6a1f0c52-2d1e-4f0b-9b71-3c1d2e4f5a06", OVERLAPPING, name="overlap")

    error = failed(node.prepare(other))

    assert "is occupied by GPU instance" in error
    assert node.mig_uuids() == [made]
    for claim in claims:
        assert node.unprepare(claim) is None
    node.assert_nothing_left(UID_C)


def test_offering_partitions_as_shares_needs_dynamic_mig() -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    with pytest.raises(ShareSelectionError, match="--dynamic-mig is off"):
        NodeInventory.from_discovery(
            found,
            simulated=True,
            mps_shares_on_dynamic_mig=PartitionShareSelection(every_partition=True),
        )
    everything = NodeInventory.from_discovery(
        found,
        simulated=True,
        dynamic_mig=True,
        mps_shares_on_dynamic_mig=PartitionShareSelection(every_partition=True),
    )
    assert {p.parent.uuid for p in everything.partition_shares} == {
        g.uuid for g in everything.partitionable_gpus()
    }
