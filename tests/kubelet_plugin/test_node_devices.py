"""The node's devices (whole GPUs and static MIG devices): what is published, and what a container
gets for each (device nodes on real GPUs, environment and a fact file on simulated ones)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from dataclasses import replace
from pathlib import Path, PurePosixPath

import pytest
import yaml

from gpu_dra.driver import slices
from gpu_dra.driver.discovery import discover_devices, discover_gpus
from gpu_dra.driver.mig_policy import DEFAULT as DEFAULT_MIG_POLICY
from gpu_dra.driver.mig_policy import EVERYTHING, MigPolicy
from gpu_dra.driver.model import Gpu, MigDevice, MigPartition, NodeDevices
from gpu_dra.driver.naming import gpu_device_name
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.shares import MigShareSelection, ShareSelection, ShareSelectionError
from gpu_dra.kubelet_plugin.cdi import CdiDevice, ClaimSpecStore, DeviceNode, build_claim_spec
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.node_devices import (
    MigCapabilityError,
    NodeInventory,
    ProcMigCapabilities,
    device_env_prefix,
)
from gpu_dra.kubelet_plugin.nvidia_driver_root import DriverRoot, DriverUserspaceError
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.simulated_facts import SharedFactFiles
from tests.fakes.claim_reader import InMemoryClaimReader, allocation_result, resource_claim
from tests.kubelet_plugin.nodes import new_preparer

NODE = "node-a"
DEMO_NODE = Path(__file__).resolve().parents[2] / "demo" / "node.yaml"
DRIVER = "gpu.nvidia.com"
UID = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"


@pytest.fixture(scope="module")
def gpus() -> tuple[Gpu, ...]:
    """The eight H100s of the simulated hgx-h100 node, in PCI bus order (minor = index)."""
    host = SimulatedHost.load("hgx-h100", NODE)
    return tuple(discover_gpus(host.nvml, host.pci))


def gpu_named(inventory: NodeInventory, name: str) -> Gpu:
    gpu = inventory.by_name(name)
    assert isinstance(gpu, Gpu), name
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


def real_driver_root(
    base: Path, minors: list[int], host: str = "/", *, caps_major: int = 236
) -> DriverRoot:
    """A driver root with ``dev/nvidia<minor>`` for `minors` and the control nodes (made with
    mknod; the tests run as root) and a ``proc/devices`` naming ``nvidia-caps``."""
    dev = base / "dev"
    dev.mkdir(parents=True)
    for minor in minors:
        os.mknod(dev / f"nvidia{minor}", stat.S_IFCHR | 0o666, os.makedev(195, minor))
    for name, minor in (("nvidiactl", 255), ("nvidia-uvm", 0)):
        os.mknod(dev / name, stat.S_IFCHR | 0o666, os.makedev(195 if minor else 510, minor))
    write_proc(base, "proc/devices", f"Character devices:\n195 nvidia\n{caps_major} nvidia-caps\n")
    return DriverRoot(base, PurePosixPath(host), sysfs=base / "sys", proc=base / "no-proc")


def test_real_gpu_gets_its_own_device_node_the_control_nodes_are_common(
    gpus: tuple[Gpu, ...], tmp_path: Path
) -> None:
    driver = real_driver_root(tmp_path / "root", [3])
    inventory = NodeInventory(gpus, simulated=False, driver=driver)
    gpu = gpu_named(inventory, "gpu-3")
    claim_dir = tmp_path / "claim"

    edits = inventory.container_edits(gpu, claim_dir)

    assert edits.device_nodes == (DeviceNode("/dev/nvidia3", permissions="rw"),)
    assert dict(edits.env) == {
        "GPU_DRA_GPU_3_UUID": gpu.uuid,
        "GPU_DRA_GPU_3_PRODUCT": gpu.product_name,
    }
    assert edits.mounts == ()
    assert edits.hooks == ()  # no DRM nodes in this root's sysfs
    assert not claim_dir.exists()


def test_real_gpu_device_nodes_get_the_host_driver_root(
    gpus: tuple[Gpu, ...], tmp_path: Path
) -> None:
    driver = real_driver_root(tmp_path, [7], host="/run/nvidia/driver")
    inventory = NodeInventory(gpus, simulated=False, driver=driver)

    edits = inventory.container_edits(gpu_named(inventory, "gpu-7"), tmp_path)

    assert edits.device_nodes == (
        DeviceNode("/dev/nvidia7", host_path="/run/nvidia/driver/dev/nvidia7", permissions="rw"),
    )


def test_a_missing_device_node_is_left_out_and_the_device_stays_valid(
    gpus: tuple[Gpu, ...], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    driver = real_driver_root(tmp_path, [0], host="/run/nvidia/driver")
    inventory = NodeInventory(gpus, simulated=False, driver=driver)

    with caplog.at_level(logging.INFO):
        edits = inventory.container_edits(gpu_named(inventory, "gpu-5"), tmp_path)

    assert edits.device_nodes == ()
    assert f"device node {tmp_path}/dev/nvidia5 not found" in caplog.text
    spec = build_claim_spec(UID, [CdiDevice("gpu-5", edits)], driver_name=DRIVER)
    assert spec["devices"][0]["containerEdits"]["env"][0].startswith("GPU_DRA_GPU_5_UUID=")


def test_real_gpu_edits_make_a_valid_cdi_device(gpus: tuple[Gpu, ...], tmp_path: Path) -> None:
    driver = real_driver_root(tmp_path, [0], host="/run/nvidia/driver")
    inventory = NodeInventory(gpus, simulated=False, driver=driver)
    edits = inventory.container_edits(gpu_named(inventory, "gpu-0"), tmp_path)

    spec = build_claim_spec(UID, [CdiDevice("gpu-0", edits)], driver_name=DRIVER)

    (device,) = spec["devices"]
    assert device["name"] == f"{UID}-gpu-0"
    assert device["containerEdits"]["deviceNodes"] == [
        {
            "path": "/dev/nvidia0",
            "hostPath": "/run/nvidia/driver/dev/nvidia0",
            "permissions": "rw",
        }
    ]


# ---- static MIG --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mig_devices() -> NodeDevices:
    """The hgx-h100-mig node: GPUs 0-6 in MIG mode (5 without slices), GPU 7 whole."""
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    return discover_devices(host.nvml, host.pci)


def mig_named(inventory: NodeInventory, name: str) -> MigDevice:
    device = inventory.by_name(name)
    assert isinstance(device, MigDevice), name
    return device


class RecordingCapabilities:
    """A `MigCapabilityLookup` answering minor 100 + 10*GI (+ CI + 1 for a compute instance)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int | None]] = []

    def __call__(self, parent_minor: int, gi_id: int, ci_id: int | None) -> int:
        self.calls.append((parent_minor, gi_id, ci_id))
        return 100 + 10 * gi_id + (0 if ci_id is None else ci_id + 1)


