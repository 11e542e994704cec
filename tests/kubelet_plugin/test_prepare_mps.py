"""Per-claim MPS in the whole-GPU preparer, NVIDIA-compatible: the real `MpsDaemonManager`
running the ``nvidia-cuda-mps-control`` test double (real processes, plain-directory shm), the
real checkpoint and CDI store, GPUs of the simulated hgx-h100 node.

Every test runs its daemons under a scratch root of its own and fails if any daemon or server
process is left running there afterwards.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.mps import DaemonHandle, DaemonState, MpsSettings, claim_daemon_id
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.tiers.state import MPS_STATE_KEY, handles_from_state
from tests.doubles import nvidia_cuda_mps_control as double
from tests.fakes.claim_reader import allocation_result, gpu_config, opaque_config, resource_claim
from tests.kubelet_plugin.nodes import (
    NODE,
    UID_A,
    UID_B,
    MpsNode,
    Node,
    assert_one_daemon_per_mig_device,
    device_env,
    failed,
    mounts,
    ok,
    wait_dead,
)

MPS_CONFIG: dict[str, Any] = {
    "defaultActiveThreadPercentage": 25,
    "defaultPinnedDeviceMemoryLimit": "10Gi",
    "defaultPerDevicePinnedMemoryLimit": {"1": "4Gi"},
}


@pytest.fixture
def node(tmp_path: Path, inventory: NodeInventory, mps_root: Path) -> MpsNode:
    return MpsNode(tmp_path, inventory, mps_root)


def commands(handle: DaemonHandle) -> list[str]:
    lines = (handle.paths.log / "control.log").read_text().splitlines()
    entries = [line.split("] ", 1)[1] for line in lines]
    return [e.removeprefix("Cmd:") for e in entries if e.startswith("Cmd:")]


# ---- prepare ---------------------------------------------------------------------------------


def test_mps_claim_starts_one_daemon_with_the_configured_settings(node: MpsNode) -> None:
    claim = node.add_mps(UID_A, "gpu-0", "gpu-1", mps_config=MPS_CONFIG)
    uuids = sorted([node.uuid_of("gpu-0"), node.uuid_of("gpu-1")])

    devices = ok(node.prepare(claim)[UID_A])

    assert [d.device_name for d in devices] == ["gpu-0", "gpu-1"]
    [handle] = node.handles(UID_A)
    assert handle.daemon_id == claim_daemon_id(UID_A, uuids)
    assert handle.root == node.mps_root / "mps" / handle.daemon_id
    assert handle.devices == tuple(uuids)
    assert node.daemon_dirs() == [handle.daemon_id]
    state = double.read_state(handle.paths.pipe)
    assert state["visibleDevices"] == uuids
    assert state["multiUser"] is False
    # 10Gi for every device, index 1 (in sorted UUID order) overridden with 4Gi.
    limits = {uuids[0]: "10240M", uuids[1]: "4096M"}
    assert state["defaults"] == {"activeThreadPercentage": 25.0, "pinnedMemLimits": limits}
    assert commands(handle)[1:4] == [
        "set_default_active_thread_percentage 25",
        f"set_default_device_pinned_mem_limit {uuids[0]} 10240M",
        f"set_default_device_pinned_mem_limit {uuids[1]} 4096M",
    ]
    assert state["servers"] == []  # no server before a client comes
    assert node.mps.status(handle).state is DaemonState.READY
    assert node.running() == [handle.pid]
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_COMPLETED
    node.unprepare(claim)
    assert node.running() == []


def test_multi_user_starts_the_daemon_with_dash_m(node: MpsNode) -> None:
    claim = node.add_mps(UID_A, "gpu-2", mps_config={"multiUser": True})

    ok(node.prepare(claim)[UID_A])

    [handle] = node.handles(UID_A)
    state = double.read_state(handle.paths.pipe)
    assert state["multiUser"] is True
    assert state["defaults"]["activeThreadPercentage"] == 100.0  # type: ignore[index]
    assert not [c for c in commands(handle) if c.startswith("set_")]
    node.unprepare(claim)
    assert node.running() == []


def test_cdi_spec_gives_every_device_of_the_group_the_pipe_and_shm(node: MpsNode) -> None:
    claim = node.add_mps(UID_A, "gpu-0", "gpu-3")

    ok(node.prepare(claim)[UID_A])

    [handle] = node.handles(UID_A)
    spec = node.spec(UID_A)
    options = ["rw", "nosuid", "nodev", "bind"]
    for spec_device in spec["devices"]:
        name = spec_device["name"].removeprefix(f"{UID_A}-")
        env = device_env(spec_device)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
        # The inventory's edits are kept next to the daemon's.
        prefix = "GPU_DRA_" + name.upper().replace("-", "_")
        assert env[f"{prefix}_UUID"] == node.uuid_of(name)
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env  # daemon defaults only
        found = mounts(spec_device)
        assert found["/tmp/nvidia-mps"] == (str(handle.paths.pipe), options)
        assert found["/dev/shm"] == (str(handle.paths.shm), options)
        assert f"/run/gpu-dra/devices/{name}.json" in found
    assert sorted(d["name"] for d in spec["devices"]) == [f"{UID_A}-gpu-0", f"{UID_A}-gpu-3"]
    node.unprepare(claim)
    assert node.running() == []


def test_two_config_groups_get_two_daemons(node: MpsNode) -> None:
    configs = [
        opaque_config(
            gpu_config(
                sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}}
            ),
            requests=["a"],
        ),
        opaque_config(
            gpu_config(
                sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 70}}
            ),
            requests=["b"],
        ),
    ]
    results = [
        allocation_result("gpu-0", request="a"),
        allocation_result("gpu-1", request="a"),
        allocation_result("gpu-2", request="b"),
        allocation_result("gpu-4"),  # request gpu: no sharing
    ]
    claim = node.add(resource_claim(UID_A, results=results, claim_configs=configs))

    ok(node.prepare(claim)[UID_A])

    handles = {h.daemon_id: h for h in node.handles(UID_A)}
    group_a = claim_daemon_id(UID_A, [node.uuid_of("gpu-0"), node.uuid_of("gpu-1")])
    group_b = claim_daemon_id(UID_A, [node.uuid_of("gpu-2")])
    assert sorted(handles) == sorted([group_a, group_b])
    assert handles[group_a].settings.active_thread_percentage == 30
    assert handles[group_b].settings.active_thread_percentage == 70
    assert double.read_state(handles[group_b].paths.pipe)["visibleDevices"] == [
        node.uuid_of("gpu-2")
    ]
    assert sorted(node.running()) == sorted(h.pid for h in handles.values())
    pipes = {
        d["name"].removeprefix(f"{UID_A}-"): mounts(d).get("/tmp/nvidia-mps", ("",))[0]
        for d in node.spec(UID_A)["devices"]
    }
    assert pipes == {
        "gpu-0": str(handles[group_a].paths.pipe),
        "gpu-1": str(handles[group_a].paths.pipe),
        "gpu-2": str(handles[group_b].paths.pipe),
        "gpu-4": "",
    }
    node.unprepare(claim)
    assert node.running() == []
    assert node.daemon_dirs() == []


def test_preparing_twice_starts_no_second_daemon(node: MpsNode) -> None:
    claim = node.add_mps(UID_A, "gpu-0")
    first = ok(node.prepare(claim)[UID_A])
    [handle] = node.handles(UID_A)

    assert ok(node.prepare(claim)[UID_A]) == first
    assert node.handles(UID_A) == [handle]
    assert node.running() == [handle.pid]
    node.unprepare(claim)
    assert node.running() == []


@pytest.mark.parametrize(
    ("mps_config", "expected"),
    [
        pytest.param(
            {"defaultPerDevicePinnedMemoryLimit": {"5": "1Gi"}},
            "spec.devices.config[0]: parameters.sharing.mpsConfig."
            "defaultPerDevicePinnedMemoryLimit[5]: device index 5 is out of range",
            id="index-out-of-range",
        ),
        pytest.param(
            {
                "defaultPerDevicePinnedMemoryLimit": {
                    "GPU-00000000-0000-0000-0000-000000000000": "1Gi"
                }
            },
            "is neither the UUID of a device in this config group",
            id="uuid-not-in-group",
        ),
        pytest.param(
            {"defaultActiveThreadPercentage": 101},
            "active thread percentage must be between 0 and 100",
            id="percentage",
        ),
        pytest.param(
            {"defaultPinnedDeviceMemoryLimit": "100Ki"},
            "pinned memory limit '100Ki' is too low",
            id="limit-too-low",
        ),
    ],
)
def test_invalid_mps_config_is_a_config_error_and_starts_nothing(
    node: MpsNode, mps_config: dict[str, Any], expected: str
) -> None:
    claim = node.add_mps(UID_A, "gpu-0", "gpu-1", mps_config=mps_config)

    error = failed(node.prepare(claim)[UID_A])

    assert f"default/claim-a ({UID_A}): " in error
    assert expected in error
    assert "(will retry)" not in error
    node.assert_nothing_left(UID_A)
    assert node.cdi.writes == []
    assert node.daemon_dirs() == []
    assert node.running() == []


def test_time_slicing_without_a_time_slicer_starts_nothing(node: MpsNode) -> None:
    config = opaque_config(gpu_config(sharing={"strategy": "TimeSlicing"}), requests=["gpu"])
    claim = node.add(
        resource_claim(UID_A, results=[allocation_result("gpu-0")], claim_configs=[config])
    )

    error = failed(node.prepare(claim)[UID_A])

    assert "time-slicing is not available on node node-a" in error
    node.assert_nothing_left(UID_A)
    assert node.daemon_dirs() == []
    assert node.running() == []


def test_mps_on_an_admin_access_device_is_refused(node: MpsNode) -> None:
    config = opaque_config(gpu_config(sharing={"strategy": "MPS"}), requests=["gpu"])
    claim = node.add(
        resource_claim(
            UID_A,
            results=[allocation_result("gpu-0", admin_access=True)],
            claim_configs=[config],
        )
    )

    error = failed(node.prepare(claim)[UID_A])

    assert "MPS cannot be used on devices allocated with adminAccess (gpu-0)" in error
    node.assert_nothing_left(UID_A)
    assert node.running() == []


def test_mps_claim_without_a_daemon_manager_fails_clearly(
    tmp_path: Path,
    inventory: NodeInventory,
) -> None:
    plain = Node(tmp_path, inventory)  # no MPS control program on this node
    config = opaque_config(gpu_config(sharing={"strategy": "MPS"}), requests=["gpu"])
    claim = plain.add(
        resource_claim(UID_A, results=[allocation_result("gpu-0")], claim_configs=[config])
    )

    error = failed(plain.prepare(claim)[UID_A])

    assert f"MPS is not available on node {NODE}" in error
    plain.assert_nothing_left(UID_A)


# ---- failures after the daemon started ---------------------------------------------------------


def test_failed_cdi_write_after_the_daemon_started_stops_it_again(node: MpsNode) -> None:
    node.fail_cdi_writes = True
    node.restart()
    claim = node.add_mps(UID_A, "gpu-0", "gpu-1", mps_config=MPS_CONFIG)

    error = failed(node.prepare(claim)[UID_A])

    assert "No space left on device" in error
    assert error.endswith("(will retry)")
    assert node.cdi.writes == [UID_A]  # the daemon had started: the write came after it
    node.assert_nothing_left(UID_A)
    assert node.daemon_dirs() == []
    assert node.running() == []
    # The GPUs are free again.
    node.fail_cdi_writes = False
    node.restart()
    other = node.add_mps(UID_B, "gpu-0", "gpu-1", name="claim-b")
    ok(node.prepare(other)[UID_B])
    node.unprepare(other)
    assert node.running() == []


def test_daemon_that_fails_to_start_fails_the_prepare_and_leaves_nothing(
    node: MpsNode,
) -> None:
    node.mps.base_env["GPU_DRA_MPS_DOUBLE_FAIL_START"] = "no GPU today"
    claim = node.add_mps(UID_A, "gpu-0")

    error = failed(node.prepare(claim)[UID_A])

    assert f"MPS control daemon {claim_daemon_id(UID_A, [node.uuid_of('gpu-0')])}" in error
    assert error.endswith("(will retry)")
    node.assert_nothing_left(UID_A)
    assert node.cdi.writes == []
    assert node.daemon_dirs() == []
    assert node.running() == []


def test_second_group_failing_to_start_stops_the_first(node: MpsNode) -> None:
    configs = [
        opaque_config(gpu_config(sharing={"strategy": "MPS"}), requests=["a"]),
        opaque_config(
            gpu_config(
                sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}
            ),
            requests=["b"],
        ),
    ]
    results = [allocation_result("gpu-0", request="a"), allocation_result("gpu-1", request="b")]
    claim = node.add(resource_claim(UID_A, results=results, claim_configs=configs))
    # The double refuses the command only the second daemon gets.
    node.mps.base_env["GPU_DRA_MPS_DOUBLE_FAIL_COMMAND"] = "set_default_active_thread_percentage"

    error = failed(node.prepare(claim)[UID_A])

    assert "set_default_active_thread_percentage" in error
    node.assert_nothing_left(UID_A)
    assert node.daemon_dirs() == []
    assert node.running() == []


# ---- unprepare ---------------------------------------------------------------------------------


def test_unprepare_stops_the_daemon_and_removes_its_directories(node: MpsNode) -> None:
    claim = node.add_mps(UID_A, "gpu-0", "gpu-1", mps_config=MPS_CONFIG)
    keep = node.add_mps(UID_B, "gpu-2", name="claim-b")
    ok(node.prepare(claim)[UID_A])
    ok(node.prepare(keep)[UID_B])
    [handle] = node.handles(UID_A)
    [kept] = node.handles(UID_B)

    assert node.unprepare(claim) == {UID_A: None}

    assert wait_dead(handle.pid)
    assert not handle.root.exists()
    node.assert_nothing_left(UID_A)
    assert node.running() == [kept.pid]
    assert node.unprepare(claim) == {UID_A: None}  # again: nothing to do
    node.unprepare(keep)
    assert node.running() == []
    assert node.daemon_dirs() == []


def test_unprepare_of_a_claim_whose_daemon_died_cleans_up(node: MpsNode) -> None:
    claim = node.add_mps(UID_A, "gpu-0")
    ok(node.prepare(claim)[UID_A])
    [handle] = node.handles(UID_A)
    os.kill(handle.pid, signal.SIGKILL)
    assert wait_dead(handle.pid)

    assert node.unprepare(claim) == {UID_A: None}

    node.assert_nothing_left(UID_A)
    assert node.daemon_dirs() == []
    assert node.running() == []


def test_a_prepared_claim_whose_daemon_died_gets_a_new_one_at_its_next_prepare(
    node: MpsNode,
) -> None:
    claim = node.add_mps(UID_A, "gpu-0", mps_config={"defaultActiveThreadPercentage": 40})
    devices = ok(node.prepare(claim)[UID_A])
    [old] = node.handles(UID_A)
    os.kill(old.pid, signal.SIGKILL)
    assert wait_dead(old.pid)

    assert ok(node.prepare(claim)[UID_A]) == devices

    [new] = node.handles(UID_A)
    assert (new.daemon_id, new.settings) == (old.daemon_id, old.settings)
    assert node.running() == [new.pid]
    assert node.mps.status(new).state is DaemonState.READY
    assert ok(node.prepare(claim)[UID_A]) == devices  # alive now: returned as recorded
    assert node.handles(UID_A) == [new]
    node.unprepare(claim)
    assert node.running() == []


# ---- plugin restarts ---------------------------------------------------------------------------


def test_recover_after_a_restart_adopts_the_running_daemon_and_unprepare_stops_it(
    node: MpsNode, caplog: pytest.LogCaptureFixture
) -> None:
    claim = node.add_mps(UID_A, "gpu-0", mps_config={"defaultActiveThreadPercentage": 40})
    devices = ok(node.prepare(claim)[UID_A])
    [handle] = node.handles(UID_A)

    node.restart()  # a new plugin process: new checkpoint, CDI store, daemon manager
    with caplog.at_level(logging.INFO):
        node.recover()

    assert f"mps daemon adopted daemon_id={handle.daemon_id}" in caplog.text
    assert node.running() == [handle.pid]  # the same daemon, untouched
    assert node.mps.status(handle).state is DaemonState.READY
    assert ok(node.prepare(claim)[UID_A]) == devices
    assert node.unprepare(claim) == {UID_A: None}
    assert wait_dead(handle.pid)
    node.assert_nothing_left(UID_A)
    assert node.running() == []
    assert node.daemon_dirs() == []


def test_recover_logs_a_dead_daemon_and_keeps_the_claim_prepared(
    node: MpsNode, caplog: pytest.LogCaptureFixture
) -> None:
    claim = node.add_mps(UID_A, "gpu-0")
    ok(node.prepare(claim)[UID_A])
    [handle] = node.handles(UID_A)
    os.kill(handle.pid, signal.SIGKILL)
    assert wait_dead(handle.pid)

    node.restart()
    with caplog.at_level(logging.INFO):
        node.recover()

    assert "mps daemon of prepared claim is gone" in caplog.text
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_COMPLETED
    assert node.cdi.path_for(UID_A).exists()
    assert node.unprepare(claim) == {UID_A: None}
    node.assert_nothing_left(UID_A)
    assert node.daemon_dirs() == []
    assert node.running() == []


def test_recover_stops_the_daemon_of_an_interrupted_prepare(node: MpsNode) -> None:
    claim = node.add_mps(UID_A, "gpu-0", "gpu-1")
    ok(node.prepare(claim)[UID_A])
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    [handle] = handles_from_state(entry.state)
    # The plugin died after the daemon started and was recorded, before PrepareCompleted.
    node.checkpoint.put(
        CheckpointEntry(
            claim=entry.claim,
            phase=ClaimPhase.PREPARE_STARTED,
            state={MPS_STATE_KEY: entry.state[MPS_STATE_KEY]},
        )
    )

    node.restart()
    node.recover()

    assert wait_dead(handle.pid)
    node.assert_nothing_left(UID_A)
    assert node.daemon_dirs() == []
    assert node.running() == []


def test_prepare_after_an_interrupted_prepare_replaces_its_daemon(node: MpsNode) -> None:
    claim = node.add_mps(UID_A, "gpu-0")
    ok(node.prepare(claim)[UID_A])
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    [old] = handles_from_state(entry.state)
    node.checkpoint.put(
        CheckpointEntry(claim=entry.claim, phase=ClaimPhase.PREPARE_STARTED, state=entry.state)
    )
    node.restart()

    ok(node.prepare(claim)[UID_A])  # rolls the interrupted one back first

    [new] = node.handles(UID_A)
    assert new.daemon_id == old.daemon_id
    assert new.pid != old.pid
    assert wait_dead(old.pid)
    assert node.running() == [new.pid]
    node.unprepare(claim)
    assert node.running() == []


def test_recover_removes_a_daemon_no_claim_records(node: MpsNode) -> None:
    kept_claim = node.add_mps(UID_B, "gpu-2", name="claim-b")
    ok(node.prepare(kept_claim)[UID_B])
    [kept] = node.handles(UID_B)
    # The plugin died after starting claim A's daemon, before recording it.
    uuid = node.uuid_of("gpu-0")
    orphan = node.mps.start(claim_daemon_id(UID_A, [uuid]), [uuid], MpsSettings())
    assert sorted(node.running()) == sorted([kept.pid, orphan.pid])

    node.restart()
    node.recover()

    assert wait_dead(orphan.pid)
    assert not orphan.root.exists()
    assert node.running() == [kept.pid]
    assert node.daemon_dirs() == [kept.daemon_id]
    node.unprepare(kept_claim)
    assert node.running() == []


def test_mps_on_mig_runs_one_daemon_per_mig_device_keyed_by_its_mig_uuid(
    tmp_path: Path, mps_root: Path
) -> None:
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    devices = discover_devices(host.nvml, host.pci)
    node = MpsNode(tmp_path, NodeInventory.from_discovery(devices, simulated=True), mps_root)
    mig_mps = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "MigDeviceConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 30,
                "defaultPinnedDeviceMemoryLimit": "4Gi",
                "defaultPerDevicePinnedMemoryLimit": {"1": "2Gi"},
            },
        },
    }
    names = ["gpu-0-mig-1g10gb-19-0", "gpu-1-mig-2g20gb-14-0"]
    config = opaque_config(mig_mps, requests=["gpu"])
    results = [allocation_result(name) for name in names]
    claim = node.add(resource_claim(UID_A, "claim-a", results=results, claim_configs=[config]))
    uuids = {name: node.uuid_of(name) for name in names}
    assert all(uuid.startswith("MIG-") for uuid in uuids.values())
    second = sorted(uuids.values())[1]  # key "1": index into the group's sorted UUIDs

    ok(node.prepare(claim)[UID_A])

    handles = {h.devices: h for h in node.handles(UID_A)}
    limits = {uuid: "2048M" if uuid == second else "4096M" for uuid in uuids.values()}
    assert_one_daemon_per_mig_device(UID_A, handles, 30.0, limits)
    for name, uuid in uuids.items():
        handle = handles[(uuid,)]
        (spec_device,) = [d for d in node.spec(UID_A)["devices"] if d["name"] == f"{UID_A}-{name}"]
        assert mounts(spec_device)["/tmp/nvidia-mps"][0] == str(handle.paths.pipe)
        assert device_env(spec_device)["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert sorted(node.running()) == sorted(h.pid for h in handles.values())

    node.unprepare(claim)
    node.assert_nothing_left(UID_A)
    assert node.daemon_dirs() == []
    assert node.running() == []


def test_a_gpu_config_naming_a_mig_device_is_a_type_mismatch(
    tmp_path: Path, mps_root: Path
) -> None:
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    devices = discover_devices(host.nvml, host.pci)
    node = MpsNode(tmp_path, NodeInventory.from_discovery(devices, simulated=True), mps_root)
    claim = node.add_mps(UID_A, "gpu-0-mig-1g10gb-19-0")

    error = failed(node.prepare(claim)[UID_A])

    assert 'cannot apply GpuConfig to device "gpu-0-mig-1g10gb-19-0" of type "mig"' in error
    node.assert_nothing_left(UID_A)
    assert node.running() == []
