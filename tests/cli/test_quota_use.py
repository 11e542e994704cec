"""The quota part of `gpu-dra explain` (cli/quota_use.py): quota lines for a claim's classes
and the refusals that keep a pod Pending, over objects shaped as the apiserver returns them
(the event messages are those of Kubernetes 1.37 in e2e/test_tier_quota.py)."""

from __future__ import annotations

from typing import Any

from gpu_dra.cli.quota_use import (
    QuotaLine,
    QuotaRefusal,
    pod_extended_resources,
    pod_refusals,
    quota_lines,
)

WHOLE = "gpu.nvidia.com.deviceclass.resource.k8s.io/devices"
MIG_1G = "mig-1g.gpu.nvidia.com.deviceclass.resource.k8s.io/devices"
QUOTA_EVENT = (
    'PodResourceClaim gpu: create ResourceClaim : resourceclaims.resource.k8s.io "templated-gpu-'
    f'q722p" is forbidden: exceeded quota: gpu-tiers, requested: {WHOLE}=1,requests.nvidia.com/'
    f"gpu=1, used: {WHOLE}=1,requests.nvidia.com/gpu=1, limited: {WHOLE}=1,requests.nvidia.com/"
    "gpu=1"
)
POLICY_EVENT = (
    'PodResourceClaim gpu: create ResourceClaim : resourceclaims.resource.k8s.io "x" is '
    "forbidden: ValidatingAdmissionPolicy 'gpu-dra-tier-quota' with binding 'gpu-dra-tier-"
    "quota' denied request: gpu-dra tier quota: namespace research may use only the "
    "DeviceClasses its ResourceQuota gpu-tiers names (gpu.nvidia.com); this ResourceClaim uses "
    "training.gpu.nvidia.com. Use a class the quota names, or ask the platform team to add "
    "<class>.deviceclass.resource.k8s.io/devices to the quota"
)


def quota(name: str, hard: dict[str, str], used: dict[str, str], tier: bool = True) -> Any:
    labels = {"gpu.nvidia.com/tier-quota": "true"} if tier else {}
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"hard": hard},
        "status": {"hard": hard, "used": used},
    }


def event(reason: str, message: str, when: str, uid: str = "pod-uid") -> Any:
    return {
        "reason": reason,
        "message": message,
        "lastTimestamp": when,
        "involvedObject": {"kind": "Pod", "uid": uid},
    }


POD = {"metadata": {"uid": "pod-uid"}, "status": {"phase": "Pending"}}


def test_the_lines_are_those_of_the_classes_and_resources_asked_for() -> None:
    quotas = [
        quota(
            "gpu-tiers",
            {
                WHOLE: "1",
                MIG_1G: "10",
                "requests.nvidia.com/gpu": "1",
                "gpu.nvidia.com/share-memory": "64Gi",
                "pods": "20",
            },
            {WHOLE: "1", MIG_1G: "3", "requests.nvidia.com/gpu": "1"},
        ),
        quota("cpu", {"requests.cpu": "8"}, {"requests.cpu": "1"}, tier=False),
    ]

    lines = quota_lines(quotas, ["gpu.nvidia.com"], ["nvidia.com/gpu"])

    assert lines == [
        QuotaLine(
            "gpu-tiers", True, "gpu.nvidia.com.deviceclass.resource.k8s.io/devices", "1", "1"
        ),
        QuotaLine("gpu-tiers", True, "gpu.nvidia.com/share-memory", "", "64Gi"),
        QuotaLine("gpu-tiers", True, "requests.nvidia.com/gpu", "1", "1"),
    ]
    assert [line.full for line in lines] == [True, False, True]
    assert quota_lines(quotas, ["mig-1g.gpu.nvidia.com"])[1].full is False


def test_a_pending_pods_newest_refusal_of_each_kind_is_reported() -> None:
    events = [
        event("FailedResourceClaimCreation", QUOTA_EVENT, "2026-11-29T06:55:36Z"),
        event("FailedResourceClaimCreation", POLICY_EVENT, "2026-11-29T06:55:40Z"),
        event("FailedScheduling", "0/1 nodes are available", "2026-11-29T06:55:41Z"),
        event("FailedResourceClaimCreation", QUOTA_EVENT, "2026-11-29T06:59:00Z", uid="other"),
    ]

    (refusal,) = pod_refusals(POD, events)

    assert refusal == QuotaRefusal(
        "policy", "FailedResourceClaimCreation", POLICY_EVENT[POLICY_EVENT.index("gpu-dra tier") :]
    )
    assert refusal.verdict("pod research/x").startswith(
        "pod research/x waits: the claim it needs is refused (the tier-quota policy): gpu-dra "
        "tier quota: namespace research may use only"
    )


def test_a_quota_refusal_names_the_quota_and_what_is_used() -> None:
    (refusal,) = pod_refusals(POD, [event("FailedScheduling", QUOTA_EVENT, "t1")])

    assert refusal.by == "quota"
    assert refusal.message.startswith(f"exceeded quota: gpu-tiers, requested: {WHOLE}=1")
    assert "(a ResourceQuota is used up)" in refusal.verdict("pod ns/p")


def test_a_pod_that_runs_waits_for_nothing() -> None:
    running = {"metadata": {"uid": "pod-uid"}, "status": {"phase": "Running"}}
    assert pod_refusals(running, [event("FailedScheduling", QUOTA_EVENT, "t1")]) == []


def test_a_pods_extended_resources_are_its_names_with_a_domain() -> None:
    pod = {"spec": {
        "containers": [{"resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1"}}}, {}],
        "initContainers": [{"resources": {"limits": {"example.com/fpga": "1"}}}],
    }}  # fmt: skip
    assert pod_extended_resources(pod) == ["example.com/fpga", "nvidia.com/gpu"]
