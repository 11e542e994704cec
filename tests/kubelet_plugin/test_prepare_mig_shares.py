"""MPS shares of static MIG devices (``--mps-shares-on-mig``): one shared daemon per MIG device,
keyed by its MIG UUID, with per-claim caps within the slice (memory of the slice, percent of its
SMs). The real `MpsDaemonManager` runs the ``nvidia-cuda-mps-control`` test double on the
simulated hgx-h100-mig node, whose 1g.10gb devices (9984 MiB each) are offered as shares.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_dra.driver.model import MigDevice
from gpu_dra.kubelet_plugin.cdi import ContainerEdits
from gpu_dra.kubelet_plugin.memory_limits import (
    MIG_REASON,
    Enforcement,
    MemoryLimitSupport,
    ShareMemory,
    watchdog_note,
)
from gpu_dra.kubelet_plugin.mps import shared_daemon_id
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.tiers.state import SHARES_STATE_KEY
from tests.doubles import nvidia_cuda_mps_control as double
from tests.kubelet_plugin.nodes import (
    MPS_CLASS_CONFIG,
    UID_A,
    UID_B,
    MigSharesNode,
    device_env,
    failed,
    mounts,
    ok,
    wait_dead,
)

UID_C = "3c1f2b7a-9d44-4e6b-8a0f-1b2c3d4e5f60"
SLICE = "gpu-0-mig-1g10gb-19-0"
OTHER_SLICE = "gpu-0-mig-1g10gb-19-1"
NOT_OFFERED = "gpu-1-mig-2g20gb-14-0"


@pytest.fixture
def node(tmp_path: Path, mps_root: Path) -> MigSharesNode:
    return MigSharesNode(tmp_path, mps_root)


def env(node: MigSharesNode, uid: str) -> dict[str, str]:
    [device] = node.spec(uid)["devices"]
    return device_env(device)


def test_two_shares_from_two_namespaces_join_one_daemon_of_the_mig_device(
    node: MigSharesNode,
) -> None:
    mig = node.inventory.by_name(SLICE)
    assert isinstance(mig, MigDevice)
    a = node.add_share(UID_A, "2Gi", "25", device=SLICE, name="a", namespace="team-a")
    b = node.add_share(UID_B, "6Gi", "50", device=SLICE, name="b", namespace="team-b")

    for claim in (a, b):
        [device] = ok(node.prepare(claim)[claim.uid])
        assert device.device_name == SLICE

    handles = node.shared_handles()
    assert set(handles) == {UID_A, UID_B}
    assert handles[UID_A] == handles[UID_B]
    handle = handles[UID_A]
    assert handle.daemon_id == shared_daemon_id(mig.uuid)  # keyed by the MIG UUID
    assert node.running() == [handle.pid]
    state = double.read_state(handle.paths.pipe)
    assert state["visibleDevices"] == [mig.uuid]
    # Defaults: the largest share allowed, of the slice (9984 MiB), not of the GPU.
    assert state["defaults"] == {
        "activeThreadPercentage": 100.0,
        "pinnedMemLimits": {mig.uuid: "9984M"},
    }
    for uid, memory, percent in ((UID_A, "2048M", "25"), (UID_B, "6144M", "50")):
        seen = env(node, uid)
        assert {k: v for k, v in seen.items() if k.startswith("CUDA_MPS_")} == {
            "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{mig.uuid}={memory}",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": percent,
        }
        # The MIG device itself is handed out as any static MIG device.
        assert seen["GPU_DRA_GPU_0_MIG_1G10GB_19_0_UUID"] == mig.uuid
        assert "NVIDIA_GPU_MEMORY_LIMIT" not in seen  # never the driver's cap on MIG
        [device] = node.spec(uid)["devices"]
        assert mounts(device)["/tmp/nvidia-mps"][0] == str(handle.paths.pipe)
        entry = node.checkpoint.get(uid)
        assert entry is not None
        recorded = entry.state[SHARES_STATE_KEY][SLICE]  # type: ignore[index]
        assert recorded["uuid"] == mig.uuid  # type: ignore[index]
        assert recorded["memoryEnforcement"] == "mps-client"  # type: ignore[index]

    assert node.unprepare(a) == {UID_A: None}
    assert node.running() == [handle.pid]  # b still holds a share
    assert node.users(handle.daemon_id) == [UID_B]
    assert node.unprepare(b) == {UID_B: None}  # the last share stops it
    assert wait_dead(handle.pid)
    assert node.running() == []
    assert node.daemon_dirs() == []
    for uid in (UID_A, UID_B):
        node.assert_nothing_left(uid)


def test_each_mig_device_has_its_own_shared_daemon(node: MigSharesNode) -> None:
    a = node.add_share(UID_A, "2Gi", "25", device=SLICE, name="a")
    b = node.add_share(UID_B, "2Gi", "25", device=OTHER_SLICE, name="b")
    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])

    handles = node.shared_handles()
    uuids = {node.uuid_of(SLICE), node.uuid_of(OTHER_SLICE)}
    assert {h.daemon_id for h in handles.values()} == {shared_daemon_id(u) for u in uuids}
    assert len(node.running()) == 2
    node.unprepare(a, b)
    assert node.running() == []


def test_plugin_restart_adopts_the_mig_shared_daemon(node: MigSharesNode) -> None:
    a = node.add_share(UID_A, "2Gi", "25", device=SLICE, name="a")
    b = node.add_share(UID_B, "4Gi", "25", device=SLICE, name="b")
    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])
    handle = node.shared_handles()[UID_A]

    node.restart()
    node.recover()

    assert node.running() == [handle.pid]
    c = node.add_share(UID_C, "3Gi", "50", device=SLICE, name="c")
    ok(node.prepare(c)[UID_C])
    assert node.shared_handles()[UID_C] == handle  # joined the adopted daemon
    assert node.unprepare(a, b) == {UID_A: None, UID_B: None}
    assert node.running() == [handle.pid]
    assert node.unprepare(c) == {UID_C: None}
    assert wait_dead(handle.pid)
    assert node.daemon_dirs() == []


def test_a_share_larger_than_the_slice_or_without_mig_mps_config_is_refused(
    node: MigSharesNode,
) -> None:
    too_big = node.add_share(UID_A, "9985Mi", "10", device=SLICE, name="big")
    message = failed(node.prepare(too_big)[UID_A])
    assert "between 1Mi and 9984Mi" in message, message
    gpu_config = node.add_share(UID_B, "2Gi", "10", device=SLICE, configs=(MPS_CLASS_CONFIG,))
    message = failed(node.prepare(gpu_config)[UID_B])
    # A class's GpuConfig does not apply to a MIG device: the share has no MPS config.
    assert "no sharing.strategy MPS" in message, message
    assert "MigDeviceConfig" in message, message
    no_config = node.add_share(UID_C, "2Gi", "10", device=SLICE, configs=())
    message = failed(node.prepare(no_config)[UID_C])
    assert "mps.mig.nvidia.com" in message, message
    assert node.running() == []


def test_a_mig_device_not_offered_is_published_and_prepared_whole(
    node: MigSharesNode,
) -> None:
    published = {d["name"]: d for d in node.inventory.published_devices()}
    assert published[SLICE]["allowMultipleAllocations"] is True
    assert published[SLICE]["capacity"]["compute"]["value"] == "100"
    assert published[SLICE]["capacity"]["memory"]["value"] == "9984Mi"
    assert "allowMultipleAllocations" not in published[NOT_OFFERED]
    assert node.inventory.shared_gpu(NOT_OFFERED) is None
    claim: ClaimRef = node.add_gpus(UID_A, "whole", NOT_OFFERED)
    ok(node.prepare(claim)[UID_A])
    assert node.running() == []


@pytest.mark.parametrize("left_out", [False, True], ids=["as-detected", "without_mig"])
def test_mig_shares_never_get_the_drivers_memory_limit(
    tmp_path: Path, mps_root: Path, left_out: bool
) -> None:
    """Even where detection claims the driver's cap for a MIG UUID (nvmlDeviceSetMemoryLimits_v1
    refuses MIG handles), with or without `without_mig`, a MIG share gets neither the variables
    nor the hook, records ``mps-client`` and reports the MPS pinned limit and the watchdog as
    what holds its memory, not the driver."""
    mig = MigSharesNode(tmp_path, mps_root).inventory.by_name(SLICE)
    assert isinstance(mig, MigDevice)
    hook = "/usr/bin/nvidia-cdi-hook"
    support = MemoryLimitSupport(hook_path=hook, enforced=frozenset({mig.uuid}))
    if left_out:
        support = support.without_mig([mig.uuid])
    assert support.edits(mig.uuid, 2048) == ContainerEdits()
    assert support.enforcement(mig.uuid) is Enforcement.MPS_CLIENT
    assert support.why(mig.uuid) == MIG_REASON
    reports: list[tuple[ClaimRef, str]] = []
    note = watchdog_note("kill", 1.0)

    class Node(MigSharesNode):
        def preparer_options(self) -> dict[str, object]:
            memory = ShareMemory(support, lambda claim, text: reports.append((claim, text)), note)
            return {**super().preparer_options(), "mps_share_memory": memory}

    node = Node(tmp_path / "with-support", mps_root)
    a = node.add_share(UID_A, "2Gi", "25", device=SLICE)
    ok(node.prepare(a)[UID_A])
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in env(node, UID_A)
    assert not node.spec(UID_A)["devices"][0]["containerEdits"].get("hooks")
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.state[SHARES_STATE_KEY][SLICE]["memoryEnforcement"] == "mps-client"  # type: ignore[index]
    [(claim, text)] = reports
    assert claim.uid == UID_A
    assert text == (
        f"MPS share of {mig.uuid} (2048 MiB, 25 % compute): memory capped per CUDA process by "
        f"MPS only, which a process can escape; not by the driver: {MIG_REASON}; the memory "
        "watchdog checks its processes every 1s and acts on an overrun after the fact "
        "(--mps-memory-watchdog=kill)"
    )
    node.unprepare(a)
    assert node.running() == []
