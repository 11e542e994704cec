"""`gpu_dra.cli.cluster.read_idle_policy` through the real client, against a stub apiserver: the
labelled namespaces, and the pods of those only; a pod gone is skipped, a refusal raised."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpu_dra.cli.cluster import read_idle_policy
from gpu_dra.kube import errors
from tests.fakes.stub_apiserver import StubApiserver, status

ML = {"metadata": {"name": "ml", "labels": {"gpu.nvidia.com/idle-reclaim": "enabled"}}}


@pytest.fixture
def stub() -> Iterator[StubApiserver]:
    with StubApiserver.running() as server:
        yield server


def test_it_reads_the_pods_of_labelled_namespaces_only(stub: StubApiserver) -> None:
    stub.route("GET", "/api/v1/namespaces", (200, {"items": [ML]}))
    pod = {"metadata": {"name": "nb", "namespace": "ml"}, "status": {}}
    stub.route("GET", "/api/v1/namespaces/ml/pods/nb", (200, pod))
    stub.route("GET", "/api/v1/namespaces/ml/pods/gone",
               (404, status(404, "NotFound", "pods gone not found")))  # fmt: skip

    namespaces, pods = read_idle_policy(stub.client, [("ml", "nb"), ("ml", "gone"), ("dev", "x")])

    assert namespaces == {"ml": ML}
    assert pods == {("ml", "nb"): pod}
    assert stub.requests[0]["query"]["labelSelector"] == ["gpu.nvidia.com/idle-reclaim"]
    assert not any(r["path"].startswith("/api/v1/namespaces/dev") for r in stub.requests)


def test_a_refused_read_is_an_error_not_an_empty_answer(stub: StubApiserver) -> None:
    stub.route("GET", "/api/v1/namespaces", (403, status(403, "Forbidden", "cannot list")))

    with pytest.raises(errors.ForbiddenError, match="list Namespaces labelled"):
        read_idle_policy(stub.client, [("ml", "nb")])
