"""`gpu-dra inventory` on what the kubelet plugin really publishes: partitionable H100s
(``--dynamic-mig``: whole GPU and every MIG placement consume the GPU's shared counters) and
GPUs offered as MPS shares (consumable capacity). Devices out of counters are ``blocked``, share
devices report their capacity left, class rows count what the scheduler can allocate now; the
controller's gauges follow. One counter implementation: explain's counters step agrees."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.cli.explain import explain
from gpu_dra.cli.inventory import render_inventory
from gpu_dra.controller.catalog import load_catalog
from gpu_dra.controller.metrics import InventoryMetrics
from gpu_dra.driver import slices
from gpu_dra.driver.cel import Quantity
from gpu_dra.driver.cluster.availability import quantity_text
from gpu_dra.driver.cluster.usage import Inventory, inventory
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.mig_policy import EVERYTHING
from gpu_dra.driver.model import MigPartition
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.shares import ShareSelection
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from tests.fakes.cluster_objects import DRIVER, claim, exactly

Obj = dict[str, Any]
NODE = "node-a"
CATALOG = Path(__file__).resolve().parents[2] / "deviceclasses"
FIVE_SLICES = [f"gpu-0-mig-1g10gb-19-{placement}" for placement in range(5)]


def published_slices(node: NodeInventory, layout: slices.SliceLayout) -> list[Obj]:
    """The node's pool as the apiserver returns it (generation 1)."""
    pool = node.desired_pool(DRIVER, NODE, layout)
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{NODE}-{DRIVER}-{index}"},
            "spec": {**spec, "pool": {**spec["pool"], "generation": 1}},
        }
        for index, spec in enumerate(pool.slices)
    ]


def dynamic_mig_node() -> NodeInventory:
    """Every profile (``--dynamic-mig-profiles=all``): the +me and 1g.20gb placements too."""
    host = SimulatedHost.load("hgx-h100", NODE)
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    return NodeInventory.from_discovery(
        found, simulated=True, dynamic_mig=True, mig_policy=EVERYTHING
    )


def share_node(selection: str = "0") -> NodeInventory:
    host = SimulatedHost.load("hgx-h100", NODE)
    return NodeInventory.from_discovery(
        discover_devices(host.nvml, host.pci),
        simulated=True,
        mps_shares=ShareSelection.parse(selection),
    )


def catalog() -> list[Obj]:
    return [dict(c) for c in load_catalog(CATALOG)]


def mig_claims(devices: list[str]) -> list[Obj]:
    return [
        claim("team-a", f"slice-{n}", allocated=[("mig", device)])
        for n, device in enumerate(devices)
    ]


def share(name: str, memory: str, compute: str, device: str = "gpu-0") -> Obj:
    result = {
        "request": "share",
        "driver": DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": f"share-{name}",
        "consumedCapacity": {"memory": memory, "compute": compute},
    }
    return claim("mps", name, results=[result])


def rendered_rows(report: Inventory, title: str) -> list[list[str]]:
    """The rows of the table printed after the section `title`."""
    out = render_inventory(report, devices=True)
    table = out[out.index(title) + 1]
    assert isinstance(table, tuple)
    return table[1]


def rows_by_device(report: Inventory) -> dict[str, Any]:
    return {row.device: row for row in report.devices}


