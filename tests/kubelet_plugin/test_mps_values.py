"""MPS values without processes: daemon ids, settings, checkpoint state, workload CDI edits."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from gpu_dra.driver.config import render_pinned_limit
from gpu_dra.driver.naming import InvalidNameError
from gpu_dra.kubelet_plugin.cdi import CdiDevice, build_claim_spec
from gpu_dra.kubelet_plugin.mps import (
    CONTAINER_PIPE_DIRECTORY,
    ClientCaps,
    DaemonHandle,
    DaemonPaths,
    MpsSettings,
    MpsStateError,
    claim_daemon_id,
    shared_daemon_id,
    workload_edits,
)
from gpu_dra.kubelet_plugin.tiers.state import (
    MPS_STATE_KEY,
    claims_using,
    handles_from_state,
    handles_to_state,
)

CLAIM = "0f6c2c6e-8a3c-4d0e-9a63-8e2b5e0c1d11"
GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
MIG = "MIG-0c6a1e8e-7a1c-5b2d-8d1e-3f2a9b8c7d6e"


# -- ids -----------------------------------------------------------------------------------------


def test_claim_daemon_id_is_nvidias_formula() -> None:
    expected = hashlib.sha256(f"{GPU_A},{GPU_B}".encode()).hexdigest()[:5]
    assert claim_daemon_id(CLAIM, [GPU_B, GPU_A]) == f"{CLAIM}-{expected}"
    assert claim_daemon_id(CLAIM, [GPU_A, GPU_B]) == claim_daemon_id(CLAIM, [GPU_B, GPU_A])
    assert len(claim_daemon_id(CLAIM, [MIG])) == 42
    single = hashlib.sha256(MIG.encode()).hexdigest()[:5]
    assert claim_daemon_id(CLAIM, [MIG]) == f"{CLAIM}-{single}"


def test_nvidia_pod_name_of_a_claim_daemon_fits_a_dns_label() -> None:
    assert len(f"mps-control-daemon-{claim_daemon_id(CLAIM, [GPU_A])}") <= 63


@pytest.mark.parametrize(
    ("claim", "uuids"),
    [
        ("../../etc", [GPU_A]),
        (CLAIM.upper(), [GPU_A]),
        (CLAIM, []),
        (CLAIM, ["GPU-a,GPU-b"]),
        (CLAIM, ["GPU-a 1"]),
        (CLAIM, ["GPU-a=1"]),
        (CLAIM, ["0"]),
    ],
)
def test_claim_daemon_id_rejects_bad_input(claim: str, uuids: list[str]) -> None:
    with pytest.raises((InvalidNameError, ValueError)):
        claim_daemon_id(claim, uuids)


def test_shared_daemon_id_is_per_device_and_never_a_claim_id() -> None:
    shared = shared_daemon_id(GPU_A)
    assert shared == "shared-" + hashlib.sha256(GPU_A.encode()).hexdigest()[:16]
    assert shared != shared_daemon_id(GPU_B)
    assert shared_daemon_id(MIG).startswith("shared-")
    assert DaemonPaths.of(Path("/d"), shared).root == Path("/d/mps") / shared


def test_daemon_paths_reject_ids_that_are_not_one_path_component() -> None:
    for bad in ("..", "a/b", "A", "", "x" * 45):
        with pytest.raises(InvalidNameError):
            DaemonPaths.of(Path("/d"), bad)


# -- settings ------------------------------------------------------------------------------------


def test_settings_commands_are_percentage_then_limits_by_uuid() -> None:
    settings = MpsSettings(
        active_thread_percentage=0,
        pinned_limits={GPU_B: render_pinned_limit("1G"), GPU_A: render_pinned_limit("10Gi")},
    )
    settings.check([GPU_A, GPU_B])
    assert settings.commands() == [
        "set_default_active_thread_percentage 0",
        f"set_default_device_pinned_mem_limit {GPU_A} 10240M",
        f"set_default_device_pinned_mem_limit {GPU_B} 953M",
    ]
    assert MpsSettings().commands() == []


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (MpsSettings(active_thread_percentage=101), "0..100"),
        (MpsSettings(active_thread_percentage=-1), "0..100"),
        (MpsSettings(pinned_limits={GPU_B: "1M"}), "not a daemon device"),
        (MpsSettings(pinned_limits={GPU_A: "1G"}), "not <MiB>M"),
        (MpsSettings(pinned_limits={GPU_A: "0M"}), "not <MiB>M"),
        (MpsSettings(pinned_limits={GPU_A: "1M\nquit"}), "not <MiB>M"),
    ],
)
def test_bad_settings_are_refused(settings: MpsSettings, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings.check([GPU_A])


# -- checkpoint state ----------------------------------------------------------------------------


def handle(**changes: object) -> DaemonHandle:
    values: dict[str, object] = {
        "daemon_id": claim_daemon_id(CLAIM, [GPU_A]),
        "devices": (GPU_A,),
        "root": Path("/var/lib/kubelet/plugins/gpu.nvidia.com/mps/x"),
        "pid": 4242,
        "pid_start_time": 123456,
        "settings": MpsSettings(50, {GPU_A: "1024M"}, multi_user=True),
        "runner": "process",
        "shm_mounted": True,
    }
    values.update(changes)
    return DaemonHandle(**values)  # type: ignore[arg-type]


def test_handles_round_trip_through_the_claim_state() -> None:
    handles = [handle(), handle(daemon_id="other", settings=MpsSettings())]
    state = {"adminAccessDevices": [], MPS_STATE_KEY: handles_to_state(handles)}
    assert handles_from_state(json.loads(json.dumps(state))) == handles
    assert handles_from_state({}) == []


def test_claims_using_a_shared_daemon_are_its_reference_count() -> None:
    shared = handle(daemon_id=shared_daemon_id(GPU_A))
    own = handle(daemon_id=claim_daemon_id(CLAIM, [GPU_B]))
    states = {
        "claim-2": {MPS_STATE_KEY: handles_to_state([shared])},
        "claim-1": {MPS_STATE_KEY: handles_to_state([own, shared])},
        "claim-3": {MPS_STATE_KEY: handles_to_state([own])},
        "claim-4": {},
    }
    assert claims_using(states, shared.daemon_id) == ["claim-1", "claim-2"]
    assert claims_using(states, shared_daemon_id(GPU_B)) == []


def test_handle_state_is_camel_case_json() -> None:
    assert handle().to_state() == {
        "version": 1,
        "daemonId": claim_daemon_id(CLAIM, [GPU_A]),
        "devices": [GPU_A],
        "root": "/var/lib/kubelet/plugins/gpu.nvidia.com/mps/x",
        "pid": 4242,
        "pidStartTime": 123456,
        "settings": {
            "activeThreadPercentage": 50,
            "pinnedLimits": {GPU_A: "1024M"},
            "multiUser": True,
        },
        "runner": "process",
        "shmMounted": True,
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "newer than this plugin's 1"),
        ({"pid": "12"}, "not a positive integer"),
        ({"pid": 0}, "not a positive integer"),
        ({"daemonId": "../x"}, "not a DNS label"),
        ({"devices": ["GPU-a,b"]}, "not a GPU or MIG device UUID"),
        ({"settings": []}, "wrong type"),
        ({"daemonId": None}, "not a DNS label"),
        ({"root": "relative/x"}, "not an absolute path"),
        ({"root": None}, "not an absolute path"),
    ],
)
def test_bad_handle_state_is_refused(change: dict[str, object], message: str) -> None:
    state = {**handle().to_state(), **change}
    with pytest.raises(MpsStateError, match=message):
        DaemonHandle.from_state(state)  # type: ignore[arg-type]


def test_handle_state_missing_a_field_or_not_a_list_is_refused() -> None:
    state = handle().to_state()
    del state["pidStartTime"]
    with pytest.raises(MpsStateError, match="incomplete or invalid"):
        DaemonHandle.from_state(state)
    with pytest.raises(MpsStateError, match="not a list"):
        handles_from_state({MPS_STATE_KEY: {"a": 1}})
    with pytest.raises(MpsStateError, match="not an object"):
        handles_from_state({MPS_STATE_KEY: ["x"]})


# -- workload CDI edits --------------------------------------------------------------------------


def test_workload_edits_are_nvidias_contract() -> None:
    paths = DaemonPaths.of(Path("/plugins/gpu.nvidia.com"), claim_daemon_id(CLAIM, [GPU_A]))
    edits = workload_edits(paths)
    spec = build_claim_spec(CLAIM, [CdiDevice("gpu-0", edits)])
    assert spec["devices"][0]["containerEdits"] == {
        "env": ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"],
        "mounts": [
            {
                "hostPath": f"{paths.root}/shm",
                "containerPath": "/dev/shm",
                "options": ["rw", "nosuid", "nodev", "bind"],
            },
            {
                "hostPath": f"{paths.root}/pipe",
                "containerPath": CONTAINER_PIPE_DIRECTORY,
                "options": ["rw", "nosuid", "nodev", "bind"],
            },
        ],
    }
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in edits.env  # never without caps


def test_client_caps_add_per_client_env() -> None:
    paths = DaemonPaths.of(Path("/d"), shared_daemon_id(GPU_A))
    caps = ClientCaps(pinned_limits={GPU_B: "20480M", GPU_A: "10240M"}, active_thread_percentage=25)
    assert dict(workload_edits(paths, caps).env) == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{GPU_A}=10240M,{GPU_B}=20480M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
    }
    only_memory = ClientCaps(pinned_limits={MIG: "5120M"})
    assert only_memory.env() == {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{MIG}=5120M"}


@pytest.mark.parametrize(
    "caps",
    [
        ClientCaps(pinned_limits={GPU_A: "10Gi"}),
        ClientCaps(pinned_limits={"GPU-a=1": "1M"}),
        ClientCaps(active_thread_percentage=150),
    ],
)
def test_bad_client_caps_are_refused(caps: ClientCaps) -> None:
    with pytest.raises((ValueError, InvalidNameError)):
        caps.env()
