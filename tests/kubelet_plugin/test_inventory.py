"""The node's GPUs: what is published, and what a container gets for each GPU (device nodes on
real GPUs, environment and a fact file on simulated ones)."""

from __future__ import annotations

import json
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from gpu_dra.driver.discovery import discover_gpus
from gpu_dra.driver.model import Gpu
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.cdi import CdiDevice, DeviceNode, build_claim_spec
from gpu_dra.kubelet_plugin.inventory import NodeInventory, device_env_prefix

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
UID = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
CONTROL_NODES = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


@pytest.fixture(scope="module")
def gpus() -> tuple[Gpu, ...]:
    """The eight H100s of the simulated hgx-h100 node, in PCI bus order (minor = index)."""
    host = SimulatedHost.load("hgx-h100", NODE)
    return tuple(discover_gpus(host.nvml, host.pci))


def gpu_named(inventory: NodeInventory, name: str) -> Gpu:
    gpu = inventory.by_name(name)
    assert gpu is not None, name
    return gpu


def test_device_env_prefix_is_unique_per_device_name() -> None:
    assert device_env_prefix("gpu-3") == "GPU_DRA_GPU_3"
    assert device_env_prefix("gpu-13") == "GPU_DRA_GPU_13"


def test_gpus_are_found_by_device_name(gpus: tuple[Gpu, ...]) -> None:
    inventory = NodeInventory(gpus, simulated=True)

    assert gpu_named(inventory, "gpu-3").minor == 3
    assert inventory.by_name("gpu-8") is None
    assert inventory.by_name("gpu-3-mig-1g10gb-19-0") is None


def test_two_gpus_with_one_minor_number_are_refused(gpus: tuple[Gpu, ...]) -> None:
    with pytest.raises(ValueError, match="share a minor number"):
        NodeInventory((gpus[0], replace(gpus[1], minor=gpus[0].minor)), simulated=True)


# ---- what is published ---------------------------------------------------------------------------


def test_published_devices_are_in_pci_bus_order_not_name_or_discovery_order(
    gpus: tuple[Gpu, ...],
) -> None:
    minors = [3, 7, 0, 12, 1, 5, 2, 10]  # by bus id; name order and given order both differ
    renumbered = [replace(gpu, minor=m) for gpu, m in zip(gpus, minors, strict=True)]
    inventory = NodeInventory(tuple(reversed(renumbered)), simulated=False)

    devices = inventory.published_devices()

    assert [d["name"] for d in devices] == [f"gpu-{m}" for m in minors]
    bus_ids = [d["attributes"]["resource.kubernetes.io/pciBusID"]["string"] for d in devices]
    assert bus_ids == sorted(bus_ids)


def test_desired_pool_is_one_slice_of_this_node_with_all_eight_gpus(
    gpus: tuple[Gpu, ...],
) -> None:
    pool = NodeInventory(gpus, simulated=True).desired_pool(DRIVER, NODE)

    (spec,) = pool.slices
    assert (pool.driver, pool.name, pool.node_name) == (DRIVER, NODE, NODE)
    assert (spec["driver"], spec["nodeName"]) == (DRIVER, NODE)
    assert spec["pool"]["name"] == NODE
    assert spec["pool"]["resourceSliceCount"] == 1
    assert [d["name"] for d in spec["devices"]] == [f"gpu-{i}" for i in range(8)]
    uuids = [d["attributes"]["uuid"]["string"] for d in spec["devices"]]
    assert uuids == [gpu.uuid for gpu in gpus]


# ---- what a container gets: simulated GPUs -----------------------------------------------------


def test_simulated_gpu_gets_its_uuid_product_and_a_simulated_marker(
    gpus: tuple[Gpu, ...], tmp_path: Path
) -> None:
    inventory = NodeInventory(gpus, simulated=True)
    gpu = gpu_named(inventory, "gpu-2")

    edits = inventory.container_edits(gpu, tmp_path)

    assert dict(edits.env) == {
        "GPU_DRA_GPU_2_UUID": gpu.uuid,
        "GPU_DRA_GPU_2_PRODUCT": "NVIDIA H100 80GB HBM3",
        "GPU_DRA_GPU_2_SIMULATED": "true",
    }
    assert edits.device_nodes == ()


def test_simulated_gpu_mounts_a_read_only_fact_file_written_to_the_claim_dir(
    gpus: tuple[Gpu, ...], tmp_path: Path
) -> None:
    inventory = NodeInventory(gpus, simulated=True)
    gpu = gpu_named(inventory, "gpu-6")

    edits = inventory.container_edits(gpu, tmp_path)

    (mount,) = edits.mounts
    assert mount.host_path == str(tmp_path / "gpu-6.json")
    assert mount.container_path == "/run/gpu-dra/devices/gpu-6.json"
    assert "ro" in mount.options
    assert "bind" in mount.options
    facts = json.loads((tmp_path / "gpu-6.json").read_text())
    assert facts == {
        "name": "gpu-6",
        "uuid": gpu.uuid,
        "productName": gpu.product_name,
        "pciBusID": gpu.pci_bus_id,
        "memoryBytes": gpu.memory_bytes,
        "minor": 6,
    }
    assert stat.S_IMODE((tmp_path / "gpu-6.json").stat().st_mode) == 0o644


# ---- what a container gets: real GPUs --------------------------------------------------------


def test_real_gpu_gets_its_device_node_and_the_control_nodes(
    gpus: tuple[Gpu, ...], tmp_path: Path
) -> None:
    inventory = NodeInventory(gpus, simulated=False)
    gpu = gpu_named(inventory, "gpu-3")
    claim_dir = tmp_path / "claim"

    edits = inventory.container_edits(gpu, claim_dir)

    assert [n.path for n in edits.device_nodes] == ["/dev/nvidia3", *CONTROL_NODES]
    assert {n.host_path for n in edits.device_nodes} == {None}
    assert {n.permissions for n in edits.device_nodes} == {"rw"}
    assert dict(edits.env) == {
        "GPU_DRA_GPU_3_UUID": gpu.uuid,
        "GPU_DRA_GPU_3_PRODUCT": gpu.product_name,
    }
    assert edits.mounts == ()
    assert not claim_dir.exists()


def test_real_gpu_device_nodes_come_from_the_driver_root(
    gpus: tuple[Gpu, ...], tmp_path: Path
) -> None:
    inventory = NodeInventory(gpus, simulated=False, driver_root=Path("/run/nvidia/driver"))

    edits = inventory.container_edits(gpu_named(inventory, "gpu-7"), tmp_path)

    assert edits.device_nodes == tuple(
        DeviceNode(path=path, host_path=f"/run/nvidia/driver{path}", permissions="rw")
        for path in ["/dev/nvidia7", *CONTROL_NODES]
    )


def test_real_gpu_edits_make_a_valid_cdi_device(gpus: tuple[Gpu, ...], tmp_path: Path) -> None:
    inventory = NodeInventory(gpus, simulated=False, driver_root=Path("/run/nvidia/driver"))
    edits = inventory.container_edits(gpu_named(inventory, "gpu-0"), tmp_path)

    spec = build_claim_spec(UID, [CdiDevice("gpu-0", edits)], driver_name=DRIVER)

    (device,) = spec["devices"]
    assert device["name"] == f"{UID}-gpu-0"
    assert device["containerEdits"]["deviceNodes"][0] == {
        "path": "/dev/nvidia0",
        "hostPath": "/run/nvidia/driver/dev/nvidia0",
        "permissions": "rw",
    }
