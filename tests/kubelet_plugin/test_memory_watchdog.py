"""The MPS memory watchdog: shares the driver does not cap, checked from the simulated NVML's
per-process memory, processes mapped to pods through cgroup files; each policy (report, kill,
evict), only unenforced shares, only the publishing instance acts, errors reported with their
cause (never as under the cap), bounded NVML cost, and detection latency."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.driver.model import MigDevice
from gpu_dra.driver.nvml.simulated import SimulatedHost, SimulatedNvml
from gpu_dra.driver.nvml.simulated_utilization import DeviceActivity, SimulatedProcess
from gpu_dra.kube import errors
from gpu_dra.kube.events import InvolvedObject
from gpu_dra.kubelet_plugin.memory_limits import MemoryLimitSupport
from gpu_dra.kubelet_plugin.mps.memory_watchdog import (
    REASON_EVICTED,
    REASON_EXCEEDED,
    REASON_KILLED,
    REASON_UNCHECKED,
    MemoryWatchdog,
    Policy,
    WatchdogMetrics,
    check,
    start_memory_watchdog,
    start_time,
    watched,
)
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice, PodRef, claim_devices
from gpu_dra.kubelet_plugin.utilization.sampler import (
    DeviceReading,
    ProcessReading,
    Sample,
    UtilizationSampler,
)
from gpu_dra.kubelet_plugin.utilization.simulated_file import (
    SIMULATED_UTILIZATION_FILE,
    write_utilization,
)
from tests.kubelet_plugin.nodes import (
    NODE,
    UID_A,
    UID_B,
    MigSharesNode,
    SharesNode,
    ok,
    shares_inventory,
)

GIB = 2**30
POD_A = "1a2b3c4d-0000-4000-8000-00000000000a"
POD_A2 = "1a2b3c4d-0000-4000-8000-0000000000a2"
POD_B = "1a2b3c4d-0000-4000-8000-00000000000b"
POD_OTHER = "1a2b3c4d-0000-4000-8000-00000000000f"
CLAIM_A = ClaimRef("team-a", UID_A, "a")
CLAIM_B = ClaimRef("team-b", UID_B, "b")


class Events:
    """`EventPoster` that records (target kind/name, reason, message)."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []
        self.first = threading.Event()

    def post(
        self, targets: Sequence[InvolvedObject], reason: str, message: str, *, warning: bool
    ) -> None:
        assert warning
        for target in targets:
            self.posted.append((f"{target.kind}/{target.name}", reason, message))
        self.first.set()

    def reasons(self) -> list[tuple[str, str]]:
        return [(target, reason) for target, reason, _ in self.posted]


class Evictions:
    def __init__(self, fail: errors.ApiError | None = None) -> None:
        self.evicted: list[tuple[str, str, str]] = []
        self.fail = fail

    def evict_pod(self, namespace: str, name: str, *, uid: str) -> None:
        if self.fail is not None:
            raise self.fail
        self.evicted.append((namespace, name, uid))


class CountingNvml(SimulatedNvml):
    """The simulated NVML, counting the calls the watchdog makes."""

    calls: dict[str, int]

    def __getattribute__(self, name: str) -> Any:
        found = super().__getattribute__(name)
        if name.startswith("device_get_") or name == "init":
            counts = super().__getattribute__("__dict__").setdefault("calls", {})
            counts[name] = counts.get(name, 0) + 1
        return found


def fake_process(proc: Path, pid: int, pod_uid: str | None, started: int = 100) -> None:
    (proc / str(pid)).mkdir(parents=True)
    cgroup = f"0::/kubepods/burstable/pod{pod_uid}/c1\n" if pod_uid else "0::/system.slice/x\n"
    (proc / str(pid) / "cgroup").write_text(cgroup)
    # field 2 has a space and a parenthesis in it, as a process name can
    stat = f"{pid} (python3 (x) y) S 1 " + " ".join(["0"] * 17) + f" {started} 0 0\n"
    (proc / str(pid) / "stat").write_text(stat)


def share(
    claim: ClaimRef,
    uuid: str,
    pods: tuple[PodRef, ...],
    memory: int,
    enforcement: str | None = "mps-client",
) -> ClaimDevice:
    return ClaimDevice(claim, "gpu-0", "mps-share", uuid, pods, memory, 25, enforcement)


