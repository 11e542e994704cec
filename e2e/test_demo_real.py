"""`demo/run --real` as it runs: the real-mode stage (demo/real.py) on a fake DGX H100 driver
root with the NVML mock library prints, for each of its three pods, an ``nvidia-smi -L`` that
lists exactly the claim's GPUs or MIG device; deleting its namespace leaks nothing."""

from __future__ import annotations

import re

import pytest

from demo.real import CLAIMS, NAMESPACE, run_real_stage
from e2e.cluster import Cluster
from e2e.driver import CDI_ROOT
from e2e.kube import Kube, wait_for

pytestmark = pytest.mark.e2e


def test_real_stage_prints_each_containers_nvidia_smi_and_cleans_up(
    cluster: Cluster, kube: Kube
) -> None:
    printed: list[str] = []
    driver = run_real_stage(cluster, kube, printed.append)
    assert driver.real is not None
    try:
        text = "\n".join(printed)
        blocks = dict(re.findall(r"--- pod \S+/(\S+): .*?\n(.*?)(?=\n--- pod |\Z)", text, re.S))
        assert set(blocks) == set(CLAIMS), text
        gpu_lines = {
            n: re.findall(r"^  GPU \d+: .*\(UUID: GPU-", b, re.M) for n, b in blocks.items()
        }
        mig_lines = {
            n: re.findall(r"^    MIG 1g\.10gb +Device +0: \(UUID: MIG-", b, re.M)
            for n, b in blocks.items()
        }
        assert {n: len(v) for n, v in gpu_lines.items()} == {
            "one-gpu": 1,
            "two-gpus": 2,
            "mig-1g": 1,
        }
        assert {n: len(v) for n, v in mig_lines.items()} == {
            "one-gpu": 0,
            "two-gpus": 0,
            "mig-1g": 1,
        }
        assert all("update-ldcache" in b and "11 libraries" in b for b in blocks.values()), text
    finally:
        kube.delete("v1", "Namespace", NAMESPACE)
        kube.wait_gone("v1", "Namespace", NAMESPACE, None, timeout=180)
        wait_for("the claims to be unprepared", lambda: not driver.checkpoint_claims(), 120)
        driver.stop_plugin()
        left = driver.real.mig_instances()
        driver.real.remove()
    assert left == []
    assert not list(CDI_ROOT.glob("k8s.gpu.nvidia.com-claim_*"))
