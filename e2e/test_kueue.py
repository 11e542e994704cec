"""Kueue quotas of gpu-dra devices end to end (issue 23, item 3; docs/kueue.md): Kueue built
from its pinned module and installed with its chart (`e2e.kueue`), DRA accounting on
(``DynamicResourceAllocation``, alpha) with ``deviceClassMappings`` for the catalog, and the
chart-installed gpu-dra on a simulated node of four H100s: two whole GPUs, one with static MIG
(7x 1g.10gb) and one offered as MPS shares.

Two teams in one cohort: team-a (1 whole GPU, 2 1g slices, 2 shares; may borrow) and team-b
(1, 1, 1; never borrows, lends what it does not use, reclaims it from lower-priority
workloads). Checked: batch Jobs over a team's quota wait suspended (no pods, no claims) with
Kueue's reason, which ``gpu-dra explain`` shows, and are admitted when quota frees; the devices
of an admitted Job's pod are allocated by gpu-dra; a team borrows from the cohort and is
preempted by the other team's higher-priority Job, never by an equal-priority one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from e2e import helm
from e2e import kueue as k
from e2e import manifests as m
from e2e.chart import (
    share_node,
)
from e2e.cluster import Cluster
from e2e.cluster.paths import REPO_ROOT
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import allocated_devices
from gpu_dra.cli.__main__ import main as gpu_dra

pytestmark = pytest.mark.e2e

PROFILE = {
    "name": "e2e-kueue",
    "description": "2 whole H100s, an H100 with 7x 1g.10gb (static MIG), an H100 as MPS shares",
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "gpus": [
        {"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0"},
        {"model": "H100-SXM5-80GB", "busId": "00000000:43:00.0"},
        {
            "model": "H100-SXM5-80GB",
            "busId": "00000000:52:00.0",
            "migDevices": [{"profileId": 19, "start": start} for start in range(7)],
        },
        {"model": "H100-SXM5-80GB", "busId": "00000000:61:00.0"},
    ],
}
SHARE_GPU = "gpu-3"
CLAIM_API = "resource.k8s.io/v1"
TEAM_A_QUOTA = {k.WHOLE_GPU: 1, k.MIG_1G: 2, k.MPS_SHARE: 2}
TEAM_B_QUOTA = {k.WHOLE_GPU: 1, k.MIG_1G: 1, k.MPS_SHARE: 1}
LOW, HIGH = "e2e-low", "e2e-high"


@dataclass
class Teams:
    a: str
    """team-a's namespace; its LocalQueue and ClusterQueue are named ``team-a``."""
    b: str


