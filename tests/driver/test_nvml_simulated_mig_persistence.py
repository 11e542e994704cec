"""Simulated MIG state survives a new `SimulatedNvml` built from a snapshot: mode, GPU and
compute instances, MIG UUIDs and the creation counter, as a real GPU keeps them across a
restart of the plugin process."""

from __future__ import annotations

import json
from typing import Any

import pynvml
import pytest

from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.nvml.simulated_mig import MigSnapshotError
from gpu_dra.driver.nvml.simulated_profiles import load_profile, parse_profile

ON, OFF = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE
FULL_CI_1G, FULL_CI_3G = 0, 2


def started(nvml: SimulatedNvml) -> SimulatedNvml:
    nvml.init()
    return nvml


def make_slice(nvml: SimulatedNvml, gpu: int, profile_id: int, start: int, size: int) -> str:
    """A GI at (start, size) with its full CI; returns the MIG UUID."""
    handle = nvml.device_get_handle_by_index(gpu)
    placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
    gi = nvml.device_create_gpu_instance_with_placement(handle, profile_id, placement)
    ci_profile = {19: FULL_CI_1G, 9: FULL_CI_3G}[profile_id]
    ci = nvml.gpu_instance_create_compute_instance(gi, ci_profile)
    return nvml.device_get_uuid(nvml.compute_instance_get_info(ci).device)


def test_a_new_simulator_from_a_snapshot_has_the_same_mode_instances_and_uuids() -> None:
    profile = load_profile("hgx-h100", "node-a")
    first = started(SimulatedNvml(profile))
    gpu0 = first.device_get_handle_by_index(0)
    first.device_set_mig_mode(gpu0, ON)
    small = make_slice(first, 0, 19, 2, 1)
    large = make_slice(first, 0, 9, 4, 4)

    saved = json.loads(json.dumps(first.mig_snapshot()))  # what a file holds
    second = started(SimulatedNvml(profile, saved_mig=saved))

    handle = second.device_get_handle_by_index(0)
    assert second.device_get_mig_mode(handle) == [ON, ON]
    infos = [
        second.gpu_instance_get_info(gi)
        for pid in (19, 9)
        for gi in second.device_get_gpu_instances(handle, pid)
    ]
    assert [(i.profileId, i.placement.start, i.placement.size) for i in infos] == [
        (19, 2, 1),
        (9, 4, 4),
    ]
    for uuid in (small, large):
        mig = second.device_get_handle_by_uuid(uuid)
        assert second.device_get_device_handle_from_mig_device_handle(mig) is handle
    assert second.device_get_mig_mode(second.device_get_handle_by_index(1)) == [OFF, OFF]


def test_restored_instances_can_be_destroyed_and_a_remade_slice_gets_a_new_uuid() -> None:
    profile = load_profile("hgx-h100", "node-a")
    first = started(SimulatedNvml(profile))
    first.device_set_mig_mode(first.device_get_handle_by_index(0), ON)
    before = make_slice(first, 0, 19, 0, 1)
    second = started(SimulatedNvml(profile, saved_mig=first.mig_snapshot()))

    handle = second.device_get_handle_by_index(0)
    (gi,) = second.device_get_gpu_instances(handle, 19)
    (ci,) = second.gpu_instance_get_compute_instances(gi, FULL_CI_1G)
    with pytest.raises(pynvml.NVMLError_InUse):
        second.gpu_instance_destroy(gi)
    second.compute_instance_destroy(ci)
    second.gpu_instance_destroy(gi)
    assert second.device_get_gpu_instances(handle, 19) == []

    after = make_slice(second, 0, 19, 0, 1)
    assert after != before  # the creation counter came back too: UUIDs are never reused