class Watch:
    """A watchdog over a simulated hgx-h100 and a fake /proc."""

    def __init__(
        self,
        tmp_path: Path,
        devices: list[ClaimDevice],
        policy: Policy = Policy.REPORT,
        *,
        turn: bool = True,
        is_turn: Callable[[], bool] | None = None,
        evictions: Evictions | None = None,
    ) -> None:
        host = SimulatedHost.load("hgx-h100", NODE)
        self.nvml = CountingNvml(host.nvml.profile)
        self.uuid = self.nvml.profile.gpus[0].uuid
        self.proc = tmp_path / "proc"
        self.proc.mkdir(parents=True)
        self.devices = devices
        self.events = Events()
        self.evictions = evictions or Evictions()
        self.killed: list[tuple[int, int]] = []
        self.registry = CollectorRegistry()
        self.turn = turn
        self.watchdog = MemoryWatchdog(
            UtilizationSampler(self.nvml, proc_root=self.proc, process_utilization=False),
            lambda: self.devices,
            policy=policy,
            interval_s=1.0,
            is_turn=is_turn or (lambda: self.turn),
            events=self.events,
            evictions=self.evictions,
            metrics=WatchdogMetrics(self.registry, NODE),
            proc_root=self.proc,
            kill=lambda pid, sig: self.killed.append((pid, sig)),
        )

    def run(self, *processes: SimulatedProcess) -> None:
        self.nvml.set_activity(self.uuid, DeviceActivity(processes=processes))
        self.watchdog.check_once()

    def metric(self, name: str, **labels: str) -> float:
        found = [
            s.value
            for m in self.registry.collect()
            for s in m.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        return sum(found)


def uuid0() -> str:
    return SimulatedHost.load("hgx-h100", NODE).nvml.profile.gpus[0].uuid


def test_report_posts_events_on_the_pods_and_the_claim_once_per_overrun(tmp_path: Path) -> None:
    pods = (PodRef(POD_A, "a-0"), PodRef(POD_A2, "a-1"))
    w = Watch(tmp_path, [share(CLAIM_A, uuid0(), pods, 4 * GIB)])
    fake_process(w.proc, 11, POD_A)
    fake_process(w.proc, 12, POD_A2)
    # each process under the share, together over it: MPS's per-process cap would not see it
    w.run(SimulatedProcess(11, 3 * GIB), SimulatedProcess(12, 2 * GIB))
    assert w.events.reasons() == [
        ("Pod/a-0", REASON_EXCEEDED),
        ("Pod/a-1", REASON_EXCEEDED),
        ("ResourceClaim/a", REASON_EXCEEDED),
    ]
    assert "5120 MiB" in w.events.posted[0][2]
    assert "4096 MiB" in w.events.posted[0][2]
    w.run(SimulatedProcess(11, 3 * GIB), SimulatedProcess(12, 2 * GIB))
    assert len(w.events.posted) == 3  # the same overrun: not posted again
    assert w.killed == []
    assert w.evictions.evicted == []
    w.run(SimulatedProcess(11, 3 * GIB))  # under again
    w.run(SimulatedProcess(11, 3 * GIB), SimulatedProcess(12, 2 * GIB))
    assert len(w.events.posted) == 6  # a new overrun
    assert w.metric("gpu_dra_mps_memory_watchdog_overruns_total", action="reported") == 2


def test_at_the_cap_is_not_over(tmp_path: Path) -> None:
    w = Watch(tmp_path, [share(CLAIM_A, uuid0(), (PodRef(POD_A, "a-0"),), 4 * GIB)])
    fake_process(w.proc, 11, POD_A)
    w.run(SimulatedProcess(11, 4 * GIB))
    assert w.events.posted == []


def test_only_shares_the_driver_does_not_cap_are_watched(tmp_path: Path) -> None:
    capped = share(CLAIM_A, uuid0(), (PodRef(POD_A, "a-0"),), GIB, enforcement="driver")
    w = Watch(tmp_path, [capped])
    fake_process(w.proc, 11, POD_A)
    w.run(SimulatedProcess(11, 8 * GIB))
    assert w.events.posted == []
    assert "init" not in getattr(w.nvml, "calls", {})  # nothing to watch: NVML not even used
    # a share recorded before enforcement was recorded counts as not capped
    assert watched([share(CLAIM_A, "GPU-x", (), GIB, enforcement=None), capped]) == [
        share(CLAIM_A, "GPU-x", (), GIB, enforcement=None)
    ]


def test_kill_kills_the_newest_process_of_the_claim_never_an_unmapped_one(
    tmp_path: Path,
) -> None:
    pods = (PodRef(POD_A, "a-0"),)
    w = Watch(tmp_path, [share(CLAIM_A, uuid0(), pods, 4 * GIB)], Policy.KILL)
    fake_process(w.proc, 11, POD_A, started=100)
    fake_process(w.proc, 12, POD_A, started=300)
    fake_process(w.proc, 13, POD_A, started=200)
    fake_process(w.proc, 50, None, started=900)  # newest of all, in no pod (an MPS server)
    fake_process(w.proc, 60, POD_OTHER, started=800)  # a pod holding no watched claim
    others = (SimulatedProcess(50, 9 * GIB), SimulatedProcess(60, 9 * GIB))
    mine = (SimulatedProcess(11, 2 * GIB), SimulatedProcess(12, 2 * GIB))
    w.run(*mine, SimulatedProcess(13, 2 * GIB), *others)
    assert w.killed == [(12, signal.SIGKILL)]
    assert [r for _, r in w.events.reasons()] == [REASON_EXCEEDED] * 2 + [REASON_KILLED] * 2
    # 12 is still listed (its context not torn down yet): not a second kill
    w.run(*mine, SimulatedProcess(13, 2 * GIB), *others)
    assert w.killed == [(12, signal.SIGKILL)]
    # 12 gone, still over: the next newest goes
    w.run(SimulatedProcess(11, 2 * GIB), SimulatedProcess(13, 3 * GIB), *others)
    assert w.killed == [(12, signal.SIGKILL), (13, signal.SIGKILL)]
    assert w.metric("gpu_dra_mps_memory_watchdog_unmapped_processes", gpu=w.uuid) == 2
    assert w.metric("gpu_dra_mps_memory_watchdog_actions_total", action="kill") == 2


def test_kill_without_a_start_time_kills_nothing_and_says_why(tmp_path: Path) -> None:
    w = Watch(tmp_path, [share(CLAIM_A, uuid0(), (PodRef(POD_A, "a-0"),), GIB)], Policy.KILL)
    fake_process(w.proc, 11, POD_A)
    (w.proc / "11" / "stat").unlink()
    w.run(SimulatedProcess(11, 2 * GIB))
    assert w.killed == []
    assert "start time of process 11" in w.events.posted[-1][2]
    assert w.metric("gpu_dra_mps_memory_watchdog_actions_total", result="failed") == 1


def test_evict_evicts_the_claims_pods_that_use_the_gpu(tmp_path: Path) -> None:
    pods = (PodRef(POD_A, "a-0"), PodRef(POD_A2, "a-1"))
    w = Watch(tmp_path, [share(CLAIM_A, uuid0(), pods, 4 * GIB)], Policy.EVICT)
    fake_process(w.proc, 11, POD_A)
    w.run(SimulatedProcess(11, 5 * GIB))
    assert w.evictions.evicted == [("team-a", "a-0", POD_A)]  # a-1 runs nothing on the GPU
    assert (("Pod/a-0", REASON_EVICTED)) in w.events.reasons()
    w.run(SimulatedProcess(11, 5 * GIB))  # the pod terminates: not evicted twice
    assert len(w.evictions.evicted) == 1


def test_a_refused_eviction_is_reported_with_its_cause(tmp_path: Path) -> None:
    refused = errors.ApiError("evict Pod team-a/a-0: 429 TooManyRequests: budget", status=429)
    w = Watch(
        tmp_path,
        [share(CLAIM_A, uuid0(), (PodRef(POD_A, "a-0"),), GIB)],
        Policy.EVICT,
        evictions=Evictions(fail=refused),
    )
    fake_process(w.proc, 11, POD_A)
    w.run(SimulatedProcess(11, 2 * GIB))
    target, reason, message = w.events.posted[-1]
    assert (target, reason) == ("ResourceClaim/a", REASON_EXCEEDED)
    assert "429 TooManyRequests" in message
    assert w.metric("gpu_dra_mps_memory_watchdog_actions_total", result="failed") == 1
    posted = len(w.events.posted)
    w.run(SimulatedProcess(11, 2 * GIB))  # tried again, failed again for the same cause
    assert w.metric("gpu_dra_mps_memory_watchdog_actions_total", result="failed") == 2
    assert len(w.events.posted) == posted  # not posted every second
    w.evictions.fail = None
    w.run(SimulatedProcess(11, 2 * GIB))
    assert w.evictions.evicted == [("team-a", "a-0", POD_A)]


@pytest.mark.parametrize("policy", [Policy.REPORT, Policy.KILL, Policy.EVICT])
def test_an_instance_that_does_not_publish_only_logs_and_counts(
    tmp_path: Path, policy: Policy
) -> None:
    w = Watch(tmp_path, [share(CLAIM_A, uuid0(), (PodRef(POD_A, "a-0"),), GIB)], policy, turn=False)
    fake_process(w.proc, 11, POD_A)
    w.run(SimulatedProcess(11, 2 * GIB))
    assert (w.events.posted, w.killed, w.evictions.evicted) == ([], [], [])
    assert w.metric("gpu_dra_mps_memory_watchdog_overruns_total", action="observed") == 1
    w.turn = True  # it publishes now (the other instance went): it acts
    w.run(SimulatedProcess(11, 2 * GIB))
    assert w.events.posted
    assert bool(w.killed) == (policy is Policy.KILL)
    assert bool(w.evictions.evicted) == (policy is Policy.EVICT)


def test_of_two_plugin_instances_only_the_publishing_one_acts(tmp_path: Path) -> None:
    """Two watchdogs on one node, turns from the real instance registry (the newest ready
    instance publishes): the old one acts until the new one is ready, then only the new one."""
    registry = InstanceRegistry(tmp_path / "data")
    old_instance = registry.register("4f1c2b9e-0000-4000-8000-0000000000a1")
    old_instance.mark_ready()
    new_instance = registry.register("4f1c2b9e-0000-4000-8000-0000000000b2")
    devices = [share(CLAIM_A, uuid0(), (PodRef(POD_A, "a-0"),), GIB)]
    old = Watch(tmp_path / "old", devices, Policy.KILL, is_turn=old_instance.newest_ready)
    new = Watch(tmp_path / "new", devices, Policy.KILL, is_turn=new_instance.newest_ready)
    for w in (old, new):
        fake_process(w.proc, 11, POD_A)
        fake_process(w.proc, 12, POD_A)
    for w in (old, new):
        w.run(SimulatedProcess(11, 2 * GIB))
    assert (len(old.killed), len(new.killed)) == (1, 0)  # the new one is still recovering
    assert new.events.posted == []
    new_instance.mark_ready()
    for w in (old, new):
        w.run(SimulatedProcess(12, 2 * GIB))  # 11 went; a new process over the share
    assert old.killed == [(11, signal.SIGKILL)]
    assert new.killed == [(12, signal.SIGKILL)]
    assert new.metric("gpu_dra_mps_memory_watchdog_overruns_total", action="observed") == 1
    assert old.metric("gpu_dra_mps_memory_watchdog_overruns_total", action="observed") == 1
    new_instance.close()
    old_instance.close()


def test_an_nvml_error_is_reported_with_its_cause_never_as_under_the_cap(tmp_path: Path) -> None:
    w = Watch(tmp_path, [share(CLAIM_A, uuid0(), (PodRef(POD_A, "a-0"),), GIB)], Policy.KILL)
    fake_process(w.proc, 11, POD_A)
    w.nvml.set_fault("device_get_compute_running_processes", pynvml.NVML_ERROR_UNKNOWN, gpu=0)
    w.run(SimulatedProcess(11, 2 * GIB))
    ((target, reason, message),) = w.events.posted
    assert (target, reason) == ("ResourceClaim/a", REASON_UNCHECKED)
    assert "device_get_compute_running_processes: NVML_ERROR_UNKNOWN" in message
    assert w.killed == []
    w.run(SimulatedProcess(11, 2 * GIB))
    assert len(w.events.posted) == 1  # the same cause: not posted again
    assert w.metric("gpu_dra_mps_memory_watchdog_unchecked_total", gpu=w.uuid) == 2


def test_pods_not_known_and_memory_not_reported_are_unchecked() -> None:
    uuid = "GPU-0"
    unknown_pods = share(CLAIM_A, uuid, (), GIB)
    no_memory = share(CLAIM_B, uuid, (PodRef(POD_B, "b-0"),), GIB)
    reading = DeviceReading(
        uuid,
        processes=(
            ProcessReading(21, POD_B, None, None),
            ProcessReading(22, POD_B, 5 * GIB, None),
        ),
    )
    found = check(Sample(0.0, 0.0, (unknown_pods, no_memory), {uuid: reading}))
    assert found.overruns == ()
    assert [(u.device.claim.name, u.cause) for u in found.unchecked] == [
        ("a", "the claim's pods are not known (claim cache not serving)"),
        ("b", "NVML reports no memory use of process(es) [21]"),
    ]


def test_claim_devices_carry_each_shares_enforcement(tmp_path: Path, mps_root: Path) -> None:
    node = SharesNode(tmp_path / "node", mps_root)
    claim = node.add_share(UID_A, "10Gi", "25", name="a", namespace="team-a")
    ok(node.prepare(claim)[UID_A])
    pods = (PodRef(POD_A, "a-0"),)
    devices = claim_devices(node.checkpoint.all(), node.inventory, lambda ns, name: pods)
    ((device,),) = [watched(devices)]
    assert (device.tier, device.share_memory_enforcement) == ("mps-share", "mps-client")
    assert (device.share_memory_bytes, device.pods) == (10 * GIB, pods)
    assert node.unprepare(claim) == {UID_A: None}


def test_cost_is_one_process_list_per_watched_gpu(tmp_path: Path) -> None:
    pods_a, pods_b = (PodRef(POD_A, "a-0"),), (PodRef(POD_B, "b-0"),)
    uuid = uuid0()
    w = Watch(tmp_path, [share(CLAIM_A, uuid, pods_a, GIB), share(CLAIM_B, uuid, pods_b, GIB)])
    for pid in range(100, 164):  # 64 processes of two claims on one GPU
        fake_process(w.proc, pid, POD_A if pid % 2 else POD_B)
    processes = [SimulatedProcess(pid, GIB // 64) for pid in range(100, 164)]
    w.nvml.calls = {}
    started = time.perf_counter()
    for _ in range(10):
        w.run(*processes)
    per_check = (time.perf_counter() - started) / 10
    assert w.nvml.calls.get("device_get_compute_running_processes") == 10
    assert "device_get_process_utilization" not in w.nvml.calls
    assert "device_get_utilization_rates" in w.nvml.calls  # the sampler's one rates call
    assert w.events.posted == []
    print(f"MPS memory watchdog check of 64 processes: {per_check * 1000:.1f} ms")
    assert per_check < 0.25, per_check


def test_start_time_reads_field_22(tmp_path: Path) -> None:
    fake_process(tmp_path, 7, POD_A, started=123456)
    assert start_time(7, tmp_path) == 123456


def settings(tmp_path: Path, *flags: str) -> KubeletPluginSettings:
    argv = ["--node-name", NODE, "--simulate=hgx-h100", f"--data-dir={tmp_path / 'data'}"]
    return KubeletPluginSettings.parse([*argv, *flags], env={})


def test_flags(tmp_path: Path) -> None:
    default = settings(tmp_path)
    assert (default.mps_memory_watchdog, default.mps_memory_watchdog_interval_s) == ("kill", 1)
    chosen = settings(tmp_path, "--mps-memory-watchdog=Evict", "--mps-memory-watchdog-interval=.5")
    assert (chosen.mps_memory_watchdog, chosen.mps_memory_watchdog_interval_s) == ("evict", 0.5)
    for bad in ("--mps-memory-watchdog=shoot", "--mps-memory-watchdog-interval=0"):
        with pytest.raises(SystemExit):
            settings(tmp_path, bad)


def test_not_started_when_off_or_every_share_is_capped_by_the_driver(tmp_path: Path) -> None:
    inventory = shares_inventory()
    nvml = SimulatedHost.load("hgx-h100", NODE).nvml
    every = frozenset(gpu.uuid for gpu in inventory.mps_shares)

    def start(flags: tuple[str, ...], support: MemoryLimitSupport) -> MemoryWatchdog | None:
        return start_memory_watchdog(
            settings(tmp_path, *flags), nvml, inventory, support, entries=dict,
            claims=lambda ns, name: None, registry=CollectorRegistry(), is_turn=lambda: True,
            events=None, evictions=None,
        )  # fmt: skip

    assert start(("--mps-memory-watchdog=off",), MemoryLimitSupport()) is None
    assert start((), MemoryLimitSupport(enforced=every)) is None
    started = start((), MemoryLimitSupport())
    assert started is not None
    started.close()


def test_detection_latency_with_the_simulated_utilization_file(
    tmp_path: Path, mps_root: Path
) -> None:
    """The plugin's wiring at the default 1 s interval: from the file write that takes a
    share's processes over its memory to the Event, at most 2 s (docs/shares.md); ``report``,
    since the fake process's PID is not this test's to kill."""
    node = SharesNode(tmp_path / "node", mps_root)
    claim = node.add_share(UID_A, "4Gi", "25", name="a", namespace="team-a")
    ok(node.prepare(claim)[UID_A])
    proc = tmp_path / "proc"
    fake_process(proc, 11, POD_A)
    reserved = {"status": {"reservedFor": [{"resource": "pods", "name": "a-0", "uid": POD_A}]}}
    nvml = SimulatedHost.load("hgx-h100", NODE).nvml
    events = Events()
    watchdog = start_memory_watchdog(
        settings(tmp_path, "--mps-memory-watchdog=report"), nvml, node.inventory,
        MemoryLimitSupport(), entries=node.checkpoint.all, claims=lambda ns, name: reserved,
        registry=CollectorRegistry(), is_turn=lambda: True, events=events, evictions=None,
        proc_root=proc,
    )  # fmt: skip
    assert watchdog is not None
    try:
        time.sleep(1.5)  # a few quiet checks first: the write lands at any point of a period
        assert events.posted == []
        written = time.monotonic()
        write_utilization(
            tmp_path / "data" / SIMULATED_UTILIZATION_FILE,
            {"gpu-0": {"processes": [{"pid": 11, "usedMemoryBytes": 5 * GIB}]}},
        )
        assert events.first.wait(5)
        latency = time.monotonic() - written
    finally:
        watchdog.close()
    print(f"MPS memory watchdog detection latency: {latency:.3f} s (interval 1 s)")
    assert [r for _, r in events.reasons()] == [REASON_EXCEEDED] * 2
    assert latency <= 2.0
    assert node.unprepare(claim) == {UID_A: None}


def test_mps_shares_of_a_mig_device_are_watched_on_the_mig_device(
    tmp_path: Path, mps_root: Path
) -> None:
    """MIG shares are never capped by the driver (``without_mig``): with no GPU offered the
    watchdog still starts for them, reads the MIG device's own processes and reports a claim
    over its share of the slice."""
    node = MigSharesNode(tmp_path / "node", mps_root)
    slice_name = "gpu-0-mig-1g10gb-19-0"
    mig = node.inventory.by_name(slice_name)
    assert isinstance(mig, MigDevice)
    assert node.inventory.mps_shares == ()
    claim = node.add_share(UID_A, "2Gi", "25", device=slice_name, name="a", namespace="team-a")
    ok(node.prepare(claim)[UID_A])
    proc = tmp_path / "proc"
    fake_process(proc, 11, POD_A)
    reserved = {"status": {"reservedFor": [{"resource": "pods", "name": "a-0", "uid": POD_A}]}}
    nvml = SimulatedHost.load("hgx-h100-mig", NODE).nvml
    migs = [device.uuid for device in node.inventory.mig_mps_shares]
    every_gpu = frozenset(gpu.uuid for gpu in node.inventory.gpus)
    support = MemoryLimitSupport(enforced=every_gpu).without_mig(migs)
    events = Events()
    watchdog = start_memory_watchdog(
        settings(tmp_path, "--mps-memory-watchdog=report", "--mps-memory-watchdog-interval=0.2"),
        nvml, node.inventory, support,
        entries=node.checkpoint.all, claims=lambda ns, name: reserved,
        registry=CollectorRegistry(), is_turn=lambda: True, events=events, evictions=None,
        proc_root=proc,
    )  # fmt: skip
    assert watchdog is not None
    try:
        write_utilization(
            tmp_path / "data" / SIMULATED_UTILIZATION_FILE,
            {mig.uuid: {"processes": [{"pid": 11, "usedMemoryBytes": 3 * GIB}]}},
        )
        assert events.first.wait(5)
    finally:
        watchdog.close()
    assert [r for _, r in events.reasons()] == [REASON_EXCEEDED] * 2
    assert node.unprepare(claim) == {UID_A: None}


def test_a_watchdog_reading_another_proc_never_signals_this_hosts_processes(
    tmp_path: Path, mps_root: Path
) -> None:
    """Unit tests give the watchdog a fake /proc: its PIDs are not this host's, so ``kill``
    (the default policy) must not reach them."""
    nvml = SimulatedHost.load("hgx-h100", NODE).nvml
    watchdog = start_memory_watchdog(
        settings(tmp_path), nvml, SharesNode(tmp_path / "node", mps_root).inventory,
        MemoryLimitSupport(), entries=dict, claims=lambda ns, name: None,
        registry=CollectorRegistry(), is_turn=lambda: True, events=None, evictions=None,
        proc_root=tmp_path / "proc",
    )  # fmt: skip
    assert watchdog is not None
    try:
        with pytest.raises(PermissionError, match="another /proc"):
            watchdog._kill(os.getpid(), 0)
    finally:
        watchdog.close()
