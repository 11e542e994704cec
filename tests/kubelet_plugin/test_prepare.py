"""Whole-GPU prepare/unprepare as the kubelet drives it: real checkpoint, CDI store and claim
files in a temporary directory, GPUs of the simulated hgx-h100 node, claims from an in-memory
API server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpu_dra.kubelet_plugin import checkpoint as checkpoint_module
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.cdi import CdiDevice, ContainerEdits
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.dra_service import ClaimCallHandler
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice, PrepareResult
from tests.fakes.claim_reader import (
    allocation_result,
    gpu_config,
    opaque_config,
    resource_claim,
)
from tests.kubelet_plugin.nodes import (
    DRIVER,
    NODE,
    UID_A,
    UID_B,
    UID_C,
    Crash,
    Node,
    device_env,
    failed,
    ok,
)


def uid(n: int) -> str:
    return f"7f000000-0000-4000-8000-{n:012d}"


@pytest.fixture
def node(tmp_path: Path, inventory: NodeInventory) -> Node:
    return Node(tmp_path, inventory)


# ---- prepare: devices, CDI spec --------------------------------------------------------------


def test_prepare_returns_each_allocated_gpu_with_its_request_pool_and_cdi_id(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0", "gpu-3")

    devices = ok(node.prepare(claim)[UID_A])

    assert devices == (
        PreparedDevice(
            request_names=("gpu",),
            pool_name=NODE,
            device_name="gpu-0",
            cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={UID_A}-gpu-0",),
        ),
        PreparedDevice(
            request_names=("gpu",),
            pool_name=NODE,
            device_name="gpu-3",
            cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={UID_A}-gpu-3",),
        ),
    )


def test_prepare_writes_one_cdi_spec_for_the_claim_with_a_device_per_gpu(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0", "gpu-3")

    node.prepare(claim)

    assert node.spec_files() == [f"k8s.gpu.nvidia.com-claim_{UID_A}.yaml"]
    spec = node.spec(UID_A)
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
    assert [d["name"] for d in spec["devices"]] == [f"{UID_A}-gpu-0", f"{UID_A}-gpu-3"]
    for spec_device, gpu in zip(spec["devices"], ("gpu-0", "gpu-3"), strict=True):
        number = gpu.removeprefix("gpu-")
        assert device_env(spec_device)[f"GPU_DRA_GPU_{number}_UUID"] == node.uuid_of(gpu)


def test_each_cdi_device_mounts_the_shared_fact_file_of_its_own_gpu(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-5")
    other = node.add_gpus(UID_B, "claim-b", "gpu-5")

    node.prepare(claim)

    (spec_device,) = node.spec(UID_A)["devices"]
    (mount,) = spec_device["containerEdits"]["mounts"]
    assert mount["containerPath"] == "/run/gpu-dra/devices/gpu-5.json"
    assert "ro" in mount["options"]
    host_file = Path(mount["hostPath"])
    assert host_file.parent == node.data_dir / "simulated-facts"
    facts = json.loads(host_file.read_text())
    assert (facts["name"], facts["uuid"]) == ("gpu-5", node.uuid_of("gpu-5"))
    assert node.claim_dirs() == []  # nothing of the claim's own to keep
    node.unprepare(claim)
    node.prepare(other)
    assert node.spec(UID_B)["devices"][0]["containerEdits"]["mounts"] == [mount]


def test_first_available_subrequest_is_reported_under_its_base_request(node: Node) -> None:
    requests = [
        {
            "name": "gpu",
            "firstAvailable": [
                {"name": "h200", "deviceClassName": "gpu-h200.nvidia.com"},
                {"name": "h100", "deviceClassName": "gpu-h100.nvidia.com"},
            ],
        }
    ]
    result = allocation_result("gpu-2", request="gpu/h100")
    claim = node.add(resource_claim(UID_A, results=[result], requests=requests))

    (device,) = ok(node.prepare(claim)[UID_A])

    assert device.request_names == ("gpu",)


def test_share_id_of_the_allocation_is_returned(node: Node) -> None:
    share_id = "3f1c2b4a-0000-4000-8000-000000000007"
    claim = node.add_gpus(UID_A, "claim-a", "gpu-1", share_id=share_id)

    (device,) = ok(node.prepare(claim)[UID_A])

    assert device.share_id == share_id


def test_results_of_other_drivers_and_other_pools_are_ignored(node: Node) -> None:
    results = [
        allocation_result("gpu-1"),
        allocation_result("gpu-2", driver="nic.example.com"),
        allocation_result("gpu-3", pool="node-b"),
    ]
    claim = node.add(resource_claim(UID_A, results=results))

    devices = ok(node.prepare(claim)[UID_A])

    assert [d.device_name for d in devices] == ["gpu-1"]
    assert [d["name"] for d in node.spec(UID_A)["devices"]] == [f"{UID_A}-gpu-1"]


def test_claim_with_no_device_of_this_driver_on_this_node_fails_clearly(node: Node) -> None:
    results = [
        allocation_result("gpu-2", driver="nic.example.com"),
        allocation_result("gpu-3", pool="node-b"),
    ]
    claim = node.add(resource_claim(UID_A, results=results))

    error = failed(node.prepare(claim)[UID_A])

    assert f"default/claim-a ({UID_A})" in error
    assert f"no device of driver {DRIVER} in pool {NODE}" in error
    node.assert_nothing_left(UID_A)


# ---- idempotency -------------------------------------------------------------------------------


def test_preparing_twice_returns_the_same_devices_without_rewriting(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0", "gpu-1")
    first = ok(node.prepare(claim)[UID_A])
    checkpoint_inode = node.checkpoint.path.stat().st_ino
    spec_mtime = node.cdi.path_for(UID_A).stat().st_mtime_ns

    second = ok(node.prepare(claim)[UID_A])

    assert second == first
    assert node.cdi.writes == [UID_A]
    assert node.checkpoint.path.stat().st_ino == checkpoint_inode  # an atomic write replaces it
    assert node.cdi.path_for(UID_A).stat().st_mtime_ns == spec_mtime


def test_prepare_after_a_plugin_restart_returns_the_recorded_devices(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-4")
    first = ok(node.prepare(claim)[UID_A])

    node.restart()
    node.recover()

    assert ok(node.prepare(claim)[UID_A]) == first
    assert node.cdi.writes == []
    assert node.cdi.path_for(UID_A).exists()


@pytest.mark.parametrize(
    ("lose", "lost"),
    [
        pytest.param(
            lambda node: node.cdi.path_for(UID_A).unlink(), "its CDI spec is gone", id="cdi-spec"
        ),
        pytest.param(
            lambda node: shutil.rmtree(node.data_dir / "simulated-facts"),
            r"its file {facts}/gpu-0-[0-9a-f]{{16}}\.json is gone; "
            r"its file {facts}/gpu-1-[0-9a-f]{{16}}\.json is gone",
            id="fact-file",
        ),
    ],
)
def test_a_prepared_claim_that_lost_its_files_is_prepared_again(
    node: Node, lose: Callable[[Node], None], lost: str, caplog: pytest.LogCaptureFixture
) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0", "gpu-1")
    first = ok(node.prepare(claim)[UID_A])
    spec = node.spec(UID_A)
    lose(node)

    assert ok(node.prepare(claim)[UID_A]) == first

    assert node.cdi.writes == [UID_A, UID_A]
    assert node.spec(UID_A) == spec
    assert all(Path(path).exists() for path in node.cdi.mounted_host_paths(UID_A))
    lost = lost.format(facts=re.escape(str(node.data_dir / "simulated-facts")))
    assert re.search(f"prepared claim lost {lost}; unpreparing and preparing it again", caplog.text)


def test_a_prepared_claim_that_cannot_be_prepared_again_fails_naming_what_it_lost(
    node: Node,
) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    ok(node.prepare(claim)[UID_A])
    node.cdi.path_for(UID_A).unlink()
    node.api.delete("default", "claim-a")

    error = failed(node.prepare(claim)[UID_A])

    assert "ResourceClaim default/claim-a not found" in error
    assert error.endswith("[while preparing it again because its CDI spec is gone]")
    node.assert_nothing_left(UID_A)


# ---- one GPU, one claim ----------------------------------------------------------------------


def test_second_claim_for_a_prepared_gpu_fails_naming_the_first_claim(node: Node) -> None:
    first = node.add_gpus(UID_A, "claim-a", "gpu-0")
    second = node.add_gpus(UID_B, "claim-b", "gpu-0", "gpu-1")
    ok(node.prepare(first)[UID_A])

    error = failed(node.prepare(second)[UID_B])

    assert error.startswith(f"claim default/claim-b ({UID_B}): ")
    assert "device gpu-0 is already prepared for claim" in error
    assert f"default/claim-a ({UID_A})" in error
    node.assert_nothing_left(UID_B)
    assert node.cdi.path_for(UID_A).exists()


def test_admin_access_claim_may_use_a_gpu_prepared_for_another_claim(node: Node) -> None:
    first = node.add_gpus(UID_A, "claim-a", "gpu-0")
    monitor = node.add_gpus(UID_B, "monitor", "gpu-0", admin_access=True)
    ok(node.prepare(first)[UID_A])

    (device,) = ok(node.prepare(monitor)[UID_B])

    assert device.device_name == "gpu-0"
    assert node.cdi.path_for(UID_B).exists()


def test_gpu_held_only_by_an_admin_access_claim_can_be_prepared_for_another(node: Node) -> None:
    # The scheduler does not count admin-access allocations: a workload may get the same GPU.
    monitor = node.add_gpus(UID_A, "monitor", "gpu-0", admin_access=True)
    workload = node.add_gpus(UID_B, "claim-b", "gpu-0")
    ok(node.prepare(monitor)[UID_A])

    (device,) = ok(node.prepare(workload)[UID_B])

    assert device.device_name == "gpu-0"
    other = node.add_gpus(UID_C, "claim-c", "gpu-0")
    assert f"default/claim-b ({UID_B})" in failed(node.prepare(other)[UID_C])


def test_unprepared_gpu_can_be_prepared_for_another_claim(node: Node) -> None:
    first = node.add_gpus(UID_A, "claim-a", "gpu-0")
    second = node.add_gpus(UID_B, "claim-b", "gpu-0")
    ok(node.prepare(first)[UID_A])

    assert node.unprepare(first) == {UID_A: None}

    assert [d.device_name for d in ok(node.prepare(second)[UID_B])] == ["gpu-0"]


# ---- per-claim errors --------------------------------------------------------------------------


def replaced(node: Node) -> None:
    node.add_gpus(UID_C, "claim-b", "gpu-1")  # same name, new object


def deleted(node: Node) -> None:
    node.api.delete("default", "claim-b")


def unallocated(node: Node) -> None:
    node.api.add(resource_claim(UID_B, "claim-b", allocated=False))


def stale_device(node: Node) -> None:
    node.add_gpus(UID_B, "claim-b", "gpu-9")


def api_down(node: Node) -> None:
    node.api.read_errors["default", "claim-b"] = "cannot read ResourceClaim default/claim-b: 503"


@pytest.mark.parametrize(
    ("break_claim", "expected"),
    [
        pytest.param(replaced, f"replaced: the API server has UID {UID_C}", id="replaced"),
        pytest.param(deleted, "ResourceClaim default/claim-b not found", id="not-found"),
        pytest.param(unallocated, "the claim is not allocated", id="not-allocated"),
        pytest.param(stale_device, "device gpu-9 does not exist on node node-a", id="unknown-dev"),
        pytest.param(api_down, "503 (will retry)", id="api-error"),
    ],
)
def test_bad_claim_gets_its_own_error_and_does_not_fail_the_batch(
    node: Node, break_claim: Callable[[Node], None], expected: str
) -> None:
    good = node.add_gpus(UID_A, "claim-a", "gpu-0")
    bad = node.add_gpus(UID_B, "claim-b", "gpu-1")
    break_claim(node)

    results = node.prepare(bad, good)

    error = failed(results[UID_B])
    assert error.startswith(f"claim default/claim-b ({UID_B}): ")
    assert expected in error
    assert [d.device_name for d in ok(results[UID_A])] == ["gpu-0"]
    node.assert_nothing_left(UID_B)


def _result(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def change(claim: dict[str, Any]) -> None:
        claim["status"]["allocation"]["devices"]["results"][0].update(fields)
        for key in [k for k, v in fields.items() if v is None]:
            del claim["status"]["allocation"]["devices"]["results"][0][key]

    return change


def _devices(value: Any) -> Callable[[dict[str, Any]], None]:
    def change(claim: dict[str, Any]) -> None:
        claim["status"]["allocation"]["devices"] = value

    return change


@pytest.mark.parametrize(
    ("malform", "expected"),
    [
        pytest.param(_result(device=None), "device is null", id="no-device"),
        pytest.param(_result(device=7), "device is number 7", id="device-number"),
        pytest.param(_result(request=None), "request is null", id="no-request"),
        pytest.param(_result(request=["gpu"]), "request is an array", id="request-list"),
        pytest.param(_result(shareID=5), "shareID is number 5", id="share-id-number"),
        pytest.param(_result(adminAccess="yes"), "adminAccess is 'yes'", id="admin-string"),
        pytest.param(
            _result(consumedCapacity={"memory": 5}), "consumedCapacity is", id="capacity-number"
        ),
        pytest.param(_devices({"results": {}}), "devices.results is not a list", id="results"),
        pytest.param(_devices(["x"]), "devices is not an object", id="devices-list"),
        pytest.param(
            _devices({"results": [], "config": "x"}), "devices.config is not a list", id="config"
        ),
    ],
)
def test_malformed_allocation_fails_only_its_claim(
    node: Node, malform: Callable[[dict[str, Any]], None], expected: str
) -> None:
    good = node.add_gpus(UID_A, "claim-a", "gpu-0")
    claim = resource_claim(UID_B, "claim-b", results=[allocation_result("gpu-1")])
    malform(claim)
    bad = node.add(claim)

    results = node.prepare(bad, good)

    error = failed(results[UID_B])
    assert error.startswith(f"claim default/claim-b ({UID_B}): ")
    assert expected in error
    assert [d.device_name for d in ok(results[UID_A])] == ["gpu-0"]
    node.assert_nothing_left(UID_B)


def test_an_unexpected_error_fails_only_its_claim(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = node.add_gpus(UID_A, "claim-a", "gpu-0")
    bad = node.add_gpus(UID_B, "claim-b", "gpu-1")
    real_get = node.api.get_claim

    def get_claim(namespace: str, name: str) -> Any:
        if name == "claim-b":
            raise KeyError("metadata")  # a bug in a reader, say
        return real_get(namespace, name)

    monkeypatch.setattr(node.api, "get_claim", get_claim)

    results = node.prepare(bad, good)

    assert "unexpected KeyError: 'metadata' (will retry)" in failed(results[UID_B])
    assert [d.device_name for d in ok(results[UID_A])] == ["gpu-0"]
    node.assert_nothing_left(UID_B)


def test_an_unexpected_unprepare_error_fails_only_its_claim(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = [node.add_gpus(UID_A, "claim-a", "gpu-0"), node.add_gpus(UID_B, "claim-b", "gpu-1")]
    node.prepare(*claims)
    real_remove = node.cdi.remove

    def remove(claim_uid: str) -> bool:
        if claim_uid == UID_B:
            raise RuntimeError("a bug")
        return real_remove(claim_uid)

    monkeypatch.setattr(node.cdi, "remove", remove)

    results = node.unprepare(*claims)

    assert results[UID_A] is None
    assert results[UID_B] == f"claim default/claim-b ({UID_B}): unexpected RuntimeError: a bug"
    node.assert_nothing_left(UID_A)
    assert node.checkpoint.get(UID_B) is not None  # kept for the kubelet's retry


def test_claim_uid_that_is_not_a_uuid_never_reaches_the_filesystem(node: Node) -> None:
    claim = node.add_gpus("../../etc", "claim-a", "gpu-0")

    error = failed(node.prepare(claim)["../../etc"])

    assert "not a lower-case UUID" in error
    assert node.spec_files() == []
    assert node.claim_dirs() == []
    assert node.checkpoint.all() == {}


# ---- opaque config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("claim_configs", "class_configs", "expected"),
    [
        pytest.param(
            [opaque_config(gpu_config(shareing={"strategy": "MPS"}))],
            [],
            "spec.devices.config[0]: parameters.shareing: unknown field",
            id="unknown-field",
        ),
        pytest.param(
            [
                opaque_config(gpu_config()),
                opaque_config(gpu_config(sharing={"strategy": "MPS", "mpsConfg": {}})),
            ],
            [],
            "spec.devices.config[1]: parameters.sharing.mpsConfg: unknown field",
            id="second-entry",
        ),
        pytest.param(
            [
                opaque_config(
                    {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"},
                    requests=["gpu"],
                )
            ],
            [],
            'spec.devices.config[0]: cannot apply MigDeviceConfig to device "gpu-0" of type "gpu"',
            id="kind-for-mig",
        ),
        pytest.param(
            [],
            [opaque_config(gpu_config(sharing={"strategy": "Exclusive"}))],
            "config[0] (FromClass): parameters.sharing.strategy",
            id="class-config",
        ),
    ],
)
def test_invalid_opaque_config_names_claim_entry_and_field_and_leaves_nothing(
    node: Node,
    claim_configs: list[dict[str, Any]],
    class_configs: list[dict[str, Any]],
    expected: str,
) -> None:
    claim = node.add(
        resource_claim(
            UID_A,
            results=[allocation_result("gpu-0")],
            claim_configs=claim_configs,
            class_configs=class_configs,
        )
    )

    error = failed(node.prepare(claim)[UID_A])

    assert f"default/claim-a ({UID_A})" in error
    assert error.count("default/claim-a") == 1  # named once, not again by the config layer
    assert expected in error
    node.assert_nothing_left(UID_A)
    assert node.cdi.writes == []


def test_time_slicing_without_a_time_slicer_is_refused_clearly(node: Node) -> None:
    config = opaque_config(gpu_config(sharing={"strategy": "TimeSlicing"}), requests=["gpu"])
    claim = node.add(
        resource_claim(UID_A, results=[allocation_result("gpu-0")], claim_configs=[config])
    )

    error = failed(node.prepare(claim)[UID_A])

    assert f"default/claim-a ({UID_A}): spec.devices.config[0]: " in error
    assert "time-slicing is not available on node node-a" in error
    assert "no nvidia-smi" in error
    assert "(will retry)" not in error
    node.assert_nothing_left(UID_A)
    assert node.cdi.writes == []
    # Nothing holds the GPU either.
    other = node.add_gpus(UID_B, "claim-b", "gpu-0")
    ok(node.prepare(other)[UID_B])


def test_gpu_config_without_sharing_and_other_drivers_configs_are_accepted(node: Node) -> None:
    configs = [
        opaque_config(gpu_config(), requests=["gpu"]),
        opaque_config({"anything": "goes"}, driver="nic.example.com"),
    ]
    claim = node.add(
        resource_claim(UID_A, results=[allocation_result("gpu-0")], claim_configs=configs)
    )

    assert [d.device_name for d in ok(node.prepare(claim)[UID_A])] == ["gpu-0"]


# ---- unprepare -----------------------------------------------------------------------------------


def test_unprepare_removes_cdi_spec_claim_files_and_checkpoint_entry(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0", "gpu-1")
    keep = node.add_gpus(UID_B, "claim-b", "gpu-2")
    node.prepare(claim, keep)
    for uid in (UID_A, UID_B):  # claim files, as a simulated MIG device made for it has
        (node.claims_dir / uid).mkdir(parents=True)
        (node.claims_dir / uid / "mig-0.json").write_text("{}\n")

    assert node.unprepare(claim) == {UID_A: None}

    node.assert_nothing_left(UID_A)
    assert node.spec_files() == [f"k8s.gpu.nvidia.com-claim_{UID_B}.yaml"]
    assert node.claim_dirs() == [UID_B]


def test_unprepare_of_an_unknown_claim_succeeds_every_time(node: Node) -> None:
    claim = ClaimRef("default", UID_A, "never-prepared")

    assert node.unprepare(claim) == {UID_A: None}
    assert node.unprepare(claim) == {UID_A: None}
    assert node.api.reads == []


def test_unprepare_works_when_the_claim_is_gone_from_the_api(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    ok(node.prepare(claim)[UID_A])
    node.api.delete("default", "claim-a")
    reads = len(node.api.reads)

    assert node.unprepare(claim) == {UID_A: None}

    node.assert_nothing_left(UID_A)
    assert len(node.api.reads) == reads


def test_unprepare_reports_each_claim_of_the_batch(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    node.prepare(claim)
    bad = ClaimRef("default", "not-a-uid", "claim-x")

    results = node.unprepare(claim, bad)

    assert results[UID_A] is None
    assert results["not-a-uid"] is not None
    assert "default/claim-x (not-a-uid)" in results["not-a-uid"]
    node.assert_nothing_left(UID_A)


# ---- crash recovery ----------------------------------------------------------------------------


def interrupted_prepare(node: Node, claim: ClaimRef, device: str = "gpu-0") -> None:
    """What a plugin that died between writing the CDI spec and `PrepareCompleted` leaves."""
    node.checkpoint.put(CheckpointEntry(claim=claim, phase=ClaimPhase.PREPARE_STARTED))
    (node.claims_dir / claim.uid).mkdir(parents=True)
    (node.claims_dir / claim.uid / f"{device}.json").write_text("{}\n")
    node.cdi.write(claim.uid, [CdiDevice(device, ContainerEdits(env={"STALE": "1"}))])


def test_recover_rolls_back_an_interrupted_prepare(node: Node) -> None:
    claim = ClaimRef("default", UID_A, "claim-a")
    interrupted_prepare(node, claim)

    node.restart()
    node.recover()

    node.assert_nothing_left(UID_A)


def test_recover_removes_cdi_specs_and_claim_files_nobody_owns(node: Node) -> None:
    node.cdi.write(UID_A, [CdiDevice("gpu-0", ContainerEdits(env={"X": "1"}))])
    (node.claims_dir / UID_B).mkdir(parents=True)
    foreign = node.cdi_root / "k8s.nic.example.com-claim_x.yaml"
    foreign.write_text("cdiVersion: 0.5.0\n")

    node.recover()

    assert node.spec_files() == [foreign.name]
    assert node.claim_dirs() == []


def test_recover_removes_temporary_files_of_interrupted_spec_writes_of_this_driver(
    node: Node,
) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    ok(node.prepare(claim)[UID_A])
    ours = f".k8s.gpu.nvidia.com-claim_{UID_B}.yaml.q8w2e4r6.tmp"
    theirs = ".k8s.nic.example.com-claim_x.yaml.q8w2e4r6.tmp"
    for name in (ours, theirs):
        (node.cdi_root / name).write_text("cdiVersion: 0.5.0\n")

    node.restart()
    node.recover()

    assert node.spec_files() == [theirs, f"k8s.gpu.nvidia.com-claim_{UID_A}.yaml"]


def test_recover_removes_temporary_files_of_interrupted_writes_in_the_data_dir(
    node: Node,
) -> None:
    left = [".simulated-nvml.json.0a1b2c3d.tmp", ".time-slicing.json.x1y2.tmp"]
    kept = ["simulated-nvml.json", ".hidden", "notes.tmp"]
    for name in left + kept:
        (node.data_dir / name).write_text("half a file")

    node.restart()
    node.recover()

    names = {p.name for p in node.data_dir.iterdir()}
    assert not names & set(left)
    assert set(kept) <= names


def test_recover_removes_temporary_files_of_interrupted_shared_fact_file_writes(
    node: Node,
) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    ok(node.prepare(claim)[UID_A])
    facts = node.data_dir / "simulated-facts"
    (mounted,) = facts.iterdir()
    left = facts / ".gpu-1-0123456789abcdef.json.k3j4h5.tmp"  # a write killed before its rename
    left.write_text("half a")

    node.restart()
    node.recover()

    assert list(facts.iterdir()) == [mounted]


def test_recover_keeps_completed_claims(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    devices = ok(node.prepare(claim)[UID_A])
    spec = node.spec(UID_A)

    node.restart()
    node.recover()

    assert node.spec(UID_A) == spec
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert (entry.phase, entry.devices) == (ClaimPhase.PREPARE_COMPLETED, devices)


def test_prepare_rolls_back_an_interrupted_prepare_of_the_same_claim_first(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-3")
    interrupted_prepare(node, claim, device="gpu-0")
    node.restart()

    devices = ok(node.prepare(claim)[UID_A])

    assert [d.device_name for d in devices] == ["gpu-3"]
    assert [d["name"] for d in node.spec(UID_A)["devices"]] == [f"{UID_A}-gpu-3"]
    # The dead prepare's claim files are gone (a recorded prepare keeps an empty directory).
    assert list((node.claims_dir / UID_A).iterdir()) == []


def test_a_whole_gpu_prepare_writes_one_record_after_its_cdi_spec(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing but the CDI spec and the claim files is made: no PrepareStarted record, one
    # checkpoint write (PrepareCompleted) per prepare.
    claim = node.add(
        resource_claim(
            UID_A,
            results=[allocation_result("gpu-0"), allocation_result("gpu-1", admin_access=True)],
        )
    )
    seen: list[CheckpointEntry | None] = []
    real_write = node.cdi.write

    def write(claim_uid: str, devices: Sequence[CdiDevice], **kwargs: Any) -> Path:
        seen.append(node.checkpoint.get(claim_uid))
        return real_write(claim_uid, devices, **kwargs)

    monkeypatch.setattr(node.cdi, "write", write)
    checkpoint_writes = count_checkpoint_writes(monkeypatch)

    devices = ok(node.prepare(claim)[UID_A])

    assert seen == [None]
    assert checkpoint_writes == [UID_A]
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert (entry.phase, entry.devices) == (ClaimPhase.PREPARE_COMPLETED, devices)
    assert entry.state == {"adminAccessDevices": ["gpu-1"]}


def count_checkpoint_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The checkpoint's writes from now on, each as the claim UIDs the file then holds."""
    writes: list[str] = []
    real_write = checkpoint_module.write_atomically

    def counting(path: Path, data: bytes, **kwargs: Any) -> None:
        real_write(path, data, **kwargs)
        writes.append(",".join(sorted(json.loads(data)["claims"])))

    monkeypatch.setattr(checkpoint_module, "write_atomically", counting)
    return writes


