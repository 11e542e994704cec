"""The health monitor's edges: MPS share daemon liveness (the supervisor's verdicts), the
simulated node's event inbox, the settings, and the runtime the plugin starts (inbox file ->
taints; a share daemon down while it is restarted -> a taint, cleared when it is back)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.health import DEFAULT_IGNORED_XIDS, TaintEffect
from gpu_dra.driver.nvml.interface import (
    EVENT_TYPE_SIMULATED_RECOVERY,
    NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
)
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.resourceapi import DeviceTaint
from gpu_dra.driver.shares import ShareSelection
from gpu_dra.kubelet_plugin.checkpoint import (
    Checkpoint,
    CheckpointEntry,
    CheckpointError,
    ClaimPhase,
)
from gpu_dra.kubelet_plugin.device_health.inbox import (
    SIMULATED_EVENTS_DIR,
    SimulatedEventInbox,
    write_event,
)
from gpu_dra.kubelet_plugin.device_health.runtime import health_runtime, health_services
from gpu_dra.kubelet_plugin.mps import (
    DaemonHandle,
    DaemonRepair,
    MpsSettings,
    claim_daemon_id,
    shared_daemon_id,
)
from gpu_dra.kubelet_plugin.mps.supervisor import DaemonSupervisor
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.tiers.state import handles_to_state

NODE = "node-a"
GPU0 = "GPU-00000000-0000-4000-8000-000000000000"
UID_A = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
UID_B = "5d2c9f71-3e8a-4b6d-8c1f-6a4e2b0d9c02"
XID = NVML_EVENT_TYPE_XID_CRITICAL_ERROR


# ---- MPS share daemon liveness ------------------------------------------------------------------
def handle(daemon_id: str, pid: int, devices: tuple[str, ...] = (GPU0,)) -> DaemonHandle:
    return DaemonHandle(
        daemon_id=daemon_id,
        devices=devices,
        root=Path("/data/mps") / daemon_id,
        pid=pid,
        pid_start_time=1,
        settings=MpsSettings(),
        runner="pod",
        shm_mounted=False,
    )


def entry(uid: str, handles: Sequence[DaemonHandle], phase: ClaimPhase) -> CheckpointEntry:
    return CheckpointEntry(
        ClaimRef("ns", uid, f"claim-{uid[:4]}"),
        phase,
        state={"mpsDaemons": handles_to_state(handles)},
    )


class Daemons:
    """Entries and verdicts the test sets: the `MpsControl` calls a read-only supervisor makes."""

    def __init__(self) -> None:
        self.entries: dict[str, CheckpointEntry] = {}
        self.dead_ids: set[str] = set()
        self.asked: list[str] = []

    def all(self) -> Mapping[str, CheckpointEntry]:
        return dict(self.entries)

    def dead(self, daemon: DaemonHandle) -> str | None:
        self.asked.append(daemon.daemon_id)
        if daemon.daemon_id in self.dead_ids:
            return f"pod of {daemon.daemon_id} (pid {daemon.pid}) is gone"
        return None

    def ensure(self, daemon: DaemonHandle, **_: object) -> DaemonRepair:
        raise AssertionError("a read-only supervisor repairs nothing")


def watching(daemons: Daemons) -> DaemonSupervisor:
    """A supervisor that only reads (supervision off, or another instance publishes)."""
    return DaemonSupervisor(
        daemons,  # type: ignore[arg-type]
        daemons.all,
        interval_s=10,
        repair=lambda: False,
    )


def test_a_share_daemon_dead_in_two_checks_in_a_row_is_reported() -> None:
    daemons = Daemons()
    shared = handle(shared_daemon_id(GPU0), 42)
    daemons.entries = {
        UID_A: entry(UID_A, [shared], ClaimPhase.PREPARE_COMPLETED),
        UID_B: entry(UID_B, [shared], ClaimPhase.PREPARE_COMPLETED),
    }
    liveness = watching(daemons)
    liveness.check()
    assert liveness.dead_shared_daemons() == {}
    daemons.dead_ids.add(shared.daemon_id)
    liveness.check()
    assert liveness.dead_shared_daemons() == {}  # once may be an unprepare under way
    liveness.check()
    reported = liveness.dead_shared_daemons()
    assert reported == {GPU0: f"{shared.daemon_id}: pod of {shared.daemon_id} (pid 42) is gone"}
    assert daemons.asked == [shared.daemon_id] * 3  # one probe per daemon and pass
    daemons.dead_ids.clear()
    liveness.check()
    assert liveness.dead_shared_daemons() == {}


def test_per_claim_daemons_and_unfinished_prepares_are_not_reported_to_health() -> None:
    daemons = Daemons()
    own = handle(claim_daemon_id(UID_A, [GPU0]), 7)
    starting = handle(shared_daemon_id(GPU0), 8)
    daemons.entries = {
        UID_A: entry(UID_A, [own], ClaimPhase.PREPARE_COMPLETED),
        UID_B: entry(UID_B, [starting], ClaimPhase.PREPARE_STARTED),
    }
    daemons.dead_ids = {own.daemon_id, starting.daemon_id}
    liveness = watching(daemons)
    for _ in range(3):
        liveness.check()
    assert liveness.dead_shared_daemons() == {}
    assert set(liveness.down()) == {own.daemon_id}  # supervised, but not a share device's
    assert starting.daemon_id not in daemons.asked  # a prepare under way owns its daemon


def test_a_different_verdict_is_a_new_death() -> None:
    daemons = Daemons()
    daemon_id = shared_daemon_id(GPU0)
    daemons.entries = {UID_A: entry(UID_A, [handle(daemon_id, 42)], ClaimPhase.PREPARE_COMPLETED)}
    daemons.dead_ids.add(daemon_id)
    liveness = watching(daemons)
    liveness.check()
    daemons.entries = {UID_A: entry(UID_A, [handle(daemon_id, 43)], ClaimPhase.PREPARE_COMPLETED)}
    liveness.check()
    assert liveness.dead_shared_daemons() == {}  # pid 43 was seen dead once only


def test_an_unreadable_checkpoint_is_an_error_not_all_alive(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path)
    checkpoint.load()
    (tmp_path / "gpu-dra-checkpoint.json").write_text("{not json")
    daemons = Daemons()
    liveness = DaemonSupervisor(
        daemons,  # type: ignore[arg-type]
        checkpoint.all,
        interval_s=10,
        repair=lambda: False,
    )
    with pytest.raises(CheckpointError):
        liveness.check()
    with pytest.raises(RuntimeError, match="cannot read the checkpoint"):
        liveness.dead_shared_daemons()


# ---- the simulated event inbox ----------------------------------------------------------------
def inbox_on(tmp_path: Path) -> tuple[SimulatedEventInbox, SimulatedHost, object]:
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    host.nvml.init()
    event_set = host.nvml.event_set_create()
    for index in range(8):
        host.nvml.device_register_events(
            host.nvml.device_get_handle_by_index(index),
            XID | NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR,
            event_set,
        )
    return SimulatedEventInbox(tmp_path / SIMULATED_EVENTS_DIR, host.nvml), host, event_set


def test_inbox_files_become_simulated_events_in_name_order(tmp_path: Path) -> None:
    inbox, host, event_set = inbox_on(tmp_path)
    nvml = host.nvml
    uuid = host.profile.gpus[2].uuid
    mig = nvml.device_get_mig_device_handle_by_index(nvml.device_get_handle_by_index(1), 0)
    gi, ci = nvml.device_get_gpu_instance_id(mig), nvml.device_get_compute_instance_id(mig)
    write_event(inbox.directory, "001", {"gpu": uuid, "event": "xid", "xid": 79})
    write_event(inbox.directory, "002", {"gpu": "3", "event": "double-bit-ecc"})
    write_event(
        inbox.directory,
        "003",
        {"gpu": 1, "event": "xid", "xid": 94, "gpuInstanceId": gi, "computeInstanceId": ci},
    )
    write_event(inbox.directory, "004", {"gpu": 4, "event": "recovered"})
    assert inbox.poll() == 4
    assert list(inbox.directory.iterdir()) == []
    seen = [nvml.event_set_wait(event_set, 100) for _ in range(4)]
    assert [(e.eventType, e.eventData) for e in seen] == [
        (XID, 79),
        (NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR, 0),
        (XID, 94),
        (EVENT_TYPE_SIMULATED_RECOVERY, 0),
    ]
    assert nvml.device_get_uuid(seen[0].device) == uuid
    assert (seen[2].gpuInstanceId, seen[2].computeInstanceId) == (gi, ci)


def test_an_inbox_lost_event_makes_the_gpu_lost(tmp_path: Path) -> None:
    inbox, host, _ = inbox_on(tmp_path)
    write_event(inbox.directory, "x", {"gpu": 6, "event": "lost"})
    assert inbox.poll() == 1
    with pytest.raises(Exception, match="GPU is lost"):
        host.nvml.device_get_handle_by_index(6)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"gpu": 0, "event": "melt"}, "'event' must be one of"),
        ({"gpu": 0, "event": "xid"}, "needs 'xid'"),
        ({"gpu": 0, "event": "xid", "xid": "79"}, "'xid' must be a whole number"),
        ({"gpu": 42, "event": "xid", "xid": 79}, "no simulated GPU"),
        ({"event": "xid", "xid": 79}, "'gpu' must be"),
        (
            {"gpu": 7, "event": "xid", "xid": 94, "gpuInstanceId": 1, "computeInstanceId": 0},
            "no MIG device",
        ),
    ],
)
def test_an_unusable_inbox_file_is_replaced_by_its_reason(
    tmp_path: Path, payload: dict[str, object], reason: str
) -> None:
    inbox, _, _ = inbox_on(tmp_path)
    write_event(inbox.directory, "bad", payload)
    assert inbox.poll() == 0
    assert reason in (inbox.directory / "bad.error").read_text()
    assert not (inbox.directory / "bad.json").exists()


def test_half_written_and_non_json_files_are_left_alone(tmp_path: Path) -> None:
    inbox, _, _ = inbox_on(tmp_path)
    inbox.directory.mkdir()
    (inbox.directory / ".tmp123.json").write_text("{")
    (inbox.directory / "notes.txt").write_text("hello")
    (inbox.directory / "broken.json").write_text("{")
    assert inbox.poll() == 0
    assert sorted(p.name for p in inbox.directory.iterdir()) == [
        ".tmp123.json",
        "broken.error",
        "notes.txt",
    ]
    assert (
        SimulatedEventInbox(tmp_path / "missing", SimulatedHost.load("t4", NODE).nvml).poll() == 0
    )


# ---- settings ---------------------------------------------------------------------------------
def parse(*flags: str, env: Mapping[str, str] | None = None) -> KubeletPluginSettings:
    return KubeletPluginSettings.parse(["--node-name=node-a", *flags], dict(env or {}))


def test_the_monitor_is_on_with_real_nvml_and_off_when_simulated_by_default() -> None:
    assert parse().health_monitor_enabled
    assert not parse("--simulate=t4").health_monitor_enabled
    assert parse("--simulate=t4", "--health-monitor").health_monitor_enabled
    assert not parse("--health-monitor=false").health_monitor_enabled
    assert parse(
        env={"GPU_DRA_SIMULATE": "t4", "GPU_DRA_HEALTH_MONITOR": "on"}
    ).health_monitor_enabled
    gate = parse("--simulate=t4", "--feature-gates=NVMLDeviceHealthCheck=true")
    assert gate.health_monitor_enabled
    assert not parse(
        "--simulate=t4", "--feature-gates=NVMLDeviceHealthCheck=false"
    ).health_monitor_enabled


def test_the_policy_takes_the_xid_lists_and_effects() -> None:
    assert parse().health_policy.ignored_xids == DEFAULT_IGNORED_XIDS
    settings = parse(
        "--health-ignored-xids=13",
        "--health-taint-effect-degraded=None",
        "--health-taint-effect-lost=noschedule",
        env={"ADDITIONAL_XIDS_TO_IGNORE": "48, 94"},
    )
    policy = settings.health_policy
    assert policy.ignored_xids == {13, 48, 94}
    assert policy.degraded_effect is TaintEffect.NONE
    assert policy.lost_effect is TaintEffect.NO_SCHEDULE
    ours = parse(env={"GPU_DRA_ADDITIONAL_XIDS_TO_IGNORE": "63", "ADDITIONAL_XIDS_TO_IGNORE": "48"})
    assert ours.additional_xids_to_ignore == {63}
    assert parse("--health-ignored-xids=").health_policy.ignored_xids == frozenset()


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--health-monitor=maybe", "--health-monitor must be true or false"),
        ("--health-ignored-xids=13,abc", "'abc' is not an XID"),
        ("--health-taint-effect-lost=Evict", "--health-taint-effect-lost must be one of"),
    ],
)
def test_bad_health_flags_are_usage_errors(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(flag)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


# ---- the runtime --------------------------------------------------------------------------------
def inventory_of(profile: str, shares: str = "none") -> tuple[SimulatedHost, NodeInventory]:
    host = SimulatedHost.load(profile, NODE)
    found = discover_devices(host.nvml, host.pci)
    return host, NodeInventory.from_discovery(
        found, simulated=True, mps_shares=ShareSelection.parse(shares)
    )


def test_no_runtime_when_the_monitor_is_off(tmp_path: Path) -> None:
    host, inventory = inventory_of("t4")
    settings = parse("--simulate=t4", f"--data-dir={tmp_path}")
    runtime = health_runtime(settings, host.nvml, inventory, supervisor=None, republish=print)
    assert runtime is None
    assert health_services(runtime) == ()


def test_an_inbox_file_reaches_the_republished_taints_and_recovery_clears_them(
    tmp_path: Path,
) -> None:
    host, inventory = inventory_of("hgx-h100-mig")
    settings = parse("--simulate=hgx-h100-mig", f"--data-dir={tmp_path}", "--health-monitor")
    published: list[Mapping[str, Sequence[DeviceTaint]]] = []
    runtime = health_runtime(
        settings,
        host.nvml,
        inventory,
        supervisor=None,
        republish=published.append,
    )
    assert runtime is not None
    assert health_services(runtime) == (runtime.service,)
    assert runtime.inbox is not None
    assert runtime.inbox.directory == tmp_path / SIMULATED_EVENTS_DIR

    async def until(condition: object, what: str) -> None:
        deadline = time.monotonic() + 5
        while not condition():  # type: ignore[operator]
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        runtime.start()
        await runtime.monitor.started()
        uuid = host.profile.gpus[7].uuid
        write_event(runtime.inbox.directory, "1", {"gpu": uuid, "event": "xid", "xid": 79})  # type: ignore[union-attr]
        await until(lambda: published and "gpu-7" in published[-1], "gpu-7 tainted")
        assert [t["key"] for t in published[-1]["gpu-7"]] == ["gpu.nvidia.com/xid"]
        write_event(runtime.inbox.directory, "2", {"gpu": uuid, "event": "recovered"})  # type: ignore[union-attr]
        await until(lambda: published[-1] == {}, "gpu-7 untainted")
        await runtime.close()
        assert not host.nvml.initialized

    asyncio.run(scenario())
    assert json.dumps([dict(p) for p in published])  # plain JSON values, ready for the API


class RestartingDaemons(Daemons):
    """A repairing supervisor's `MpsControl`: each daemon in `dead_ids` is found dead and
    restarted, the restart held until `restarted` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.restarted = threading.Event()

    def ensure(
        self, daemon: DaemonHandle, *, on_dead: Callable[[DaemonHandle, str], None] | None = None
    ) -> DaemonRepair:
        if daemon.daemon_id not in self.dead_ids:
            return DaemonRepair(daemon)
        why = f"pod of {daemon.daemon_id} is gone"
        if on_dead is not None:
            on_dead(daemon, why)
        assert self.restarted.wait(10)
        self.dead_ids.discard(daemon.daemon_id)
        return DaemonRepair(daemon, restarted=why)


