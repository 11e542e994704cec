"""The chart's tier-quota policy (templates/quota-policy.yaml, docs/quotas.md), evaluated as the
apiserver does (`tests.helmchart.AdmissionPolicy`): in a namespace whose tier quota (a
ResourceQuota labelled ``gpu.nvidia.com/tier-quota: "true"``) names some DeviceClasses, claims,
claim templates and pods may use those classes only, and no admin access. The same objects on
the local cluster: e2e/test_tier_quota.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helmchart import AdmissionPolicy, Decision, Rendered

POLICY = "gpu-dra-tier-quota"
TEAM = "research"
NAMESPACE_OBJECT = {"metadata": {"name": TEAM}}
QUOTA = yaml.safe_load(
    (Path(__file__).resolve().parents[1] / "deployments" / "quotas" / "research.yaml").read_text()
)
"""The recipe's research quota: gpu, mig-1g, mig-3g and mps classes."""
HOST_DRIVER = {"gpuResourcesEnabledOverride": True}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return Rendered.of(HOST_DRIVER, tmp_path_factory.mktemp("tier-quota"))


@pytest.fixture(scope="module")
def policy(rendered: Rendered) -> AdmissionPolicy:
    return AdmissionPolicy(rendered.one("ValidatingAdmissionPolicy", POLICY))


def requests_of(*classes: str) -> list[dict[str, Any]]:
    return [{"name": f"r{i}", "exactly": {"deviceClassName": c}} for i, c in enumerate(classes)]


def claim(*classes: str) -> dict[str, Any]:
    return {"kind": "ResourceClaim", "spec": {"devices": {"requests": requests_of(*classes)}}}


def pod(resources: dict[str, str], init: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            # As the apiserver stores it: requests defaulted to the limits.
            {"name": "main", "resources": {"limits": dict(resources), "requests": dict(resources)}},
            {"name": "sidecar"},
        ]
    }
    if init is not None:
        spec["initContainers"] = [{"name": "init", "resources": {"limits": dict(init)}}]
    return {"kind": "Pod", "spec": spec}


def decide(
    policy: AdmissionPolicy, resource: str, obj: dict[str, Any], quota: Any = QUOTA
) -> Decision:
    assert policy.matches("" if resource == "pods" else "resource.k8s.io", resource, "CREATE")
    return policy.decide(
        user="alice", node=None, operation="CREATE", resource=resource, obj=obj,
        namespace=NAMESPACE_OBJECT, params=quota,
    )  # fmt: skip


NAMED = {"gpu.nvidia.com", "mig-1g.gpu.nvidia.com", "mig-3g.gpu.nvidia.com", "mps.gpu.nvidia.com"}
REFUSAL = re.compile(
    rf"gpu-dra tier quota: namespace {TEAM} may use only the DeviceClasses its ResourceQuota "
    r"gpu-tiers names \((?P<named>[^)]*)\); this (?P<kind>[A-Za-z]+) uses (?P<used>.*)\. Use a "
    r"class the quota names, or ask the platform team to add "
    r"<class>\.deviceclass\.resource\.k8s\.io/devices to the quota"
)


def refused(decision: Decision, classes: str, kind: str, named: set[str] = NAMED) -> bool:
    """Whether `decision` is the policy's refusal of `classes` in a `kind` (the quota's names
    come in the map's order, which the apiserver does not fix)."""
    found = REFUSAL.fullmatch(decision.message)
    assert found is not None, decision.message
    listed = set() if found["named"] == "none" else set(found["named"].split(", "))
    return (
        not decision.allowed
        and listed == named
        and (found["kind"], found["used"]) == (kind, classes)
    )


def test_the_policy_judges_only_namespaces_with_a_labelled_quota(rendered: Rendered) -> None:
    binding = rendered.one("ValidatingAdmissionPolicyBinding", POLICY)["spec"]
    policy = rendered.one("ValidatingAdmissionPolicy", POLICY)["spec"]

    assert binding["policyName"] == POLICY
    assert binding["validationActions"] == ["Deny"]
    assert binding["paramRef"] == {
        "selector": {"matchLabels": {"gpu.nvidia.com/tier-quota": "true"}},
        "parameterNotFoundAction": "Allow",
    }
    assert "namespace" not in binding["paramRef"]  # the quota of the request's own namespace
    assert policy["paramKind"] == {"apiVersion": "v1", "kind": "ResourceQuota"}
    assert policy["failurePolicy"] == "Fail"
    assert QUOTA["metadata"]["labels"] == {"gpu.nvidia.com/tier-quota": "true"}


def test_claims_are_judged_at_creation_only(policy: AdmissionPolicy) -> None:
    """An update (a finalizer removed after the quota changed) must never be refused."""
    for resource in ("resourceclaims", "resourceclaimtemplates", "pods"):
        group = "" if resource == "pods" else "resource.k8s.io"
        assert policy.matches(group, resource, "CREATE")
        assert not policy.matches(group, resource, "UPDATE")
        assert not policy.matches(group, resource, "DELETE")
    assert not policy.matches("resource.k8s.io", "resourceclaims/status", "UPDATE")