@contextlib.contextmanager
def killed_at(node: Node, point: str) -> Iterator[None]:
    """The plugin process dies at crash point ``point`` inside the block: the node's files are
    put back as they were there, and a new process (`Node.restart`) starts over them."""
    frozen = node.root / "at-crash"

    def crash(reached: str) -> None:
        if reached == point:
            crash_points.arm(None)
            for name, path in (("data", node.data_dir), ("cdi", node.cdi_root)):
                if path.exists():
                    shutil.copytree(path, frozen / name)
            raise Crash(reached)

    crash_points.arm(crash)
    try:
        with pytest.raises(Crash):
            yield
    finally:
        crash_points.arm(None)
    for name, path in (("data", node.data_dir), ("cdi", node.cdi_root)):
        shutil.rmtree(path, ignore_errors=True)
        if (frozen / name).exists():
            shutil.copytree(frozen / name, path)
    shutil.rmtree(frozen)
    node.restart()


WHOLE_GPU_PREPARE_POINTS = [
    crash_points.PREPARE_AFTER_CLAIM_FILES,
    crash_points.CDI_BEFORE_RENAME,
    crash_points.PREPARE_AFTER_CDI_SPEC,
    crash_points.CHECKPOINT_BEFORE_RENAME,
]
"""Where a whole-GPU prepare can die before `PrepareCompleted` is on disk."""