def request(name: str, device_class: str, **exactly: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": device_class, **exactly}}


TEMPLATES = {
    "whole": [request("gpu", "gpu.nvidia.com")],
    "two-whole": [request("gpu", "gpu.nvidia.com", allocationMode="ExactCount", count=2)],
    "mig-1g": [request("slice", "mig-1g.gpu.nvidia.com")],
    # 20Gi of memory: Kueue counts it as one share, whatever the memory (docs/kueue.md).
    "share": [
        request(
            "share",
            "mps.gpu.nvidia.com",
            capacity={"requests": {"memory": "20Gi", "compute": "20"}},
        )
    ],
}


@pytest.fixture(scope="module")
def gpu_dra_release(
    cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Driver]:
    """The chart-installed gpu-dra on the module's node (PROFILE, SHARE_GPU offered as shares
    served by the MPS double's daemon pods)."""
    directory = tmp_path_factory.mktemp("kueue-gpu-dra")
    shares = SHARE_GPU.removeprefix("gpu-")
    with share_node(cluster, kube, directory, mps_shares=shares, profile=PROFILE) as driver:
        yield driver


@pytest.fixture(scope="module")
def teams(
    cluster: Cluster,
    kube: Kube,
    gpu_dra_release: Driver,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Teams]:
    """Kueue installed; the two teams' namespaces, ClusterQueues in cohort ``research``,
    LocalQueues and ResourceClaimTemplates; the two WorkloadPriorityClasses. Afterwards the
    Jobs, then (once Kueue has released their Workloads) the queues and Kueue are removed."""
    installed = k.Kueue(cluster, kube, helm.binary(cluster.paths))
    suffix = uuid.uuid4().hex[:5]
    names = Teams(a=f"e2e-kueue-team-a-{suffix}", b=f"e2e-kueue-team-b-{suffix}")
    queues = [
        k.cluster_queue("team-a", names.a, TEAM_A_QUOTA, cohort="research"),
        k.cluster_queue("team-b", names.b, TEAM_B_QUOTA, cohort="research", borrowing_limit=0),
        k.priority_class(LOW, 100),
        k.priority_class(HIGH, 1000),
    ]
    try:
        installed.install(tmp_path_factory.mktemp("kueue") / "values.yaml")
        for item in queues:
            kube.create(item)
        for team, namespace in (("team-a", names.a), ("team-b", names.b)):
            kube.create_namespace(namespace)
            kube.create(k.local_queue(team, namespace, team))
            for template, requests in TEMPLATES.items():
                kube.create(m.claim_template(template, namespace, m.claim_spec(requests)))
        wait_for("both ClusterQueues to be active", lambda: all(
            k.condition(kube.get(k.KUEUE_API, "ClusterQueue", q), "Active").get("status")
            == "True" for q in ("team-a", "team-b")), 60)  # fmt: skip
        yield names
    finally:
        for namespace in (names.a, names.b):
            for item in kube.list("batch/v1", "Job", namespace=namespace):
                k.delete_job(kube, item["metadata"]["name"], namespace)
        for namespace in (names.a, names.b):
            released(kube, namespace)
            for queue in kube.list(k.KUEUE_API, "LocalQueue", namespace=namespace):
                kube.delete(k.KUEUE_API, "LocalQueue", queue["metadata"]["name"], namespace)
            kube.delete("v1", "Namespace", namespace)
        installed.uninstall()
        for namespace in (names.a, names.b):
            kube.wait_gone("v1", "Namespace", namespace, None, timeout=180)


def submit(kube: Kube, name: str, namespace: str, queue: str, templates: list[str],
           priority: str | None = None) -> None:  # fmt: skip
    kube.create(k.job(name, namespace, queue, templates, priority=priority))


def workload(kube: Kube, job: str, namespace: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def made() -> bool:
        found[:] = [w] if (w := k.workload_of(kube, job, namespace)) else []
        return bool(found)

    wait_for(f"Kueue's Workload of Job {namespace}/{job}", made, 30)
    return found[0]


def wait_admitted(kube: Kube, job: str, namespace: str, timeout: float = 60) -> dict[str, Any]:
    wait_for(f"Job {namespace}/{job} to be admitted",
             lambda: k.admitted(k.workload_of(kube, job, namespace)), timeout)  # fmt: skip
    return workload(kube, job, namespace)


def wait_pending(kube: Kube, job: str, namespace: str) -> str:
    """Kueue's message for Job `job` waiting without quota; checks that the Job is suspended
    and has no pods."""
    message = ""

    def pending() -> bool:
        nonlocal message
        reserved = k.condition(k.workload_of(kube, job, namespace), "QuotaReserved")
        message = str(reserved.get("message", ""))
        return reserved.get("status") == "False" and bool(message)

    wait_for(f"Job {namespace}/{job} to wait for quota", pending, 60)
    assert kube.get("batch/v1", "Job", job, namespace)["spec"]["suspend"] is True
    assert not job_pods(kube, job, namespace)
    return message


def released(kube: Kube, namespace: str) -> None:
    """Wait until Kueue released every Workload of `namespace` and its pods are gone."""
    wait_for(f"the Workloads and pods of {namespace} to be gone", lambda: not (
        kube.list(k.KUEUE_API, "Workload", namespace=namespace)
        or kube.list("v1", "Pod", namespace=namespace)), 120)  # fmt: skip


def job_pods(kube: Kube, job: str, namespace: str) -> list[dict[str, Any]]:
    return kube.list("v1", "Pod", namespace=namespace, label_selector=f"job-name={job}")


def running_pod(kube: Kube, job: str, namespace: str) -> dict[str, Any]:
    """The Job's one pod, once Running."""
    found: list[dict[str, Any]] = []

    def running() -> bool:
        found[:] = [p for p in job_pods(kube, job, namespace)
                    if p.get("status", {}).get("phase") == "Running"]  # fmt: skip
        return bool(found)

    wait_for(f"the pod of Job {namespace}/{job} to run", running, 90)
    return found[0]


def pod_devices(kube: Kube, pod: dict[str, Any]) -> dict[str, list[str]]:
    """{pod claim name: devices allocated by gpu-dra} of the pod's claims."""
    namespace = pod["metadata"]["namespace"]
    out = {}
    for status in pod["status"].get("resourceClaimStatuses", []):
        claim = kube.get(CLAIM_API, "ResourceClaim", status["resourceClaimName"], namespace)
        (driver,) = {r["driver"] for r in claim["status"]["allocation"]["devices"]["results"]}
        assert driver == "gpu.nvidia.com"
        out[status["name"]] = allocated_devices(kube, status["resourceClaimName"], namespace)
    return out


def usage(workload_object: dict[str, Any]) -> dict[str, str]:
    """What Kueue charged the Workload's quota: {resource: amount}."""
    (assignment,) = workload_object["status"]["admission"]["podSetAssignments"]
    return {str(name): str(value) for name, value in assignment["resourceUsage"].items()}


def explain(kube: Kube, cluster: Cluster, target: str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    gpu_dra(["explain", target, f"--kubeconfig={cluster.kubeconfig}"], environ={})
    return capsys.readouterr().out


def test_every_catalog_class_is_mapped_once() -> None:
    catalog = {
        str(document["metadata"]["name"])
        for path in (REPO_ROOT / "deviceclasses").glob("*.yaml")
        for document in yaml.safe_load_all(path.read_text())
        if document
    }
    mapped = [name for _, classes in k.DEVICE_CLASS_MAPPINGS for name in classes]
    assert sorted(mapped) == sorted(catalog)


def test_a_job_over_its_teams_quota_waits_suspended_until_quota_frees(
    cluster: Cluster, kube: Kube, teams: Teams, capsys: pytest.CaptureFixture[str]
) -> None:
    templates = ["whole", "mig-1g", "share"]
    submit(kube, "first", teams.b, "team-b", templates)
    admitted = wait_admitted(kube, "first", teams.b)
    assert usage(admitted) == {k.WHOLE_GPU: "1", k.MIG_1G: "1", k.MPS_SHARE: "1"}
    pod = running_pod(kube, "first", teams.b)
    devices = pod_devices(kube, pod)
    assert devices["c0"][0] in {"gpu-0", "gpu-1"}, devices
    assert devices["c1"][0].startswith("gpu-2-mig-1g10gb-"), devices
    assert devices["c2"] == [SHARE_GPU], devices

    # The same again: team-b's quota is used and it may not borrow. Suspended, no pods.
    submit(kube, "second", teams.b, "team-b", templates)
    message = wait_pending(kube, "second", teams.b)
    assert "insufficient" in message, message
    out = explain(kube, cluster, f"{teams.b}/job/second", capsys)
    verdict = out.splitlines()[0]
    assert "waits in Kueue" in verdict, out
    assert f"LocalQueue {teams.b}/team-b" in verdict, out
    assert "ClusterQueue team-b" in verdict, out
    assert message in verdict, out

    # Quota freed: the waiting Job is admitted and its pod gets devices.
    k.delete_job(kube, "first", teams.b)
    wait_admitted(kube, "second", teams.b)
    pod = running_pod(kube, "second", teams.b)
    assert set(pod_devices(kube, pod)) == {"c0", "c1", "c2"}
    k.delete_job(kube, "second", teams.b)
    released(kube, teams.b)


def test_a_team_borrows_and_is_preempted_by_a_higher_priority_job_of_the_lender(
    kube: Kube, teams: Teams
) -> None:
    # team-a borrows team-b's unused whole GPU.
    submit(kube, "borrower", teams.a, "team-a", ["two-whole"], LOW)
    admitted = wait_admitted(kube, "borrower", teams.a)
    assert usage(admitted) == {k.WHOLE_GPU: "2"}
    pod = running_pod(kube, "borrower", teams.a)
    assert sorted(pod_devices(kube, pod)["c0"]) == ["gpu-0", "gpu-1"]
    reserved = kube.get(k.KUEUE_API, "ClusterQueue", "team-a")["status"]["flavorsReservation"]
    (gpus,) = [r for r in reserved[0]["resources"] if r["name"] == k.WHOLE_GPU]
    assert (gpus["total"], gpus["borrowed"]) == ("2", "1")

    # An equal-priority Job of the lender does not preempt the borrower: it waits.
    submit(kube, "same-priority", teams.b, "team-b", ["whole"], LOW)
    wait_pending(kube, "same-priority", teams.b)
    assert k.admitted(k.workload_of(kube, "borrower", teams.a))

    # A higher-priority one reclaims the lent GPU: the borrower is evicted, its Job suspended.
    submit(kube, "urgent", teams.b, "team-b", ["whole"], HIGH)
    wait_for("the borrower to be preempted", lambda: k.condition(
        k.workload_of(kube, "borrower", teams.a), "Preempted").get("status") == "True",
        60)  # fmt: skip
    evicted = k.condition(k.workload_of(kube, "borrower", teams.a), "Evicted")
    assert evicted.get("reason") == "Preempted", evicted
    wait_admitted(kube, "urgent", teams.b)
    pod = running_pod(kube, "urgent", teams.b)
    assert pod_devices(kube, pod)["c0"][0] in {"gpu-0", "gpu-1"}
    assert kube.get("batch/v1", "Job", "borrower", teams.a)["spec"]["suspend"] is True
    wait_for("the borrower's pod to be gone",
             lambda: not job_pods(kube, "borrower", teams.a), 60)  # fmt: skip
    assert not k.admitted(k.workload_of(kube, "same-priority", teams.b))
