"""The MPS memory watchdog end to end (issue 16, item 3): a simulated hgx-h100 node offering
gpu-0 as MPS shares (``--mps-shares=0``), where the driver cannot cap a share's memory (the
simulator has no driver: every share is ``mps-client``). The test drives a share's processes
over its memory through ``<data-dir>/simulated-utilization.json``, naming the share pod's own
container processes (found by their cgroups, as the plugin finds them).

``kill`` (the default): the share's process over its memory is SIGKILLed, with an Event
``MpsShareProcessKilled`` on its pod; the other share's process runs on. ``report`` (the plugin
restarted with GPU_DRA_MPS_MEMORY_WATCHDOG=report): Warning Events ``MpsShareMemoryExceeded`` on
the pod and the claim, the pod keeps running, a share under its memory gets nothing. ``evict``
(restarted with GPU_DRA_MPS_MEMORY_WATCHDOG=evict, its identity granted ``pods/eviction``): the
pod is evicted.
See docs/shares.md, "Memory watchdog"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.test_utilization import metric_or_none
from e2e.workloads import delete_pods, pids_of_pod, wait_running
from gpu_dra.kubelet_plugin.mps.memory_watchdog import (
    REASON_EVICTED,
    REASON_EXCEEDED,
    REASON_KILLED,
)
from gpu_dra.kubelet_plugin.utilization.simulated_file import (
    SIMULATED_UTILIZATION_FILE,
    write_utilization,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100"
PLUGIN_ARGS = ("--mps-shares=0", "--mps-memory-watchdog-interval=1")
GIB = 2**30
EVICTION_ROLE = "gpu-dra-e2e-watchdog-evictions"


def reasons(kube: Kube, namespace: str, name: str, kind: str) -> list[str]:
    return [
        str(e.get("reason"))
        for e in kube.events_for(namespace, name)
        if e.get("involvedObject", {}).get("kind") == kind
    ]


def start_shares(kube: Kube, namespace: str, shares: dict[str, str]) -> dict[str, int]:
    """A claim of `shares[name]` memory and a pod using it, per name; each pod's first pid."""
    for name, memory in shares.items():
        kube.create(m.share_claim(name, namespace, memory, 20))
        kube.create(m.gpu_pod(name, namespace, claim=name))
    pids = {}
    for name in shares:
        wait_running(kube, name, namespace)
        uid = kube.get("v1", "Pod", name, namespace)["metadata"]["uid"]
        found = pids_of_pod(uid)
        assert found, f"no process of pod {name} ({uid}) on the node"
        pids[name] = found[0]
    return pids


def use_memory(driver: Driver, used: dict[int, int]) -> None:
    processes = [{"pid": pid, "usedMemoryBytes": size} for pid, size in used.items()]
    write_utilization(
        driver.state_dir / SIMULATED_UTILIZATION_FILE, {"gpu-0": {"processes": processes}}
    )


