"""Health taints on the node's published devices: a GPU's taint reaches its static MIG devices,
its dynamic-MIG partitions and its MPS share device; a MIG device's stays on that device."""

from __future__ import annotations

from datetime import UTC, datetime

from gpu_dra.driver import slices
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.health import (
    KEY_XID,
    HealthPolicy,
    HealthState,
    Problem,
    Target,
    classify_event,
    device_health,
    device_taints,
)
from gpu_dra.driver.model import MigDevice
from gpu_dra.driver.nvml.interface import NVML_EVENT_TYPE_XID_CRITICAL_ERROR
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.shares import MigShareSelection, ShareSelection
from gpu_dra.kubelet_plugin.node_devices import NodeInventory

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
NOW = datetime(2026, 7, 22, 12, 0, tzinfo=UTC)


def xid(code: int) -> Problem:
    found = classify_event(NVML_EVENT_TYPE_XID_CRITICAL_ERROR, code, HealthPolicy(), NOW)
    assert isinstance(found, Problem)
    return found


def tainted(inventory: NodeInventory, state: HealthState) -> dict[str, list[str]]:
    """Device name -> taint keys=values:effects, through the published pool."""
    health = device_health(state, inventory.health_scopes())
    pool = inventory.desired_pool(
        DRIVER, NODE, taints=device_taints(health, HealthPolicy(), DRIVER)
    )
    return {
        device["name"]: [f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in device["taints"]]
        for spec in pool.slices
        for device in spec.get("devices", [])
        if "taints" in device
    }


def static_mig_inventory() -> NodeInventory:
    """hgx-h100-mig: static MIG devices on GPUs 0-6, GPU 7 whole and offered as MPS shares."""
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    found = discover_devices(host.nvml, host.pci)
    return NodeInventory.from_discovery(found, simulated=True, mps_shares=ShareSelection.parse("7"))


def test_scopes_name_every_published_device_with_its_gpu_and_mig_ids() -> None:
    inventory = static_mig_inventory()
    scopes = {scope.name: scope for scope in inventory.health_scopes()}
    assert list(scopes) == [d["name"] for d in inventory.published_devices()]
    for name, scope in scopes.items():
        device = inventory.by_name(name)
        if isinstance(device, MigDevice):
            assert (scope.gpu_uuid, scope.mig) == (device.parent.uuid, (device.gi_id, device.ci_id))
        else:
            assert (scope.gpu_uuid, scope.mig) == (device.uuid, None)  # type: ignore[union-attr]


def test_a_gpu_taint_reaches_all_its_static_mig_devices_and_nothing_else() -> None:
    inventory = static_mig_inventory()
    gpu0 = inventory.gpus[0]
    found = tainted(inventory, HealthState().with_problem(Target(gpu0.uuid), xid(79)))
    mig_of_gpu0 = [d.name for d in inventory.health_scopes() if d.gpu_uuid == gpu0.uuid]
    assert len(mig_of_gpu0) == 7
    assert found == {name: ["gpu.nvidia.com/xid=79:NoExecute"] for name in mig_of_gpu0}


def test_a_mig_device_taint_stays_on_that_device() -> None:
    inventory = static_mig_inventory()
    target = next(d for d in inventory.mig_devices if d.parent.index == 1)
    state = HealthState().with_problem(
        Target(target.parent.uuid, (target.gi_id, target.ci_id)), xid(94)
    )
    (name,) = tainted(inventory, state)
    assert inventory.by_name(name) == target


def test_the_mps_share_device_of_a_gpu_takes_its_taint_and_stays_shareable() -> None:
    inventory = static_mig_inventory()
    gpu7 = inventory.gpus[7]
    state = HealthState().with_mps_daemons([gpu7.uuid], {gpu7.uuid: "pod gone"}, NOW)
    assert tainted(inventory, state) == {
        "gpu-7": ["gpu.nvidia.com/mps-daemon=not-running:NoSchedule"]
    }
    pool = inventory.desired_pool(
        DRIVER,
        NODE,
        taints=device_taints(
            device_health(state, inventory.health_scopes()), HealthPolicy(), DRIVER
        ),
    )
    (device,) = [d for s in pool.slices for d in s.get("devices", []) if d["name"] == "gpu-7"]
    assert device["allowMultipleAllocations"] is True


def test_a_gpu_taint_reaches_every_dynamic_mig_partition_of_it() -> None:
    host = SimulatedHost.load("hgx-h100", NODE)
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    inventory = NodeInventory.from_discovery(found, simulated=True, dynamic_mig=True)
    gpu3 = inventory.gpus[3]
    state = HealthState().with_problem(Target(gpu3.uuid), xid(48))
    taints = tainted(inventory, state)
    assert len(taints) == 15  # the whole GPU and its 14 placements (the default policy)
    assert all(name.startswith("gpu-3") for name in taints)
    assert set(map(tuple, taints.values())) == {("gpu.nvidia.com/xid=48:NoSchedule",)}
    pool = inventory.desired_pool(DRIVER, NODE, slices.SliceLayout.SPLIT)
    assert all("taints" not in d for s in pool.slices for d in s.get("devices", []))


def test_a_dead_shared_daemon_of_a_mig_device_taints_that_mig_device_only() -> None:
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    found = discover_devices(host.nvml, host.pci)
    inventory = NodeInventory.from_discovery(
        found, simulated=True, mps_shares_on_mig=MigShareSelection.parse("3g.40gb")
    )
    mig, other, _ = inventory.mig_mps_shares
    migs = {m.uuid: Target(m.parent.uuid, (m.gi_id, m.ci_id)) for m in (mig, other)}

    state = HealthState().with_mps_daemons([], {mig.uuid: "pod gone"}, NOW, migs)

    (name,) = tainted(inventory, state)
    assert inventory.by_name(name) == mig
    assert tainted(inventory, state)[name] == ["gpu.nvidia.com/mps-daemon=not-running:NoSchedule"]
    # Running again: the taint goes, other problems of the MIG device stay.
    target = migs[mig.uuid]
    with_xid = state.with_problem(target, xid(94))
    healed = with_xid.with_mps_daemons([], {}, NOW, migs)
    assert set(healed.of(target)) == {KEY_XID}
    assert HealthState().with_mps_daemons([], {}, NOW, migs).problems == {}
    assert state.with_mps_daemons([], {}, NOW, migs).problems == {}
