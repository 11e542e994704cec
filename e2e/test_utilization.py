"""Utilization per claim end to end (issue 14): a simulated hgx-h100 node whose plugin samples
every second; the test sets what the GPUs do through ``<data-dir>/simulated-utilization.json``
and reads the plugin's metrics and ``gpu-dra inventory --idle``.

Whole GPUs: a busy and an idle claim side by side. MPS shares of gpu-0 (``--mps-shares=0``):
the processes the file names are the share pods' own container processes (found by their
cgroups, as the plugin finds them), so each claim gets the usage of its own pods."""

from __future__ import annotations

import json

import pytest
import yaml

from e2e import manifests as m
from e2e.driver import METRICS_PORT, Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import (
    allocated_devices,
    delete_pods,
    pids_of_pod,
    share_claim_uid,
    wait_running,
)
from gpu_dra.cli.__main__ import main as gpu_dra
from gpu_dra.kubelet_plugin.utilization.simulated_file import (
    SIMULATED_UTILIZATION_FILE,
    write_utilization,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100"
PLUGIN_ARGS = ("--mps-shares=0", "--utilization-interval=1")
METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"
GIB = 2**30


def metric_or_none(driver: Driver, name: str, **labels: str) -> float | None:
    try:
        return driver.metric(name, **labels)
    except (KeyError, OSError):
        return None


def test_busy_and_idle_whole_gpus_side_by_side(
    driver: Driver, kube: Kube, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("busy", "idle"):
        kube.create(m.claim(name, namespace, m.claim_spec([m.request()])))
        kube.create(m.gpu_pod(name, namespace, claim=name))
    for name in ("busy", "idle"):
        wait_running(kube, name, namespace)
    (busy_device,) = allocated_devices(kube, "busy", namespace)
    (idle_device,) = allocated_devices(kube, "idle", namespace)
    write_utilization(
        driver.state_dir / SIMULATED_UTILIZATION_FILE,
        {busy_device: {"gpu": 90, "memory": 40, "memoryUsedBytes": 20 * GIB}},
    )
    wait_for(
        "the busy claim's utilization in the plugin's metrics",
        lambda: metric_or_none(driver, "gpu_dra_claim_gpu_utilization_percent", claim="busy") == 90,
        30,
    )
    labels = {"namespace": namespace, "device": idle_device, "tier": "gpu"}
    assert driver.metric("gpu_dra_claim_gpu_utilization_percent", claim="idle", **labels) == 0
    for claim in ("busy", "idle"):  # one series per pod, to join with kube-state-metrics
        assert driver.metric("gpu_dra_claim_pod_info", namespace=namespace, claim=claim,
                             pod=claim) == 1  # fmt: skip
    assert driver.metric("gpu_dra_claim_memory_used_bytes", claim="busy") == 20 * GIB
    assert driver.metric("gpu_dra_claim_devices", claim="busy", device=busy_device) == 1

    def idle_claims() -> list[str]:
        args = ["inventory", "--idle", "--idle-for", "3s", "--plugin-metrics", METRICS_URL]
        assert (
            gpu_dra([*args, "-o", "json"], environ={"KUBECONFIG": str(driver.cluster.kubeconfig)})
            == 0
        )
        data = json.loads(capsys.readouterr().out)
        assert data["warnings"] == []
        return [c["name"] for c in data["idleClaims"] if c["namespace"] == namespace]

    wait_for("the idle claim to be listed idle", lambda: idle_claims() == ["idle"], 30)
    delete_pods(kube, namespace, ["busy", "idle"])
    (driver.state_dir / SIMULATED_UTILIZATION_FILE).unlink()


def test_mps_shares_get_their_own_pods_usage(driver: Driver, kube: Kube, namespace: str) -> None:
    for name, memory, compute in (("share-a", "10Gi", 30), ("share-b", "20Gi", 50)):
        kube.create(m.share_claim(name, namespace, memory, compute))
        kube.create(m.gpu_pod(name, namespace, claim=name))
    pids = {}
    for name in ("share-a", "share-b"):
        wait_running(kube, name, namespace)
        uid = kube.get("v1", "Pod", name, namespace)["metadata"]["uid"]
        pids[name] = pids_of_pod(uid)
        assert pids[name], f"no process of pod {name} ({uid}) on the node"
    processes = [{"pid": pids["share-a"][0], "sm": 25, "usedMemoryBytes": 3 * GIB}]
    processes += [{"pid": pids["share-b"][0], "sm": 2, "usedMemoryBytes": GIB}]
    write_utilization(
        driver.state_dir / SIMULATED_UTILIZATION_FILE,
        {"gpu-0": {"gpu": 30, "processes": processes}},
    )
    wait_for(
        "share-a's usage in the plugin's metrics",
        lambda: (
            metric_or_none(driver, "gpu_dra_claim_gpu_utilization_percent", claim="share-a") == 25
        ),
        30,
    )
    share = {"tier": "mps-share", "device": "gpu-0"}
    assert driver.metric("gpu_dra_claim_gpu_utilization_percent", claim="share-b", **share) == 2
    assert driver.metric("gpu_dra_claim_memory_used_bytes", claim="share-a") == 3 * GIB
    assert driver.metric("gpu_dra_claim_memory_limit_bytes", claim="share-a") == 10 * GIB
    assert driver.metric("gpu_dra_claim_compute_limit_percent", claim="share-b") == 50
    assert driver.metric("gpu_dra_claim_processes", claim="share-b") == 1
    delete_pods(kube, namespace, ["share-a", "share-b"])
    wait_for("the shares to be unprepared", lambda: not driver.checkpoint_claims(), 60)
    (driver.state_dir / SIMULATED_UTILIZATION_FILE).unlink()


def test_rightsize_advice_from_the_plugins_peaks_applies(
    driver: Driver, kube: Kube, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A whole-GPU claim that used at most 6 GiB and 12 % (then less): the plugin keeps the
    peaks, ``gpu-dra rightsize`` advises the MPS share gpu-0 offers (7Gi / 15 %), and its
    ResourceClaimTemplate, applied as printed, gets a pod running on that share."""
    kube.create(m.claim("notebook", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("notebook", namespace, claim="notebook"))
    wait_running(kube, "notebook", namespace)
    (device,) = allocated_devices(kube, "notebook", namespace)
    uid = kube.get("v1", "Pod", "notebook", namespace)["metadata"]["uid"]
    (pid, *_) = pids_of_pod(uid)
    path = driver.state_dir / SIMULATED_UTILIZATION_FILE
    busy = {"pid": pid, "sm": 12, "usedMemoryBytes": 6 * GIB}
    write_utilization(path, {device: {"gpu": 12, "memoryUsedBytes": 6 * GIB, "processes": [busy]}})
    peak = "gpu_dra_claim_gpu_utilization_peak_percent"
    wait_for(
        "the peak in the metrics", lambda: metric_or_none(driver, peak, claim="notebook") == 12, 30
    )
    quiet = {"pid": pid, "sm": 3, "usedMemoryBytes": 2 * GIB}
    write_utilization(path, {device: {"gpu": 3, "memoryUsedBytes": 2 * GIB, "processes": [quiet]}})
    now = "gpu_dra_claim_gpu_utilization_percent"
    wait_for("the quieter sample", lambda: metric_or_none(driver, now, claim="notebook") == 3, 30)

    environ = {"KUBECONFIG": str(driver.cluster.kubeconfig)}
    args = ["rightsize", "-n", namespace, "--plugin-metrics", METRICS_URL]
    assert gpu_dra([*args, "-o", "json"], environ=environ) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["warnings"] == []
    (claim,) = data["claims"]
    (advised,) = claim["devices"]
    assert advised["peak"]["memoryUsedBytes"] == 6 * GIB
    assert advised["peak"]["gpuUtilizationPercent"] == 12
    assert advised["windowSeconds"] > 0
    recommended = advised["recommended"]
    assert (recommended["kind"], recommended["offered"]) == ("mps-share", True)
    assert (recommended["memoryBytes"], recommended["computePercent"]) == (7 * GIB, 15)
    assert gpu_dra([*args, "--templates"], environ=environ) == 0
    (template,) = yaml.safe_load_all(capsys.readouterr().out)

    delete_pods(kube, namespace, ["notebook"])
    kube.delete("resource.k8s.io/v1", "ResourceClaim", "notebook", namespace)
    kube.wait_gone("resource.k8s.io/v1", "ResourceClaim", "notebook", namespace)
    path.unlink()
    kube.create(template)
    kube.create(m.gpu_pod("notebook-2", namespace, template="notebook-rightsized"))
    wait_running(kube, "notebook-2", namespace)
    pod = kube.get("v1", "Pod", "notebook-2", namespace)
    (status,) = pod["status"]["resourceClaimStatuses"]
    share_claim_uid(kube, status["resourceClaimName"], namespace, "gpu-0", "7Gi", 15)
    delete_pods(kube, namespace, ["notebook-2"])
    wait_for("the share to be unprepared", lambda: not driver.checkpoint_claims(), 60)
