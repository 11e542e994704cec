"""Dynamic MIG through prepare/unprepare on a simulated hgx-h100 node: partition devices become
MIG devices at prepare and go at unprepare; intents are on disk before any NVML call; a plugin
that dies halfway is rolled back on restart (a new simulator from the state file) or by the next
prepare of the claim; start-up removes instances no prepared claim owns."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.kubelet_plugin.cdi import CdiDevice
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.metrics import ClaimStateCollector
from gpu_dra.kubelet_plugin.mig import CRASH_AFTER_GPU_INSTANCE
from gpu_dra.kubelet_plugin.prepare_protocol import PrepareResult
from gpu_dra.kubelet_plugin.tiers.state import DYNAMIC_MIG_STATE_KEY
from tests.fakes.claim_reader import (
    opaque_config,
)
from tests.kubelet_plugin.nodes import (
    UID_A,
    UID_B,
    UID_C,
    Crash,
    DynamicMigNode,
    device_var,
    env_of,
    failed,
    ok,
)

ON, OFF = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE

# gpu-test4's shape on an H100: 1g.10gb x2, 2g.20gb, 3g.40gb fill all 8 memory slices of gpu-1.
FOUR = (
    "gpu-1-mig-1g10gb-19-0",
    "gpu-1-mig-1g10gb-19-1",
    "gpu-1-mig-2g20gb-14-2",
    "gpu-1-mig-3g40gb-9-4",
)


@pytest.fixture
def node(tmp_path: Path) -> DynamicMigNode:
    return DynamicMigNode(tmp_path)


def test_four_partitions_become_mig_devices_each_container_sees_its_uuid(
    node: DynamicMigNode,
) -> None:
    claim = node.add(UID_A, *FOUR)

    devices = ok(node.prepare(claim))

    assert [d.device_name for d in devices] == sorted(FOUR)
    assert node.layout(1) == [(19, 0, (0,)), (19, 1, (0,)), (14, 2, (0,)), (9, 4, (0,))]
    assert node.mig_mode(1) == [ON, ON]
    # The CDI device of each partition carries the UUID of the MIG device made for it ...
    env = env_of(node.spec(UID_A))
    uuids = {name: env[f"{UID_A}-{name}"][device_var(name, "UUID")] for name in FOUR}
    assert all(u.startswith("MIG-") for u in uuids.values())
    assert len(set(uuids.values())) == 4
    assert {env[f"{UID_A}-{n}"][device_var(n, "PARENT_UUID")] for n in FOUR} == {node.gpu(1).uuid}
    # ... the same the simulated GPU holds, and the checkpoint records.
    held = {
        ci["uuid"] for gi in node.all_instances()[node.gpu(1).uuid] for ci in gi["computeInstances"]
    }
    assert held == set(uuids.values())
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_COMPLETED
    recorded = {i["device"]: i for i in entry.state[DYNAMIC_MIG_STATE_KEY]}  # type: ignore[union-attr]
    assert {name: i["uuid"] for name, i in recorded.items()} == uuids
    assert recorded["gpu-1-mig-3g40gb-9-4"]["parentUUID"] == node.gpu(1).uuid
    assert recorded["gpu-1-mig-3g40gb-9-4"]["giProfileID"] == 9
    assert recorded["gpu-1-mig-3g40gb-9-4"]["placementStart"] == 4


def test_preparing_again_returns_the_same_devices_and_makes_nothing(node: DynamicMigNode) -> None:
    claim = node.add(UID_A, FOUR[0])
    first = ok(node.prepare(claim))
    before = node.all_instances()

    assert ok(node.prepare(claim)) == first
    assert node.all_instances() == before


def test_unprepare_destroys_the_instances_and_turns_mig_off(node: DynamicMigNode) -> None:
    claim = node.add(UID_A, *FOUR)
    ok(node.prepare(claim))

    assert node.unprepare(claim) is None

    node.assert_nothing_left(UID_A)
    # The whole GPU can be prepared again.
    whole = node.add(UID_B, "gpu-1", name="claim-b")
    ok(node.prepare(whole))


def test_the_intent_is_on_disk_before_the_gpu_instance_and_a_restart_rolls_it_back(
    node: DynamicMigNode,
) -> None:
    node.restart(crash_at=CRASH_AFTER_GPU_INSTANCE)
    claim = node.add(UID_A, "gpu-2-mig-3g40gb-9-0")

    with pytest.raises(Crash):
        node.prepare(claim)

    # What the dead plugin left: the intent (no ids yet) and a GPU instance without CI.
    node.crashed()
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_STARTED
    assert entry.state[DYNAMIC_MIG_STATE_KEY] == [
        {
            "device": "gpu-2-mig-3g40gb-9-0",
            "parentUUID": node.gpu(2).uuid,
            "giProfileID": 9,
            "placementStart": 0,
        }
    ]
    assert node.layout(2) == [(9, 0, ())]

    node.recover()

    node.assert_nothing_left(UID_A)


def test_the_next_prepare_of_a_crashed_claim_rolls_back_first_then_prepares(
    node: DynamicMigNode,
) -> None:
    node.restart(crash_at=CRASH_AFTER_GPU_INSTANCE)
    claim = node.add(UID_A, "gpu-2-mig-1g10gb-19-5", "gpu-2-mig-2g20gb-14-0")
    with pytest.raises(Crash):
        node.prepare(claim)
    node.crashed()

    devices = ok(node.prepare(claim))

    assert [d.device_name for d in devices] == ["gpu-2-mig-1g10gb-19-5", "gpu-2-mig-2g20gb-14-0"]
    assert node.layout(2) == [(14, 0, (0,)), (19, 5, (0,))]
    assert node.unprepare(claim) is None
    node.assert_nothing_left(UID_A)


def test_a_failure_halfway_destroys_what_was_made_and_names_the_occupant(
    node: DynamicMigNode,
) -> None:
    # Something outside gpu-dra holds memory slices 4..7 of gpu-3.
    node.lifecycle.create(node.gpu(3), 9, 4)
    outside = node.layout(3)
    claim = node.add(UID_A, "gpu-3-mig-1g10gb-19-0", "gpu-3-mig-2g20gb-14-4")

    error = failed(node.prepare(claim))

    assert f"claim default/claim-a ({UID_A})" in error
    assert "2g.20gb (profile ID 14) at memory slices 4..5" in error
    assert "occupied by GPU instance" in error
    assert "(will retry)" in error
    assert node.layout(3) == outside  # the 1g made first is gone again; the outsider stays
    assert node.checkpoint.get(UID_A) is None
    assert not node.cdi.path_for(UID_A).exists()


def test_start_up_destroys_instances_no_prepared_claim_owns_and_keeps_the_others(
    node: DynamicMigNode,
) -> None:
    kept = node.add(UID_A, "gpu-4-mig-3g40gb-9-0")
    ok(node.prepare(kept))
    node.lifecycle.create(node.gpu(4), 19, 6)  # a leftover beside a prepared claim's device
    node.lifecycle.create(node.gpu(5), 0, 0)  # a leftover alone on its GPU
    node.lifecycle.create(node.gpu(6), 19, 2)  # two leftovers on one GPU: both go
    node.lifecycle.create(node.gpu(6), 19, 3)

    node.restart()
    node.recover()

    assert node.layout(4) == [(9, 0, (0,))]
    assert node.layout(5) == []
    assert node.mig_mode(5) == [OFF, OFF]
    assert node.layout(6) == []
    assert node.mig_mode(6) == [OFF, OFF]
    assert node.unprepare(kept) is None
    node.assert_nothing_left(UID_A)


def test_start_up_turns_off_mig_left_on_without_instances(node: DynamicMigNode) -> None:
    nvml = node.host.nvml
    nvml.init()
    nvml.device_set_mig_mode(nvml.device_get_handle_by_uuid(node.gpu(6).uuid), ON)
    nvml.shutdown()

    node.restart()
    node.recover()

    assert node.mig_mode(6) == [OFF, OFF]


def test_a_whole_gpu_with_another_claims_mig_device_is_refused_and_vice_versa(
    node: DynamicMigNode,
) -> None:
    mig = node.add(UID_A, "gpu-0-mig-1g10gb-19-3", name="slices")
    ok(node.prepare(mig))

    whole = node.add(UID_B, "gpu-0", name="whole")
    error = failed(node.prepare(whole))
    assert "has MIG device gpu-0-mig-1g10gb-19-3 of claim default/slices" in error
    assert node.checkpoint.get(UID_B) is None

    assert node.unprepare(mig) is None
    ok(node.prepare(whole))
    again = node.add(UID_A, "gpu-0-mig-1g10gb-19-3", name="slices")
    error = failed(node.prepare(again))
    assert "its GPU gpu-0" in error
    assert "is prepared whole for claim default/whole" in error
    assert node.all_instances() == {}


def test_a_whole_gpu_and_a_mig_device_of_it_prepared_at_once_get_one_of_them(
    node: DynamicMigNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The whole GPU's prepare is under way (PrepareStarted on disk, CDI spec not written yet)
    # when the MIG device's prepare checks the records: it must see the whole GPU's.
    whole = node.add(UID_A, "gpu-2", name="whole")
    mig = node.add(UID_B, "gpu-2-mig-1g10gb-19-0", name="slices")
    writing, go_on = threading.Event(), threading.Event()
    real_write = node.cdi.write

    def write(claim_uid: str, devices: Sequence[CdiDevice], **kwargs: Any) -> Path:
        if claim_uid == UID_A:
            writing.set()
            assert go_on.wait(10)
        return real_write(claim_uid, devices, **kwargs)

    monkeypatch.setattr(node.cdi, "write", write)

    async def both() -> tuple[Mapping[str, PrepareResult], Mapping[str, PrepareResult]]:
        first = asyncio.create_task(node.preparer.prepare([whole]))
        assert await asyncio.to_thread(writing.wait, 5)
        second = asyncio.create_task(node.preparer.prepare([mig]))
        await asyncio.wait({second}, timeout=0.5)
        go_on.set()
        return await first, await second

    first, second = asyncio.run(both())

    ok(first[UID_A])
    assert "is prepared whole for claim default/whole" in failed(second[UID_B])
    assert node.all_instances() == {}


def test_a_prepared_claim_whose_mig_device_is_gone_gets_it_made_again(
    node: DynamicMigNode,
) -> None:
    claim = node.add(UID_A, "gpu-2-mig-2g20gb-14-2")
    devices = ok(node.prepare(claim))
    node.lifecycle.destroy(node.gpu(2), 14, 2)  # by hand, behind the plugin's back
    assert node.layout(2) == []

    assert ok(node.prepare(claim)) == devices

    assert node.layout(2) == [(14, 2, (0,))]
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    [recorded] = entry.state[DYNAMIC_MIG_STATE_KEY]  # type: ignore[misc]
    [made] = [
        ci["uuid"] for gi in node.all_instances()[node.gpu(2).uuid] for ci in gi["computeInstances"]
    ]
    assert recorded["uuid"] == made  # type: ignore[index]
    uuid_var = device_var("gpu-2-mig-2g20gb-14-2", "UUID")
    assert env_of(node.spec(UID_A))[f"{UID_A}-gpu-2-mig-2g20gb-14-2"][uuid_var] == made
    assert node.unprepare(claim) is None
    node.assert_nothing_left(UID_A)


def test_a_prepared_claim_whose_mig_device_cannot_be_made_again_fails_clearly(
    node: DynamicMigNode,
) -> None:
    claim = node.add(UID_A, "gpu-2-mig-2g20gb-14-2")
    ok(node.prepare(claim))
    node.lifecycle.destroy(node.gpu(2), 14, 2)
    node.lifecycle.create(node.gpu(2), 19, 2)  # someone took the placement

    error = failed(node.prepare(claim))

    assert "NVML_ERROR_INSUFFICIENT_RESOURCES" in error
    assert error.endswith(
        "[while preparing it again because MIG device gpu-2-mig-2g20gb-14-2 on gpu-2 "
        f"({node.gpu(2).uuid}, NVIDIA H100 80GB HBM3) is gone]"
    )
    assert node.checkpoint.get(UID_A) is None


def test_a_prepared_claim_is_not_touched_when_its_mig_devices_cannot_be_listed(
    node: DynamicMigNode,
) -> None:
    claim = node.add(UID_A, "gpu-2-mig-2g20gb-14-2")
    devices = ok(node.prepare(claim))
    gpu = node.gpu(2)
    node.host.nvml.set_fault(PROFILE_INFO, pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=gpu.index)

    error = failed(node.prepare(claim))

    assert "NVML_ERROR_NOT_SUPPORTED" in error
    node.host.nvml.set_fault(PROFILE_INFO, None, gpu=gpu.index)
    assert node.layout(2) == [(14, 2, (0,))]
    assert node.cdi.path_for(UID_A).exists()
    assert ok(node.prepare(claim)) == devices


def test_a_whole_gpu_and_a_mig_device_of_it_prepared_at_once_do_not_both_succeed(
    node: DynamicMigNode,
) -> None:
    # The scheduler's counters prevent it; a stale allocation must still not get both: the GPU's
    # lock orders the two checks.
    for round_ in range(5):
        mig = node.add(UID_A, "gpu-0-mig-1g10gb-19-3", name="slices")
        whole = node.add(UID_B, "gpu-0", name="whole")

        results = asyncio.run(node.preparer.prepare([mig, whole]))

        assert sum(r.ok for r in results.values()) == 1, (round_, results)
        for claim in (mig, whole):
            assert node.unprepare(claim) is None
        assert node.all_instances() == {}


def test_mig_device_config_time_slicing_is_a_no_op_and_gpu_config_a_mismatch(
    node: DynamicMigNode,
) -> None:
    time_sliced = opaque_config(
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "MigDeviceConfig",
            "sharing": {"strategy": "TimeSlicing"},
        }
    )
    claim = node.add(UID_A, "gpu-7-mig-1g10gb-19-0", claim_configs=[time_sliced])
    ok(node.prepare(claim))
    assert node.unprepare(claim) is None

    gpu_config = opaque_config(
        {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}, requests=["r0"]
    )
    wrong = node.add(UID_B, "gpu-7-mig-1g10gb-19-0", name="wrong", claim_configs=[gpu_config])
    error = failed(node.prepare(wrong))
    assert "cannot apply GpuConfig" in error
    assert node.all_instances() == {}


def test_a_plugin_without_dynamic_mig_refuses_partitions_clearly(node: DynamicMigNode) -> None:
    node.restart(dynamic=False)
    claim = node.add(UID_A, "gpu-7-mig-1g10gb-19-0")

    error = failed(node.prepare(claim))

    assert "gpu-7-mig-1g10gb-19-0 is a dynamic MIG partition" in error
    assert "without dynamic MIG" in error


def test_a_gpu_instance_still_in_use_fails_the_unprepare_and_keeps_the_entry(
    node: DynamicMigNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = node.add(UID_A, "gpu-6-mig-2g20gb-14-4")
    ok(node.prepare(claim))
    nvml = node.host.nvml
    real_destroy = nvml.compute_instance_destroy

    def busy(compute_instance: object) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)

    monkeypatch.setattr(nvml, "compute_instance_destroy", busy)
    error = node.unprepare(claim)

    assert error is not None
    assert "processes still use it (NVML_ERROR_IN_USE)" in error
    assert node.checkpoint.get(UID_A) is not None  # the kubelet's next unprepare retries
    assert not node.cdi.path_for(UID_A).exists()  # the CDI spec went first
    assert node.layout(6) == [(14, 4, (0,))]

    monkeypatch.setattr(nvml, "compute_instance_destroy", real_destroy)
    assert node.unprepare(claim) is None
    node.assert_nothing_left(UID_A)


def test_rolling_back_an_intent_without_ids_spares_a_placement_another_claim_records(
    node: DynamicMigNode,
) -> None:
    # Claim A died after recording its intent; its instance never got made (or is gone). Claim
    # B has since prepared the same placement. Rolling A back must not destroy B's device.
    node.restart(crash_at=CRASH_AFTER_GPU_INSTANCE)
    a = node.add(UID_A, "gpu-0-mig-3g40gb-9-4", name="crashed")
    with pytest.raises(Crash):
        node.prepare(a)
    node.crashed()
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    # B's prepare runs while A's entry still waits for its rollback (as if recovery had failed):
    # the bare GPU instance of A goes first, by hand, so B can make its own there.
    node.lifecycle.destroy(node.gpu(0), 9, 4)
    b = node.add(UID_B, "gpu-0-mig-3g40gb-9-4", name="later")
    # A's PrepareStarted entry names the device: B waits for A's rollback ...
    assert "is already prepared for claim default/crashed" in failed(node.prepare(b))
    # ... unless A's entry was written by a plugin of schema 1, whose entries name no devices.
    node.checkpoint.update(UID_A, lambda e: None if e is None else replace(e, devices=()))
    ok(node.prepare(b))
    made = node.layout(0)

    assert node.unprepare(a) is None

    assert node.checkpoint.get(UID_A) is None
    assert node.layout(0) == made  # B's MIG device is still there
    assert node.unprepare(b) is None
    node.assert_nothing_left(UID_B)


# ---- NVML errors are never "no instances" (issue 10) ---------------------------------------------

PROFILE_INFO = "device_get_gpu_instance_profile_info"


def test_an_unprepare_that_cannot_read_the_instances_fails_keeps_mig_and_is_retried(
    node: DynamicMigNode,
) -> None:
    claim = node.add(UID_A, "gpu-6-mig-2g20gb-14-4")
    ok(node.prepare(claim))
    gpu = node.gpu(6)
    node.host.nvml.set_fault(PROFILE_INFO, pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=gpu.index)

    error = node.unprepare(claim)

    assert error is not None
    assert "nvmlDeviceGetGpuInstanceProfileInfo answered NVML_ERROR_NOT_SUPPORTED" in error
    assert node.checkpoint.get(UID_A) is not None  # the kubelet's next unprepare retries
    node.host.nvml.set_fault(PROFILE_INFO, None, gpu=gpu.index)
    assert node.mig_mode(6) == [ON, ON]
    assert node.layout(6) == [(14, 4, (0,))]
    assert node.unprepare(claim) is None
    node.assert_nothing_left(UID_A)
    assert node.mig_mode(6) == [OFF, OFF]


def test_the_start_up_sweep_destroys_nothing_and_keeps_mig_on_when_it_cannot_read(
    node: DynamicMigNode, caplog: pytest.LogCaptureFixture
) -> None:
    node.lifecycle.create(node.gpu(5), 19, 0)  # a leftover no claim owns
    nvml = node.host.nvml
    nvml.init()
    nvml.device_set_mig_mode(nvml.device_get_handle_by_uuid(node.gpu(6).uuid), ON)  # no GIs
    nvml.shutdown()
    node.restart()
    for minor in (5, 6):
        node.host.nvml.set_fault(
            PROFILE_INFO, pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=node.gpu(minor).index
        )

    node.recover()

    for minor in (5, 6):
        node.host.nvml.set_fault(PROFILE_INFO, None, gpu=node.gpu(minor).index)
        assert node.mig_mode(minor) == [ON, ON]
    assert node.layout(5) == [(19, 0, (0,))]
    assert node.layout(6) == []
    errors = [r.message for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2
    assert all("leftover MIG instances of gpu-" in e for e in errors)
    assert all("NVML_ERROR_NOT_SUPPORTED" in e for e in errors)


# ---- the start-up sweep fails closed (issue 12) --------------------------------------------------


def corrupt_mig_state(node: DynamicMigNode, uid: str) -> None:
    """The claim's recorded MIG devices become unreadable (a hand edit, a bug of a writer)."""

    def mutate(entry: CheckpointEntry | None) -> CheckpointEntry | None:
        assert entry is not None
        return replace(entry, state={**entry.state, DYNAMIC_MIG_STATE_KEY: [{"device": 3}]})

    node.checkpoint.update(uid, mutate)


