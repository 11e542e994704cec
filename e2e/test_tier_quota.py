"""Tier quotas that cannot be bypassed (issue 23, docs/quotas.md), with the chart-installed
driver on the recipe's node: 8x A100 80GB, GPUs 0-3 whole, 4-5 as seven 1g.10gb MIG slices
each, 6 as two 3g.40gb slices, 7 offered as MPS shares.

Two team namespaces get the recipe's quotas verbatim (deployments/quotas/research.yaml and
training.yaml, applied as ``kubectl apply -n <team> -f``). Claims within quota are admitted and
run; the next claim of each tier is refused at creation with the quota's message; deleting a
claim frees its quota. Every bypass route is tried and refused: another class over the same
hardware, a hand-written selector, firstAvailable, a claim template (at creation, and the claim
a pod's template makes), ``nvidia.com/gpu``, ``nvidia.com/mig-<profile>`` and
``deviceclass.resource.kubernetes.io/<class>`` pods, and admin access."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import CoreV1Api
from kubernetes.dynamic.exceptions import DynamicApiError

from e2e import manifests as m
from e2e.chart import (
    share_node,
)
from e2e.cluster import Cluster
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.quotas import QUOTA, QUOTAS, apply_tier_quota
from e2e.workloads import delete_pods, wait_event, wait_running
from gpu_dra.cli.__main__ import main as gpu_dra

pytestmark = pytest.mark.e2e

A100 = "A100-SXM4-80GB"
PROFILE_NAME = "e2e-tier-quota"
PROFILE: dict[str, Any] = {
    "name": PROFILE_NAME,
    "description": "docs/quotas.md's node: 8x A100 80GB; 4 whole, 14 1g.10gb, 2 3g.40gb, shares",
    "driverVersion": "580.65.06",
    "cudaDriverVersion": 13000,
    "gpus": [
        *({"model": A100, "busId": f"00000000:{bus}:00.0"} for bus in ("07", "0F", "47", "4E")),
        *(
            {
                "model": A100,
                "busId": f"00000000:{bus}:00.0",
                "migDevices": [{"profileId": 19, "start": start} for start in range(7)],
            }
            for bus in ("87", "90")
        ),
        {
            "model": A100,
            "busId": "00000000:B7:00.0",
            "migDevices": [{"profileId": 9, "start": 0}, {"profileId": 9, "start": 4}],
        },
        {"model": A100, "busId": "00000000:BD:00.0"},
    ],
}
"""GPU 7 (minor 7) is offered as MPS shares (GPU_DRA_MPS_SHARES=7)."""

WHOLE = "gpu.nvidia.com"
MIG_1G = "mig-1g.gpu.nvidia.com"
MIG_3G = "mig-3g.gpu.nvidia.com"
SHARES = "mps.gpu.nvidia.com"
A100_SELECTOR = "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-SXM4-80GB'"


@pytest.fixture(scope="module")
def installed(
    cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Driver]:
    """The chart (tier-quota policy on, as by default) on the recipe's node."""
    directory = tmp_path_factory.mktemp("tier-quota")
    with share_node(cluster, kube, directory, mps_shares="7", profile=PROFILE) as driver:
        wait_for("the catalog's classes", lambda: kube.exists(
            "resource.k8s.io/v1", "DeviceClass", MIG_3G, None), 60)  # fmt: skip
        yield driver


def claim(name: str, namespace: str, device_class: str, selectors: list[str] | None = None) -> Any:
    return m.claim(name, namespace, m.claim_spec([m.request(device_class=device_class,
                                                            selectors=selectors)]))  # fmt: skip


def first_available(name: str, namespace: str, classes: list[str]) -> Any:
    subrequests = [{"name": f"option{i}", "deviceClassName": c} for i, c in enumerate(classes)]
    return m.claim(name, namespace, {"devices": {"requests": [
        {"name": "gpu", "firstAvailable": subrequests}]}})  # fmt: skip


def refused(kube: Kube, manifest: dict[str, Any]) -> str:
    """The apiserver's message refusing to create `manifest` (403); fails if it is created."""
    with pytest.raises(DynamicApiError) as refusal:
        kube.create(manifest)
    assert refusal.value.status == 403, refusal.value.body
    return str(json.loads(str(refusal.value.body))["message"])


