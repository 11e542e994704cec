"""Real-mode prepare: every claim's CDI spec carries the driver userspace as its common edits.

Whole GPUs, static MIG devices, MPS and time-sliced claims all get the node's `CommonEdits` (the
fake driver root of tests/kubelet_plugin/fake_driver_root.py, seen at a mount and standing for
the GPU Operator's ``/run/nvidia/driver``), their own device nodes per CDI device, and nothing
is left when the driver cannot be found. Simulated nodes keep specs without common edits.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from gpu_dra.driver.discovery import discover_devices, discover_gpus
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.cdi import CdiDevice, ContainerEdits, build_claim_spec
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.nvidia_driver_root import DriverRoot, DriverUserspaceError
from gpu_dra.kubelet_plugin.nvidia_userspace import CommonEdits
from gpu_dra.kubelet_plugin.time_slicer import RecordedTimeSlicer
from tests.fakes.claim_reader import allocation_result as result
from tests.fakes.claim_reader import gpu_config, opaque_config, resource_claim
from tests.kubelet_plugin.fake_driver_root import (
    CAPS_MAJOR,
    NVIDIA_MAJOR,
    VERSION,
    FakeDriverRoot,
    build_driver_root,
)
from tests.kubelet_plugin.nodes import NODE, UID_A, UID_B, MpsNode, Node, failed, ok

HOST_ROOT = "/run/nvidia/driver"


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> FakeDriverRoot:
    """The fake root with ``/dev/nvidia0..7`` (the hgx-h100 profile's minors)."""
    fake = build_driver_root(tmp_path_factory.mktemp("driver"))
    for minor in range(1, 8):
        node = fake.root / f"dev/nvidia{minor}"
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(NVIDIA_MAJOR, minor))
    return fake


@pytest.fixture(scope="module")
def driver(fake: FakeDriverRoot) -> DriverRoot:
    return DriverRoot(fake.root, PurePosixPath(HOST_ROOT), sysfs=fake.sysfs, proc=fake.proc)


@pytest.fixture(scope="module")
def common(driver: DriverRoot) -> CommonEdits:
    return CommonEdits(driver, lambda: VERSION)


class RealNode(Node):
    """A `Node` in real mode: its preparer asks `common` for the claims' common edits."""

    def __init__(self, root: Path, inventory: NodeInventory, common: Any) -> None:
        self.common = common
        super().__init__(root, inventory)

    def preparer_options(self) -> dict[str, Any]:
        return {**super().preparer_options(), "common_edits": self.common}


class RealMpsNode(MpsNode):
    def __init__(self, root: Path, inventory: NodeInventory, mps_root: Path, common: Any) -> None:
        self.common = common
        super().__init__(root, inventory, mps_root)

    def preparer_options(self) -> dict[str, Any]:
        return {**super().preparer_options(), "common_edits": self.common}


def real_gpus(driver: DriverRoot) -> NodeInventory:
    host = SimulatedHost.load("hgx-h100", NODE)
    return NodeInventory(tuple(discover_gpus(host.nvml, host.pci)), simulated=False, driver=driver)


def expected_common(common: CommonEdits) -> dict[str, Any]:
    """The common ``containerEdits`` as a spec writes them."""
    device = CdiDevice("gpu-0", ContainerEdits(env={"X": "1"}))
    written = build_claim_spec(UID_A, [device], common_edits=common.current())
    edits: dict[str, Any] = written["containerEdits"]
    return edits


def device_nodes(spec: dict[str, Any]) -> dict[str, list[str]]:
    return {
        d["name"]: [n["path"] for n in d["containerEdits"].get("deviceNodes", [])]
        for d in spec["devices"]
    }


