"""`gpu-dra explain` and Kueue (docs/kueue.md): the queue state of a Workload
(`gpu_dra.cli.queueing`), a claim held back by a waiting Workload, ``NAMESPACE/job/NAME``, and
the Kueue reads through the real client against a stub apiserver."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from gpu_dra.cli import cluster as cli_cluster
from gpu_dra.cli.__main__ import main
from gpu_dra.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gpu_dra.cli.explain import explain, with_queue
from gpu_dra.cli.queueing import QUEUE_LABEL, claim_wait, job_wait, workload_state
from gpu_dra.kube import errors
from tests.cli.support import FakeCoreV1
from tests.fakes.cluster_objects import Obj, claim, exactly, mixed_node, standard_classes
from tests.fakes.stub_apiserver import StubApiserver, status

NS = "team-a"
NO_QUOTA = (
    "couldn't assign flavors to pod set main: insufficient unused quota for "
    "gpu.nvidia.com/gpu in flavor default-flavor, 1 more needed"
)
LOCAL_QUEUE = {
    "metadata": {"name": "team-a", "namespace": NS},
    "spec": {"clusterQueue": "research-a"},
}


def owner(kind: str, name: str) -> Obj:
    return {"kind": kind, "name": name, "uid": f"uid-{name}"}


def job(name: str, *, queue: str | None = "team-a", claims: list[Obj] | None = None) -> Obj:
    labels = {QUEUE_LABEL: queue} if queue else {}
    return {
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "labels": labels},
        "spec": {
            "suspend": True,
            "template": {"spec": {"resourceClaims": claims or [], "containers": []}},
        },
    }


def workload(
    name: str, owned_by: Obj, *, conditions: list[Obj], queue: str = "team-a", admitted_to: str = ""
) -> Obj:
    status_: Obj = {"conditions": conditions}
    if admitted_to:
        status_["admission"] = {"clusterQueue": admitted_to}
    return {
        "metadata": {"name": name, "namespace": NS, "ownerReferences": [owned_by]},
        "spec": {"queueName": queue},
        "status": status_,
    }


def cond(kind: str, value: str, message: str = "", reason: str = "") -> Obj:
    return {"type": kind, "status": value, "message": message, "reason": reason}


PENDING = [cond("QuotaReserved", "False", NO_QUOTA, "Pending")]
ADMITTED = [cond("QuotaReserved", "True"), cond("Admitted", "True")]


# ---- the Workload's state ----------------------------------------------------------------------


def test_a_workload_without_quota_waits_with_kueues_message_and_its_queues() -> None:
    wait = workload_state(workload("job-train", owner("Job", "train"), conditions=PENDING),
                          [LOCAL_QUEUE])  # fmt: skip
    assert (wait.state, wait.waiting) == ("waiting", True)
    assert (wait.local_queue, wait.cluster_queue) == ("team-a/team-a", "research-a")
    assert wait.verdict("job team-a/train") == (
        "job team-a/train waits in Kueue: Workload team-a/job-train in LocalQueue team-a/team-a "
        f"(ClusterQueue research-a) has no quota reserved: {NO_QUOTA}"
    )


def test_an_admitted_workload_does_not_wait_and_names_the_admitting_cluster_queue() -> None:
    wait = workload_state(
        workload("w", owner("Job", "train"), conditions=ADMITTED, admitted_to="research-x"),
        [LOCAL_QUEUE],
    )
    assert (wait.state, wait.waiting, wait.cluster_queue) == ("admitted", False, "research-x")
    assert wait.verdict("job ns/j").startswith("job ns/j is admitted by Kueue")


def test_quota_reserved_but_not_admitted_waits_for_admission_checks() -> None:
    conditions = [cond("QuotaReserved", "True"),
                  cond("Admitted", "False", "The workload has not all checks ready")]  # fmt: skip
    wait = workload_state(workload("w", owner("Job", "j"), conditions=conditions), [LOCAL_QUEUE])
    assert (wait.state, wait.waiting) == ("checks", True)
    assert "waits for admission checks: The workload has not all checks ready" in wait.verdict("x")


def test_a_missing_local_queue_and_an_eviction_are_said() -> None:
    conditions = [*PENDING, cond("Evicted", "True", "Preempted to accommodate a workload")]
    wait = workload_state(workload("w", owner("Job", "j"), conditions=conditions, queue="nope"),
                          [LOCAL_QUEUE])  # fmt: skip
    assert wait.cluster_queue == ""
    assert wait.message == (
        f"LocalQueue team-a/nope does not exist; {NO_QUOTA}; "
        "evicted: Preempted to accommodate a workload"
    )


def test_a_job_is_matched_to_its_workload_by_owner_and_unqueued_jobs_are_none() -> None:
    mine = workload("job-train", owner("Job", "train"), conditions=PENDING)
    other = workload("job-other", owner("Job", "other"), conditions=ADMITTED)
    wait = job_wait(job("train"), [other, mine], [LOCAL_QUEUE])
    assert wait is not None
    assert wait.workload == "team-a/job-train"
    assert job_wait(job("plain", queue=None), [other, mine], [LOCAL_QUEUE]) is None
    early = job_wait(job("new"), [other], [])
    assert early is not None
    assert early.waiting
    assert early.message.startswith("LocalQueue team-a/team-a does not exist; Kueue has made no")


def test_a_claim_waits_when_a_pod_or_job_using_it_waits() -> None:
    made = claim(NS, "p-gpu-x1z")
    made["metadata"]["ownerReferences"] = [owner("Pod", "p")]
    pod = {"metadata": {"name": "p", "namespace": NS, "uid": "uid-p",
                        "ownerReferences": [owner("Job", "train")]}, "spec": {}}  # fmt: skip
    waiting = workload("job-train", owner("Job", "train"), conditions=PENDING)
    wait = claim_wait(made, [pod], [], [waiting], [LOCAL_QUEUE])
    assert wait is not None
    assert wait.workload == "team-a/job-train"
    # A Job that names an existing claim (Kueue refuses such Workloads: inadmissible).
    named = claim(NS, "shared")
    user = job("user", claims=[{"name": "gpu", "resourceClaimName": "shared"}])
    refused = workload("job-user", owner("Job", "user"), conditions=[
        cond("QuotaReserved", "False", "DynamicResourceAllocation feature does not support "
             "use of resource claims", "Inadmissible")])  # fmt: skip
    wait = claim_wait(named, [], [user], [refused], [LOCAL_QUEUE])
    assert wait is not None
    assert "does not support use of resource claims" in wait.message
    # Admitted users, or none at all: nothing waits.
    admitted = workload("job-train", owner("Job", "train"), conditions=ADMITTED)
    assert claim_wait(made, [pod], [], [admitted], [LOCAL_QUEUE]) is None
    assert claim_wait(claim(NS, "lonely"), [pod], [user], [waiting, refused], []) is None


def test_with_queue_puts_kueue_first_and_keeps_the_device_verdict() -> None:
    target = claim(NS, "c", [exactly("gpu")])
    report = explain(target, standard_classes(), [mixed_node()], [target])
    assert report.satisfied
    wait = workload_state(workload("w", owner("Job", "j"), conditions=PENDING), [LOCAL_QUEUE])
    with_queue(report, wait)
    assert report.verdict.startswith("claim team-a/c waits in Kueue: Workload team-a/w in ")
    assert report.verdict.endswith(
        "(devices: is not allocated, but each request has enough devices: it is allocated when "
        "a pod using it is scheduled (no backtracking search was made across requests))"
    )
    assert not report.satisfied
    assert report.to_json()["queue"]["clusterQueue"] == "research-a"


# ---- the commands, with the cluster reads replaced ---------------------------------------------


FakePods = FakeCoreV1
"""`CoreV1Api` for `read_pods`: the given pods."""


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Obj]]:
    """Objects by plural (``resourceclaims``, ``workloads``, ``jobs``, ...); tests fill it.
    ``workloads`` absent: Kueue's API is not served."""
    objects: dict[str, list[Obj]] = {
        "deviceclasses": standard_classes(),
        "resourceslices": [mixed_node()],
        "resourceclaims": [],
        "jobs": [],
        "localqueues": [LOCAL_QUEUE],
        "resourceclaimtemplates": [],
    }

    def find(plural: str, namespace: str, name: str) -> Obj:
        for item in objects.get(plural, []):
            if (item["metadata"]["namespace"], item["metadata"]["name"]) == (namespace, name):
                return item
        raise errors.NotFoundError(f"read {plural} {namespace}/{name}: 404 NotFound", status=404)

    def listed(client: object, api_version: str, plural: str, namespace: str) -> list[Obj]:
        if plural not in objects:
            raise errors.NotFoundError(f"list {plural}: 404 NotFound", status=404)
        return [i for i in objects[plural] if i["metadata"]["namespace"] == namespace]

    monkeypatch.setattr(cli_cluster, "new_api_client", lambda path: object())
    monkeypatch.setattr(
        cli_cluster, "list_resource_objects", lambda client, plural: objects[plural]
    )
    monkeypatch.setattr(cli_cluster, "read_resource_claim",
                        lambda client, ns, name: find("resourceclaims", ns, name))  # fmt: skip
    monkeypatch.setattr(cli_cluster, "list_namespaced_objects", listed)
    monkeypatch.setattr(cli_cluster, "read_namespaced_object",
                        lambda client, api, plural, ns, name: find(plural, ns, name))  # fmt: skip
    FakePods.pods, FakePods.events, FakePods.quotas = [], [], []
    monkeypatch.setattr(cli_cluster, "CoreV1Api", FakePods)
    return objects


