"""The health record (issue 25, item 1): NVML's problems of the node's GPUs outlive the plugin,
atomically and versioned; only evidence clears them (a recovery, the operator's clear request);
an unreadable record is never read as healthy."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.health import (
    HEALTH_RECORD_VERSION,
    KEY_MPS_DAEMON,
    KEY_UNMONITORED,
    KEY_XID,
    HealthPolicy,
    HealthRecordError,
    HealthState,
    Problem,
    Target,
    classify_event,
    device_taints,
    gpu_lost,
    mps_daemon_dead,
    persisted_from_json,
    persisted_to_json,
    unmonitored,
)
from gpu_dra.driver.nvml.interface import NVML_EVENT_TYPE_XID_CRITICAL_ERROR
from gpu_dra.driver.nvml.simulated import SimulatedHost, SimulatedNvml
from gpu_dra.kubelet_plugin.device_health.monitor import HealthMonitor
from gpu_dra.kubelet_plugin.device_health.monitor_inputs import MonitorTiming
from gpu_dra.kubelet_plugin.device_health.record import (
    CLEAR_REQUEST_FILE,
    HEALTH_RECORD_FILE,
    HealthRecord,
    request_clear,
)
from gpu_dra.kubelet_plugin.health_command import clear_health
from gpu_dra.kubelet_plugin.node_devices import NodeInventory

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
XID = NVML_EVENT_TYPE_XID_CRITICAL_ERROR
FAST = MonitorTiming(wait_timeout_ms=50, mps_interval_s=0.05, backoff_initial_s=0.01,
                     clear_poll_s=0.05)  # fmt: skip
T0 = datetime(2026, 7, 22, 12, 0, tzinfo=UTC)
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_GONE = "GPU-0ff0ff0f-0000-0000-0000-000000000000"


def problem_xid(xid: int) -> Problem:
    found = classify_event(XID, xid, HealthPolicy(), T0)
    assert isinstance(found, Problem)
    return found


def entry(**changed: object) -> dict[str, object]:
    return {
        "gpuUUID": GPU_A, "key": "xid", "value": "48", "severity": "degraded",
        "message": "critical XID 48", "since": T0.isoformat(), **changed,
    }  # fmt: skip


# ---- the document (pure) -------------------------------------------------------------------------
def test_the_record_keeps_nvml_problems_and_leaves_out_liveness_verdicts() -> None:
    state = (
        HealthState()
        .with_problem(Target(GPU_A), gpu_lost("nvmlDeviceGetMemoryInfo answered", T0))
        .with_problem(Target(GPU_A, (1, 0)), problem_xid(48))
        .with_problem(Target(GPU_A), mps_daemon_dead("pid 7 is gone", T0))
        .with_problem(Target(GPU_GONE), unmonitored("nvmlDeviceRegisterEvents: NOT_SUPPORTED", T0))
    )

    document = persisted_to_json(state)
    read = persisted_from_json(json.loads(json.dumps(document)))

    assert document["version"] == HEALTH_RECORD_VERSION
    assert set(read.problems) == {Target(GPU_A), Target(GPU_A, (1, 0))}
    assert set(read.of(Target(GPU_A))) == {"gpu-lost"}
    assert read.of(Target(GPU_A, (1, 0)))[KEY_XID] == problem_xid(48)
    assert KEY_MPS_DAEMON not in read.of(Target(GPU_A))
    assert all(KEY_UNMONITORED not in p for p in read.problems.values())


@pytest.mark.parametrize(
    ("document", "says"),
    [
        ({"version": HEALTH_RECORD_VERSION + 1, "problems": []}, "is newer than this plugin's"),
        ({"problems": []}, "no version number"),
        ({"version": 1, "problems": {}}, "problems is not a list"),
        ({"version": 1, "problems": [{"gpuUUID": GPU_A}]}, "problems[0] is unusable"),
        ({"version": 1, "problems": [entry(key="mps-daemon")]}, "is not one that is recorded"),
        ({"version": 1, "problems": [entry(since="2026-07-22T12:00:00")]}, "has no time zone"),
        ([], "not a JSON object"),
    ],
)
def test_an_unusable_document_is_refused_naming_why(document: object, says: str) -> None:
    with pytest.raises(HealthRecordError, match=r".*" + says.replace("[", r"\[")):
        persisted_from_json(document)


# ---- the file ------------------------------------------------------------------------------------
def test_a_corrupt_record_stops_the_start_naming_the_file_and_the_way_out(tmp_path: Path) -> None:
    (tmp_path / HEALTH_RECORD_FILE).write_text('{"version": 1, "problems": [')

    with pytest.raises(HealthRecordError) as refused:
        HealthRecord(tmp_path).load()

    message = str(refused.value)
    assert str(tmp_path / HEALTH_RECORD_FILE) in message
    assert "remove it to start with every GPU healthy" in message


def test_a_missing_record_is_no_problem_and_a_dead_writers_temporary_is_removed(
    tmp_path: Path,
) -> None:
    (tmp_path / f".{HEALTH_RECORD_FILE}.abc123.tmp").write_text('{"half":')

    assert HealthRecord(tmp_path).load() == HealthState()
    assert list(tmp_path.iterdir()) == []


def test_a_clear_request_merges_with_one_still_waiting(tmp_path: Path) -> None:
    request_clear(tmp_path, [GPU_A])
    request = request_clear(tmp_path, [GPU_GONE])

    assert request.gpus == {GPU_A, GPU_GONE}
    assert HealthRecord(tmp_path).pending_clear() == request


def test_the_command_writes_the_request_for_the_running_plugin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert clear_health(["--all", "--data-dir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / CLEAR_REQUEST_FILE).read_text()) == {"gpus": ["*"]}
    assert "clear requested for *" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        clear_health(["--data-dir", str(tmp_path)])  # a GPU or --all is required


# ---- the monitor with a record -------------------------------------------------------------------
@dataclass
class Node:
    root: Path
    nvml: SimulatedNvml
    inventory: NodeInventory
    published: list[dict[str, list[object]]] = field(default_factory=list)

    def monitor(self) -> HealthMonitor:
        """A new monitor (a restarted plugin) over the node's record."""
        record = HealthRecord(self.root)
        monitor = HealthMonitor(
            self.nvml,
            self.inventory.gpus,
            self.inventory.health_scopes(),
            policy=HealthPolicy(),
            timing=FAST,
            clock=lambda: T0,
            record=record,
            recorded=record.load(),
        )
        monitor.add_listener(
            lambda s: self.published.append(dict(device_taints(s, HealthPolicy(), DRIVER)))
        )
        return monitor

    def record(self) -> list[dict[str, object]]:
        """The problems the record file holds."""
        loaded: list[dict[str, object]] = json.loads((self.root / HEALTH_RECORD_FILE).read_text())[
            "problems"
        ]
        return loaded

    def taints_of(self, device: str) -> list[object]:
        """The device's taints in the last snapshot the listener got."""
        return list(self.published[-1].get(device, [])) if self.published else []