def test_mig_inventory_publishes_whole_gpus_with_mig_off_and_the_static_mig_devices(
    mig_devices: NodeDevices,
) -> None:
    inventory = NodeInventory.from_discovery(mig_devices, simulated=True)

    names = [d["name"] for d in inventory.published_devices()]

    assert names[:3] == ["gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1", "gpu-0-mig-1g10gb-19-2"]
    assert names[7:11] == [
        "gpu-1-mig-2g20gb-14-0",
        "gpu-1-mig-1g10gb-19-2",
        "gpu-1-mig-1g10gb-me-20-3",
        "gpu-1-mig-3g40gb-9-4",
    ]
    assert names[-1] == "gpu-7"
    assert len(names) == 20
    assert not [name for name in names if name in {f"gpu-{i}" for i in range(7)}]
    (spec,) = inventory.desired_pool(DRIVER, NODE).slices
    assert [d["name"] for d in spec["devices"]] == names


def test_by_name_resolves_mig_devices_and_refuses_their_parents(mig_devices: NodeDevices) -> None:
    inventory = NodeInventory.from_discovery(mig_devices, simulated=True)

    mig = mig_named(inventory, "gpu-2-mig-3g40gb-9-4")
    assert (mig.parent.minor, mig.profile, mig.placement_start) == (2, "3g.40gb", 4)
    assert mig.uuid.startswith("MIG-")
    assert inventory.by_name("gpu-2") is None  # MIG on: not offered whole
    assert inventory.by_name("gpu-5") is None  # MIG on, no slices
    assert inventory.by_name("gpu-6-mig-3g40gb-9-0") is None  # a GI without compute instance
    whole = inventory.by_name("gpu-7")
    assert isinstance(whole, Gpu)
    assert whole.minor == 7


