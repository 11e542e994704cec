"""The share-memory quota end to end (issue 23, docs/shares.md#share-memory-quota): the
chart-installed controller's webhook refuses a ResourceClaim whose MPS share memory would bring
its namespace over ``gpu.nvidia.com/share-memory`` of the namespace's labelled ResourceQuota.

A simulated H100 node whose gpu-0 is offered as MPS shares (``--mps-shares=0``, the MPS control
TEST DOUBLE as daemon). A namespace whose GPU quota allows 16Gi of share memory runs two 8Gi
shares; a third is refused at creation with the quota's wording; once one is deleted a new one
is admitted and runs. The apiserver accepts the key, Kubernetes' quota controller leaves it out
of ``status.used``, and a namespace without the quota is not limited."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.dynamic.exceptions import DynamicApiError

from e2e import manifests as m
from e2e.chart import (
    NAMESPACE,
    share_node,
)
from e2e.cluster import Cluster
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import delete_pods, wait_running
from gpu_dra.controller.share_memory import ledger_name
from gpu_dra.driver.cluster.tier_quota import SHARE_MEMORY, TIER_QUOTA_LABEL

pytestmark = pytest.mark.e2e

CLAIMS = "resource.k8s.io/v1"
DEVICES_KEY = "mps.gpu.nvidia.com.deviceclass.resource.k8s.io/devices"


@pytest.fixture(scope="module")
def installed(
    cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Driver]:
    """The chart, gpu-0 offered as MPS shares (daemons of the MPS double, not kept warm)."""
    with share_node(cluster, kube, tmp_path_factory.mktemp("chart"), mps_shares="0") as driver:
        yield driver


def gpu_quota(namespace: str, share_memory: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "gpu", "namespace": namespace, "labels": {TIER_QUOTA_LABEL: "true"}},
        "spec": {"hard": {SHARE_MEMORY: share_memory, DEVICES_KEY: "10"}},
    }


def created(kube: Kube, manifest: dict[str, Any]) -> str:
    """Create `manifest`, retrying while the apiserver cannot call the webhook yet (the
    controller's address not in its Service); "" when created, else the refusal's message."""
    refusal = ""

    def answered() -> bool:
        nonlocal refusal
        try:
            kube.create(manifest)
        except DynamicApiError as error:
            body = json.loads(error.body) if error.body else {}
            refusal = str(body.get("message", error))
            return "failed calling webhook" not in refusal
        refusal = ""
        return True

    wait_for(f"the webhook to answer for {manifest['metadata']['name']}", answered, 120, 2)
    return refusal


def share(kube: Kube, name: str, namespace: str, memory: str) -> str:
    """Create a share claim of `memory` (compute 10); the refusal, or "" and its pod."""
    refusal = created(kube, m.share_claim(name, namespace, memory, 10))
    if not refusal:
        kube.create(m.gpu_pod(name, namespace, claim=name, command=m.SHOW_MPS))
    return refusal


def test_two_8gi_shares_fit_a_16gi_quota_a_third_is_refused_until_one_is_deleted(
    installed: Driver, kube: Kube, namespace: str, other_namespace: str
) -> None:
    kube.create(gpu_quota(namespace, "16Gi"))
    # The quota controller counts the devices key and leaves gpu-dra's key alone.
    wait_for(
        "the quota controller to count the namespace",
        lambda: (
            DEVICES_KEY
            in kube.get("v1", "ResourceQuota", "gpu", namespace).get("status", {}).get("used", {})
        ),
        60,
    )
    status = kube.get("v1", "ResourceQuota", "gpu", namespace)["status"]
    assert status["hard"][SHARE_MEMORY] == "16Gi"
    assert SHARE_MEMORY not in status["used"]

    for name in ("first", "second"):
        assert share(kube, name, namespace, "8Gi") == ""
    for name in ("first", "second"):
        wait_running(kube, name, namespace)

    refusal = share(kube, "third", namespace, "8Gi")
    assert refusal == (
        'admission webhook "share-memory.gpu.nvidia.com" denied the request: exceeded quota: '
        "gpu, requested: gpu.nvidia.com/share-memory=8Gi, used: gpu.nvidia.com/share-memory="
        "16Gi, limited: gpu.nvidia.com/share-memory=16Gi"
    )
    assert not kube.exists(CLAIMS, "ResourceClaim", "third", namespace)
    ledger = kube.get("v1", "ConfigMap", ledger_name(namespace), NAMESPACE)
    assert sorted(json.loads(v)["name"] for v in ledger["data"].values()) == ["first", "second"]

    # A namespace without a GPU quota is not limited.
    assert share(kube, "big", other_namespace, "40Gi") == ""

    # Deleting a share (pod, then claim) frees its memory.
    delete_pods(kube, namespace, ["first"])
    kube.delete(CLAIMS, "ResourceClaim", "first", namespace)
    kube.wait_gone(CLAIMS, "ResourceClaim", "first", namespace)
    assert share(kube, "fourth", namespace, "8Gi") == ""
    wait_running(kube, "fourth", namespace)
    wait_running(kube, "big", other_namespace)
    delete_pods(kube, namespace, ["second", "fourth"])
    delete_pods(kube, other_namespace, ["big"])


@pytest.fixture
def other_namespace(kube: Kube, deleted_namespaces: list[str]) -> Iterator[str]:
    """A second namespace without a GPU quota; emptied of pods and claims before the test ends
    (the plugin that unprepares them goes with the module)."""
    name = f"e2e-share-memory-free-{uuid.uuid4().hex[:5]}"
    kube.create_namespace(name)
    yield name
    kube.delete("v1", "Namespace", name)
    deleted_namespaces.append(name)
    for api_version, kind in (("v1", "Pod"), (CLAIMS, "ResourceClaim")):
        for item in kube.list(api_version, kind, namespace=name):
            kube.delete(api_version, kind, item["metadata"]["name"], name)
    wait_for(
        f"the pods and ResourceClaims of namespace {name} to be gone",
        lambda: (
            not kube.list("v1", "Pod", namespace=name)
            and not kube.list(CLAIMS, "ResourceClaim", namespace=name)
        ),
        180,
    )