@pytest.mark.parametrize("point", WHOLE_GPU_PREPARE_POINTS)
def test_a_whole_gpu_prepare_killed_before_its_record_leaves_nothing_after_recovery(
    node: Node, point: str
) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    with killed_at(node, point):
        node.prepare(claim)
    assert node.checkpoint.get(UID_A) is None  # no record names what it left

    node.recover()

    node.assert_nothing_left(UID_A)
    assert node.spec_files() == []
    assert not any(p.name.endswith(".tmp") for p in node.data_dir.iterdir())
    # The kubelet's retry prepares it again.
    assert [d.device_name for d in ok(node.prepare(claim)[UID_A])] == ["gpu-0"]
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_COMPLETED


def test_the_retry_of_a_whole_gpu_prepare_killed_after_its_cdi_spec_prepares_it_anew(
    node: Node,
) -> None:
    # No recovery in between (another plugin instance gets the retry): what the dead prepare
    # left is replaced, stale claim files included.
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    with killed_at(node, crash_points.PREPARE_AFTER_CDI_SPEC):
        node.prepare(claim)
    (node.claims_dir / UID_A).mkdir(parents=True)
    (node.claims_dir / UID_A / "gpu-5.json").write_text("{}\n")

    devices = ok(node.prepare(claim)[UID_A])

    assert [d.device_name for d in devices] == ["gpu-0"]
    assert [d["name"] for d in node.spec(UID_A)["devices"]] == [f"{UID_A}-gpu-0"]
    assert node.claim_dirs() == []
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert (entry.phase, entry.devices) == (ClaimPhase.PREPARE_COMPLETED, devices)