@pytest.mark.parametrize("layout", [slices.SliceLayout.SPLIT, slices.SliceLayout.COMBINED])
def test_five_slices_of_an_h100_block_the_whole_gpu_and_overlapping_placements(
    layout: slices.SliceLayout,
) -> None:
    node = dynamic_mig_node()
    report = inventory(published_slices(node, layout), catalog(), mig_claims(FIVE_SLICES))
    rows = rows_by_device(report)

    taken = set()
    for name in FIVE_SLICES:
        partition = node.by_name(name)
        assert isinstance(partition, MigPartition)
        taken |= set(partition.memory_slices)
        assert rows[name].state == "allocated"
    assert taken == {0, 1, 2, 3, 4}
    assert rows["gpu-0"].state == "blocked"
    holders = ", ".join(f"team-a/slice-{n}" for n in range(5))
    assert rows["gpu-0"].reason == f"counters of gpu-0-counter-set used by {holders}"
    # Every other placement of gpu-0: blocked exactly when it shares a memory slice with the
    # allocated ones (the other counters still cover one more small slice).
    expected_free = set()
    for name, row in rows.items():
        partition = node.by_name(name)
        if name in FIVE_SLICES or not isinstance(partition, MigPartition):
            continue
        if partition.parent.minor != 0:
            assert row.state == "free", name
            continue
        overlaps = bool(taken & set(partition.memory_slices))
        assert row.state == ("blocked" if overlaps else "free"), name
        assert (row.reason == "") != overlaps
        if not overlaps:
            expected_free.add(name)
    assert expected_free == {
        "gpu-0-mig-1g10gb-19-5",
        "gpu-0-mig-1g10gb-19-6",
        "gpu-0-mig-1g10gb-me-20-5",
        "gpu-0-mig-1g10gb-me-20-6",
        "gpu-0-mig-1g20gb-15-6",
    }
    assert [rows[f"gpu-{minor}"].state for minor in range(1, 8)] == ["free"] * 7

    # 26 devices per GPU: the whole GPU and 25 placements.
    assert report.nodes()[NODE] == {
        "devices": 8 * 26,
        "free": 7 * 26 + 5,
        "allocated": 5,
        "shared": 0,
        "blocked": 26 - 5 - 5,
        "types": {"gpu": {"devices": 8, "free": 7}, "mig": {"devices": 200, "free": 180}},
    }
    classes = {row.name: row for row in report.classes}
    assert (classes["gpu.nvidia.com"].total, classes["gpu.nvidia.com"].free) == (8, 7)
    assert classes["gpu.nvidia.com"].blocked == 1
    assert (classes["hopper.gpu.nvidia.com"].free, classes["hopper.gpu.nvidia.com"].blocked) == (
        7,
        1,
    )
    assert (classes["mig.nvidia.com"].total, classes["mig.nvidia.com"].free) == (200, 180)
    assert classes["mig.nvidia.com"].blocked == 15
    # 1g profiles per GPU: 7x 1g.10gb, 7x 1g.10gb+me, 4x 1g.20gb; on gpu-0 5 taken, 5 left.
    one_g = classes["mig-1g.gpu.nvidia.com"]
    assert (one_g.total, one_g.free, one_g.blocked) == (8 * 18, 7 * 18 + 5, 18 - 5 - 5)
    assert classes["mig-7g.gpu.nvidia.com"].free == 7


def test_a_whole_gpu_allocated_blocks_every_placement_and_nothing_else() -> None:
    node = dynamic_mig_node()
    claims = [claim("team-b", "whole", allocated=[("gpu", "gpu-3")])]
    report = inventory(published_slices(node, slices.SliceLayout.SPLIT), catalog(), claims)

    states = {row.device: row.state for row in report.devices if row.device.startswith("gpu-3-")}
    assert len(states) == 25
    assert set(states.values()) == {"blocked"}
    assert rows_by_device(report)["gpu-3"].state == "allocated"
    assert all(row.state == "free" for row in report.devices if not row.device.startswith("gpu-3"))
    classes = {row.name: row for row in report.classes}
    assert (classes["gpu.nvidia.com"].free, classes["gpu.nvidia.com"].blocked) == (7, 0)
    assert (classes["mig.nvidia.com"].free, classes["mig.nvidia.com"].blocked) == (175, 25)


