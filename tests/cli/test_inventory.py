"""`gpu-dra inventory` and its model (`gpu_dra.driver.cluster`): pools at their highest generation,
devices per node with allocation state and holders, DeviceClass totals and free counts."""

from __future__ import annotations

from gpu_dra.cli.inventory import render_inventory
from gpu_dra.driver.cel import CelRuntimeError, compile_selector, to_cel_device
from gpu_dra.driver.cluster.state import ALL_NODES, build_cluster_state, select_all
from gpu_dra.driver.cluster.usage import inventory
from tests.fakes.cluster_objects import (
    DRIVER,
    GPU_CLASS_CEL,
    a100,
    claim,
    device_class,
    gpu,
    l4,
    mixed_node,
    resource_slice,
    standard_classes,
)


def test_pools_keep_only_the_highest_generation_and_mark_incomplete_pools() -> None:
    slices = [
        resource_slice("node-a", [l4("old-0"), l4("old-1")], generation=1),
        resource_slice("node-a", [l4("gpu-0")], generation=2, count=2, name="a-2"),
        resource_slice("node-b", [a100("gpu-0")]),
    ]
    state = build_cluster_state(slices, [])
    pools = {pool.key: pool for pool in state.pools}
    assert [d.name for d in pools["gpu.nvidia.com/node-a"].devices] == ["gpu-0"]
    assert pools["gpu.nvidia.com/node-a"].incomplete
    assert not pools["gpu.nvidia.com/node-b"].incomplete
    report = inventory(slices, standard_classes(), [])
    lines = [block for block in render_inventory(report) if isinstance(block, str)]
    assert any("pool gpu.nvidia.com/node-a is incomplete (1 of 2 slices" in line for line in lines)


def test_devices_per_node_with_state_and_holders() -> None:
    slices = [
        mixed_node("node-a"),
        resource_slice(
            "node-b",
            [
                gpu("gpu-0", "NVIDIA A100-SXM4-40GB", memory="40Gi"),
                gpu("gpu-0-mig-1g5gb-0", "NVIDIA A100-SXM4-40GB", kind="mig"),
                gpu("gpu-0-mig-1g5gb-1", "NVIDIA A100-SXM4-40GB", kind="mig"),
            ],
        ),
        resource_slice("node-c", [l4("gpu-0")], driver="other.example.com"),
    ]
    claims = [
        claim("team-a", "train", allocated=[("gpu", "gpu-0")]),
        claim("team-b", "infer", allocated=[("gpu", "gpu-2")]),
        claim("team-b", "mig", allocated=[("mig", "gpu-0-mig-1g5gb-1")], pool="node-b"),
        claim(
            "monitoring",
            "admin",
            results=[
                {
                    "request": "all",
                    "driver": DRIVER,
                    "pool": "node-a",
                    "device": "gpu-3",
                    "adminAccess": True,
                }
            ],
        ),
        claim("team-c", "pending"),
    ]
    report = inventory(slices, standard_classes(), claims)
    rows = {(r.node, r.device): r for r in report.devices}
    assert len(rows) == 7  # the other driver's node-c is not listed
    assert rows[("node-a", "gpu-0")].state == "allocated"
    assert rows[("node-a", "gpu-0")].holders == ("team-a/train (gpu)",)
    assert rows[("node-a", "gpu-1")].state == "free"
    assert rows[("node-a", "gpu-2")].holders == ("team-b/infer (gpu)",)
    assert rows[("node-a", "gpu-3")].state == "admin"
    assert rows[("node-b", "gpu-0-mig-1g5gb-1")].type == "mig"
    assert rows[("node-b", "gpu-0-mig-1g5gb-1")].state == "allocated"
    nodes = report.nodes()
    assert nodes["node-a"]["devices"] == 4
    assert nodes["node-a"]["free"] == 2  # gpu-1, and gpu-3 (admin access only)
    assert nodes["node-a"]["allocated"] == 2
    assert nodes["node-b"]["types"] == {
        "gpu": {"devices": 1, "free": 1},
        "mig": {"devices": 2, "free": 1},
    }
    assert "node-c" not in nodes