def test_the_unprepare_of_a_claim_killed_mid_prepare_removes_what_it_left(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    with killed_at(node, crash_points.PREPARE_AFTER_CDI_SPEC):
        node.prepare(claim)
    assert node.cdi.path_for(UID_A).exists()

    assert node.unprepare(claim) == {UID_A: None}

    node.assert_nothing_left(UID_A)


def test_a_claim_killed_mid_prepare_holds_no_gpu_and_its_retry_is_refused_once_taken(
    node: Node,
) -> None:
    # The kubelet never got A's devices (the reply comes after PrepareCompleted): B may have the
    # GPU; A's retry is then refused, and what A's dead prepare left is gone.
    a = node.add_gpus(UID_A, "claim-a", "gpu-0")
    with killed_at(node, crash_points.PREPARE_AFTER_CDI_SPEC):
        node.prepare(a)
    b = node.add_gpus(UID_B, "claim-b", "gpu-0")

    ok(node.prepare(b)[UID_B])
    error = failed(node.prepare(a)[UID_A])

    assert f"device gpu-0 is already prepared for claim default/claim-b ({UID_B})" in error
    node.assert_nothing_left(UID_A)
    assert node.spec_files() == [f"k8s.gpu.nvidia.com-claim_{UID_B}.yaml"]


def test_a_whole_gpu_prepare_under_way_without_a_record_still_refuses_a_second_claim(
    node: Node,
) -> None:
    # A's prepare hangs at its CDI write, before any record: B's prepare of the same GPU waits
    # for A's device lock, then A's PrepareCompleted refuses it.
    a = node.add_gpus(UID_A, "claim-a", "gpu-0")
    b = node.add_gpus(UID_B, "claim-b", "gpu-0")
    node.cdi.gate = threading.Event()

    async def race() -> tuple[Mapping[str, PrepareResult], Mapping[str, PrepareResult]]:
        first = asyncio.create_task(node.preparer.prepare([a]))
        assert await asyncio.to_thread(node.cdi.writing.wait, 5)
        assert await asyncio.to_thread(node.checkpoint.get, UID_A) is None
        second = asyncio.create_task(node.preparer.prepare([b]))
        done, _ = await asyncio.wait({second}, timeout=0.3)
        assert not done  # waiting for gpu-0's lock
        assert node.cdi.gate is not None
        node.cdi.gate.set()
        return await first, await second

    first, second = asyncio.run(race())

    ok(first[UID_A])
    assert f"device gpu-0 is already prepared for claim default/claim-a ({UID_A})" in failed(
        second[UID_B]
    )
    assert node.cdi.writes == [UID_A]
    node.assert_nothing_left(UID_B)


def test_rollback_of_an_interrupted_prepare_holds_the_locks_of_its_devices(node: Node) -> None:
    # A died preparing gpu-0 and is now allocated gpu-3. While its next prepare rolls the old
    # one back, B's prepare of gpu-0 waits instead of running beside the rollback.
    a = node.add_gpus(UID_A, "claim-a", "gpu-3")
    node.checkpoint.put(
        CheckpointEntry(
            claim=a,
            phase=ClaimPhase.PREPARE_STARTED,
            devices=(
                PreparedDevice(
                    ("gpu",), NODE, "gpu-0", (f"k8s.gpu.nvidia.com/claim={UID_A}-gpu-0",)
                ),
            ),
        )
    )
    b = node.add_gpus(UID_B, "claim-b", "gpu-0")
    node.restart()
    removing = threading.Event()
    go_on = threading.Event()
    real_remove = node.cdi.remove

    def remove(claim_uid: str) -> bool:
        if claim_uid == UID_A:
            removing.set()
            assert go_on.wait(10)
        return real_remove(claim_uid)

    node.cdi.remove = remove  # type: ignore[method-assign]

    async def both() -> tuple[bool, Mapping[str, PrepareResult], Mapping[str, PrepareResult]]:
        rolling_back = asyncio.create_task(node.preparer.prepare([a]))
        assert await asyncio.to_thread(removing.wait, 5)
        other = asyncio.create_task(node.preparer.prepare([b]))
        done, _ = await asyncio.wait({other}, timeout=0.5)
        go_on.set()
        return bool(done), await rolling_back, await other

    b_done_during_rollback, first, second = asyncio.run(both())

    assert not b_done_during_rollback
    assert [d.device_name for d in ok(first[UID_A])] == ["gpu-3"]
    assert [d.device_name for d in ok(second[UID_B])] == ["gpu-0"]


def test_checkpoint_of_an_earlier_boot_is_discarded_and_its_files_cleaned_up(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    ok(node.prepare(claim)[UID_A])

    node.boot.id = "boot-2"
    loaded = node.restart()
    node.recover()

    assert (loaded.discarded_boot_id, loaded.discarded_claims) == ("boot-1", (UID_A,))
    node.assert_nothing_left(UID_A)
    other = node.add_gpus(UID_B, "claim-b", "gpu-0")
    assert [d.device_name for d in ok(node.prepare(other)[UID_B])] == ["gpu-0"]


# ---- concurrency ---------------------------------------------------------------------------------


def test_eight_claims_in_one_call_each_get_their_own_gpu(node: Node) -> None:
    claims = [node.add_gpus(uid(i), f"claim-{i}", f"gpu-{i}") for i in range(8)]

    results = node.prepare(*claims)

    prepared = {u: ok(r) for u, r in results.items()}
    assert sorted(prepared) == sorted(uid(i) for i in range(8))
    assert {u: [d.device_name for d in devices] for u, devices in prepared.items()} == {
        uid(i): [f"gpu-{i}"] for i in range(8)
    }
    assert len(node.spec_files()) == 8
    entries = node.checkpoint.all()
    assert {e.phase for e in entries.values()} == {ClaimPhase.PREPARE_COMPLETED}
    assert len(entries) == 8


def test_claims_racing_for_one_gpu_get_it_exactly_once(node: Node) -> None:
    claims = [node.add_gpus(uid(i), f"claim-{i}", "gpu-0") for i in range(8)]

    results = node.prepare(*claims)

    winners = [u for u, r in results.items() if r.ok]
    assert len(winners) == 1
    winner = next(c for c in claims if c.uid == winners[0])
    for loser in (r for u, r in results.items() if u != winner.uid):
        assert f"already prepared for claim default/{winner.name} ({winner.uid})" in failed(loser)
    assert node.spec_files() == [f"k8s.gpu.nvidia.com-claim_{winner.uid}.yaml"]
    assert list(node.checkpoint.all()) == [winner.uid]


def test_concurrent_prepares_of_the_same_claim_prepare_it_once(node: Node) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0", "gpu-1")

    async def twice() -> tuple[Mapping[str, PrepareResult], Mapping[str, PrepareResult]]:
        return await asyncio.gather(node.preparer.prepare([claim]), node.preparer.prepare([claim]))

    first, second = asyncio.run(twice())

    assert ok(first[UID_A]) == ok(second[UID_A])
    assert node.cdi.writes == [UID_A]
    assert list(node.checkpoint.all()) == [UID_A]


def test_cancelled_prepare_finishes_before_an_unprepare_of_the_claim_runs(node: Node) -> None:
    # The servicer cancels a prepare at its deadline; the file work in the worker thread cannot
    # be stopped, so an unprepare that ran beside it would leave a prepared GPU nobody owns.
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    node.cdi.gate = threading.Event()

    async def cancel_then_unprepare() -> dict[str, str | None]:
        preparing = asyncio.create_task(node.preparer.prepare([claim]))
        assert await asyncio.to_thread(node.cdi.writing.wait, 5)
        preparing.cancel()
        unpreparing = asyncio.create_task(node.preparer.unprepare([claim]))
        await asyncio.wait({unpreparing}, timeout=0.5)  # as far as it gets while the disk hangs
        assert node.cdi.gate is not None
        node.cdi.gate.set()
        with contextlib.suppress(asyncio.CancelledError):
            await preparing
        return dict(await unpreparing)

    assert asyncio.run(cancel_then_unprepare()) == {UID_A: None}

    node.assert_nothing_left(UID_A)
    other = node.add_gpus(UID_B, "claim-b", "gpu-0")
    ok(node.prepare(other)[UID_B])


def test_the_reply_is_sent_by_the_deadline_and_the_work_behind_it_is_done_once(
    node: Node,
) -> None:
    # The CDI write hangs (a slow disk, say) for 2 s; the call's budget is 0.3 s. The kubelet
    # gets its answer by then, not when the worker thread is done.
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")
    node.cdi.gate = threading.Event()
    threading.Timer(2.0, node.cdi.gate.set).start()

    async def call_then_retry() -> tuple[float, dict[str, PrepareResult], dict[str, PrepareResult]]:
        handler = ClaimCallHandler(node.preparer, call_timeout_s=0.3)
        started = time.monotonic()
        first = await handler.prepare([claim])
        answered_after = time.monotonic() - started
        # The kubelet's retry waits for the work left behind, then finds the claim prepared.
        retry = ClaimCallHandler(node.preparer, call_timeout_s=10)
        return answered_after, first, await retry.prepare([claim])

    answered_after, first, second = asyncio.run(call_then_retry())

    assert answered_after < 1.0
    assert "prepare did not finish within 0.3s" in failed(first[UID_A])
    assert [d.device_name for d in ok(second[UID_A])] == ["gpu-0"]
    assert node.cdi.writes == [UID_A]  # prepared once
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_COMPLETED


def test_claims_of_one_call_share_checkpoint_writes_each_durable_in_protocol_order(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Group commit: the claims of one call write PrepareCompleted (and, unpreparing,
    # UnprepareStarted) while another write is under way, so they share writes; the order on
    # disk per claim is kept.
    claims = [node.add_gpus(uid(i), f"claim-{i}", f"gpu-{i}") for i in range(8)]
    real_write = checkpoint_module.write_atomically
    writes: list[dict[str, str]] = []
    seen_by_cdi: dict[str, str | None] = {}

    def slow_write(path: Path, data: bytes, **kwargs: Any) -> None:
        time.sleep(0.02)  # a slow disk: the other claims' changes queue meanwhile
        real_write(path, data, **kwargs)
        phases = {u: c["phase"] for u, c in json.loads(data)["claims"].items()}
        dropped = set(writes[-1] if writes else {}) - set(phases)
        writes.append(phases)
        for claim_uid in dropped:  # unprepare: the CDI spec was gone before the entry goes
            assert not node.cdi.path_for(claim_uid).exists()

    def on_disk_phase(claim_uid: str) -> str | None:
        if not node.checkpoint.path.exists():
            return None
        document = json.loads(node.checkpoint.path.read_text())
        phase: str | None = document["claims"].get(claim_uid, {}).get("phase")
        return phase

    real_cdi_write = node.cdi.write

    def cdi_write(claim_uid: str, devices: Sequence[CdiDevice], **kwargs: Any) -> Path:
        seen_by_cdi[claim_uid] = on_disk_phase(claim_uid)
        return real_cdi_write(claim_uid, devices, **kwargs)

    monkeypatch.setattr(checkpoint_module, "write_atomically", slow_write)
    monkeypatch.setattr(node.cdi, "write", cdi_write)

    async def prepare_with_a_thread_per_claim() -> Mapping[str, PrepareResult]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=8))
        return await node.preparer.prepare(claims)

    results = asyncio.run(prepare_with_a_thread_per_claim())

    assert all(r.ok for r in results.values())
    # Whole GPUs: no record before each claim's CDI spec was written (no PrepareStarted)...
    assert seen_by_cdi == {c.uid: None for c in claims}
    # ... and PrepareCompleted on disk before the call returned.
    assert {c.uid: on_disk_phase(c.uid) for c in claims} == {
        c.uid: "PrepareCompleted" for c in claims
    }
    assert len(writes) < len(claims)  # one write per change would be 8

    writes[:-1] = []
    seen_by_cdi_remove: dict[str, str | None] = {}
    real_cdi_remove = node.cdi.remove

    def cdi_remove(claim_uid: str) -> bool:
        seen_by_cdi_remove[claim_uid] = on_disk_phase(claim_uid)
        return real_cdi_remove(claim_uid)

    monkeypatch.setattr(node.cdi, "remove", cdi_remove)
    assert node.unprepare(*claims) == {c.uid: None for c in claims}
    for claim in claims:
        node.assert_nothing_left(claim.uid)
    # UnprepareStarted was on disk before each claim's CDI spec went; the entry went last.
    assert seen_by_cdi_remove == {c.uid: "UnprepareStarted" for c in claims}
    assert writes[-1] == {}
    assert len(writes) - 1 < 2 * len(claims)  # one write per change would be 16
