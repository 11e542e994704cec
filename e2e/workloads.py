"""What the e2e tests wait for and read back about their pods and claims: running pods, the
devices a claim was allocated, the GPUs a container printed, events, the node's processes of a
pod, and deleting pods."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from kubernetes.client.exceptions import ApiException

from e2e import manifests as m
from e2e.kube import Kube, wait_for
from gpu_dra.kubelet_plugin.utilization.cgroups import pod_uid_from_cgroup

_UUID_LINE = re.compile(r"^GPU_DRA_(GPU_\d+)_UUID=(GPU-[0-9a-f-]+)$", re.M)


def wait_running(kube: Kube, name: str, namespace: str, timeout: float = 90) -> None:
    def running() -> bool:
        status = kube.get("v1", "Pod", name, namespace)["status"]
        assert status.get("phase") not in ("Failed", "Succeeded"), status
        return bool(status.get("phase") == "Running")

    wait_for(f"pod {namespace}/{name} to run", running, timeout)


def gpus_seen(kube: Kube, pod: str, namespace: str, container: str | None = None) -> dict[str, str]:
    """`{device env name: UUID}` the container printed; waits for the output."""
    seen: dict[str, str] = {}

    def printed() -> bool:
        seen.clear()
        try:
            log = kube.pod_log(pod, namespace, container)
        except ApiException:  # e.g. while a restarted kubelet is not serving logs yet
            return False
        seen.update(dict(_UUID_LINE.findall(log)))
        return bool(seen)

    wait_for(f"GPU lines in {pod}'s log", printed, 30)
    return dict(seen)


def allocated_devices(kube: Kube, claim: str, namespace: str) -> list[str]:
    status = kube.get("resource.k8s.io/v1", "ResourceClaim", claim, namespace)["status"]
    return [r["device"] for r in status["allocation"]["devices"]["results"]]


def extended_resource_claim(kube: Kube, pod: str, namespace: str) -> m.Obj:
    """The claim the scheduler made for the pod's extended resources (DRAExtendedResource)."""
    status = kube.get("v1", "Pod", pod, namespace)["status"]
    name = status["extendedResourceClaimStatus"]["resourceClaimName"]
    return kube.get("resource.k8s.io/v1", "ResourceClaim", name, namespace)


def share_claim_uid(
    kube: Kube, name: str, namespace: str, device: str, memory: str, compute: int
) -> str:
    """The UID of claim ``name``, once checked to hold one share of ``device``: the scheduler
    gave it a ``shareID`` and accounted ``memory`` and ``compute`` as its consumed capacity."""
    claim = kube.get("resource.k8s.io/v1", "ResourceClaim", name, namespace)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["device"] == device, (name, result)
    assert result["shareID"], (name, result)
    assert result["consumedCapacity"] == {"memory": memory, "compute": str(compute)}, result
    return str(claim["metadata"]["uid"])


def claim_uid(kube: Kube, name: str, namespace: str) -> str:
    return str(kube.get("resource.k8s.io/v1", "ResourceClaim", name, namespace)["metadata"]["uid"])


def wait_event(kube: Kube, namespace: str, pod: str, reason: str, timeout: float) -> str:
    """The message of the first event of `reason` about the pod; waits for one."""
    message = ""

    def seen() -> bool:
        nonlocal message
        for event in kube.events_for(namespace, pod):
            if event["reason"] == reason:
                message = event["message"]
                return True
        return False

    wait_for(f"a {reason} event of {namespace}/{pod}", seen, timeout)
    return message


def wait_refused_by_quota(kube: Kube, namespace: str, pod: str, resource: str) -> None:
    """Wait until the scheduler could not make the claim for the pod's extended resources
    because a ResourceQuota on `resource` is used up (the pod itself was admitted: the quota
    counts the claim the scheduler creates at binding); the pod stays Pending."""
    message = wait_event(kube, namespace, pod, "FailedScheduling", 60)
    assert "exceeded quota" in message, message
    assert f"requested: {resource}=1" in message, message
    assert kube.get("v1", "Pod", pod, namespace)["status"]["phase"] == "Pending"


def delete_pods(kube: Kube, namespace: str, names: Iterable[str]) -> None:
    """Delete the pods, then wait until every one is gone."""
    names = list(names)
    for name in names:
        kube.delete("v1", "Pod", name, namespace)
    for name in names:
        kube.wait_gone("v1", "Pod", name, namespace)


def run_pods_sharing(
    kube: Kube,
    namespace: str,
    claim: str,
    pods: Iterable[str],
    *,
    command: str = m.SHOW_GPUS,
    timeout: float = 90,
) -> None:
    """Create one pod per name, each using the existing `claim` and running `command`, and wait
    until every one runs."""
    pods = list(pods)
    for name in pods:
        kube.create(m.gpu_pod(name, namespace, claim=claim, command=command))
    for name in pods:
        wait_running(kube, name, namespace, timeout)


def pids_of_pod(pod_uid: str) -> list[int]:
    """The node's processes in the pod's cgroup (what the plugin maps to the pod's claims)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cgroup").read_text()
        except OSError:
            continue
        if pod_uid_from_cgroup(text) == pod_uid:
            pids.append(int(entry.name))
    return sorted(pids)