def assert_over_quota(message: str, device_class: str, limit: int) -> None:
    resource = m.class_quota(device_class)
    assert f"exceeded quota: {QUOTA}" in message, message
    assert f"requested: {resource}=1" in message, message
    assert f"used: {resource}={limit}" in message, message
    assert f"limited: {resource}={limit}" in message, message


def assert_policy_refused(message: str, namespace: str, refused_class: str) -> None:
    assert f"gpu-dra tier quota: namespace {namespace} may use only the DeviceClasses" in message
    assert f"ResourceQuota {QUOTA} names" in message, message
    assert f"uses {refused_class}." in message, message


def run_with(kube: Kube, pod: str, claim_name: str, namespace: str) -> None:
    kube.create(m.gpu_pod(pod, namespace, claim=claim_name))
    wait_running(kube, pod, namespace)


def create_until_admitted(kube: Kube, manifest: dict[str, Any], timeout: float = 60) -> None:
    """Create `manifest`, retrying while the quota still counts a deleted claim (the quota
    controller recounts after the deletion)."""

    def created() -> bool:
        try:
            kube.create(manifest)
        except DynamicApiError as error:
            if error.status == 403 and "exceeded quota" in str(error.body):
                return False
            raise
        return True

    wait_for(f"{manifest['metadata']['name']} to be admitted", created, timeout)


def test_each_team_runs_within_its_quota_and_the_next_claim_of_a_tier_is_refused(
    cluster: Cluster, kube: Kube, installed: Driver, namespace: str, other_namespace: str
) -> None:
    research, training = namespace, other_namespace
    apply_tier_quota(cluster, kube, "research.yaml", research)
    apply_tier_quota(cluster, kube, "training.yaml", training)

    # Research: within quota every tier is admitted, and one claim of each runs.
    kube.create(claim("whole", research, WHOLE))
    for index in range(10):
        kube.create(claim(f"notebook-{index}", research, MIG_1G))
    kube.create(claim("finetune", research, MIG_3G))
    for index in range(8):
        # 8 x 4Gi: within the 64Gi of share memory, so the ninth share meets the device limit.
        kube.create(m.share_claim(f"share-{index}", research, "4Gi", 12))
    run_with(kube, "whole", "whole", research)
    run_with(kube, "notebook", "notebook-0", research)
    run_with(kube, "finetune", "finetune", research)
    run_with(kube, "share", "share-0", research)

    # The next claim of each tier is refused at creation, naming the quota.
    assert_over_quota(refused(kube, claim("whole-2", research, WHOLE)), WHOLE, 1)
    assert_over_quota(refused(kube, claim("notebook-10", research, MIG_1G)), MIG_1G, 10)
    assert_over_quota(refused(kube, claim("finetune-2", research, MIG_3G)), MIG_3G, 1)
    assert_over_quota(refused(kube, m.share_claim("share-8", research, "1Gi", 1)), SHARES, 8)

    # Training's quota is its own: its three whole GPUs run beside research's one.
    for index in range(3):
        kube.create(claim(f"trainer-{index}", training, WHOLE))
        kube.create(m.gpu_pod(f"trainer-{index}", training, claim=f"trainer-{index}"))
    for index in range(3):
        wait_running(kube, f"trainer-{index}", training)
    assert_over_quota(refused(kube, claim("trainer-3", training, WHOLE)), WHOLE, 3)
    kube.create(claim("eval-1", training, MIG_3G))
    assert_over_quota(refused(kube, claim("eval-2", training, MIG_3G)), MIG_3G, 1)

    # Deleting a claim frees its quota.
    delete_pods(kube, research, ["whole"])
    kube.delete("resource.k8s.io/v1", "ResourceClaim", "whole", research)
    create_until_admitted(kube, claim("whole-2", research, WHOLE))
    run_with(kube, "whole-2", "whole-2", research)