def template(name: str, requests: list[Obj]) -> Obj:
    return {"metadata": {"name": name, "namespace": NS},
            "spec": {"spec": {"devices": {"requests": requests}}}}  # fmt: skip


def test_explain_job_names_the_queues_and_kueues_message_then_its_claims(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster["jobs"] = [job("train", claims=[{"name": "c0", "resourceClaimTemplateName": "two"}])]
    cluster["resourceclaimtemplates"] = [template("two", [exactly("gpu", count=2)])]
    cluster["workloads"] = [workload("job-train", owner("Job", "train"), conditions=PENDING)]
    assert main(["explain", f"{NS}/job/train"], environ={}) == EXIT_FAILED
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "verdict: job team-a/train waits in Kueue: Workload team-a/job-train in LocalQueue "
        f"team-a/team-a (ClusterQueue research-a) has no quota reserved: {NO_QUOTA}"
    )
    assert lines[1] == "claim team-a/two (template):"
    assert lines[2].startswith("verdict: claim team-a/two (template) is not allocated, but each")
    # Once admitted, the Job is fine: its template's devices exist.
    cluster["workloads"] = [workload("job-train", owner("Job", "train"), conditions=ADMITTED)]
    assert main(["explain", f"{NS}/job/train", "-o", "json"], environ={}) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["queue"]["state"] == "admitted"
    assert data["claims"][0]["requests"][0]["satisfied"] is True


