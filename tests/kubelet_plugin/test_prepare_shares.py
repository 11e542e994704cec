"""MPS shares in the whole-GPU preparer: one daemon per GPU, reference-counted across claims
through the checkpoint, per-claim caps from ``consumedCapacity``. The real `MpsDaemonManager`
runs the ``nvidia-cuda-mps-control`` test double; GPUs of the simulated hgx-h100 node, gpu-0 and
gpu-1 offered as shares. Every test fails if a daemon process is left running.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.mps import (
    DaemonHandle,
    shared_daemon_id,
)
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.tiers.state import SHARES_STATE_KEY
from tests.doubles import nvidia_cuda_mps_control as double
from tests.fakes.claim_reader import allocation_result, gpu_config, opaque_config, resource_claim
from tests.kubelet_plugin.nodes import (
    UID_A,
    UID_B,
    SharesNode,
    device_env,
    failed,
    mounts,
    ok,
    wait_dead,
)

UID_C = "3c1f2b7a-9d44-4e6b-8a0f-1b2c3d4e5f60"
UID_D = "4d2e3c8b-0e55-4f7c-9b1a-2c3d4e5f6071"
MIB = 2**20
WHOLE_MEMORY = "81559Mi"  # the simulated H100 80GB HBM3


@pytest.fixture
def node(tmp_path: Path, mps_root: Path) -> SharesNode:
    return SharesNode(tmp_path, mps_root)


def only(handles: Iterable[DaemonHandle]) -> DaemonHandle:
    """The one handle all of ``handles`` are."""
    first, *rest = handles
    assert all(handle == first for handle in rest), "more than one shared daemon"
    return first


def caps(node: SharesNode, uid: str) -> dict[str, str]:
    [device] = node.spec(uid)["devices"]
    env = device_env(device)
    return {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")}


# ---- one daemon per GPU, caps per claim ------------------------------------------------------


def test_three_shares_from_two_namespaces_join_one_daemon_with_their_own_caps(
    node: SharesNode,
) -> None:
    uuid = node.uuid_of("gpu-0")
    a = node.add_share(UID_A, "10Gi", "10", name="a", namespace="team-a")
    b = node.add_share(UID_B, "20Gi", "20", name="b", namespace="team-b")
    c = node.add_share(UID_C, "40Gi", "40", name="c", namespace="team-a")

    for claim in (a, b, c):
        [device] = ok(node.prepare(claim)[claim.uid])
        assert device.device_name == "gpu-0"
        assert device.share_id is not None

    handles = node.shared_handles()
    assert set(handles) == {UID_A, UID_B, UID_C}
    handle = only(handles.values())
    assert handle.daemon_id == shared_daemon_id(uuid)
    assert node.running() == [handle.pid]
    assert node.users(handle.daemon_id) == sorted([UID_A, UID_B, UID_C])
    # Multi-user (-M): tenants of other UIDs are served at once, not after every client of
    # the first UID has exited (docs/mps.md, "Facts seen on real GPUs").
    assert handle.settings.multi_user is True
    argv = Path(f"/proc/{handle.pid}/cmdline").read_bytes().split(b"\0")
    assert b"-M" in argv
    # Daemon defaults: the largest share allowed (the whole GPU with the default 100 %).
    state = double.read_state(handle.paths.pipe)
    assert state["visibleDevices"] == [uuid]
    assert state["defaults"] == {
        "activeThreadPercentage": 100.0,
        "pinnedMemLimits": {uuid: "81559M"},
    }
    expected = {UID_A: ("10240M", "10"), UID_B: ("20480M", "20"), UID_C: ("40960M", "40")}
    for uid, (memory, percent) in expected.items():
        assert caps(node, uid) == {
            "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{uuid}={memory}",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": percent,
        }
        [device] = node.spec(uid)["devices"]
        # The pipe directory read-only: no tenant can remove, replace or create files in it.
        assert mounts(device)["/tmp/nvidia-mps"] == (
            str(handle.paths.pipe),
            ["ro", "nosuid", "nodev", "bind"],
        )
        assert mounts(device)["/dev/shm"] == (
            str(handle.paths.shm),
            ["rw", "nosuid", "nodev", "bind"],
        )
        entry = node.checkpoint.get(uid)
        assert entry is not None
        assert entry.state[SHARES_STATE_KEY]["gpu-0"]["uuid"] == uuid  # type: ignore[index]

    # The daemon stays while any share is prepared, and goes with the last.
    assert node.unprepare(a, b) == {UID_A: None, UID_B: None}
    assert node.running() == [handle.pid]
    assert node.users(handle.daemon_id) == [UID_C]
    assert node.unprepare(c) == {UID_C: None}
    assert wait_dead(handle.pid)
    assert node.running() == []
    assert node.daemon_dirs() == []
    for uid in (UID_A, UID_B, UID_C):
        node.assert_nothing_left(uid)


def test_shares_prepared_in_one_call_start_one_daemon(node: SharesNode) -> None:
    claims = [
        node.add_share(uid, f"{10 * (i + 1)}Gi", "10", name=f"s{i}")
        for i, uid in enumerate((UID_A, UID_B, UID_C))
    ]

    results = node.prepare(*claims)

    for claim in claims:
        ok(results[claim.uid])
    only(node.shared_handles().values())
    assert len(node.running()) == 1
    node.unprepare(*claims)
    assert node.running() == []


def test_each_gpu_has_its_own_shared_daemon(node: SharesNode) -> None:
    a = node.add_share(UID_A, "10Gi", "10", device="gpu-0")
    b = node.add_share(UID_B, "10Gi", "10", device="gpu-1", name="b")

    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])

    handles = node.shared_handles()
    assert handles[UID_A].daemon_id != handles[UID_B].daemon_id
    assert len(node.running()) == 2
    node.unprepare(a)
    assert node.running() == [handles[UID_B].pid]
    node.unprepare(b)
    assert node.running() == []


# ---- shares and whole GPUs -------------------------------------------------------------------


def test_a_claim_allocated_whole_before_share_only_is_exclusive_and_shares_are_refused_beside_it(
    node: SharesNode,
) -> None:
    # All of the GPU without a share's config: a gpu.nvidia.com claim the scheduler placed on
    # an offered GPU before the whole-GPU classes stopped selecting offered GPUs.
    whole = node.add(
        resource_claim(
            UID_A,
            "whole",
            results=[
                allocation_result(
                    "gpu-0",
                    share_id="aaaaaaaa-0000-4000-8000-000000000000",
                    consumed_capacity={"memory": WHOLE_MEMORY, "compute": "100"},
                )
            ],
        )
    )
    share = node.add_share(UID_B, "10Gi", "10")

    ok(node.prepare(whole)[UID_A])
    assert node.shared_handles() == {}
    assert node.running() == []  # no MPS config: no daemon at all

    error = failed(node.prepare(share)[UID_B])
    assert "gpu-0 is already prepared for claim default/whole" in error
    assert node.running() == []
    node.assert_nothing_left(UID_B)
    node.unprepare(whole)


def test_a_whole_gpu_claim_is_refused_on_a_gpu_that_holds_shares(node: SharesNode) -> None:
    share = node.add_share(UID_A, "10Gi", "10", name="share")
    whole = node.add_gpus(UID_B, "whole", "gpu-0")
    ok(node.prepare(share)[UID_A])

    error = failed(node.prepare(whole)[UID_B])

    assert "gpu-0 is already prepared for claim default/share" in error
    node.assert_nothing_left(UID_B)
    node.unprepare(share)
    assert node.running() == []


def test_a_share_of_all_of_the_gpu_joins_the_shared_daemon_with_whole_gpu_caps(
    node: SharesNode,
) -> None:
    # Offered GPUs are share-only: all of the GPU through mps.gpu.nvidia.com is a share too.
    uuid = node.uuid_of("gpu-0")
    claim = node.add_share(UID_A, WHOLE_MEMORY, "100")

    ok(node.prepare(claim)[UID_A])

    handle = only(node.shared_handles().values())
    assert handle.daemon_id == shared_daemon_id(uuid)
    assert caps(node, UID_A) == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{uuid}=81559M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
    }
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.state[SHARES_STATE_KEY]["gpu-0"]["computePercent"] == 100  # type: ignore[index]
    node.unprepare(claim)
    assert node.running() == []


def test_whole_gpu_allocated_with_mps_config_fields_keeps_its_per_claim_daemon(
    node: SharesNode,
) -> None:
    # NVIDIA's per-claim MPS (mpsConfig set) on a GPU allocated whole before share-only.
    config = opaque_config(
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}})
    )
    claim = node.add_share(UID_A, WHOLE_MEMORY, "100", configs=(), claim_configs=(config,))

    ok(node.prepare(claim)[UID_A])

    [handle] = node.handles(UID_A)
    assert not handle.daemon_id.startswith("shared-")  # NVIDIA's per-claim daemon
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in caps(node, UID_A)
    node.unprepare(claim)
    assert node.running() == []


# ---- refusals --------------------------------------------------------------------------------


def test_a_share_without_mps_config_is_refused(node: SharesNode) -> None:
    claim = node.add_share(UID_A, "10Gi", "10", configs=())

    error = failed(node.prepare(claim)[UID_A])

    assert "device gpu-0 (request share, memory 10Gi, compute 10) is an MPS share" in error
    assert "use DeviceClass mps.gpu.nvidia.com" in error
    assert "will retry" not in error
    node.assert_nothing_left(UID_A)
    assert node.running() == []


def test_a_share_with_mps_config_defaults_is_refused(node: SharesNode) -> None:
    config = opaque_config(
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}})
    )
    claim = node.add_share(UID_A, "10Gi", "10", claim_configs=(config,))

    error = failed(node.prepare(claim)[UID_A])

    assert "sets mpsConfig defaultActiveThreadPercentage" in error
    assert "remove mpsConfig" in error
    assert node.running() == []


def test_a_share_larger_than_the_largest_allowed_is_refused(tmp_path: Path, mps_root: Path) -> None:
    class HalfNode(SharesNode):
        max_percent = 50

    node = HalfNode(tmp_path, mps_root)
    small = node.add_share(UID_A, "30Gi", "50", name="small")
    big = node.add_share(UID_B, "10Gi", "60", name="big")

    ok(node.prepare(small)[UID_A])
    error = failed(node.prepare(big)[UID_B])

    assert "larger than the largest MPS share this node allows" in error
    assert "--mps-share-max-percent=50" in error
    handle = only(node.shared_handles().values())
    assert double.read_state(handle.paths.pipe)["defaults"] == {
        "activeThreadPercentage": 50.0,
        "pinnedMemLimits": {node.uuid_of("gpu-0"): f"{81559 * MIB // 2 // MIB}M"},
    }
    node.unprepare(small)
    assert node.running() == []


def test_an_unreadable_consumed_capacity_is_refused(node: SharesNode) -> None:
    claim = node.add_share(UID_A, "100Gi", "10")

    error = failed(node.prepare(claim)[UID_A])

    assert "consumedCapacity of gpu-0: memory 100Gi" in error
    assert node.running() == []


# ---- failures, restarts ----------------------------------------------------------------------


def test_a_failed_share_prepare_keeps_the_daemon_of_the_other_shares(node: SharesNode) -> None:
    first = node.add_share(UID_A, "10Gi", "10", name="first")
    ok(node.prepare(first)[UID_A])
    handle = only(node.shared_handles().values())

    node.fail_cdi_writes = True
    node.restart()
    node.recover()
    second = node.add_share(UID_B, "10Gi", "10", name="second")
    error = failed(node.prepare(second)[UID_B])

    assert "No space left on device" in error
    node.assert_nothing_left(UID_B)
    assert node.running() == [handle.pid]  # still serving the first share
    node.fail_cdi_writes = False
    node.restart()
    node.unprepare(first)
    assert node.running() == []


def test_a_failed_first_share_stops_the_daemon_it_started(node: SharesNode) -> None:
    node.fail_cdi_writes = True
    node.restart()
    claim = node.add_share(UID_A, "10Gi", "10")

    failed(node.prepare(claim)[UID_A])

    node.assert_nothing_left(UID_A)
    assert node.running() == []
    assert node.daemon_dirs() == []


def test_plugin_restart_adopts_the_shared_daemon_and_its_reference_count(
    node: SharesNode,
) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    b = node.add_share(UID_B, "20Gi", "20", name="b")
    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])
    handle = only(node.shared_handles().values())

    node.restart()
    node.recover()

    assert node.running() == [handle.pid]
    c = node.add_share(UID_C, "30Gi", "30", name="c")
    ok(node.prepare(c)[UID_C])
    assert node.shared_handles()[UID_C] == handle  # joined, not restarted
    assert node.running() == [handle.pid]
    node.unprepare(a, c)
    assert node.running() == [handle.pid]
    node.restart()
    node.recover()
    node.unprepare(b)
    assert node.running() == []
    assert node.daemon_dirs() == []


def test_an_interrupted_share_prepare_is_rolled_back_at_restart_without_stopping_the_daemon(
    node: SharesNode,
) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    handle = only(node.shared_handles().values())
    # A second share that died after joining: PrepareStarted with the daemon recorded.
    node.fail_cdi_writes = True
    node.restart()
    b = node.add_share(UID_B, "10Gi", "10", name="b")
    entry_before = node.checkpoint.get(UID_A)
    assert entry_before is not None
    node.checkpoint.put(
        CheckpointEntry(claim=b, phase=ClaimPhase.PREPARE_STARTED, state=dict(entry_before.state))
    )
    node.fail_cdi_writes = False
    node.restart()
    node.recover()

    assert node.checkpoint.get(UID_B) is None
    assert node.running() == [handle.pid]
    node.unprepare(a)
    assert node.running() == []


def test_a_dead_shared_daemon_is_restarted_in_place_for_the_next_share(
    node: SharesNode,
) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    old = only(node.shared_handles().values())
    pipe, shm = old.paths.pipe.stat().st_ino, old.paths.shm.stat().st_ino
    (old.paths.shm / "a-buffer").write_text("share a's shared memory")
    os.kill(old.pid, signal.SIGKILL)
    assert wait_dead(old.pid)

    b = node.add_share(UID_B, "10Gi", "10", name="b")
    ok(node.prepare(b)[UID_B])

    new = node.shared_handles()[UID_B]
    assert new.daemon_id == old.daemon_id
    assert new.pid != old.pid
    assert node.running() == [new.pid]
    # In place: the directories share a's container has mounted are the same ones.
    assert (new.paths.pipe.stat().st_ino, new.paths.shm.stat().st_ino) == (pipe, shm)
    assert (new.paths.shm / "a-buffer").read_text() == "share a's shared memory"
    [a_device] = node.spec(UID_A)["devices"]
    assert mounts(a_device)["/tmp/nvidia-mps"][0] == str(new.paths.pipe)
    # The last claim to go may hold the dead daemon's handle: the new one still goes.
    node.unprepare(b)
    assert node.running() == [new.pid]
    node.unprepare(a)
    assert node.running() == []
    assert node.daemon_dirs() == []


def test_shares_whose_daemon_died_are_restarted_in_place_at_their_next_prepare(
    node: SharesNode,
) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    b = node.add_share(UID_B, "20Gi", "20", name="b")
    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])
    old = only(node.shared_handles().values())
    pipe = old.paths.pipe.stat().st_ino
    spec_a = node.spec(UID_A)
    os.kill(old.pid, signal.SIGKILL)
    assert wait_dead(old.pid)

    # Prepare checks what a prepared claim holds: the dead daemon is restarted in place (the
    # other share has its directories mounted), not the claim prepared again.
    ok(node.prepare(a)[UID_A])
    (new_pid,) = node.running()
    assert new_pid != old.pid
    assert node.spec(UID_A) == spec_a
    assert old.paths.pipe.stat().st_ino == pipe
    ok(node.prepare(b)[UID_B])  # the other share finds it running
    assert node.running() == [new_pid]
    assert caps(node, UID_B)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"
    node.unprepare(a)
    assert node.running() == [new_pid]
    node.unprepare(b)
    assert node.running() == []


def test_settings_a_tenant_changed_are_restored_when_the_next_share_joins(
    tmp_path: Path, mps_root: Path
) -> None:
    class HalfNode(SharesNode):
        max_percent = 50

    node = HalfNode(tmp_path, mps_root)
    uuid = node.uuid_of("gpu-0")
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    handle = only(node.shared_handles().values())
    # A tenant raises the daemon's defaults to the whole GPU through the socket it can reach.
    node.mps.client.run(handle.paths.pipe, "set_default_active_thread_percentage 100")
    node.mps.client.run(handle.paths.pipe, f"set_default_device_pinned_mem_limit {uuid} 81559M")

    b = node.add_share(UID_B, "10Gi", "10", name="b")
    ok(node.prepare(b)[UID_B])

    assert node.shared_handles()[UID_B] == handle  # the same daemon, not restarted
    assert double.read_state(handle.paths.pipe)["defaults"] == {
        "activeThreadPercentage": 50.0,
        "pinnedMemLimits": {uuid: f"{81559 // 2}M"},
    }
    node.unprepare(a, b)
    assert node.running() == []


def test_unprepare_of_an_unknown_share_claim_succeeds(node: SharesNode) -> None:
    claim = ClaimRef("default", UID_D, "gone")
    assert node.unprepare(claim) == {UID_D: None}


def test_a_share_waits_while_the_shared_daemon_does_not_answer(node: SharesNode) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    handle = only(node.shared_handles().values())
    node.mps.client.timeout_s = 0.5
    os.kill(handle.pid, signal.SIGSTOP)
    try:
        b = node.add_share(UID_B, "10Gi", "10", name="b")
        error = failed(node.prepare(b)[UID_B])
    finally:
        os.kill(handle.pid, signal.SIGCONT)

    assert "that serves this GPU's shares does not answer" in error
    assert error.endswith("(will retry)")
    node.assert_nothing_left(UID_B)
    assert node.running() == [handle.pid]  # not replaced: its clients keep running
    ok(node.prepare(b)[UID_B])  # the kubelet's retry, once it answers again
    assert node.shared_handles()[UID_B] == handle
    node.unprepare(a, b)
    assert node.running() == []


def as_an_older_plugin_wrote_it(node: SharesNode, uid: str) -> None:
    """The claim's spec with the pipe mounted read-write, as plugins before containment did."""
    path = node.cdi.path_for(uid)
    spec = yaml.safe_load(path.read_text())
    for mount in spec["devices"][0]["containerEdits"]["mounts"]:
        if mount["containerPath"] == "/tmp/nvidia-mps":
            mount["options"][0] = "rw"
    path.write_text(yaml.safe_dump(spec))
    [device] = node.spec(uid)["devices"]
    assert mounts(device)["/tmp/nvidia-mps"][1][0] == "rw"


def test_a_share_an_older_plugin_mounted_read_write_gets_the_pipe_read_only(
    node: SharesNode,
) -> None:
    a = node.add_share(UID_A, "10Gi", "10", name="a")
    b = node.add_share(UID_B, "10Gi", "10", name="b")
    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])
    handle = only(node.shared_handles().values())
    as_an_older_plugin_wrote_it(node, UID_A)
    as_an_older_plugin_wrote_it(node, UID_B)

    ok(node.prepare(a)[UID_A])  # prepare of a prepared claim: the spec is put right ...
    [device] = node.spec(UID_A)["devices"]
    assert mounts(device)["/tmp/nvidia-mps"] == (
        str(handle.paths.pipe),
        ["ro", "nosuid", "nodev", "bind"],
    )
    assert mounts(device)["/dev/shm"][1][0] == "rw"  # the shm stays writable
    assert node.running() == [handle.pid]  # ... without touching the daemon
    node.restart()
    node.recover()  # ... and so is every prepared share's at start-up
    [device] = node.spec(UID_B)["devices"]
    assert mounts(device)["/tmp/nvidia-mps"][1][0] == "ro"
    assert node.running() == [handle.pid]
    node.unprepare(a, b)
    assert node.running() == []