def test_the_sweep_keeps_the_gpus_of_a_claim_whose_mig_state_cannot_be_read(
    node: DynamicMigNode, caplog: pytest.LogCaptureFixture
) -> None:
    claim = node.add(UID_A, "gpu-4-mig-3g40gb-9-0")
    ok(node.prepare(claim))
    corrupt_mig_state(node, UID_A)
    node.lifecycle.create(node.gpu(4), 19, 6)  # may be the claim's: kept
    node.lifecycle.create(node.gpu(5), 19, 0)  # a leftover on a GPU the claim does not name

    node.restart()
    node.recover()

    assert node.layout(4) == [(9, 0, (0,)), (19, 6, (0,))]
    assert node.layout(5) == []
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(
        "MIG instances of gpu-4 (" in e
        and f"kept at start-up: they may be claim_uid={UID_A}'s" in e
        for e in errors
    ), errors
    registry = CollectorRegistry()
    registry.register(ClaimStateCollector("node-a", node.checkpoint.all))
    assert (
        registry.get_sample_value(
            "gpu_dra_claim_state_unreadable",
            {
                "node": "node-a",
                "claim": "default/claim-a",
                "claim_uid": UID_A,
                "state": "dynamicMig",
            },
        )
        == 1
    )


def test_the_sweep_keeps_every_gpu_when_the_unreadable_claim_names_no_mig_device(
    node: DynamicMigNode,
) -> None:
    claim = node.add(UID_A, "gpu-4-mig-3g40gb-9-0")
    ok(node.prepare(claim))

    def whole_gpu_names(entry: CheckpointEntry | None) -> CheckpointEntry | None:
        assert entry is not None
        devices = tuple(replace(d, device_name="gpu-3") for d in entry.devices)
        return replace(entry, devices=devices, state={DYNAMIC_MIG_STATE_KEY: "garbage"})

    node.checkpoint.update(UID_A, whole_gpu_names)
    node.lifecycle.create(node.gpu(5), 19, 0)

    node.restart()
    node.recover()

    assert node.layout(4) == [(9, 0, (0,))]
    assert node.layout(5) == [(19, 0, (0,))]


