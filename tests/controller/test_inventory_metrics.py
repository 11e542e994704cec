"""The controller's inventory gauges (`controller/metrics.py` `InventoryMetrics`, refreshed by
`controller/__main__.py`): values per node/type/state and per class, label sets that disappear are
dropped, a failed read keeps the last snapshot and counts an error; `--inventory-interval`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.controller.__main__ import inventory_loop, refresh_inventory, run
from gpu_dra.controller.metrics import CatalogMetrics, InventoryMetrics
from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.driver.cluster.availability import DEVICE_STATES
from gpu_dra.driver.cluster.usage import CLASS_STATES, Inventory, inventory
from gpu_dra.kube import errors
from tests.fakes.cluster_objects import (
    claim,
    gpu,
    mixed_node,
    resource_slice,
    standard_classes,
)
from tests.fakes.deviceclass_api import RecordingDeviceClassApi


def devices(registry: CollectorRegistry, node: str, kind: str, state: str) -> float | None:
    return registry.get_sample_value(
        "gpu_dra_devices", {"node": node, "type": kind, "state": state}
    )


def class_devices(registry: CollectorRegistry, name: str, state: str) -> float | None:
    return registry.get_sample_value(
        "gpu_dra_deviceclass_devices", {"deviceclass": name, "state": state}
    )


def errors_total(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value("gpu_dra_inventory_errors_total")


def two_nodes() -> Inventory:
    """node-a: 4 GPUs, the L4s held by two claims; node-b: a GPU and two MIG slices, one held."""
    node_b = resource_slice(
        "node-b",
        [gpu("gpu-0", "NVIDIA A100"), gpu("mig-0", kind="mig"), gpu("mig-1", kind="mig")],
    )
    claims = [
        claim("team-a", "one", allocated=[("gpu", "gpu-2")]),
        claim("team-b", "two", allocated=[("gpu", "gpu-3")]),
        claim("team-c", "slice", allocated=[("mig", "mig-1")], pool="node-b"),
    ]
    return inventory([mixed_node("node-a"), node_b], standard_classes(), claims)


def export(report: Inventory) -> tuple[InventoryMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = InventoryMetrics(registry)
    metrics.update(report.device_counts(), report.class_counts())
    return metrics, registry


def test_devices_per_node_type_and_state() -> None:
    _, registry = export(two_nodes())

    assert devices(registry, "node-a", "gpu", "free") == 2
    assert devices(registry, "node-a", "gpu", "allocated") == 2
    assert devices(registry, "node-a", "gpu", "shared") == 0
    assert devices(registry, "node-a", "gpu", "admin") == 0
    assert devices(registry, "node-a", "gpu", "blocked") == 0
    assert devices(registry, "node-b", "gpu", "free") == 1
    assert devices(registry, "node-b", "mig", "free") == 1
    assert devices(registry, "node-b", "mig", "allocated") == 1
    assert devices(registry, "node-a", "mig", "free") is None


def test_shared_and_admin_states_are_counted() -> None:
    node = resource_slice(
        "node-a", [gpu("gpu-0", allowMultipleAllocations=True), gpu("gpu-1"), gpu("gpu-2")]
    )
    admin = {"request": "r", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-1"}
    claims = [
        claim("ns", "sharer", allocated=[("gpu", "gpu-0")]),
        claim("ns", "admin", results=[{**admin, "adminAccess": True}]),
    ]
    _, registry = export(inventory([node], standard_classes(), claims))

    assert devices(registry, "node-a", "gpu", "shared") == 1
    assert devices(registry, "node-a", "gpu", "admin") == 1
    assert devices(registry, "node-a", "gpu", "free") == 1
    assert devices(registry, "node-a", "gpu", "allocated") == 0


def test_class_totals_and_free() -> None:
    _, registry = export(two_nodes())

    assert class_devices(registry, "gpu.nvidia.com", "total") == 5
    assert class_devices(registry, "gpu.nvidia.com", "free") == 3
    assert class_devices(registry, "mig.nvidia.com", "total") == 2
    assert class_devices(registry, "mig.nvidia.com", "free") == 1
    assert class_devices(registry, "mig.nvidia.com", "blocked") == 0


def test_label_sets_that_disappear_are_dropped() -> None:
    metrics, registry = export(two_nodes())
    assert devices(registry, "node-b", "mig", "allocated") == 1

    smaller = inventory([mixed_node("node-a")], standard_classes()[:1], [])
    metrics.update(smaller.device_counts(), smaller.class_counts())

    assert devices(registry, "node-a", "gpu", "free") == 4
    assert devices(registry, "node-a", "gpu", "allocated") == 0
    for state in DEVICE_STATES:
        assert devices(registry, "node-b", "mig", state) is None
        assert devices(registry, "node-b", "gpu", state) is None
    assert class_devices(registry, "gpu.nvidia.com", "total") == 4
    for state in CLASS_STATES:
        assert class_devices(registry, "mig.nvidia.com", state) is None


def test_a_failed_read_keeps_the_snapshot_and_counts_an_error() -> None:
    registry = CollectorRegistry()
    metrics = InventoryMetrics(registry)
    assert errors_total(registry) == 0

    assert asyncio.run(refresh_inventory(two_nodes, metrics)) is True
    assert devices(registry, "node-a", "gpu", "allocated") == 2

    def failing() -> Inventory:
        raise errors.ApiError("list resourceslices: timeout")

    def broken() -> Inventory:
        raise RuntimeError("bug")

    assert asyncio.run(refresh_inventory(failing, metrics)) is False
    assert asyncio.run(refresh_inventory(broken, metrics)) is False

    assert errors_total(registry) == 2
    assert devices(registry, "node-a", "gpu", "allocated") == 2
    assert class_devices(registry, "gpu.nvidia.com", "free") == 3


def test_the_loop_rereads_every_interval_until_stopped() -> None:
    registry = CollectorRegistry()
    metrics = InventoryMetrics(registry)
    reports = [two_nodes(), inventory([mixed_node("node-a")], standard_classes(), [])]
    reads: list[int] = []

    def read() -> Inventory:
        reads.append(1)
        return reports[min(len(reads), len(reports)) - 1]

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(inventory_loop(0.01, read, metrics, stop))
        for _ in range(200):
            if len(reads) >= 2:
                break
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(scenario())

    assert len(reads) >= 2
    assert devices(registry, "node-a", "gpu", "free") == 4
    assert devices(registry, "node-b", "mig", "free") is None


@pytest.mark.parametrize(
    ("interval", "once", "reads_expected"),
    [(0.01, False, True), (0, False, False), (0.01, True, False)],
)
def test_run_exports_the_inventory_unless_off_or_once(
    tmp_path: Path, interval: float, once: bool, reads_expected: bool
) -> None:
    settings = ControllerSettings(
        deviceclasses_dir=tmp_path,
        inventory_interval_s=interval,
        resync_interval_s=0.05,
        once=once,
    )
    reads: list[int] = []

    def read() -> Inventory:
        reads.append(1)
        return two_nodes()

    async def scenario() -> int:
        stop = asyncio.Event()
        task = asyncio.create_task(
            run(
                settings,
                RecordingDeviceClassApi(),
                CatalogMetrics(CollectorRegistry()),
                stop=stop,
                read_inventory=read,
                inventory_metrics=InventoryMetrics(CollectorRegistry()),
            )
        )
        await asyncio.sleep(0.1)
        stop.set()
        return await asyncio.wait_for(task, timeout=5)

    assert asyncio.run(scenario()) == 0
    assert bool(reads) is reads_expected


def test_inventory_interval_flag_env_and_default() -> None:
    assert ControllerSettings.from_env({}).inventory_interval_s == 30.0
    assert (
        ControllerSettings.from_env({"GPU_DRA_INVENTORY_INTERVAL": "0"}).inventory_interval_s == 0
    )
    flagged = ControllerSettings.from_args(
        ["--inventory-interval", "5"], {"GPU_DRA_INVENTORY_INTERVAL": "60"}
    )
    assert flagged.inventory_interval_s == 5.0
    with pytest.raises(SystemExit):
        ControllerSettings.from_args(["--inventory-interval", "-1"], {})