def test_without_discovered_mig_devices_mig_parents_are_still_not_offered(
    mig_devices: NodeDevices,
) -> None:
    inventory = NodeInventory(mig_devices.gpus, simulated=True)

    assert [d["name"] for d in inventory.published_devices()] == ["gpu-7"]
    assert inventory.by_name("gpu-0") is None


def test_two_mig_devices_with_one_name_are_refused(mig_devices: NodeDevices) -> None:
    first = mig_devices.mig_devices[0]
    twin = replace(first, ci_id=1, uuid="MIG-00000000-0000-5000-8000-000000000001")
    with pytest.raises(ValueError, match="two devices share the name gpu-0-mig-1g10gb-19-0"):
        NodeInventory(mig_devices.gpus, simulated=True, mig_devices=(first, twin))


def test_simulated_mig_device_gets_its_mig_uuid_parent_and_a_fact_file(
    mig_devices: NodeDevices, tmp_path: Path
) -> None:
    inventory = NodeInventory.from_discovery(mig_devices, simulated=True)
    mig = mig_named(inventory, "gpu-1-mig-1g10gb-me-20-3")

    edits = inventory.container_edits(mig, tmp_path)

    prefix = "GPU_DRA_GPU_1_MIG_1G10GB_ME_20_3"
    assert dict(edits.env) == {
        f"{prefix}_UUID": mig.uuid,
        f"{prefix}_PARENT_UUID": mig.parent.uuid,
        f"{prefix}_PROFILE": "1g.10gb+me",
        f"{prefix}_PRODUCT": "NVIDIA H100 80GB HBM3",
        f"{prefix}_SIMULATED": "true",
    }
    assert edits.device_nodes == ()
    (mount,) = edits.mounts
    name = "gpu-1-mig-1g10gb-me-20-3"
    assert mount.container_path == f"/run/gpu-dra/devices/{name}.json"
    assert "ro" in mount.options
    facts = json.loads((tmp_path / f"{name}.json").read_text())
    assert facts == {
        "name": name,
        "uuid": mig.uuid,
        "parentUUID": mig.parent.uuid,
        "parentMinor": 1,
        "profile": "1g.10gb+me",
        "productName": "NVIDIA H100 80GB HBM3",
        "pciBusID": "0000:43:00.0",
        "memoryBytes": 9984 * 1024 * 1024,
        "gpuInstanceProfileId": 20,
        "placement": {"start": 3, "size": 1},
        "gpuInstanceId": mig.gi_id,
        "computeInstanceId": 0,
    }
    assert stat.S_IMODE((tmp_path / f"{name}.json").stat().st_mode) == 0o644


def test_real_mig_device_gets_its_parent_node_and_the_gi_and_ci_capability_nodes(
    mig_devices: NodeDevices, tmp_path: Path
) -> None:
    capabilities = RecordingCapabilities()
    inventory = NodeInventory.from_discovery(
        mig_devices,
        simulated=False,
        driver=real_driver_root(tmp_path / "root", [4], caps_major=511),
        mig_capabilities=capabilities,
    )
    mig = mig_named(inventory, "gpu-4-mig-1g20gb-15-6")
    claim_dir = tmp_path / "claim"

    edits = inventory.container_edits(mig, claim_dir)

    gi = mig.gi_id
    assert capabilities.calls == [(4, gi, None), (4, gi, 0)]
    assert edits.device_nodes == (
        DeviceNode("/dev/nvidia4", permissions="rw"),
        *(
            DeviceNode(
                f"/dev/nvidia-caps/nvidia-cap{minor}",
                permissions="rw",
                type="c",
                major=511,
                minor=minor,
                file_mode=0o444,
            )
            for minor in (100 + 10 * gi, 100 + 10 * gi + 1)
        ),
    )
    prefix = "GPU_DRA_GPU_4_MIG_1G20GB_15_6"
    assert dict(edits.env)[f"{prefix}_UUID"] == mig.uuid
    assert dict(edits.env)[f"{prefix}_PARENT_UUID"] == mig.parent.uuid
    assert f"{prefix}_SIMULATED" not in dict(edits.env)
    assert edits.mounts == ()
    assert not claim_dir.exists()


