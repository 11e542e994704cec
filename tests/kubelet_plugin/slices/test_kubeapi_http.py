"""KubernetesSliceApi through the real client, against a stub apiserver on localhost: request
paths, query parameters, bodies, error mapping, watch streaming."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from gpu_dra.kube import errors
from gpu_dra.kubelet_plugin.slices.kubeapi import (
    KubernetesSliceApi,
    ResourceSlice,
    SliceEvent,
    SliceSelector,
)
from tests.fakes.stub_apiserver import StubApiserver, status

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
SELECTOR = SliceSelector(driver="gpu.example.com", node_name="node-a")


WATCH_EVENTS: list[dict[str, Any]] = [
    {"type": "DELETED", "object": {"metadata": {"name": "s1", "resourceVersion": "8"}}},
    {"type": "ERROR", "object": status(410, "Expired", "too old resource version")},
]


@pytest.fixture
def stub() -> Iterator[StubApiserver]:
    """Node node-a, a list of one slice, a create that collides, a stale update, a delete, and a
    watch that sends `WATCH_EVENTS` and ends (or, with `hold`, holds the stream open)."""
    with StubApiserver.running() as server:
        node = {"kind": "Node", "metadata": {"name": "node-a", "uid": "uid-a"}}
        server.route("GET", "/api/v1/nodes/node-a", (200, node))
        listing = {
            "kind": "ResourceSliceList",
            "metadata": {"resourceVersion": "7"},
            "items": [{"metadata": {"name": "s1", "resourceVersion": "5"}, "spec": {}}],
        }
        server.route("GET", SLICES, (200, listing))
        exists = status(409, "AlreadyExists", 'resourceslices "s1" already exists')
        server.route("POST", SLICES, (409, exists))
        server.route(
            "PUT", f"{SLICES}/s1", (409, status(409, "Conflict", "the object has been modified"))
        )
        server.route("DELETE", f"{SLICES}/s1", (200, {"kind": "Status", "status": "Success"}))
        server.watch_paths.add(SLICES)
        server.watch_events = WATCH_EVENTS
        yield server


@pytest.fixture
def api_client(stub: StubApiserver) -> k8s.ApiClient:
    assert stub.client is not None
    return stub.client


def slice_body(name: str = "", resource_version: str = "") -> ResourceSlice:
    metadata: dict[str, str] = {"generateName": "node-a-gpu.example.com-"}
    if name:
        metadata = {"name": name, "resourceVersion": resource_version}
    return ResourceSlice(
        apiVersion="resource.k8s.io/v1",
        kind="ResourceSlice",
        metadata=metadata,  # type: ignore[typeddict-item]
        spec={
            "driver": "gpu.example.com",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        },
    )


def test_list_sends_the_field_selector_and_returns_the_list_version(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    listing = KubernetesSliceApi(api_client).list_slices(SELECTOR)

    assert listing.resource_version == "7"
    assert [item["metadata"]["name"] for item in listing.items] == ["s1"]
    (request,) = stub.requests
    assert request["query"]["fieldSelector"] == [SELECTOR.field_selector]


def test_create_collision_surfaces_as_already_exists(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    with pytest.raises(errors.AlreadyExistsError):
        KubernetesSliceApi(api_client).create_slice(slice_body())

    (request,) = stub.requests
    assert request["method"] == "POST"
    assert request["body"]["metadata"] == {"generateName": "node-a-gpu.example.com-"}


def test_stale_update_surfaces_as_conflict(api_client: k8s.ApiClient, stub: StubApiserver) -> None:
    with pytest.raises(errors.ConflictError):
        KubernetesSliceApi(api_client).replace_slice(slice_body("s1", "5"))

    (request,) = stub.requests
    assert (request["method"], request["path"]) == ("PUT", f"{SLICES}/s1")
    assert request["body"]["metadata"]["resourceVersion"] == "5"


def test_delete_sends_uid_and_version_preconditions(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    KubernetesSliceApi(api_client).delete_slice("s1", uid="uid-s1", resource_version="5")

    (request,) = stub.requests
    assert (request["method"], request["path"]) == ("DELETE", f"{SLICES}/s1")
    assert request["body"]["preconditions"] == {"uid": "uid-s1", "resourceVersion": "5"}


def test_node_uid_is_read_from_the_node(api_client: k8s.ApiClient) -> None:
    assert KubernetesSliceApi(api_client).node_uid("node-a") == "uid-a"
    with pytest.raises(errors.NotFoundError):
        KubernetesSliceApi(api_client).node_uid("node-z")


def test_watch_streams_events_then_reports_410(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    watch = KubernetesSliceApi(api_client).watch_slices(
        SELECTOR, resource_version="7", timeout_seconds=30
    )
    try:
        event = watch.next_event()
        assert event is not None
        assert (event.type, event.name, event.resource_version) == ("DELETED", "s1", "8")
        with pytest.raises(errors.ResourceExpiredError):
            watch.next_event()
    finally:
        watch.close()

    (request,) = stub.requests
    assert request["query"]["watch"] == ["true"]
    assert request["query"]["resourceVersion"] == ["7"]
    assert request["query"]["allowWatchBookmarks"] == ["true"]
    assert request["query"]["fieldSelector"] == [SELECTOR.field_selector]


def test_close_unblocks_a_read_on_a_connection_close_stream(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    stub.watch_events = WATCH_EVENTS[:1]
    stub.hold = True  # only closing the socket ends the read
    watch = KubernetesSliceApi(api_client).watch_slices(
        SELECTOR, resource_version="7", timeout_seconds=30
    )
    events: list[SliceEvent] = []

    def drain() -> None:
        while (event := watch.next_event()) is not None:
            events.append(event)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    time.sleep(0.2)  # the reader is blocked on the socket: the stub holds the stream open
    assert reader.is_alive()

    started = time.monotonic()
    watch.close()
    reader.join(5.0)
    elapsed = time.monotonic() - started

    assert not reader.is_alive()
    assert elapsed < 2.0
    assert [(e.type, e.name) for e in events] in ([], [("DELETED", "s1")])