def test_no_route_gets_around_the_tier_quota(
    cluster: Cluster,
    kube: Kube,
    installed: Driver,
    namespace: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    team = namespace
    apply_tier_quota(cluster, kube, "research.yaml", team)
    kube.create(claim("whole", team, WHOLE))  # the whole-GPU quota (1) is used up

    # Another class over the same hardware: every class the quota does not name is refused.
    for other in ("training.gpu.nvidia.com", "large-memory.gpu.nvidia.com", "mig.nvidia.com",
                  "mig-1g.10gb.gpu.nvidia.com", "capped.gpu.nvidia.com"):  # fmt: skip
        assert_policy_refused(refused(kube, claim("other", team, other)), team, other)

    # A hand-written selector narrows its class and counts against it.
    assert_over_quota(refused(kube, claim("picked", team, WHOLE, [A100_SELECTOR])), WHOLE, 1)

    # firstAvailable: an unnamed class among the alternatives is refused; named ones count.
    message = refused(kube, first_available("either", team, [WHOLE, "training.gpu.nvidia.com"]))
    assert_policy_refused(message, team, "training.gpu.nvidia.com")
    assert_over_quota(refused(kube, first_available("fallback", team, [WHOLE])), WHOLE, 1)

    # A claim template naming another class is refused at creation; one of a named class is
    # admitted, but the claim it makes for a pod over quota is refused: the pod never runs.
    template = m.claim_template("other", team, m.claim_spec([m.request(
        device_class="training.gpu.nvidia.com")]))  # fmt: skip
    assert_policy_refused(refused(kube, template), team, "training.gpu.nvidia.com")
    kube.create(m.claim_template("whole-gpu", team, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("templated", team, template="whole-gpu"))
    message = wait_event(kube, team, "templated", "FailedResourceClaimCreation", 60)
    assert_over_quota(message, WHOLE, 1)
    assert kube.get("v1", "Pod", "templated", team)["status"]["phase"] == "Pending"
    # gpu-dra explain names the quota that keeps the pod waiting.
    code = gpu_dra(["explain", f"{team}/pod/templated", f"--kubeconfig={cluster.kubeconfig}"],
                   environ={})  # fmt: skip
    verdict = capsys.readouterr().out.splitlines()[0]
    assert code == 1
    assert verdict.startswith(
        f"verdict: pod {team}/templated waits: the claim it needs is refused (a ResourceQuota "
        f"is used up): exceeded quota: {QUOTA}, requested: {m.class_quota(WHOLE)}=1"
    ), verdict

    # Pods written for the device plugin: nvidia.com/gpu is counted and refused at creation;
    # resource names of classes the quota does not name are refused by the policy.
    message = refused(kube, m.device_plugin_pod("legacy", team, {"nvidia.com/gpu": "1"}))
    assert "exceeded quota: gpu-tiers, requested: requests.nvidia.com/gpu=1" in message, message
    for resource, its_class in (
        ("nvidia.com/mig-1g.10gb", "mig-1g.10gb.gpu.nvidia.com"),
        ("deviceclass.resource.kubernetes.io/training.gpu.nvidia.com", "training.gpu.nvidia.com"),
    ):
        message = refused(kube, m.device_plugin_pod("legacy", team, {resource: "1"}))
        assert_policy_refused(message, team, its_class)

    # Admin access (allowed in the namespace by its label) is refused where a tier quota rules.
    CoreV1Api(kube.api_client).patch_namespace(
        team, {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}}
    )
    admin = claim("admin", team, MIG_1G)
    admin["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
    message = refused(kube, admin)
    assert "gpu-dra tier quota: admin access (adminAccess: true)" in message, message

    # Nothing was created by any refused route.
    names = {c["metadata"]["name"] for c in kube.list("resource.k8s.io/v1", "ResourceClaim",
                                                       namespace=team)}  # fmt: skip
    assert names == {"whole"}, names


def test_a_namespace_without_a_tier_quota_is_not_governed(
    kube: Kube, installed: Driver, namespace: str
) -> None:
    """A quota without the label limits what it names, but the policy leaves the namespace
    alone: every other class stays unlimited (the hole `gpu-dra lint` warns about)."""
    quota = yaml.safe_load(Path(QUOTAS / "training.yaml").read_text())
    del quota["metadata"]["labels"]
    quota["metadata"]["namespace"] = namespace
    kube.create(quota)
    wait_for("the quota to be counted", lambda: "used" in kube.get(
        "v1", "ResourceQuota", QUOTA, namespace).get("status", {}), 60)  # fmt: skip
    kube.create(claim("through-another-class", namespace, "training.gpu.nvidia.com"))
    kube.create(claim("fine", namespace, WHOLE))