def test_a_mig_device_fails_without_the_nvidia_caps_major(
    mig_devices: NodeDevices, tmp_path: Path
) -> None:
    driver = real_driver_root(tmp_path, [4])
    (tmp_path / "proc/devices").write_text("Character devices:\n195 nvidia\n")
    inventory = NodeInventory.from_discovery(
        mig_devices, simulated=False, driver=driver, mig_capabilities=RecordingCapabilities()
    )

    with pytest.raises(DriverUserspaceError, match="no character device major for nvidia-caps"):
        inventory.container_edits(mig_named(inventory, "gpu-4-mig-1g20gb-15-6"), tmp_path)


def write_proc(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_capability_minors_come_from_the_drivers_procfs_under_the_driver_root(
    mig_devices: NodeDevices, tmp_path: Path
) -> None:
    mig = next(m for m in mig_devices.mig_devices if m.parent.minor == 3)  # the 7g.80gb
    caps = f"proc/driver/nvidia/capabilities/gpu3/mig/gi{mig.gi_id}"
    write_proc(tmp_path, f"{caps}/access", "DeviceFileMinor: 30\nDeviceFileMode: 292\n")
    write_proc(tmp_path, f"{caps}/ci0/access", "DeviceFileMinor: 31\nDeviceFileMode: 292\n")
    driver = real_driver_root(tmp_path, [3], host="/run/nvidia/driver")
    inventory = NodeInventory.from_discovery(mig_devices, simulated=False, driver=driver)

    edits = inventory.container_edits(mig, tmp_path / "claim")

    host = "/run/nvidia/driver/dev/nvidia-caps"
    assert [(n.path, n.host_path, n.minor) for n in edits.device_nodes][-2:] == [
        ("/dev/nvidia-caps/nvidia-cap30", f"{host}/nvidia-cap30", 30),
        ("/dev/nvidia-caps/nvidia-cap31", f"{host}/nvidia-cap31", 31),
    ]


def test_capability_minors_fall_back_to_the_mig_minors_table(tmp_path: Path) -> None:
    write_proc(
        tmp_path,
        "driver/nvidia-caps/mig-minors",
        "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu1/gi1/access 147\n",
    )
    lookup = ProcMigCapabilities((tmp_path,))

    assert lookup(0, 1, None) == 12
    assert lookup(0, 1, 0) == 13
    assert lookup(1, 1, None) == 147


def test_an_unresolvable_capability_is_a_clear_error(
    mig_devices: NodeDevices, tmp_path: Path
) -> None:
    inventory = NodeInventory.from_discovery(
        mig_devices,
        simulated=False,
        mig_capabilities=ProcMigCapabilities((tmp_path / "proc",)),
    )
    mig = mig_named(inventory, "gpu-0-mig-1g10gb-19-0")

    with pytest.raises(MigCapabilityError, match="cannot find the MIG capability device of GPU 0"):
        inventory.container_edits(mig, tmp_path / "claim")
    assert issubclass(MigCapabilityError, OSError)  # the preparer reports it, will retry


def test_the_preparer_hands_out_mig_devices_through_by_name_and_container_edits(
    mig_devices: NodeDevices, tmp_path: Path
) -> None:
    inventory = NodeInventory.from_discovery(mig_devices, simulated=True)
    api = InMemoryClaimReader()
    names = ["gpu-1-mig-2g20gb-14-0", "gpu-1-mig-3g40gb-9-4"]
    api.add(
        resource_claim(
            UID,
            "mig-claim",
            results=[allocation_result(n, request="mig") for n in names],
        )
    )
    cdi = ClaimSpecStore(tmp_path / "cdi", driver_name=DRIVER)
    checkpoint = Checkpoint(tmp_path / "data", boot_id=lambda: "boot-1")
    checkpoint.load()
    preparer = new_preparer(
        inventory=inventory,
        claims=api,
        checkpoint=checkpoint,
        cdi=cdi,
        claims_dir=tmp_path / "data" / "claims",
    )
    claim = ClaimRef("default", UID, "mig-claim")

    result = asyncio.run(preparer.prepare([claim]))[UID]

    assert result.error is None, result.error
    assert [d.device_name for d in result.devices] == names
    spec = yaml.safe_load(cdi.path_for(UID).read_text())
    for device, name in zip(spec["devices"], names, strict=True):
        env = dict(item.split("=", 1) for item in device["containerEdits"]["env"])
        prefix = device_env_prefix(name)
        assert env[f"{prefix}_UUID"] == mig_named(inventory, name).uuid
        assert env[f"{prefix}_PARENT_UUID"] == mig_devices.gpus[1].uuid
    assert asyncio.run(preparer.unprepare([claim])) == {UID: None}
    assert not cdi.path_for(UID).exists()


def dynamic_inventory(profile: str, policy: MigPolicy = DEFAULT_MIG_POLICY) -> NodeInventory:
    host = SimulatedHost.load(profile, NODE)
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    return NodeInventory.from_discovery(found, simulated=True, dynamic_mig=True, mig_policy=policy)


def test_dynamic_mig_partitions_are_found_by_name_with_parent_profile_and_placement() -> None:
    inventory = dynamic_inventory("hgx-h100")

    partition = inventory.by_name("gpu-3-mig-3g40gb-9-4")
    assert isinstance(partition, MigPartition)
    assert partition.parent == gpu_named(inventory, "gpu-3")
    assert (partition.gi_profile_id, partition.profile_name) == (9, "3g.40gb")
    assert (partition.placement_start, partition.placement_size) == (4, 4)
    assert list(partition.memory_slices) == [4, 5, 6, 7]
    assert inventory.by_name("gpu-3-mig-3g40gb-9-2") is None  # not a possible placement
    names = [device["name"] for device in inventory.published_devices()]
    assert len(names) == 8 * 15  # the default policy: 1g x7, 2g x3, 3g x2, 4g, 7g, the whole GPU
    assert [inventory.by_name(name) is not None for name in names] == [True] * len(names)
    # a profile the policy leaves out is not a device of this node (prepare calls it stale)
    assert isinstance(inventory.by_name("gpu-3-mig-4g40gb-5-0"), MigPartition)
    assert inventory.by_name("gpu-3-mig-1g20gb-15-2") is None
    everything = dynamic_inventory("hgx-h100", EVERYTHING)
    assert isinstance(everything.by_name("gpu-3-mig-1g20gb-15-2"), MigPartition)
    assert len(everything.published_devices()) == 8 * 26


def test_without_dynamic_mig_partitions_are_neither_published_nor_found() -> None:
    host = SimulatedHost.load("hgx-h100", NODE)
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    inventory = NodeInventory.from_discovery(found, simulated=True)

    assert inventory.by_name("gpu-3-mig-3g40gb-9-4") is None
    assert [d["name"] for d in inventory.published_devices()] == [f"gpu-{i}" for i in range(8)]
    assert inventory.counter_sets() == []


def test_dynamic_mig_replaces_static_devices_of_partitionable_gpus() -> None:
    inventory = dynamic_inventory("hgx-h100-mig")

    device = inventory.by_name("gpu-1-mig-3g40gb-9-4")  # exists statically, published as partition
    assert isinstance(device, MigPartition)
    assert len(inventory.counter_sets()) == 8


def test_dynamic_mig_pool_split_layout_keeps_counters_apart_and_64_devices_per_slice() -> None:
    pool = dynamic_inventory("hgx-h100").desired_pool(DRIVER, NODE, slices.SliceLayout.SPLIT)

    counter_slices = [s for s in pool.slices if "sharedCounters" in s]
    device_slices = [s for s in pool.slices if "sharedCounters" not in s]
    assert [len(s["sharedCounters"]) for s in counter_slices] == [8]
    assert all("devices" not in s for s in counter_slices)
    assert [len(s["devices"]) for s in device_slices] == [64, 56]
    assert pool.slices[0] is counter_slices[0]
    assert pool.device_count == 8 * 15
    every = dynamic_inventory("hgx-h100", EVERYTHING)
    pool = every.desired_pool(DRIVER, NODE, slices.SliceLayout.SPLIT)
    assert [len(s.get("devices", [])) for s in pool.slices] == [0, 64, 64, 64, 16]


def test_dynamic_mig_pool_combined_layout_is_one_slice_per_gpu() -> None:
    pool = dynamic_inventory("hgx-h100").desired_pool(DRIVER, NODE, slices.SliceLayout.COMBINED)

    assert len(pool.slices) == 8
    for minor, spec in enumerate(pool.slices):
        (shared,) = spec["sharedCounters"]
        assert shared["name"] == f"gpu-{minor}-counter-set"
        consumed = {e["counterSet"] for d in spec["devices"] for e in d["consumesCounters"]}
        assert consumed == {shared["name"]}
        assert len(spec["devices"]) == 15


def test_gpus_offered_as_mps_shares_are_published_with_consumable_capacity(
    gpus: tuple[Gpu, ...],
) -> None:
    inventory = NodeInventory.from_discovery(
        NodeDevices(gpus), simulated=True, mps_shares=ShareSelection.parse(f"1,{gpus[3].uuid}")
    )

    published = {device["name"]: device for device in inventory.published_devices()}
    offered = sorted(name for name, d in published.items() if d.get("allowMultipleAllocations"))
    assert offered == ["gpu-1", "gpu-3"]
    assert set(published["gpu-1"]["capacity"]) == {"memory", "compute"}
    assert published["gpu-0"]["capacity"] == {
        "memory": {"value": "81559Mi"}
    }  # as NVIDIA publishes it
    assert inventory.shared_gpu("gpu-3") == gpus[3]
    assert inventory.shared_gpu("gpu-0") is None
    assert inventory.shared_gpu("gpu-9") is None


def test_default_publishing_offers_no_mps_shares(gpus: tuple[Gpu, ...]) -> None:
    inventory = NodeInventory.from_discovery(NodeDevices(gpus), simulated=True)

    assert inventory.mps_shares == ()
    assert not any("allowMultipleAllocations" in d for d in inventory.published_devices())


def test_dynamic_mig_gpus_cannot_be_named_as_mps_shares() -> None:
    host = SimulatedHost.load("hgx-h100", NODE)
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)

    with pytest.raises(ShareSelectionError, match="GPU 0, which --dynamic-mig publishes as MIG"):
        NodeInventory.from_discovery(
            found, simulated=True, dynamic_mig=True, mps_shares=ShareSelection.parse("0")
        )
    every = NodeInventory.from_discovery(
        found, simulated=True, dynamic_mig=True, mps_shares=ShareSelection.parse("all")
    )
    assert every.mps_shares == ()  # every H100 is partitioned: nothing left to share
    assert not any("allowMultipleAllocations" in d for d in every.published_devices())


