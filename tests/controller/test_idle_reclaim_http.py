"""KubernetesIdleReclaimApi through the real client, against a stub apiserver on localhost: the
paths, queries, bodies and content types it sends, and how answers become errors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpu_dra.controller.idle_reclaim import EvictionRefused, KubernetesIdleReclaimApi
from gpu_dra.kube import errors
from tests.fakes.stub_apiserver import StubApiserver, status

EVICTION = "/api/v1/namespaces/ml/pods/nb/eviction"


@pytest.fixture
def stub() -> Iterator[StubApiserver]:
    with StubApiserver.running() as server:
        yield server


@pytest.fixture
def api(stub: StubApiserver) -> KubernetesIdleReclaimApi:
    assert stub.client is not None
    return KubernetesIdleReclaimApi(stub.client)


def test_it_lists_only_labelled_namespaces_and_their_objects(
    stub: StubApiserver, api: KubernetesIdleReclaimApi
) -> None:
    stub.route("GET", "/api/v1/namespaces", (200, {"items": [{"metadata": {"name": "ml"}}]}))
    stub.route("GET", "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims",
               (200, {"items": [{"metadata": {"name": "c"}}]}))  # fmt: skip
    stub.route("GET", "/api/v1/namespaces/ml/pods", (200, {"items": []}))

    assert api.list_policy_namespaces() == [{"metadata": {"name": "ml"}}]
    assert api.list_claims("ml") == [{"metadata": {"name": "c"}}]
    assert api.list_pods("ml") == []
    assert stub.requests[0]["query"]["labelSelector"] == ["gpu.nvidia.com/idle-reclaim"]


def test_the_condition_is_a_strategic_merge_of_the_status_with_the_pods_uid(
    stub: StubApiserver, api: KubernetesIdleReclaimApi
) -> None:
    stub.route("PATCH", "/api/v1/namespaces/ml/pods/nb/status", (200, {}))
    condition = {"type": "gpu.nvidia.com/GpuIdle", "status": "True", "reason": "Idle"}

    api.patch_pod_condition("ml", "nb", "uid-1", condition)

    (request,) = stub.requests
    assert request["content_type"] == "application/strategic-merge-patch+json"
    assert request["body"] == {"metadata": {"uid": "uid-1"}, "status": {"conditions": [condition]}}


@pytest.mark.parametrize("dry_run", [False, True])
def test_an_eviction_names_the_pods_uid_and_a_dry_run_says_so_twice(
    stub: StubApiserver, api: KubernetesIdleReclaimApi, dry_run: bool
) -> None:
    stub.route("POST", EVICTION, (201, {}))

    api.evict("ml", "nb", "uid-1", dry_run=dry_run)

    (request,) = stub.requests
    assert request["body"]["kind"] == "Eviction"
    assert request["body"]["deleteOptions"]["preconditions"] == {"uid": "uid-1"}
    if dry_run:  # the query for admission (request.dryRun), the body for the eviction
        assert request["query"]["dryRun"] == ["All"]
        assert request["body"]["deleteOptions"]["dryRun"] == ["All"]
    else:
        assert "dryRun" not in request["query"]
        assert "dryRun" not in request["body"]["deleteOptions"]


def test_a_429_is_a_refused_eviction_and_other_failures_stay_errors(
    stub: StubApiserver, api: KubernetesIdleReclaimApi
) -> None:
    budget = "Cannot evict pod as it would violate the pod's disruption budget."
    stub.route("POST", EVICTION, (429, status(429, "TooManyRequests", budget)))
    with pytest.raises(EvictionRefused, match="disruption budget"):
        api.evict("ml", "nb", "uid-1", dry_run=False)

    stub.route("POST", EVICTION, (403, status(403, "Forbidden", "denied by the policy")))
    with pytest.raises(errors.ForbiddenError, match="denied by the policy") as forbidden:
        api.evict("ml", "nb", "uid-1", dry_run=False)
    assert not isinstance(forbidden.value, EvictionRefused)

    stub.route("POST", EVICTION, (404, status(404, "NotFound", "pods nb not found")))
    with pytest.raises(errors.NotFoundError):
        api.evict("ml", "nb", "uid-1", dry_run=False)


def test_plugin_pods_are_listed_by_their_selector_in_every_namespace(
    stub: StubApiserver, api: KubernetesIdleReclaimApi
) -> None:
    stub.route("GET", "/api/v1/pods", (200, {"items": [{"metadata": {"name": "p"}}]}))

    assert api.list_plugin_pods("app.kubernetes.io/component=kubelet-plugin") == [
        {"metadata": {"name": "p"}}
    ]
    assert stub.requests[0]["query"]["labelSelector"] == [
        "app.kubernetes.io/component=kubelet-plugin"
    ]