def test_every_change_is_reported_in_order_and_failed_calls_report_nothing() -> None:
    snapshots: list[dict[str, Any]] = []
    nvml = started(
        SimulatedNvml(load_profile("hgx-h100", "node-a"), on_mig_change=snapshots.append)
    )
    handle = nvml.device_get_handle_by_index(3)
    uuid = nvml.device_get_uuid(handle)

    nvml.device_set_mig_mode(handle, ON)
    make_slice(nvml, 3, 19, 6, 1)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.device_create_gpu_instance_with_placement(
            handle, 19, pynvml.c_nvmlGpuInstancePlacement_t(6, 1)
        )

    states = [s["gpus"][uuid] for s in snapshots]
    assert [s["current"] for s in states] == [ON, ON, ON]
    assert [len(s["gpuInstances"]) for s in states] == [0, 1, 1]
    assert [[len(gi["computeInstances"]) for gi in s["gpuInstances"]] for s in states] == [
        [],
        [0],
        [1],
    ]


def test_pending_ampere_mode_survives_a_restart() -> None:
    doc = {
        "driverVersion": "580.95.05",
        "cudaDriverVersion": 13000,
        "gpus": [{"model": "A100-SXM4-40GB", "busId": "0000:07:00.0", "migMode": [0, 0]}],
    }
    profile = parse_profile(doc, name="a100", node_name="node-a")
    first = started(SimulatedNvml(profile))
    first.device_set_mig_mode(first.device_get_handle_by_index(0), ON)

    second = started(SimulatedNvml(profile, saved_mig=first.mig_snapshot()))

    assert second.device_get_mig_mode(second.device_get_handle_by_index(0)) == [OFF, ON]


def test_gpus_the_snapshot_does_not_name_keep_the_profiles_static_mig() -> None:
    profile = load_profile("hgx-h100-mig", "node-a")
    untouched = started(SimulatedNvml(profile))
    saved = untouched.mig_snapshot()
    gpu3 = untouched.device_get_uuid(untouched.device_get_handle_by_index(3))
    kept = {"gpus": {gpu3: saved["gpus"][gpu3]}}  # type: ignore[index]

    restored = started(SimulatedNvml(profile, saved_mig=kept))

    assert restored.mig_snapshot() == saved


def _with_gpu_state(nvml: SimulatedNvml, state: dict[str, Any]) -> dict[str, object]:
    uuid = nvml.device_get_uuid(nvml.device_get_handle_by_index(0))
    return {"gpus": {uuid: state}}


@pytest.mark.parametrize(
    ("gpu_instances", "message"),
    [
        ([{"id": 7, "profileId": 99, "start": 0, "computeInstances": []}], "does not fit"),
        ([{"id": 7, "profileId": 19, "start": 7, "computeInstances": []}], "no placement"),
        (
            [
                {"id": 1, "profileId": 9, "start": 4, "computeInstances": []},
                {"id": 9, "profileId": 19, "start": 5, "computeInstances": []},
            ],
            "does not fit",
        ),
        (
            [
                {"id": 7, "profileId": 19, "start": 0, "computeInstances": []},
                {"id": 7, "profileId": 19, "start": 1, "computeInstances": []},
            ],
            "appears twice",
        ),
        ([{"id": 7, "profileId": 19, "start": 0}], "computeInstances"),
    ],
)
def test_a_snapshot_that_does_not_fit_the_profile_is_refused_naming_the_gpu(
    gpu_instances: list[dict[str, Any]], message: str
) -> None:
    profile = load_profile("hgx-h100", "node-a")
    probe = SimulatedNvml(profile)
    probe.init()
    state = {"current": ON, "pending": ON, "computeInstancesCreated": 0}
    saved = _with_gpu_state(probe, {**state, "gpuInstances": gpu_instances})

    with pytest.raises(MigSnapshotError, match=message) as raised:
        SimulatedNvml(profile, saved_mig=saved)
    assert profile.gpus[0].uuid in str(raised.value)


def test_a_snapshot_of_unknown_gpus_is_refused() -> None:
    profile = load_profile("hgx-h100", "node-a")
    other = load_profile("hgx-h100", "node-b")  # same GPUs, other UUIDs

    with pytest.raises(MigSnapshotError, match="this profile does not have"):
        SimulatedNvml(profile, saved_mig=SimulatedNvml(other).mig_snapshot())