def test_admin_access_allocations_consume_no_counters() -> None:
    node = dynamic_mig_node()
    admin = {"request": "all", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}
    claims = [claim("monitoring", "admin", results=[{**admin, "adminAccess": True}])]
    report = inventory(published_slices(node, slices.SliceLayout.SPLIT), catalog(), claims)

    rows = rows_by_device(report)
    assert rows["gpu-0"].state == "admin"
    assert rows["gpu-0-mig-7g80gb-0-0"].state == "free"
    assert {row.name: row.free for row in report.classes}["mig.nvidia.com"] == 200


def test_explain_rejects_by_counters_exactly_the_devices_inventory_blocks() -> None:
    node = dynamic_mig_node()
    published = published_slices(node, slices.SliceLayout.SPLIT)
    claims = mig_claims(FIVE_SLICES)
    pending = claim("team-c", "next", [exactly("mig", "mig.nvidia.com")])
    report = inventory(published, catalog(), [*claims, pending])
    free_mig = {row.device for row in report.devices if row.type == "mig" and row.state == "free"}

    explanation = explain(pending, catalog(), published, [*claims, pending])
    (alternative,) = explanation.requests[0].alternatives
    assert {device.name for device in alternative.candidates} == free_mig
    assert len(free_mig) == 180


def test_blocked_devices_show_their_reason_in_the_table_and_json() -> None:
    node = dynamic_mig_node()
    report = inventory(
        published_slices(node, slices.SliceLayout.SPLIT), catalog(), mig_claims(FIVE_SLICES[:1])
    )
    data = report.to_json()
    whole = next(d for d in data["devices"] if d["device"] == "gpu-0")
    assert whole["state"] == "blocked"
    assert whole["reason"] == "counters of gpu-0-counter-set used by team-a/slice-0"
    # The GPU and every other placement on memory slice 0: 1g.10gb+me, 1g.20gb, 2g, 3g, 4g, 7g.
    assert data["nodes"][NODE]["blocked"] == 7
    device_rows = rendered_rows(report, "devices:")
    assert next(r for r in device_rows if r[2] == "gpu-0")[5] == (
        "blocked (counters of gpu-0-counter-set used by team-a/slice-0)"
    )


def test_mps_shares_report_the_capacity_their_allocations_leave() -> None:
    node = share_node("0,1,2")
    published = published_slices(node, slices.SliceLayout.SPLIT)
    memory = Quantity.parse(node.published_devices()[0]["capacity"]["memory"]["value"]).value
    claims = [
        share("a", "10Gi", "10"),
        share("b", "20Gi", "20"),
        share("c", "40Gi", "30"),
        share("full", quantity_text(memory), "100", device="gpu-1"),
    ]
    report = inventory(published, catalog(), claims)
    rows = rows_by_device(report)

    left = rows["gpu-0"].capacity
    assert rows["gpu-0"].state == "shared"
    assert left["memory"].value == memory
    assert left["memory"].remaining == memory - Quantity.parse("70Gi").value
    assert (left["compute"].value, left["compute"].remaining) == (100, 40)
    assert rows["gpu-1"].state == "allocated"  # a share took all of it
    assert rows["gpu-1"].capacity["memory"].remaining == 0
    assert rows["gpu-2"].state == "free"
    assert rows["gpu-2"].capacity["compute"].remaining == 100
    assert rows["gpu-3"].capacity == {}  # not offered as shares: taken whole, no capacity row
    assert report.nodes()[NODE]["shared"] == 1

    mps = {row.name: row for row in report.classes}["mps.gpu.nvidia.com"]
    assert (mps.total, mps.free, mps.blocked) == (3, 2, 0)
    assert mps.capacity["compute"].value == 300
    assert mps.capacity["compute"].remaining == 40 + 0 + 100
    assert mps.capacity["memory"].remaining == 2 * memory - Quantity.parse("70Gi").value
    json_row = next(d for d in report.to_json()["devices"] if d["device"] == "gpu-0")
    assert json_row["capacity"] == {
        "compute": {"value": "100", "remaining": "40"},
        "memory": {"value": "81559Mi", "remaining": f"{81559 - 70 * 1024}Mi"},  # as published
    }
    assert json_row["state"] == "shared"
    (mps_row,) = [
        r for r in rendered_rows(report, "device classes:") if r[0] == "mps.gpu.nvidia.com"
    ]
    assert mps_row[4] == f"compute 140/300, memory {2 * 81559 - 70 * 1024}Mi/{3 * 81559}Mi"