def test_a_whole_gpu_claim_gets_the_driver_userspace_as_common_edits(
    tmp_path: Path, driver: DriverRoot, common: CommonEdits
) -> None:
    node = RealNode(tmp_path, real_gpus(driver), common.current)
    claim = node.add_gpus(UID_A, "claim-a", "gpu-2", "gpu-5")

    ok(node.prepare(claim)[UID_A])

    spec = node.spec(UID_A)
    assert spec["containerEdits"] == expected_common(common)
    mounts = [m["containerPath"] for m in spec["containerEdits"]["mounts"]]
    assert f"/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}" in mounts
    assert "/usr/bin/nvidia-smi" in mounts
    assert device_nodes(spec) == {
        f"{UID_A}-gpu-2": ["/dev/nvidia2"],
        f"{UID_A}-gpu-5": ["/dev/nvidia5"],
    }
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["hostPath"] == (
        f"{HOST_ROOT}/dev/nvidia2"
    )


def test_a_static_mig_claim_gets_the_common_edits_and_capability_nodes(
    tmp_path: Path, driver: DriverRoot, common: CommonEdits
) -> None:
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    inventory = NodeInventory.from_discovery(
        discover_devices(host.nvml, host.pci),
        simulated=False,
        driver=driver,
        mig_capabilities=lambda gpu, gi, ci: 100 + 10 * gi + (0 if ci is None else ci + 1),
    )
    node = RealNode(tmp_path, inventory, common.current)
    name = "gpu-1-mig-3g40gb-9-4"
    claim = node.add(resource_claim(UID_A, "mig", results=[result(name, request="mig")]))

    ok(node.prepare(claim)[UID_A])

    spec = node.spec(UID_A)
    assert spec["containerEdits"] == expected_common(common)
    (device,) = spec["devices"]
    nodes = device["containerEdits"]["deviceNodes"]
    assert nodes[0]["path"] == "/dev/nvidia1"
    assert [(n["type"], n["major"]) for n in nodes[1:]] == [("c", CAPS_MAJOR)] * 2


def test_mps_and_time_sliced_claims_get_the_common_edits_too(
    tmp_path: Path, mps_root: Path, driver: DriverRoot, common: CommonEdits
) -> None:
    mps_node = RealMpsNode(tmp_path / "mps", real_gpus(driver), mps_root, common.current)
    mps_claim = mps_node.add_mps(UID_A, "gpu-0")

    ok(mps_node.prepare(mps_claim)[UID_A])

    mps_spec = mps_node.spec(UID_A)
    assert mps_spec["containerEdits"] == expected_common(common)
    device_mounts = [m["containerPath"] for m in mps_spec["devices"][0]["containerEdits"]["mounts"]]
    assert device_mounts == ["/dev/shm", "/tmp/nvidia-mps"]  # the claim's own daemon
    mps_node.unprepare(mps_claim)

    class SlicedNode(RealNode):
        def preparer_options(self) -> dict[str, Any]:
            slicer = RecordedTimeSlicer(tmp_path / "ts.json")
            return {**super().preparer_options(), "time_slicer": slicer}

    sliced = SlicedNode(tmp_path / "ts", real_gpus(driver), common.current)
    config = opaque_config(
        gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
        requests=["gpu"],
    )
    claim = sliced.add(resource_claim(UID_B, results=[result("gpu-3")], claim_configs=[config]))

    ok(sliced.prepare(claim)[UID_B])

    assert sliced.spec(UID_B)["containerEdits"] == expected_common(common)


def test_a_driver_that_cannot_be_found_fails_the_claim_and_leaves_nothing(
    tmp_path: Path, driver: DriverRoot
) -> None:
    def missing() -> ContainerEdits:
        raise DriverUserspaceError("no library of NVIDIA driver 999.0.0 under driver root /x")

    node = RealNode(tmp_path, real_gpus(driver), missing)
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")

    error = failed(node.prepare(claim)[UID_A])

    assert "no library of NVIDIA driver 999.0.0" in error
    assert error.endswith("(will retry)")
    node.assert_nothing_left(UID_A)
    assert node.cdi.writes == []


def test_a_simulated_node_writes_no_common_edits(tmp_path: Path) -> None:
    host = SimulatedHost.load("hgx-h100", NODE)
    node = Node(tmp_path, NodeInventory(tuple(discover_gpus(host.nvml, host.pci)), simulated=True))
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")

    ok(node.prepare(claim)[UID_A])

    assert "containerEdits" not in node.spec(UID_A)
