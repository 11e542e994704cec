"""The shared Event helpers: the core/v1 Event `event` builds (what ``kubectl describe`` lists)
and `KubernetesEventApi` posting it to a stub apiserver, a refusal as an ApiError."""

from __future__ import annotations

import pytest

from gpu_dra.kube import errors
from gpu_dra.kube.events import MESSAGE_LIMIT, InvolvedObject, KubernetesEventApi, event
from tests.fakes.stub_apiserver import StubApiserver

POD = InvolvedObject("v1", "Pod", "ml", "nb", "uid-1")


def test_an_event_names_its_object_recorder_and_time() -> None:
    body = event(POD, "GpuClaimIdle", "idle", warning=True, component="gpu-dra-controller",
                 instance="controller-0", now=1_800_000_000.0)  # fmt: skip
    assert body == {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "nb.gpu-dra-", "namespace": "ml"},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": "ml", "name": "nb",
                           "uid": "uid-1"},
        "reason": "GpuClaimIdle",
        "message": "idle",
        "type": "Warning",
        "source": {"component": "gpu-dra-controller"},
        "reportingComponent": "gpu-dra-controller",
        "reportingInstance": "controller-0",
        "firstTimestamp": "2027-01-15T08:00:00Z",
        "lastTimestamp": "2027-01-15T08:00:00Z",
        "count": 1,
    }  # fmt: skip


def test_a_node_event_names_its_host_and_a_long_message_is_cut() -> None:
    body = event(POD, "MpsDaemonRestarted", "x" * 2000, warning=False,
                 component="gpu-dra-kubelet-plugin", instance="node-a", host="node-a",
                 now=0.0)  # fmt: skip
    assert body["type"] == "Normal"
    assert body["source"] == {"component": "gpu-dra-kubelet-plugin", "host": "node-a"}
    assert len(body["message"]) == MESSAGE_LIMIT
    assert body["message"].endswith("x…")


def test_the_api_posts_it_to_the_objects_namespace_and_reports_a_refusal() -> None:
    body = event(POD, "GpuClaimIdle", "idle", warning=True, component="c", instance="i", now=0.0)
    with StubApiserver.running() as stub:
        stub.route("POST", "/api/v1/namespaces/ml/events", (201, body))
        KubernetesEventApi(stub.client).create_event("ml", body)
        posted = stub.requests[-1]["body"]
        assert (posted["involvedObject"], posted["reason"]) == (POD.to_json(), "GpuClaimIdle")
        with pytest.raises(errors.ApiError, match="create Event in other"):
            KubernetesEventApi(stub.client).create_event("other", body)