def test_explain_job_without_kueue_and_usage_errors(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster["jobs"] = [job("plain", queue=None)]
    assert main(["explain", f"{NS}/job/plain"], environ={}) == EXIT_OK
    out = capsys.readouterr().out
    assert (
        out.splitlines()[0] == "verdict: job team-a/plain is not queued by Kueue and is suspended"
    )
    assert main(["explain", f"{NS}/job/missing"], environ={}) == EXIT_FAILED
    assert "read jobs team-a/missing: 404" in capsys.readouterr().err
    assert main(["explain", f"{NS}/deployment/x"], environ={}) == EXIT_USAGE
    assert "expected NAMESPACE/CLAIM, NAMESPACE/pod/NAME or NAMESPACE/job/NAME" in (
        capsys.readouterr().err
    )


def test_explain_claim_of_a_gated_pod_says_kueue_holds_it(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    made = claim(NS, "p-gpu-x1z")
    made["metadata"]["ownerReferences"] = [owner("Pod", "p")]
    cluster["resourceclaims"] = [made]
    FakePods.pods = [{"metadata": {"name": "p", "namespace": NS, "uid": "uid-p"}, "spec": {}}]
    cluster["workloads"] = [workload("pod-p", owner("Pod", "p"), conditions=PENDING)]
    assert main(["explain", f"{NS}/p-gpu-x1z"], environ={}) == EXIT_FAILED
    verdict = capsys.readouterr().out.splitlines()[0]
    assert verdict.startswith("verdict: claim team-a/p-gpu-x1z waits in Kueue: Workload ")
    assert NO_QUOTA in verdict
    # Without Kueue's API the claim is explained as before.
    del cluster["workloads"]
    assert main(["explain", f"{NS}/p-gpu-x1z"], environ={}) == EXIT_OK
    assert "Kueue" not in capsys.readouterr().out


# ---- the reads, through the real client --------------------------------------------------------


@pytest.fixture
def stub() -> Iterator[StubApiserver]:
    with StubApiserver.running() as server:
        yield server


WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/team-a/workloads"


def test_read_kueue_is_none_when_the_api_is_not_served(stub: StubApiserver) -> None:
    stub.route("GET", WORKLOADS, (404, status(404, "NotFound", "the server could not find it")))
    assert cli_cluster.read_kueue(stub.client, NS) is None


def test_read_kueue_lists_workloads_and_local_queues_and_reports_refusals(
    stub: StubApiserver,
) -> None:
    item = workload("w", owner("Job", "j"), conditions=PENDING)
    stub.route("GET", WORKLOADS, (200, {"items": [item], "metadata": {}}))
    stub.route("GET", "/apis/kueue.x-k8s.io/v1beta2/namespaces/team-a/localqueues",
               (403, status(403, "Forbidden", "cannot list localqueues")))  # fmt: skip
    with pytest.raises(
        errors.ForbiddenError, match=r"list localqueues\.kueue\.x-k8s\.io in namesp"
    ):
        cli_cluster.read_kueue(stub.client, NS)
    stub.route("GET", "/apis/kueue.x-k8s.io/v1beta2/namespaces/team-a/localqueues",
               (200, {"items": [LOCAL_QUEUE], "metadata": {}}))  # fmt: skip
    assert cli_cluster.read_kueue(stub.client, NS) == ([item], [LOCAL_QUEUE])