def test_mps_shares_go_to_the_gpus_dynamic_mig_does_not_partition() -> None:
    host = SimulatedHost.load(str(DEMO_NODE), NODE)  # H100s, A100s with MIG off, L4s
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)

    inventory = NodeInventory.from_discovery(
        found, simulated=True, dynamic_mig=True, mps_shares=ShareSelection.parse("all")
    )

    partitioned = {gpu.uuid for gpu in inventory.partitionable_gpus()}
    assert 0 < len(partitioned) < len(inventory.gpus)
    assert {gpu.uuid for gpu in inventory.mps_shares} == {
        gpu.uuid for gpu in inventory.gpus if gpu.uuid not in partitioned
    }
    published = {d["name"]: d for d in inventory.published_devices()}
    offered = sorted(name for name, d in published.items() if d.get("allowMultipleAllocations"))
    assert offered == sorted(gpu_device_name(gpu.minor) for gpu in inventory.mps_shares)
    for name in offered:
        assert set(published[name]["capacity"]) == {"memory", "compute"}
        assert "consumesCounters" not in published[name]
        assert inventory.shared_gpu(name) is not None
    assert any(d.get("consumesCounters") for d in published.values())  # partitions still there
    assert len(inventory.counter_sets()) == len(partitioned)


def test_static_mig_devices_offered_as_shares_unless_dynamic_mig_partitions_their_gpu() -> None:
    host = SimulatedHost.load("hgx-h100-mig", "node-a")
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    every = MigShareSelection(every_device=True)

    static = NodeInventory.from_discovery(found, simulated=True, mps_shares_on_mig=every)
    shared = {d["name"] for d in static.published_devices() if d.get("allowMultipleAllocations")}
    assert len(shared) == len(found.mig_devices) == 19
    assert all(static.shared_gpu(name) in static.mig_mps_shares for name in shared)
    assert static.shared_gpu("gpu-7") is None  # MIG off, not offered by --mps-shares

    # Dynamic MIG partitions every H100 of this node: none of their static devices is offered.
    dynamic = NodeInventory.from_discovery(
        found, simulated=True, dynamic_mig=True, mps_shares_on_mig=every
    )
    assert dynamic.mig_mps_shares == ()
    assert not any(d.get("allowMultipleAllocations") for d in dynamic.published_devices())
    with pytest.raises(ShareSelectionError, match="--dynamic-mig"):
        NodeInventory.from_discovery(
            found,
            simulated=True,
            dynamic_mig=True,
            mps_shares_on_mig=MigShareSelection.parse(found.mig_devices[0].uuid),
        )