def test_a_share_daemon_is_tainted_while_it_is_restarted_and_untainted_once_it_runs(
    tmp_path: Path,
) -> None:
    host, inventory = inventory_of("hgx-h100", "7")
    settings = parse("--simulate=hgx-h100", f"--data-dir={tmp_path}", "--health-monitor")
    [gpu] = inventory.mps_shares
    shared = handle(shared_daemon_id(gpu.uuid), 42, devices=(gpu.uuid,))
    daemons = RestartingDaemons()
    daemons.entries = {UID_A: entry(UID_A, [shared], ClaimPhase.PREPARE_COMPLETED)}
    supervisor = DaemonSupervisor(
        daemons,  # type: ignore[arg-type]
        daemons.all,
        interval_s=10,
        repair=lambda: True,
    )
    published: list[Mapping[str, Sequence[DeviceTaint]]] = []
    runtime = health_runtime(
        settings, host.nvml, inventory, supervisor=supervisor, republish=published.append
    )
    assert runtime is not None
    [share_device] = [
        scope.name for scope in inventory.health_scopes() if scope.gpu_uuid == gpu.uuid
    ]

    async def until(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 5  # well below the monitor's 10 s MPS interval
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    def keys() -> list[str]:
        return [t["key"] for t in published[-1].get(share_device, ())] if published else []

    async def scenario() -> None:
        runtime.start()
        await runtime.monitor.started()
        supervisor.check()  # every daemon runs
        daemons.dead_ids.add(shared.daemon_id)
        passing = asyncio.create_task(asyncio.to_thread(supervisor.check))
        await until(lambda: keys() == ["gpu.nvidia.com/mps-daemon"], "tainted while down")
        daemons.restarted.set()
        [repair] = await passing
        assert repair.restarted == f"pod of {shared.daemon_id} is gone"
        await until(lambda: keys() == [], "untainted once restarted")
        await runtime.close()

    asyncio.run(scenario())


class NodeEvents:
    """Events the runtime records about the Node (cluster-scoped: no namespace of their own)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        self.events.append((namespace, event))


def test_a_gpu_nvml_cannot_watch_gets_a_warning_event_on_the_node(tmp_path: Path) -> None:
    host, inventory = inventory_of("hgx-h100")
    host.nvml.set_fault("device_register_events", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=5)
    settings = parse("--simulate=hgx-h100", f"--data-dir={tmp_path}", "--health-monitor",
                     "--node-name=gpu-node-1", "--event-namespace=gpu-dra")  # fmt: skip
    events = NodeEvents()
    runtime = health_runtime(settings, host.nvml, inventory, supervisor=None,
                             republish=print, events=events)  # fmt: skip
    assert runtime is not None
    gpu_5 = inventory.by_name("gpu-5")
    assert gpu_5 is not None

    async def scenario() -> None:
        runtime.start()
        deadline = time.monotonic() + 5
        while not events.events:
            assert time.monotonic() < deadline, "no Event"
            await asyncio.sleep(0.02)
        await runtime.close()

    asyncio.run(scenario())
    ((namespace, event),) = events.events
    assert namespace == "gpu-dra"
    assert event["involvedObject"] == {
        "apiVersion": "v1", "kind": "Node", "name": "gpu-node-1", "uid": ""
    }  # fmt: skip
    assert (event["type"], event["reason"]) == ("Warning", "GPUHealthNotMonitored")
    assert event["message"] == (
        f"gpu-dra kubelet plugin cannot watch GPU {gpu_5.uuid} for XIDs and ECC errors "
        "(nvmlDeviceRegisterEvents: NVML_ERROR_NOT_SUPPORTED): its health is Unknown and a "
        "fault would go unseen; its devices are not tainted (--health-taint-effect-unmonitored)"
    )
