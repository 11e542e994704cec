"""`gpu-dra explain` and `gpu-dra inventory` against the real cluster (simulated mixed node:
2x A100 80GB PCIe, 2x L4): the installed CLI, run as an operator would, with the admin
kubeconfig, from the test process (which is in the cluster's network namespace)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from e2e import manifests as m
from e2e.cluster import Cluster, versions
from e2e.driver import BIN, Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import allocated_devices, wait_running

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = "mixed"
FUTURE_DRIVER = (
    "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('999.0.0')) >= 0"
)
L4 = "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA L4'"


def gpu_dra(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "gpu-dra"), *args, f"--kubeconfig={cluster.kubeconfig}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def json_of(cluster: Cluster, *args: str) -> tuple[int, Any]:
    done = gpu_dra(cluster, *args, "-o", "json")
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def test_explain_names_the_selector_no_device_passes(
    driver: Driver, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    spec = m.claim_spec([m.request(selectors=[FUTURE_DRIVER])])
    kube.create(m.claim("impossible", namespace, spec))
    kube.create(m.gpu_pod("pod", namespace, claim="impossible"))
    wait_for(
        "a FailedScheduling event",
        lambda: any(e["reason"] == "FailedScheduling" for e in kube.events_for(namespace, "pod")),
        60,
    )

    done = gpu_dra(cluster, "explain", f"{namespace}/impossible")
    assert done.returncode == 1, done.stdout + done.stderr
    verdict = done.stdout.splitlines()[0]
    assert verdict.startswith(f"verdict: claim {namespace}/impossible cannot be allocated now: ")
    assert (
        "request gpu: 0 of 4 devices pass (needs 1): 4 rejected by request selector #0" in verdict
    )
    assert "semver('999.0.0')" in verdict

    code, data = json_of(cluster, "explain", f"{namespace}/impossible")
    assert code == 1
    assert data["allocated"] is False
    (alternative,) = data["requests"][0]["alternatives"]
    funnel = {step["step"]: step for step in alternative["funnel"]}
    pool = f"gpu.nvidia.com/{versions.NODE_NAME}"
    assert funnel["class gpu.nvidia.com selector #0"]["passingByPool"] == {pool: 4}
    selector = funnel["request selector #0"]
    assert (selector["in"], selector["pass"], selector["rejected"]) == (4, 0, 4)
    assert selector["detail"] == FUTURE_DRIVER
    assert [p["pool"] for p in data["pools"]] == [versions.NODE_NAME]
    assert not data["pools"][0]["incomplete"]


def test_explain_and_inventory_name_the_claims_holding_the_l4s(
    driver: Driver, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    l4_spec = m.claim_spec([m.request(selectors=[L4])])
    for name in ("l4-a", "l4-b"):
        kube.create(m.claim(name, namespace, l4_spec))
        kube.create(m.gpu_pod(f"pod-{name}", namespace, claim=name))
    held = {}
    for name in ("l4-a", "l4-b"):
        wait_running(kube, f"pod-{name}", namespace)
        (held[name],) = allocated_devices(kube, name, namespace)
    assert sorted(held.values()) == ["gpu-2", "gpu-3"]
    kube.create(m.claim("want-l4", namespace, l4_spec))

    done = gpu_dra(cluster, "explain", f"{namespace}/want-l4")
    assert done.returncode == 1, done.stdout + done.stderr
    verdict = done.stdout.splitlines()[0]
    holders = f"2 allocated to other claims ({namespace}/l4-a, {namespace}/l4-b)"
    assert "request gpu: 0 of 4 devices pass" in verdict
    assert holders in verdict
    for name, device in held.items():
        line = f"allocated: gpu.nvidia.com/{versions.NODE_NAME}/{device} -> {namespace}/{name}"
        assert line in done.stdout

    # A holder itself: allocated, and said so first.
    code, data = json_of(cluster, "explain", f"{namespace}/l4-a")
    assert code == 0
    assert data["allocated"] is True
    device = f"gpu.nvidia.com/{versions.NODE_NAME}/{held['l4-a']}"
    assert data["allocation"] == [{"request": "gpu", "device": device}]
    assert data["verdict"].startswith(f"claim {namespace}/l4-a is allocated: gpu -> {device}")
    assert data["reservedFor"] == ["pods/pod-l4-a"]

    code, inventory = json_of(cluster, "inventory")
    assert code == 0
    node = inventory["nodes"][versions.NODE_NAME]
    assert node == {
        "devices": 4,
        "free": 2,
        "allocated": 2,
        "shared": 0,
        "blocked": 0,
        "types": {"gpu": {"devices": 4, "free": 2}},
    }
    rows = {row["device"]: row for row in inventory["devices"]}
    assert sorted(rows) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    for name, device_name in held.items():
        assert rows[device_name]["state"] == "allocated"
        assert rows[device_name]["holders"] == [f"{namespace}/{name} (gpu)"]
    assert [rows[d]["state"] for d in ("gpu-0", "gpu-1")] == ["free", "free"]
    classes = {c["name"]: (c["total"], c["free"], c["errors"]) for c in inventory["classes"]}
    catalog = {  # the classes of deviceclasses/ (other tests may add their own)
        "gpu.nvidia.com": (4, 2, 0),
        "hopper.gpu.nvidia.com": (0, 0, 0),
        "large-memory.gpu.nvidia.com": (2, 2, 0),
        "mig.nvidia.com": (0, 0, 0),
        "training.gpu.nvidia.com": (2, 2, 0),
    }
    assert {name: classes.get(name) for name in catalog} == catalog
    summary = gpu_dra(cluster, "inventory")  # the default: nodes and classes, no device rows
    assert summary.returncode == 0, summary.stderr
    assert "gpu: 2/4 free" in summary.stdout
    assert f"{namespace}/l4-a (gpu)" not in summary.stdout
    assert "gpu-dra inventory --devices" in summary.stdout
    table = gpu_dra(cluster, "inventory", "--devices")
    assert table.returncode == 0, table.stderr
    assert f"{namespace}/l4-a (gpu)" in table.stdout
    assert "gpu: 2/4 free" in table.stdout