def test_gauges_follow_the_device_and_class_states() -> None:
    node = dynamic_mig_node()
    report = inventory(
        published_slices(node, slices.SliceLayout.SPLIT), catalog(), mig_claims(FIVE_SLICES)
    )
    registry = CollectorRegistry()
    InventoryMetrics(registry).update(report.device_counts(), report.class_counts())

    def devices(kind: str, state: str) -> float | None:
        labels = {"node": NODE, "type": kind, "state": state}
        return registry.get_sample_value("gpu_dra_devices", labels)

    def classes(name: str, state: str) -> float | None:
        labels = {"deviceclass": name, "state": state}
        return registry.get_sample_value("gpu_dra_deviceclass_devices", labels)

    assert (devices("gpu", "free"), devices("gpu", "blocked")) == (7, 1)
    assert (devices("mig", "free"), devices("mig", "allocated"), devices("mig", "blocked")) == (
        180,
        5,
        15,
    )
    assert devices("gpu", "shared") == 0
    assert (classes("gpu.nvidia.com", "free"), classes("gpu.nvidia.com", "blocked")) == (7, 1)
    assert classes("hopper.gpu.nvidia.com", "total") == 8


def test_the_device_table_puts_a_gpus_mig_devices_on_one_line() -> None:
    node = dynamic_mig_node()
    claims = [
        *mig_claims(FIVE_SLICES[:3]),
        claim("team-b", "pair", allocated=[("mig", FIVE_SLICES[3]), ("mig", FIVE_SLICES[4])]),
    ]
    report = inventory(published_slices(node, slices.SliceLayout.SPLIT), catalog(), claims)
    rows = rendered_rows(report, "devices:")
    # per GPU: its own line, then one line for its 25 placements
    assert [row[2] for row in rows] == [
        name for minor in range(8) for name in (f"gpu-{minor}", f"gpu-{minor}-mig-* (25)")
    ]
    group = rows[1]
    assert group[3:5] == ["mig", "NVIDIA H100 80GB HBM3"]
    assert group[5].startswith("5 free, 5 allocated, 15 blocked (counters of gpu-0-counter-set")
    assert group[6] == (
        "team-a/slice-0 (mig), team-a/slice-1 (mig), team-a/slice-2 (mig), team-b/pair x2"
    )
    assert rows[3][5:] == ["25 free", "-", "-"]
    # the summary (the default) has no device table and says how to get it
    summary = render_inventory(report)
    assert "devices:" not in summary
    assert summary[-1] == "(the devices and their holders: gpu-dra inventory --devices)"
    assert "nodes (gpu.nvidia.com):" in summary
    assert "device classes:" in summary


def test_a_lone_mig_device_keeps_its_own_line() -> None:
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    node = NodeInventory.from_discovery(discover_devices(host.nvml, host.pci), simulated=True)
    report = inventory(published_slices(node, slices.SliceLayout.SPLIT), catalog(), [])
    names = [row[2] for row in rendered_rows(report, "devices:")]
    mig = [device.device for device in report.devices if device.type == "mig"]
    parents = Counter(name.split("-mig-")[0] for name in mig)
    for parent, count in parents.items():
        if count == 1:
            assert next(name for name in mig if name.startswith(f"{parent}-mig-")) in names
        else:
            assert f"{parent}-mig-* ({count})" in names
    assert len(names) == len(report.devices) - sum(c - 1 for c in parents.values() if c > 1)