# ---- MIG state fails closed at prepare too (issue 25, item 2) ------------------------------------


def test_a_whole_gpu_an_unreadable_record_may_have_mig_devices_on_is_refused(
    node: DynamicMigNode,
) -> None:
    slices = node.add(UID_A, "gpu-4-mig-3g40gb-9-0", name="slices")
    ok(node.prepare(slices))
    corrupt_mig_state(node, UID_A)

    whole = node.add(UID_B, "gpu-4", name="whole")
    error = failed(node.prepare(whole))

    assert "GPU gpu-4 (" in error
    assert f"may have MIG devices of claim default/slices ({UID_A})" in error
    assert "dynamic MIG state cannot be read" in error
    assert node.checkpoint.get(UID_B) is None
    assert node.layout(4) == [(9, 0, (0,))]  # the claim's MIG device is untouched
    other = node.add(UID_C, "gpu-5", name="other-gpu")
    ok(node.prepare(other))  # a GPU the unreadable record does not name is not held back


def test_a_gpu_whose_start_up_sweep_failed_is_not_prepared_whole_until_a_sweep_succeeds(
    node: DynamicMigNode, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = node.gpu(5)
    node.lifecycle.create(gpu, 19, 0)  # a leftover no claim owns: MIG mode is on
    node.restart()
    node.host.nvml.set_fault(PROFILE_INFO, pynvml.NVML_ERROR_UNKNOWN, gpu=gpu.index)
    node.recover()  # the sweep of gpu-5 fails
    assert any("not handed out whole until a later try" in r.getMessage() for r in caplog.records)

    whole = node.add(UID_A, "gpu-5", name="whole")
    error = failed(node.prepare(whole))
    assert "GPU gpu-5 (" in error
    assert "may hold MIG instances no claim owns" in error
    assert "NVML_ERROR_UNKNOWN" in error
    assert node.checkpoint.get(UID_A) is None

    assert set(asyncio.run(node.preparer.retry_mig_sweeps())) == {gpu.uuid}  # still failing

    node.host.nvml.set_fault(PROFILE_INFO, None, gpu=gpu.index)
    ok(node.prepare(whole))  # the kubelet's retry: swept now, then handed out whole
    assert node.layout(5) == []
    assert node.mig_mode(5) == [OFF, OFF]
    assert node.unprepare(whole) is None


def test_the_periodic_sweep_cleans_a_gpu_whose_start_up_sweep_failed(node: DynamicMigNode) -> None:
    gpu = node.gpu(5)
    node.lifecycle.create(gpu, 19, 0)  # a leftover no claim owns
    slices = node.add(UID_B, "gpu-5-mig-1g10gb-19-2", name="slices")
    node.restart()
    node.host.nvml.set_fault(PROFILE_INFO, pynvml.NVML_ERROR_UNKNOWN, gpu=gpu.index)
    node.recover()
    node.host.nvml.set_fault(PROFILE_INFO, None, gpu=gpu.index)
    ok(node.prepare(slices))  # a MIG device of another claim, made meanwhile: kept

    assert asyncio.run(node.preparer.retry_mig_sweeps()) == {}

    assert node.layout(5) == [(19, 2, (0,))]  # the leftover went, the claim's device stayed
    assert asyncio.run(node.preparer.retry_mig_sweeps()) == {}  # nothing left to sweep
    assert node.unprepare(slices) is None