# --- fact files shared by the claims of a device (simulated devices the node has from its start)


def shared(gpus: tuple[Gpu, ...], tmp_path: Path) -> tuple[NodeInventory, Path]:
    """A simulated inventory whose fact files are shared from ``<tmp_path>/simulated-facts``."""
    shared_dir = tmp_path / "simulated-facts"
    return NodeInventory(gpus, simulated=True, fact_files=SharedFactFiles(shared_dir)), shared_dir


def test_claims_of_a_discovered_gpu_mount_one_durably_written_fact_file(
    gpus: tuple[Gpu, ...], tmp_path: Path
) -> None:
    inventory, shared_dir = shared(gpus, tmp_path)
    gpu = gpu_named(inventory, "gpu-6")
    claims = [tmp_path / "claims" / uid for uid in ("a", "b")]
    mounts = [inventory.container_edits(gpu, claim_dir).mounts for claim_dir in claims]

    (file,) = shared_dir.iterdir()
    assert file.name.startswith("gpu-6-")
    assert file.name.endswith(".json")
    for (mount,) in mounts:
        assert mount.host_path == str(file)
        assert mount.container_path == "/run/gpu-dra/devices/gpu-6.json"
        assert mount.options == ("ro", "nosuid", "nodev", "bind")
    assert not (tmp_path / "claims").exists()  # no claim directory, no file per claim
    assert stat.S_IMODE(file.stat().st_mode) == 0o644
    facts = json.loads(file.read_text())
    assert (facts["name"], facts["uuid"]) == ("gpu-6", gpu.uuid)


