"""Peaks per claim device for right-sizing: kept in the plugin's memory across samples (the most
memory used, the highest GPU utilization, the most processes, since the first sample), exported
as metrics; values NVML does not give (MIG utilization, failed calls) have no peak, never 0."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from gpu_dra.driver.nvml.simulated_utilization import DeviceActivity, SimulatedProcess
from gpu_dra.kubelet_plugin.utilization.claims import PodRef
from gpu_dra.kubelet_plugin.utilization.monitor import ClaimReading
from gpu_dra.kubelet_plugin.utilization.peaks import Peak, PeakTracker
from tests.kubelet_plugin.nodes import UID_A, UID_B, Node, SharesNode, hgx_h100_inventory, ok
from tests.kubelet_plugin.test_utilization import (
    POD_A,
    POD_B,
    Sampling,
    fake_process,
    mig_sampling,
    systemd_cgroup,
)

GIB = 2**30
PEAK_MEMORY = "gpu_dra_claim_memory_used_peak_bytes"
PEAK_GPU = "gpu_dra_claim_gpu_utilization_peak_percent"
PEAK_PROCESSES = "gpu_dra_claim_processes_peak"
SINCE = "gpu_dra_claim_observed_since_timestamp_seconds"


def test_whole_gpu_peaks_span_samples_and_restart_with_the_claim(tmp_path: Path) -> None:
    node = Node(tmp_path / "node", hgx_h100_inventory())
    train = node.add_gpus(UID_A, "train", "gpu-0")
    notebook = node.add_gpus(UID_B, "notebook", "gpu-1")
    ok(node.prepare(train)[UID_A])
    ok(node.prepare(notebook)[UID_B])
    sampling = Sampling(node, tmp_path / "proc", {})
    gpu0 = node.uuid_of("gpu-0")
    sampling.nvml.set_activity(
        gpu0,
        DeviceActivity(80, processes=(SimulatedProcess(1, 30 * GIB), SimulatedProcess(2, GIB))),
    )
    sampling.monitor.sample_once()
    sampling.clock.now = 1600.0
    sampling.nvml.set_activity(gpu0, DeviceActivity(12, processes=(SimulatedProcess(1, 6 * GIB),)))
    sampling.monitor.sample_once()

    # the newest sample says 12 % and 6 GiB; the peaks keep 80 % and 31 GiB
    assert sampling.values("gpu_dra_claim_gpu_utilization_percent")[("train", "gpu-0")] == 12
    assert sampling.values(PEAK_GPU) == {("train", "gpu-0"): 80, ("notebook", "gpu-1"): 0}
    assert sampling.values(PEAK_MEMORY) == {("train", "gpu-0"): 31 * GIB, ("notebook", "gpu-1"): 0}
    assert sampling.values(PEAK_PROCESSES) == {("train", "gpu-0"): 2, ("notebook", "gpu-1"): 0}
    assert sampling.values(SINCE) == {("train", "gpu-0"): 1000.0, ("notebook", "gpu-1"): 1000.0}
    peak = sampling.monitor.peak((UID_A, "gpu-0"))
    assert peak == Peak(since=1000.0, samples=2, memory_used_bytes=31 * GIB, gpu_percent=80,
                        processes=2)  # fmt: skip

    # unprepared: forgotten; prepared again later: observed from its new first sample
    assert node.unprepare(train) == {UID_A: None}
    sampling.clock.now = 1700.0
    sampling.monitor.sample_once()
    assert list(sampling.values(SINCE)) == [("notebook", "gpu-1")]
    assert sampling.monitor.peak((UID_A, "gpu-0")) is None
    ok(node.prepare(train)[UID_A])
    sampling.clock.now = 1800.0
    sampling.nvml.set_activity(gpu0, DeviceActivity(3))
    sampling.monitor.sample_once()
    assert sampling.values(SINCE)[("train", "gpu-0")] == 1800.0
    assert sampling.values(PEAK_GPU)[("train", "gpu-0")] == 3


def test_a_failed_read_keeps_the_peak_and_a_value_never_read_has_none(tmp_path: Path) -> None:
    node = Node(tmp_path / "node", hgx_h100_inventory())
    ok(node.prepare(node.add_gpus(UID_A, "a", "gpu-0"))[UID_A])
    sampling = Sampling(node, tmp_path / "proc", {})
    sampling.nvml.set_activity(node.uuid_of("gpu-0"), DeviceActivity(40))
    sampling.nvml.set_fault("device_get_memory_info", pynvml.NVML_ERROR_UNKNOWN, gpu=0)
    sampling.monitor.sample_once()
    assert sampling.values(PEAK_MEMORY) == {}  # never read: no series, not 0
    assert sampling.values(PEAK_GPU) == {("a", "gpu-0"): 40}
    sampling.nvml.set_fault("device_get_memory_info", None, gpu=0)
    sampling.nvml.set_fault("device_get_utilization_rates", pynvml.NVML_ERROR_UNKNOWN, gpu=0)
    sampling.clock.now = 1010.0
    sampling.monitor.sample_once()
    assert sampling.values(PEAK_GPU) == {("a", "gpu-0"): 40}  # the failed read is no 0
    assert ("a", "gpu-0") in sampling.values(PEAK_MEMORY)


@pytest.mark.parametrize("gpm", [True, False], ids=["hopper-gpm", "no-gpm"])
def test_mig_peaks_have_sm_utilization_only_with_gpm(tmp_path: Path, gpm: bool) -> None:
    """MIG devices: memory and process peaks always; a utilization peak (the GPU instance's SM
    utilization, from GPM between two samples) only where the GPU has GPM (Hopper and newer;
    here the simulated H100s answer the GPM query NotSupported, as an A100 does)."""
    _, sampling, uuid, name = mig_sampling(tmp_path, "hgx-h100-mig")
    if not gpm:
        for gpu in range(8):
            sampling.nvml.set_fault(
                "gpm_query_device_support", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=gpu
            )
    sampling.nvml.set_activity(
        uuid, DeviceActivity(gpu_percent=60, processes=(SimulatedProcess(77, 2 * GIB),))
    )
    sampling.monitor.sample_once()
    sampling.clock.now = 1100.0
    sampling.monitor.sample_once()
    sampling.clock.now = 2000.0
    sampling.nvml.set_activity(uuid, DeviceActivity(gpu_percent=5))
    sampling.monitor.sample_once()
    assert sampling.values(PEAK_GPU) == ({("slice", name): 60} if gpm else {})
    assert sampling.values(PEAK_MEMORY) == {("slice", name): 2 * GIB}
    assert sampling.values(PEAK_PROCESSES) == {("slice", name): 1}
    assert sampling.values(SINCE) == {("slice", name): 1000.0}


def test_mps_share_peaks_are_its_own_pods_processes(tmp_path: Path, mps_root: Path) -> None:
    node = SharesNode(tmp_path / "node", mps_root)
    a = node.add_share(UID_A, "10Gi", "25", name="a")
    b = node.add_share(UID_B, "20Gi", "50", name="b")
    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])
    proc = tmp_path / "proc"
    fake_process(proc, 101, systemd_cgroup(POD_A))
    fake_process(proc, 201, systemd_cgroup(POD_B))
    pods = {"a": (PodRef(POD_A, "a-0"),), "b": (PodRef(POD_B, "b-0"),)}
    sampling = Sampling(node, proc, pods)
    gpu0 = node.uuid_of("gpu-0")
    sampling.nvml.set_activity(
        gpu0,
        DeviceActivity(
            gpu_percent=60,
            processes=(SimulatedProcess(101, 3 * GIB, 15), SimulatedProcess(201, 9 * GIB, 45)),
        ),
    )
    sampling.monitor.sample_once()
    sampling.clock.now = 1100.0
    sampling.nvml.set_activity(
        gpu0, DeviceActivity(gpu_percent=20, processes=(SimulatedProcess(101, 5 * GIB, 20),))
    )
    sampling.monitor.sample_once()
    assert sampling.values(PEAK_GPU) == {("a", "gpu-0"): 20, ("b", "gpu-0"): 45}
    assert sampling.values(PEAK_MEMORY) == {("a", "gpu-0"): 5 * GIB, ("b", "gpu-0"): 9 * GIB}
    assert node.unprepare(a, b) == {UID_A: None, UID_B: None}


def test_the_tracker_keeps_maxima_per_key_and_drops_keys_gone() -> None:
    tracker = PeakTracker()
    key, other = ("uid", "gpu-0"), ("uid", "gpu-1")
    tracker.observe(10.0, [(key, ClaimReading(5.0, None, 100, 200, 1)), (other, _unknown())])
    tracker.observe(20.0, [(key, ClaimReading(2.0, None, 300, 200, 0)), (other, _unknown())])
    assert tracker.peak(key) == Peak(10.0, 2, memory_used_bytes=300, gpu_percent=5.0, processes=1)
    assert tracker.peak(other) == Peak(10.0, 2)
    tracker.observe(30.0, [(other, _unknown())])
    assert tracker.peak(key) is None


def _unknown() -> ClaimReading:
    return ClaimReading(None, None, None, None, None)
