"""Utilization per claim: claims prepared by the real preparer, NVML of a simulated hgx-h100,
processes mapped to pods through cgroup files, the Prometheus metrics that come out, errors
reported (never exported as 0), idle tracking, and the simulated utilization file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pynvml
import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.simulated import SimulatedHost, SimulatedNvml
from gpu_dra.driver.nvml.simulated_utilization import DeviceActivity, SimulatedProcess
from gpu_dra.kubelet_plugin.node_devices import NodeInventory, device_name
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.utilization.cgroups import pod_uid_from_cgroup, pod_uid_of
from gpu_dra.kubelet_plugin.utilization.claims import (
    ClaimDevice,
    PodRef,
    claim_devices,
    pods_from_claim,
)
from gpu_dra.kubelet_plugin.utilization.metrics import ClaimUtilizationCollector, SampleMetrics
from gpu_dra.kubelet_plugin.utilization.monitor import UtilizationMonitor
from gpu_dra.kubelet_plugin.utilization.runtime import start_utilization
from gpu_dra.kubelet_plugin.utilization.sampler import UtilizationSampler
from gpu_dra.kubelet_plugin.utilization.simulated_file import (
    SIMULATED_UTILIZATION_FILE,
    SimulatedUtilizationFile,
    write_utilization,
)
from tests.kubelet_plugin.nodes import (
    NODE,
    UID_A,
    UID_B,
    UID_C,
    Node,
    SharesNode,
    hgx_h100_inventory,
    ok,
)

GIB = 2**30
POD_A = "1a2b3c4d-0000-4000-8000-00000000000a"
POD_B = "1a2b3c4d-0000-4000-8000-00000000000b"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Sampling:
    """The plugin's utilization parts over `node`'s checkpoint and a simulated NVML."""

    def __init__(
        self,
        node: Node,
        proc_root: Path,
        pods: dict[str, tuple[PodRef, ...]],
        profile: str = "hgx-h100",
    ) -> None:
        self.nvml: SimulatedNvml = SimulatedHost.load(profile, NODE).nvml
        self.clock = Clock()
        self.registry = CollectorRegistry()

        def devices() -> list[ClaimDevice]:
            return claim_devices(
                node.checkpoint.all(), node.inventory, lambda ns, name: pods.get(name, ())
            )

        self.monitor = UtilizationMonitor(
            UtilizationSampler(self.nvml, proc_root=proc_root, clock=self.clock),
            devices,
            interval_s=10,
            idle_threshold_percent=5,
            on_sample=SampleMetrics(self.registry, NODE).observe,
        )
        self.registry.register(ClaimUtilizationCollector(NODE, devices, self.monitor))

    def values(self, name: str) -> dict[tuple[str, str], float]:
        """``{(claim, device): value}`` of one per-claim metric."""
        return {
            (s.labels["claim"], s.labels["device"]): s.value
            for m in self.registry.collect()
            for s in m.samples
            if s.name == name
        }

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [
            (s.labels, s.value)
            for m in self.registry.collect()
            for s in m.samples
            if s.name == name
        ]


def fake_process(proc: Path, pid: int, cgroup: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(cgroup)


def systemd_cgroup(pod_uid: str) -> str:
    slice_uid = pod_uid.replace("-", "_")
    return (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{slice_uid}.slice/"
        "cri-containerd-0123abcd.scope\n"
    )


@pytest.fixture
def gpus(tmp_path: Path) -> Node:
    return Node(tmp_path / "node", hgx_h100_inventory())


def test_whole_gpus_export_utilization_with_claim_labels(gpus: Node, tmp_path: Path) -> None:
    busy = gpus.add_gpus(UID_A, "train", "gpu-0")
    idle = gpus.add_gpus(UID_B, "notebook", "gpu-1")
    ok(gpus.prepare(busy)[UID_A])
    ok(gpus.prepare(idle)[UID_B])
    sampling = Sampling(gpus, tmp_path / "proc", {"train": (PodRef(POD_A, "trainer-0"),)})
    sampling.nvml.set_activity(
        gpus.uuid_of("gpu-0"),
        DeviceActivity(80, 35, processes=(SimulatedProcess(4242, 30 * GIB, 80),)),
    )
    sampling.nvml.set_activity(gpus.uuid_of("gpu-1"), DeviceActivity(memory_used_bytes=GIB))
    sampling.monitor.sample_once()

    held = sampling.samples("gpu_dra_claim_devices")
    assert sorted((labels["claim"], labels["tier"]) for labels, _ in held) == [
        ("notebook", "gpu"),
        ("train", "gpu"),
    ]
    assert all(labels["namespace"] == "default" and labels["node"] == NODE for labels, _ in held)
    assert all("pod" not in labels for labels, _ in held)  # one series per claim device
    # One series per pod a claim is reserved for, none for a claim whose pods are unknown.
    assert [labels for labels, _ in sampling.samples("gpu_dra_claim_pod_info")] == [
        {"node": NODE, "namespace": "default", "claim": "train", "pod": "trainer-0",
         "pod_uid": POD_A},
    ]  # fmt: skip
    assert sampling.values("gpu_dra_claim_gpu_utilization_percent") == {
        ("train", "gpu-0"): 80,
        ("notebook", "gpu-1"): 0,
    }
    assert sampling.values("gpu_dra_claim_memory_utilization_percent")[("train", "gpu-0")] == 35
    assert sampling.values("gpu_dra_claim_memory_used_bytes") == {
        ("train", "gpu-0"): 30 * GIB,
        ("notebook", "gpu-1"): GIB,
    }
    total = sampling.nvml.device_get_memory_info(sampling.nvml.device_get_handle_by_index(0)).total
    assert sampling.values("gpu_dra_claim_memory_limit_bytes")[("train", "gpu-0")] == total
    assert sampling.values("gpu_dra_claim_processes") == {
        ("train", "gpu-0"): 1,
        ("notebook", "gpu-1"): 0,
    }
    # idle tracking: the busy claim was active at 1000, then idle although its process still
    # holds its context and memory (an idle notebook); the idle one never active
    sampling.clock.now = 1600.0
    sampling.nvml.set_activity(
        gpus.uuid_of("gpu-0"),
        DeviceActivity(gpu_percent=4, processes=(SimulatedProcess(4242, 30 * GIB, 0),)),
    )
    sampling.monitor.sample_once()
    assert sampling.values("gpu_dra_claim_last_active_timestamp_seconds") == {
        ("train", "gpu-0"): 1000.0,
        ("notebook", "gpu-1"): 1000.0,
    }
    sampling.clock.now = 1700.0
    sampling.nvml.set_activity(gpus.uuid_of("gpu-1"), DeviceActivity(gpu_percent=5))
    sampling.monitor.sample_once()
    active = sampling.values("gpu_dra_claim_last_active_timestamp_seconds")
    assert active == {("train", "gpu-0"): 1000.0, ("notebook", "gpu-1"): 1700.0}
    # unprepared: its series go, with its activity
    assert gpus.unprepare(idle) == {UID_B: None}
    sampling.monitor.sample_once()
    assert list(sampling.values("gpu_dra_claim_last_active_timestamp_seconds")) == [
        ("train", "gpu-0")
    ]


def test_an_nvml_error_is_counted_and_its_values_left_out_not_zero(
    gpus: Node, tmp_path: Path
) -> None:
    for uid, name, device in ((UID_A, "a", "gpu-0"), (UID_B, "b", "gpu-1"), (UID_C, "c", "gpu-2")):
        ok(gpus.prepare(gpus.add_gpus(uid, name, device))[uid])
    sampling = Sampling(gpus, tmp_path / "proc", {})
    for device in ("gpu-0", "gpu-1", "gpu-2"):
        sampling.nvml.set_activity(gpus.uuid_of(device), DeviceActivity(gpu_percent=50))
    sampling.nvml.set_fault("device_get_utilization_rates", pynvml.NVML_ERROR_UNKNOWN, gpu=1)
    sampling.nvml.lose_gpu(2)
    sampling.monitor.sample_once()
    sampling.monitor.sample_once()

    assert sampling.values("gpu_dra_claim_gpu_utilization_percent") == {("a", "gpu-0"): 50}
    used = sampling.values("gpu_dra_claim_memory_used_bytes")
    assert set(used) == {("a", "gpu-0"), ("b", "gpu-1")}  # gpu-1's memory still read
    errors = {
        (labels["device"], labels["call"], labels["reason"]): value
        for labels, value in sampling.samples("gpu_dra_utilization_errors_total")
    }
    assert errors == {
        (gpus.uuid_of("gpu-1"), "device_get_utilization_rates", "NVML_ERROR_UNKNOWN"): 2,
        (gpus.uuid_of("gpu-2"), "device_get_handle_by_uuid", "NVML_ERROR_GPU_IS_LOST"): 2,
    }
    assert len(sampling.samples("gpu_dra_claim_devices")) == 3
    assert sampling.samples("gpu_dra_utilization_sample_duration_seconds_count")[0][1] == 2
    # b (rates failed, no process read) turns idle; c (nothing read) is unknown, not idle
    sampling.clock.now = 2000.0
    sampling.monitor.sample_once()
    assert sampling.values("gpu_dra_claim_last_active_timestamp_seconds") == {
        ("a", "gpu-0"): 2000.0,
        ("b", "gpu-1"): 1000.0,
        ("c", "gpu-2"): 2000.0,
    }


def test_a_claim_shared_by_two_pods_has_one_series_per_device_and_one_per_pod(
    gpus: Node, tmp_path: Path
) -> None:
    shared = gpus.add_gpus(UID_A, "shared", "gpu-0", "gpu-1")
    ok(gpus.prepare(shared)[UID_A])
    pods = (PodRef(POD_B, "worker-1"), PodRef(POD_A, "worker-0"))
    sampling = Sampling(gpus, tmp_path / "proc", {"shared": pods})
    sampling.monitor.sample_once()
    held = sampling.samples("gpu_dra_claim_devices")
    assert sorted(labels["device"] for labels, _ in held) == ["gpu-0", "gpu-1"]
    info = sampling.samples("gpu_dra_claim_pod_info")
    assert [(labels["pod"], labels["pod_uid"], value) for labels, value in info] == [
        ("worker-0", POD_A, 1),
        ("worker-1", POD_B, 1),
    ]


def test_mps_shares_get_their_pods_processes(tmp_path: Path, mps_root: Path) -> None:
    node = SharesNode(tmp_path / "node", mps_root)
    a = node.add_share(UID_A, "10Gi", "25", name="a", namespace="team-a")
    b = node.add_share(UID_B, "20Gi", "50", name="b", namespace="team-b")
    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])
    proc = tmp_path / "proc"
    fake_process(proc, 101, systemd_cgroup(POD_A))
    fake_process(proc, 102, f"12:memory:/kubepods/besteffort/pod{POD_A}/abc\n")
    fake_process(proc, 201, f"0::/kubepods/pod{POD_B}/def\n")
    fake_process(proc, 300, "0::/system.slice/nvidia-mps.service\n")  # the MPS server
    pods = {"a": (PodRef(POD_A, "a-0"),), "b": (PodRef(POD_B, "b-0"),)}
    sampling = Sampling(node, proc, pods)
    sampling.nvml.set_activity(
        node.uuid_of("gpu-0"),
        DeviceActivity(
            gpu_percent=45,
            processes=(
                SimulatedProcess(101, 3 * GIB, 15),
                SimulatedProcess(102, 2 * GIB, 10),
                SimulatedProcess(201, 1 * GIB, 2),
                SimulatedProcess(300, GIB // 2, 0),
                SimulatedProcess(999, GIB, 50),  # gone from /proc: in no pod
            ),
        ),
    )
    sampling.monitor.sample_once()

    assert sampling.values("gpu_dra_claim_gpu_utilization_percent") == {
        ("a", "gpu-0"): 25,
        ("b", "gpu-0"): 2,
    }
    assert sampling.values("gpu_dra_claim_memory_used_bytes") == {
        ("a", "gpu-0"): 5 * GIB,
        ("b", "gpu-0"): GIB,
    }
    assert sampling.values("gpu_dra_claim_memory_limit_bytes") == {
        ("a", "gpu-0"): 10 * GIB,
        ("b", "gpu-0"): 20 * GIB,
    }
    assert sampling.values("gpu_dra_claim_compute_limit_percent") == {
        ("a", "gpu-0"): 25,
        ("b", "gpu-0"): 50,
    }
    assert sampling.values("gpu_dra_claim_processes") == {("a", "gpu-0"): 2, ("b", "gpu-0"): 1}
    tiers = {labels["tier"] for labels, _ in sampling.samples("gpu_dra_claim_devices")}
    assert tiers == {"mps-share"}
    # b's 2 % is under the idle threshold: never active
    active = sampling.values("gpu_dra_claim_last_active_timestamp_seconds")
    assert active == {("a", "gpu-0"): 1000.0, ("b", "gpu-0"): 1000.0}
    sampling.clock.now = 2000.0
    sampling.monitor.sample_once()
    active = sampling.values("gpu_dra_claim_last_active_timestamp_seconds")
    assert active == {("a", "gpu-0"): 2000.0, ("b", "gpu-0"): 1000.0}
    assert node.unprepare(a, b) == {UID_A: None, UID_B: None}


def test_a_share_whose_pods_are_unknown_reports_no_usage(tmp_path: Path, mps_root: Path) -> None:
    node = SharesNode(tmp_path / "node", mps_root)
    claim = node.add_share(UID_A, "10Gi", "25", name="a")
    ok(node.prepare(claim)[UID_A])
    sampling = Sampling(node, tmp_path / "proc", {})
    sampling.monitor.sample_once()
    assert sampling.values("gpu_dra_claim_gpu_utilization_percent") == {}
    assert sampling.values("gpu_dra_claim_memory_used_bytes") == {}
    assert sampling.values("gpu_dra_claim_memory_limit_bytes") == {("a", "gpu-0"): 10 * GIB}
    assert node.unprepare(claim) == {UID_A: None}


def test_nvml_that_cannot_be_initialised_is_one_error_per_sample(
    gpus: Node, tmp_path: Path
) -> None:
    ok(gpus.prepare(gpus.add_gpus(UID_A, "a", "gpu-0"))[UID_A])
    sampling = Sampling(gpus, tmp_path / "proc", {})
    sampling.nvml.set_fault("init", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    sample = sampling.monitor.sample_once()
    assert [(e.call, e.reason) for e in sample.errors] == [("init", "NVML_ERROR_DRIVER_NOT_LOADED")]
    assert sampling.values("gpu_dra_claim_gpu_utilization_percent") == {}
    sampling.nvml.set_fault("init", None)  # the next sample tries again
    assert sampling.monitor.sample_once().errors == ()
    assert sampling.values("gpu_dra_claim_gpu_utilization_percent") == {("a", "gpu-0"): 0}


def mig_sampling(tmp_path: Path, profile: str) -> tuple[Node, Sampling, str, str]:
    host = SimulatedHost.load(profile, NODE)
    found = discover_devices(host.nvml, host.pci)
    node = Node(tmp_path / "node", NodeInventory.from_discovery(found, simulated=True))
    mig = found.mig_devices[0]
    name = device_name(mig)
    ok(node.prepare(node.add_gpus(UID_A, "slice", name))[UID_A])
    return node, Sampling(node, tmp_path / "proc", {}, profile=profile), mig.uuid, name


def test_mig_devices_report_memory_processes_and_gpm_sm_utilization(tmp_path: Path) -> None:
    node, sampling, uuid, name = mig_sampling(tmp_path, "hgx-h100-mig")
    busy = DeviceActivity(gpu_percent=99, processes=(SimulatedProcess(77, 2 * GIB),))
    sampling.nvml.set_activity(uuid, busy)
    sample = sampling.monitor.sample_once()

    assert sample.errors == ()  # what NVML does not offer on MIG is not asked
    # SM utilization comes from GPM between two samples: none in the first.
    assert sampling.values("gpu_dra_claim_gpu_utilization_percent") == {}
    assert sampling.values("gpu_dra_claim_memory_used_bytes") == {("slice", name): 2 * GIB}
    limit = sampling.values("gpu_dra_claim_memory_limit_bytes")[("slice", name)]
    assert limit == next(m for m in node.inventory.mig_devices if m.uuid == uuid).memory_bytes
    assert sampling.values("gpu_dra_claim_processes") == {("slice", name): 1}
    assert [labels["tier"] for labels, _ in sampling.samples("gpu_dra_claim_devices")] == ["mig"]
    sampling.clock.now = 1100.0
    sampling.monitor.sample_once()
    assert sampling.values("gpu_dra_claim_gpu_utilization_percent") == {("slice", name): 99}
    # The notebook stops computing but keeps its context and memory: idle from then on.
    sampling.nvml.set_activity(
        uuid, DeviceActivity(gpu_percent=0, processes=(SimulatedProcess(77, 2 * GIB),))
    )
    for now in (1500.0, 1900.0):
        sampling.clock.now = now
        sampling.monitor.sample_once()
    active = sampling.values("gpu_dra_claim_last_active_timestamp_seconds")
    assert active == {("slice", name): 1100.0}
    # Memory that grows is activity, without SM utilization too.
    sampling.nvml.set_activity(
        uuid, DeviceActivity(gpu_percent=0, processes=(SimulatedProcess(77, 3 * GIB),))
    )
    sampling.clock.now = 2000.0
    sampling.monitor.sample_once()
    assert sampling.values("gpu_dra_claim_last_active_timestamp_seconds") == {
        ("slice", name): 2000.0
    }


def test_without_gpm_a_mig_process_counts_as_active_and_no_process_as_idle(
    tmp_path: Path,
) -> None:
    """Pre-Hopper GPUs (here: the simulated H100s answering the GPM query NotSupported, as an
    A100 does) give no SM activity on MIG devices: a process that holds the slice might compute,
    so it is not called idle; an empty slice is."""
    _, sampling, uuid, name = mig_sampling(tmp_path, "hgx-h100-mig")
    for gpu in range(8):
        sampling.nvml.set_fault(
            "gpm_query_device_support", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=gpu
        )
    holding = DeviceActivity(gpu_percent=0, processes=(SimulatedProcess(77, 2 * GIB),))
    sampling.nvml.set_activity(uuid, holding)
    for now in (1000.0, 1500.0):
        sampling.clock.now = now
        sampling.monitor.sample_once()
    assert sampling.values("gpu_dra_claim_gpu_utilization_percent") == {}
    assert sampling.values("gpu_dra_claim_last_active_timestamp_seconds") == {
        ("slice", name): 1500.0
    }
    sampling.nvml.set_activity(uuid, DeviceActivity())
    for now in (1600.0, 1900.0):  # the process ends (a change: active), then nothing runs
        sampling.clock.now = now
        sampling.monitor.sample_once()
    assert sampling.values("gpu_dra_claim_last_active_timestamp_seconds") == {
        ("slice", name): 1600.0
    }
    latest = sampling.monitor.latest
    assert latest is not None
    assert latest.errors == ()


@pytest.mark.parametrize(
    ("text", "uid"),
    [
        (systemd_cgroup(POD_A), POD_A),
        (f"0::/kubepods/burstable/pod{POD_B}/0123\n", POD_B),
        (f"11:devices:/kubepods/pod{POD_A}/x\n10:cpu:/\n", POD_A),
        ("0::/user.slice/user-0.slice/session-1.scope\n", None),
        ("", None),
    ],
)
def test_pod_uid_from_cgroup(text: str, uid: str | None) -> None:
    assert pod_uid_from_cgroup(text) == uid


def test_pod_of_a_gone_process_is_none(tmp_path: Path) -> None:
    assert pod_uid_of(12345, tmp_path) is None


def test_pods_from_claim_reads_reserved_for() -> None:
    claim = {
        "status": {
            "reservedFor": [
                {"resource": "pods", "name": "p", "uid": POD_A},
                {"resource": "jobs", "name": "j", "uid": POD_B},
            ]
        }
    }
    assert pods_from_claim(claim) == (PodRef(POD_A, "p"),)
    assert pods_from_claim(None) == ()
    assert pods_from_claim({"status": {"reservedFor": "junk"}}) == ()


def test_simulated_file_sets_the_whole_picture(tmp_path: Path) -> None:
    nvml = SimulatedHost.load("hgx-h100", NODE).nvml
    nvml.init()
    path = tmp_path / "simulated-utilization.json"
    feed = SimulatedUtilizationFile(path, nvml)

    def rates(index: int) -> int:
        return nvml.device_get_utilization_rates(nvml.device_get_handle_by_index(index)).gpu

    write_utilization(path, {"gpu-0": {"gpu": 90}, "1": {"gpu": 20, "processes": [{"pid": 7}]}})
    feed.apply()
    assert (rates(0), rates(1), rates(2)) == (90, 20, 0)
    path.write_text(json.dumps({"devices": {"gpu-0": {"gpu": 300}}}))
    feed.apply()  # refused: the last picture stays
    assert rates(0) == 90
    write_utilization(path, {nvml.profile.gpus[2].uuid: {"gpu": 60}})
    feed.apply()
    assert (rates(0), rates(2)) == (0, 60)
    path.unlink()
    feed.apply()
    assert rates(2) == 0


@pytest.mark.parametrize(
    ("argv", "interval", "threshold"),
    [([], 10.0, 5.0), (["--utilization-interval=0", "--utilization-idle-threshold=12.5"], 0, 12.5)],
)
def test_utilization_flags(argv: list[str], interval: float, threshold: float) -> None:
    settings = KubeletPluginSettings.parse(["--node-name=n", *argv], env={})
    assert settings.utilization_interval_s == interval
    assert settings.utilization_idle_threshold == threshold


@pytest.mark.parametrize(
    "flag",
    ["--utilization-interval=-1", "--utilization-interval=x", "--utilization-idle-threshold=101"],
)
def test_bad_utilization_flags_are_usage_errors(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        KubeletPluginSettings.parse(["--node-name=n", flag], env={})
    assert flag.split("=", maxsplit=1)[0] in capsys.readouterr().err


def test_the_plugin_wiring_samples_in_the_background_from_the_simulated_file(
    gpus: Node, tmp_path: Path
) -> None:
    claim = gpus.add_gpus(UID_A, "train", "gpu-3")
    ok(gpus.prepare(claim)[UID_A])
    settings = KubeletPluginSettings.parse(
        ["--node-name", NODE, "--simulate=hgx-h100", f"--data-dir={tmp_path / 'data'}",
         "--utilization-interval=0.05"],
        env={},
    )  # fmt: skip
    nvml = SimulatedHost.load("hgx-h100", NODE).nvml
    reserved = {"status": {"reservedFor": [{"resource": "pods", "name": "t-0", "uid": POD_A}]}}
    registry = CollectorRegistry()
    monitor = start_utilization(
        settings,
        nvml,
        gpus.inventory,
        entries=gpus.checkpoint.all,
        claims=lambda namespace, name: reserved if name == "train" else None,
        registry=registry,
    )
    assert monitor is not None
    try:
        write_utilization(tmp_path / "data" / SIMULATED_UTILIZATION_FILE, {"gpu-3": {"gpu": 77}})

        def utilization() -> list[tuple[dict[str, str], float]]:
            return [
                (s.labels, s.value)
                for m in registry.collect()
                for s in m.samples
                if s.name == "gpu_dra_claim_gpu_utilization_percent"
            ]

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and [v for _, v in utilization()] != [77]:
            time.sleep(0.02)
        ((labels, value),) = utilization()
        assert (labels["claim"], labels["device"], value) == ("train", "gpu-3", 77)
        ((pod, _),) = [
            (s.labels, s.value)
            for m in registry.collect()
            for s in m.samples
            if s.name == "gpu_dra_claim_pod_info"
        ]
        assert (pod["claim"], pod["pod"], pod["pod_uid"]) == ("train", "t-0", POD_A)
    finally:
        monitor.close()
    assert not nvml.initialized  # released at close


def test_sampling_off_keeps_the_allocation_gauge(gpus: Node, tmp_path: Path) -> None:
    ok(gpus.prepare(gpus.add_gpus(UID_A, "train", "gpu-3"))[UID_A])
    settings = KubeletPluginSettings.parse(
        ["--node-name", NODE, "--utilization-interval=0"], env={}
    )
    registry = CollectorRegistry()
    nvml = SimulatedHost.load("hgx-h100", NODE).nvml
    monitor = start_utilization(
        settings,
        nvml,
        gpus.inventory,
        entries=gpus.checkpoint.all,
        claims=lambda namespace, name: None,
        registry=registry,
    )
    assert monitor is None
    names = {s.name for m in registry.collect() for s in m.samples}
    assert names == {"gpu_dra_claim_devices"}