def test_claims_of_named_classes_pass_and_others_are_refused(policy: AdmissionPolicy) -> None:
    assert decide(policy, "resourceclaims", claim("gpu.nvidia.com", "mps.gpu.nvidia.com")) == (
        Decision(True)
    )
    other = decide(policy, "resourceclaims", claim("gpu.nvidia.com", "hopper.gpu.nvidia.com"))
    assert refused(other, "hopper.gpu.nvidia.com", "ResourceClaim")


def test_every_first_available_alternative_must_be_named(policy: AdmissionPolicy) -> None:
    def first_available(*classes: str) -> dict[str, Any]:
        subrequests = [{"name": f"s{i}", "deviceClassName": c} for i, c in enumerate(classes)]
        request = {"name": "gpu", "firstAvailable": subrequests}
        return {"spec": {"devices": {"requests": [request]}}}

    named = first_available("mig-3g.gpu.nvidia.com", "gpu.nvidia.com")
    assert decide(policy, "resourceclaims", named).allowed
    fallback = first_available("mig-3g.gpu.nvidia.com", "mig.nvidia.com", "training.gpu.nvidia.com")
    assert refused(
        decide(policy, "resourceclaims", fallback),
        "mig.nvidia.com, training.gpu.nvidia.com",
        "ResourceClaim",
    )


def test_claim_templates_are_judged_by_the_claim_they_make(policy: AdmissionPolicy) -> None:
    def template(*classes: str) -> dict[str, Any]:
        return {"spec": {"spec": {"devices": {"requests": requests_of(*classes)}}}}

    assert decide(policy, "resourceclaimtemplates", template("mig-1g.gpu.nvidia.com")).allowed
    assert refused(
        decide(policy, "resourceclaimtemplates", template("mig.nvidia.com")),
        "mig.nvidia.com",
        "ResourceClaimTemplate",
    )


@pytest.mark.parametrize(
    ("resource", "its_class"),
    [
        ("nvidia.com/gpu", None),
        ("nvidia.com/gpu.shared", None),
        ("nvidia.com/mig-1g.10gb", "mig-1g.10gb.gpu.nvidia.com"),
        ("nvidia.com/mig-1g.10gb.me", "mig-1g.10gb.me.gpu.nvidia.com"),
        ("deviceclass.resource.kubernetes.io/gpu.nvidia.com", None),
        ("deviceclass.resource.kubernetes.io/training.gpu.nvidia.com", "training.gpu.nvidia.com"),
    ],
)
def test_pods_extended_resources_map_to_the_class_that_serves_them(
    policy: AdmissionPolicy, resource: str, its_class: str | None
) -> None:
    decision = decide(policy, "pods", pod({resource: "1", "cpu": "1"}))
    if its_class is None:
        assert decision == Decision(True)
    else:
        assert refused(decision, its_class, "pod")
    init = decide(policy, "pods", pod({"memory": "1Gi"}, init={resource: "1"}))
    assert init.allowed is (its_class is None)


def test_a_pod_without_gpus_or_with_other_vendors_resources_passes(
    policy: AdmissionPolicy,
) -> None:
    assert decide(policy, "pods", pod({"cpu": "2", "example.com/fpga": "1"})).allowed


def test_admin_access_is_refused_where_a_tier_quota_rules(policy: AdmissionPolicy) -> None:
    admin = claim("gpu.nvidia.com")
    admin["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
    decision = decide(policy, "resourceclaims", admin)
    assert not decision.allowed
    assert decision.message.startswith(
        "gpu-dra tier quota: admin access (adminAccess: true) reaches devices other claims hold "
        f"and is refused in namespace {TEAM}, which ResourceQuota gpu-tiers governs"
    )
    admin["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = False
    assert decide(policy, "resourceclaims", admin).allowed


def test_a_tier_quota_that_names_no_class_refuses_every_class(policy: AdmissionPolicy) -> None:
    empty = {"metadata": {"name": "gpu-tiers"}, "spec": {}}
    decision = decide(policy, "resourceclaims", claim("gpu.nvidia.com"), quota=empty)
    assert not decision.allowed
    assert "its ResourceQuota gpu-tiers names (none); this ResourceClaim uses gpu.nvidia.com." in (
        decision.message
    )
    assert decide(policy, "pods", pod({"cpu": "1"}), quota=empty).allowed


def test_the_pod_mapping_follows_the_platforms_shared_tier(tmp_path: Path) -> None:
    rendered = Rendered.of(
        {**HOST_DRIVER, "deviceClasses": {"sharedResource": "capped", "migProfiles": []}}, tmp_path
    )
    policy = AdmissionPolicy(rendered.one("ValidatingAdmissionPolicy", POLICY))

    decision = decide(policy, "pods", pod({"nvidia.com/gpu.shared": "1"}))
    assert refused(decision, "capped.gpu.nvidia.com", "pod")
    assert decide(policy, "pods", pod({"nvidia.com/mig-1g.10gb": "1"})).allowed  # no such class


def test_the_policy_can_be_left_out(tmp_path: Path) -> None:
    rendered = Rendered.of({**HOST_DRIVER, "tierQuota": {"enabled": False}}, tmp_path)
    names = {o["metadata"]["name"] for o in rendered.all("ValidatingAdmissionPolicy")}
    assert POLICY not in names
    assert names  # the plugin's own policies stay