@pytest.fixture
def node(tmp_path: Path) -> Node:
    host = SimulatedHost.load("hgx-h100", NODE)
    inventory = NodeInventory.from_discovery(discover_devices(host.nvml, host.pci), simulated=True)
    return Node(tmp_path, host.nvml, inventory)


async def run_until(
    monitor: HealthMonitor,
    condition: Callable[[], bool],
    what: str,
    then: Callable[[], None] = lambda: None,
) -> None:
    """Run the monitor; once it watches, ``then()``; return when ``condition()`` holds."""
    task = asyncio.create_task(monitor.run())
    try:
        await asyncio.wait_for(monitor.started(), 2)
        then()
        deadline = time.monotonic() + 3
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)
    finally:
        monitor.stop()
        await asyncio.wait_for(task, 2)


def test_a_gpu_tainted_for_xid_48_stays_tainted_after_a_restart_until_cleared(node: Node) -> None:
    first = node.monitor()
    asyncio.run(
        run_until(
            first,
            lambda: node.taints_of("gpu-3") != [],
            "the XID's taint",
            then=lambda: node.nvml.inject_event(3, XID, 48),
        )
    )
    assert [p["value"] for p in node.record()] == ["48"]

    node.published.clear()
    restarted = node.monitor()  # no event this time: only the record knows
    assert restarted.snapshot()["gpu-3"].status.value == "Unhealthy"
    asyncio.run(run_until(restarted, lambda: bool(node.published), "the first snapshot"))
    (taint,) = node.published[0]["gpu-3"]  # type: ignore[index]
    assert (taint["key"], taint["value"], taint["effect"]) == (  # type: ignore[index]
        f"{DRIVER}/xid",
        "48",
        "NoSchedule",
    )
    assert taint["timeAdded"] == "2026-07-22T12:00:00Z"  # type: ignore[index]

    gpu_3 = node.inventory.by_name("gpu-3")
    assert gpu_3 is not None
    request_clear(node.root, [gpu_3.uuid])
    node.published.clear()
    cleared = node.monitor()
    asyncio.run(run_until(cleared, lambda: not (node.root / CLEAR_REQUEST_FILE).exists(),
                          "the clear request applied"))  # fmt: skip
    assert cleared.snapshot()["gpu-3"].status.value == "Healthy"
    assert node.record() == []
    assert node.monitor().snapshot()["gpu-3"].status.value == "Healthy"  # and after a restart


def test_problems_of_a_gpu_no_longer_on_the_node_are_kept_in_the_record(node: Node) -> None:
    gone = HealthState().with_problem(Target(GPU_GONE), gpu_lost("answered GPU_IS_LOST", T0))
    HealthRecord(node.root).save(gone)
    monitor = node.monitor()

    asyncio.run(
        run_until(
            monitor,
            lambda: len(node.record()) == 2,
            "the new problem recorded",
            then=lambda: node.nvml.inject_event(1, XID, 95),
        )
    )

    gpu_1 = node.inventory.by_name("gpu-1")
    assert gpu_1 is not None
    assert {p["gpuUUID"] for p in node.record()} == {GPU_GONE, gpu_1.uuid}
    assert "gpu-lost" not in {k for h in monitor.snapshot().values() for k in
                              (p.key for p in h.problems)}  # fmt: skip