def test_a_shared_fact_file_removed_is_written_again(gpus: tuple[Gpu, ...], tmp_path: Path) -> None:
    inventory, shared_dir = shared(gpus, tmp_path)
    gpu = gpu_named(inventory, "gpu-2")
    (first,) = inventory.container_edits(gpu, tmp_path / "claim").mounts
    assert Path(first.host_path).parent == shared_dir
    Path(first.host_path).unlink()  # removed behind the plugin's back

    (again,) = inventory.container_edits(gpu, tmp_path / "claim").mounts

    assert again.host_path == first.host_path
    assert json.loads(Path(again.host_path).read_text())["uuid"] == gpu.uuid


def test_other_facts_of_a_device_get_a_file_of_their_own(tmp_path: Path) -> None:
    shared_dir = tmp_path / "simulated-facts"
    fact_files = SharedFactFiles(shared_dir)
    first = fact_files.path("gpu-0", '{"uuid": "GPU-1"}\n')
    other = fact_files.path("gpu-0", '{"uuid": "GPU-2"}\n')  # another machine
    assert fact_files.path("gpu-0", '{"uuid": "GPU-1"}\n') == first
    assert first != other
    assert sorted(shared_dir.iterdir()) == sorted([first, other])
    assert first.read_text() == '{"uuid": "GPU-1"}\n'
    assert other.read_text() == '{"uuid": "GPU-2"}\n'


def test_a_mig_device_made_for_a_claim_gets_a_fact_file_in_the_claim_directory(
    mig_devices: NodeDevices, tmp_path: Path
) -> None:
    shared_dir = tmp_path / "simulated-facts"
    inventory = NodeInventory.from_discovery(
        mig_devices, simulated=True, fact_files=SharedFactFiles(shared_dir)
    )
    static = inventory.mig_devices[0]
    made = replace(static, uuid="MIG-made-for-this-claim")
    (static_mount,) = inventory.container_edits(static, tmp_path / "claim").mounts
    assert Path(static_mount.host_path).parent == shared_dir
    claim_dir = tmp_path / "claims" / "other"

    (mount,) = inventory.container_edits(made, claim_dir).mounts

    written = Path(mount.host_path)
    assert written.parent == claim_dir
    assert stat.S_IMODE(claim_dir.stat().st_mode) == 0o755
    assert stat.S_IMODE(written.stat().st_mode) == 0o644
    assert json.loads(written.read_text())["uuid"] == "MIG-made-for-this-claim"
    assert len(list(shared_dir.iterdir())) == 1  # the static device's file only
    assert not (tmp_path / "claim").exists()