def test_kill_by_default_ends_the_process_of_the_share_over_its_memory(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    pids = start_shares(kube, namespace, {"hog": "2Gi", "fair": "4Gi"})
    use_memory(driver, {pids["hog"]: 3 * GIB, pids["fair"]: GIB})
    try:
        wait_for(
            "the process of the share over its memory to be killed",
            lambda: not Path(f"/proc/{pids['hog']}").exists(),
            30,
        )
        wait_for(
            "MpsShareProcessKilled on its pod",
            lambda: REASON_KILLED in reasons(kube, namespace, "hog", "Pod"),
            30,
        )
        assert Path(f"/proc/{pids['fair']}").exists()
        assert REASON_EXCEEDED not in reasons(kube, namespace, "fair", "ResourceClaim")
    finally:
        (driver.state_dir / SIMULATED_UTILIZATION_FILE).unlink(missing_ok=True)
    delete_pods(kube, namespace, ["hog", "fair"])
    wait_for("the shares to be unprepared", lambda: not driver.checkpoint_claims(), 60)


@pytest.fixture
def reporting_plugin(driver: Driver) -> Iterator[None]:
    """The plugin restarted with ``report``; restored after."""
    driver.stop_plugin()
    driver.start_plugin(env={"GPU_DRA_MPS_MEMORY_WATCHDOG": "report"})
    try:
        yield
    finally:
        driver.stop_plugin()
        driver.start_plugin()


@pytest.mark.usefixtures("reporting_plugin")
def test_report_puts_events_on_the_pod_and_claim_over_its_share(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    pids = start_shares(kube, namespace, {"over": "2Gi", "under": "4Gi"})
    use_memory(driver, {pids["over"]: 3 * GIB, pids["under"]: 3 * GIB})
    try:
        wait_for(
            "MpsShareMemoryExceeded on the pod and the claim over its share",
            lambda: (
                REASON_EXCEEDED in reasons(kube, namespace, "over", "Pod")
                and REASON_EXCEEDED in reasons(kube, namespace, "over", "ResourceClaim")
            ),
            30,
        )
        message = next(
            e["message"]
            for e in kube.events_for(namespace, "over")
            if e.get("reason") == REASON_EXCEEDED
        )
        assert "3072 MiB" in message
        assert "2048 MiB" in message
        overruns = metric_or_none(
            driver, "gpu_dra_mps_memory_watchdog_overruns_total", claim="over"
        )
        assert overruns == 1
        # report only: the pod runs on, the share under its memory gets nothing
        assert kube.get("v1", "Pod", "over", namespace)["status"]["phase"] == "Running"
        assert "deletionTimestamp" not in kube.get("v1", "Pod", "over", namespace)["metadata"]
        assert REASON_EXCEEDED not in reasons(kube, namespace, "under", "Pod")
        assert REASON_EXCEEDED not in reasons(kube, namespace, "under", "ResourceClaim")
    finally:
        (driver.state_dir / SIMULATED_UTILIZATION_FILE).unlink(missing_ok=True)
    delete_pods(kube, namespace, ["over", "under"])
    wait_for("the shares to be unprepared", lambda: not driver.checkpoint_claims(), 60)


@pytest.fixture
def evicting_plugin(driver: Driver, kube: Kube) -> Iterator[None]:
    """The plugin restarted with ``evict``, its identity allowed to evict; restored after."""
    role: dict[str, Any] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": EVICTION_ROLE},
        "rules": [{"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}],
    }
    binding: dict[str, Any] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": EVICTION_ROLE},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": EVICTION_ROLE,
        },
        "subjects": [
            {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "gpu-dra-driver"}
        ],
    }
    kube.create(role)
    kube.create(binding)
    driver.stop_plugin()
    driver.start_plugin(env={"GPU_DRA_MPS_MEMORY_WATCHDOG": "evict"})
    try:
        yield
    finally:
        driver.stop_plugin()
        driver.start_plugin()
        kube.delete("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", EVICTION_ROLE)
        kube.delete("rbac.authorization.k8s.io/v1", "ClusterRole", EVICTION_ROLE)


@pytest.mark.usefixtures("evicting_plugin")
def test_evict_evicts_the_pod_over_its_share(driver: Driver, kube: Kube, namespace: str) -> None:
    pids = start_shares(kube, namespace, {"greedy": "2Gi", "modest": "4Gi"})
    use_memory(driver, {pids["greedy"]: 3 * GIB, pids["modest"]: GIB})
    try:

        def evicted() -> bool:
            pods = {p["metadata"]["name"]: p for p in kube.list("v1", "Pod", namespace)}
            greedy = pods.get("greedy")
            return greedy is None or "deletionTimestamp" in greedy["metadata"]

        wait_for("the pod over its share to be evicted", evicted, 30)
        wait_for(
            "MpsSharePodEvicted on the evicted pod",
            lambda: REASON_EVICTED in reasons(kube, namespace, "greedy", "Pod"),
            30,
        )
        assert REASON_EXCEEDED in reasons(kube, namespace, "greedy", "ResourceClaim")
        modest = kube.get("v1", "Pod", "modest", namespace)
        assert "deletionTimestamp" not in modest["metadata"]
        assert modest["status"]["phase"] == "Running"
        kube.wait_gone("v1", "Pod", "greedy", namespace)
    finally:
        (driver.state_dir / SIMULATED_UTILIZATION_FILE).unlink(missing_ok=True)
    delete_pods(kube, namespace, ["modest"])
    wait_for("the shares to be unprepared", lambda: not driver.checkpoint_claims(), 60)