def test_class_totals_and_free_counts_over_all_devices() -> None:
    slices = [
        mixed_node("node-a"),
        mixed_node("node-b"),
        resource_slice("node-b", [gpu("gpu-9-mig", kind="mig")], pool="node-b-mig"),
    ]
    classes = [
        *standard_classes(),
        device_class(
            "large",
            GPU_CLASS_CEL,
            f"device.capacity['{DRIVER}'].memory.compareTo(quantity('40Gi')) >= 0",
        ),
        device_class("broken", "device.attributes['gpu.nvidia.com'].vendorName == 'x'"),
        device_class("syntax", "device.driver =="),
    ]
    claims = [
        claim("ns", "a", allocated=[("gpu", "gpu-0"), ("gpu", "gpu-2")]),
        claim("ns", "b", allocated=[("gpu", "gpu-1")], pool="node-b"),
    ]
    report = inventory(slices, classes, claims)
    by_class = {row.name: row for row in report.classes}
    assert (by_class["gpu.nvidia.com"].total, by_class["gpu.nvidia.com"].free) == (8, 5)
    assert (by_class["large"].total, by_class["large"].free) == (4, 2)
    assert (by_class["mig.nvidia.com"].total, by_class["mig.nvidia.com"].free) == (1, 1)
    assert by_class["broken"].errors == 9
    assert "no such key: vendorName" in by_class["broken"].error
    assert by_class["syntax"].error.startswith("selector #0: ")
    data = report.to_json()
    assert data["nodes"]["node-b"]["devices"] == 5
    assert {c["name"]: c["free"] for c in data["classes"]}["large"] == 2


def test_multi_allocatable_devices_are_shared_and_stay_free_for_the_class() -> None:
    shared = gpu("gpu-0", allowMultipleAllocations=True)
    slices = [resource_slice("node-a", [shared])]
    claims = [
        claim(
            "ns",
            "s1",
            results=[
                {
                    "request": "gpu",
                    "driver": DRIVER,
                    "pool": "node-a",
                    "device": "gpu-0",
                    "shareID": "0b7c",
                    "consumedCapacity": {"memory": "1Gi"},
                }
            ],
        )
    ]
    report = inventory(slices, standard_classes(), claims)
    (row,) = report.devices
    assert row.state == "shared"
    assert {c.name: c.free for c in report.classes}["gpu.nvidia.com"] == 1


def test_cluster_wide_pools_and_allocations_of_unknown_devices() -> None:
    slices = [resource_slice(None, [l4("net-0")], pool="fabric")]
    claims = [claim("ns", "gone", allocated=[("gpu", "gpu-7")])]
    report = inventory(slices, standard_classes(), claims)
    assert [r.node for r in report.devices] == [ALL_NODES]
    assert report.unknown_allocations == ("gpu.nvidia.com/node-a/gpu-7 held by ns/gone",)
    rendered = render_inventory(report)
    assert any(isinstance(b, str) and "gpu-7 held by ns/gone" in b for b in rendered)


def test_class_selectors_run_in_order_each_on_the_devices_the_ones_before_matched() -> None:
    devices = [
        gpu("gpu-0", memory="80Gi"),
        gpu("gpu-1", memory="16Gi"),
        # rejected by the first selector: its missing productName never reaches the second
        {**gpu("gpu-2"), "attributes": {"type": {"string": "mig"}}},
        gpu("gpu-3", driver_version="not-a-version"),  # does not convert: an error of its own
        {**gpu("gpu-4", memory="80Gi"), "attributes": {"type": {"string": "gpu"}}},
    ]
    state = build_cluster_state([resource_slice("node-a", devices)], [])
    selectors = [
        compile_selector(GPU_CLASS_CEL),
        compile_selector(f"device.attributes['{DRIVER}'].productName == 'NVIDIA L4'"),
    ]
    matched, failures = select_all(selectors, state.devices)
    names = [d.raw["name"] for d in state.devices]
    assert [names[i] for i in matched] == ["gpu-0", "gpu-1"]
    assert [(names[i], message.split(":")[0]) for i, message in failures] == [
        ("gpu-3", "device gpu-3"),
        ("gpu-4", "no such key"),
    ]
    # the same as each device through every selector, in order
    for index, device in enumerate(state.devices):
        try:
            value = to_cel_device(device.driver, device.raw)  # type: ignore[arg-type]
            outcome: object = all(s.matches(value) for s in selectors)
        except CelRuntimeError as error:
            outcome = str(error)
        expected = index in matched if isinstance(outcome, bool) else dict(failures)[index]
        assert outcome == expected
