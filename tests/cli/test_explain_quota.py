"""`gpu-dra explain` names the quota (docs/quotas.md): the namespace's ResourceQuota limits on a
claim's classes, and, for ``NAMESPACE/pod/NAME``, the quota or tier-quota policy that refused the
claim a pod needs (its events, as kube-controller-manager and the scheduler record them),
with the cluster reads replaced."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from gpu_dra.cli import cluster as cli_cluster
from gpu_dra.cli.command import EXIT_FAILED, EXIT_OK
from gpu_dra.kube.errors import NotFoundError
from tests.cli.support import FakeCoreV1, run
from tests.fakes.cluster_objects import Obj, claim, mixed_node, standard_classes

NS = "research"
WHOLE = "gpu.nvidia.com.deviceclass.resource.k8s.io/devices"
REFUSAL = (
    f"exceeded quota: gpu-tiers, requested: {WHOLE}=1,requests.nvidia.com/gpu=1, used: "
    f"{WHOLE}=1,requests.nvidia.com/gpu=1, limited: {WHOLE}=1,requests.nvidia.com/gpu=1"
)
QUOTA = {
    "metadata": {"name": "gpu-tiers", "namespace": NS,
                 "labels": {"gpu.nvidia.com/tier-quota": "true"}},
    "spec": {"hard": {WHOLE: "1", "requests.nvidia.com/gpu": "1", "pods": "10"}},
    "status": {"used": {WHOLE: "1", "requests.nvidia.com/gpu": "1", "pods": "2"}},
}  # fmt: skip


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Obj]]:
    objects: dict[str, list[Obj]] = {
        "deviceclasses": standard_classes(),
        "resourceslices": [mixed_node()],
        "resourceclaims": [],
        "resourceclaimtemplates": [],
    }

    def find(plural: str, namespace: str, name: str) -> Obj:
        for item in objects.get(plural, []):
            if (item["metadata"]["namespace"], item["metadata"]["name"]) == (namespace, name):
                return item
        raise NotFoundError(f"read {plural} {namespace}/{name}: 404 NotFound", status=404)

    def no_kueue(client: object, api_version: str, plural: str, namespace: str) -> list[Obj]:
        raise NotFoundError(f"list {plural}: 404 NotFound", status=404)

    monkeypatch.setattr(cli_cluster, "new_api_client", lambda path: object())
    monkeypatch.setattr(cli_cluster, "list_resource_objects", lambda c, plural: objects[plural])
    monkeypatch.setattr(cli_cluster, "read_resource_claim",
                        lambda c, ns, name: find("resourceclaims", ns, name))  # fmt: skip
    monkeypatch.setattr(cli_cluster, "read_namespaced_object",
                        lambda c, api, plural, ns, name: find(plural, ns, name))  # fmt: skip
    monkeypatch.setattr(cli_cluster, "list_namespaced_objects", no_kueue)
    FakeCoreV1.pods, FakeCoreV1.events, FakeCoreV1.quotas = [], [], [QUOTA]
    monkeypatch.setattr(cli_cluster, "CoreV1Api", FakeCoreV1)
    return objects


def pod(name: str, phase: str, claims: list[Obj], limits: dict[str, str] | None = None) -> Obj:
    container: dict[str, Any] = {"name": "ctr"}
    if limits:
        container["resources"] = {"limits": limits}
    return {
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
        "spec": {"containers": [container], "resourceClaims": claims},
        "status": {"phase": phase},
    }


def event(pod_name: str, reason: str, message: str) -> Obj:
    return {
        "metadata": {"namespace": NS, "name": f"{pod_name}.1"},
        "involvedObject": {"kind": "Pod", "name": pod_name, "uid": f"uid-{pod_name}"},
        "reason": reason,
        "message": message,
        "lastTimestamp": "2026-11-29T06:55:36Z",
    }


def test_a_claims_explanation_shows_the_quota_on_its_class(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster["resourceclaims"] = [claim(NS, "whole")]

    code, out, _ = run(capsys, "explain", f"{NS}/whole")

    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[1] == "quota:"
    assert lines[3].split() == ["gpu-tiers", "(tier", "quota)", WHOLE, "1", "1", "full"]
    assert "pods" not in out  # only limits on the claim's classes
    code, out, _ = run(capsys, "explain", f"{NS}/whole", "-o", "json")
    assert json.loads(out)["quota"][0] == {
        "quota": "gpu-tiers", "tierQuota": True, "resource": WHOLE, "used": "1", "hard": "1",
        "full": True,
    }  # fmt: skip


def test_a_pod_whose_template_claim_the_quota_refused_is_told_so(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster["resourceclaimtemplates"] = [{
        "metadata": {"namespace": NS, "name": "whole-gpu"},
        "spec": {"spec": claim(NS, "x")["spec"]},
    }]  # fmt: skip
    source = {"name": "gpu", "resourceClaimTemplateName": "whole-gpu"}
    FakeCoreV1.pods = [pod("templated", "Pending", [source])]
    message = (
        f'PodResourceClaim gpu: create ResourceClaim "templated-gpu-q7" is forbidden: {REFUSAL}'
    )
    FakeCoreV1.events = [event("templated", "FailedResourceClaimCreation", message)]

    code, out, _ = run(capsys, "explain", f"{NS}/pod/templated")

    assert code == EXIT_FAILED
    assert out.splitlines()[0] == (
        f"verdict: pod {NS}/templated waits: the claim it needs is refused (a ResourceQuota is "
        f"used up): {REFUSAL}"
    )
    row = ["gpu-tiers", "(tier", "quota)", WHOLE, "1", "1", "full"]
    assert row in [line.split() for line in out.splitlines()]
    assert "claim research/whole-gpu (template):" in out  # its devices, from the template


def test_a_device_plugin_pod_refused_by_the_policy_names_it(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    FakeCoreV1.pods = [pod("legacy", "Pending", [], limits={"nvidia.com/gpu": "1"})]
    policy = ("gpu-dra tier quota: namespace research may use only the DeviceClasses its "
              "ResourceQuota gpu-tiers names (mig-1g.gpu.nvidia.com)")  # fmt: skip
    FakeCoreV1.events = [event("legacy", "FailedScheduling", f"... denied request: {policy}")]

    code, out, _ = run(capsys, "explain", f"{NS}/pod/legacy", "-o", "json")

    data = json.loads(out)
    assert code == EXIT_FAILED
    assert data["refusals"] == [{"by": "policy", "event": "FailedScheduling", "message": policy}]
    assert [line["resource"] for line in data["quota"]] == ["requests.nvidia.com/gpu"]


def test_a_running_pod_waits_for_nothing(
    cluster: dict[str, list[Obj]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster["resourceclaims"] = [claim(NS, "mine", allocated=[("gpu", "gpu-2")])]
    FakeCoreV1.pods = [pod("runner", "Running", [{"name": "gpu", "resourceClaimName": "mine"}])]
    FakeCoreV1.events = [event("runner", "FailedScheduling", REFUSAL)]  # an old one

    code, out, _ = run(capsys, "explain", f"{NS}/pod/runner")

    assert code == EXIT_OK
    assert out.splitlines()[0] == f"verdict: pod {NS}/runner is Running"
    assert "claim research/mine:" in out


def test_unreadable_quotas_are_said_and_the_rest_stands(
    cluster: dict[str, list[Obj]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Forbidden(FakeCoreV1):
        def list_namespaced_resource_quota(self, namespace: str, **_: Any) -> Any:
            raise ApiException(status=403, reason="Forbidden")

    monkeypatch.setattr(cli_cluster, "CoreV1Api", Forbidden)
    cluster["resourceclaims"] = [claim(NS, "whole")]

    code, out, _ = run(capsys, "explain", f"{NS}/whole")

    assert code == EXIT_OK
    assert out.splitlines()[1].startswith(f"quota: list ResourceQuotas in namespace {NS}: 403")
