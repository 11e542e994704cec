"""KubernetesSliceApi and KubernetesDeviceClassApi through the real client, against a stub HTTP
server on localhost: request paths, query parameters, bodies, error mapping, watch streaming."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client as k8s

from gpu_dra.controller.catalog import DeviceClass, KubernetesDeviceClassApi
from gpu_dra.kube import errors
from gpu_dra.kube.client import read_server_version
from gpu_dra.kubelet_plugin.slices.kubeapi import (
    KubernetesSliceApi,
    ResourceSlice,
    SliceEvent,
    SliceSelector,
)

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
SELECTOR = SliceSelector(driver="gpu.example.com", node_name="node-a")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


WATCH_EVENTS: list[dict[str, Any]] = [
    {"type": "DELETED", "object": {"metadata": {"name": "s1", "resourceVersion": "8"}}},
    {"type": "ERROR", "object": status(410, "Expired", "too old resource version")},
]


class StubApiserver(BaseHTTPRequestHandler):
    """HTTP/1.0, so every response is `Connection: close`. A watch sends `watch_events`, then ends
    the stream, or (`hold`) holds it open until `release` is set."""

    requests: ClassVar[list[dict[str, Any]]] = []
    watch_events: ClassVar[list[dict[str, Any]]] = WATCH_EVENTS
    hold: ClassVar[bool] = False
    release: ClassVar[threading.Event] = threading.Event()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _record(self) -> tuple[str, dict[str, list[str]], Any]:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        query = parse_qs(url.query)
        self.requests.append(
            {
                "method": self.command,
                "path": url.path,
                "query": query,
                "body": body,
                "content_type": self.headers.get("Content-Type"),
            }
        )
        return url.path, query, body

    def _reply(self, code: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path, query, _ = self._record()
        if path == "/api/v1/nodes/node-a":
            self._reply(200, {"kind": "Node", "metadata": {"name": "node-a", "uid": "uid-a"}})
        elif path.rstrip("/") == "/version":
            self._reply(200, {"major": "1", "minor": "34+", "gitVersion": "v1.34.2-gke.1"})
        elif path == SLICES and query.get("watch") == ["true"]:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            for event in self.watch_events:
                self.wfile.write(json.dumps(event).encode() + b"\n")
                self.wfile.flush()
            if self.hold:
                self.release.wait(10)
        elif path == SLICES:
            self._reply(
                200,
                {
                    "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": "7"},
                    "items": [{"metadata": {"name": "s1", "resourceVersion": "5"}, "spec": {}}],
                },
            )
        else:
            self._reply(404, status(404, "NotFound", f"{path} not found"))

    def do_POST(self) -> None:
        self._record()
        self._reply(409, status(409, "AlreadyExists", 'resourceslices "s1" already exists'))

    def do_PUT(self) -> None:
        self._record()
        self._reply(409, status(409, "Conflict", "the object has been modified"))

    def do_DELETE(self) -> None:
        self._record()
        self._reply(200, {"kind": "Status", "status": "Success"})

    def do_PATCH(self) -> None:
        _, _, body = self._record()
        self._reply(200, body)


@pytest.fixture
def api_client() -> Iterator[k8s.ApiClient]:
    StubApiserver.requests = []
    StubApiserver.watch_events = WATCH_EVENTS
    StubApiserver.hold = False
    StubApiserver.release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubApiserver)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    client = k8s.ApiClient(configuration)
    try:
        yield client
    finally:
        StubApiserver.release.set()
        client.close()  # type: ignore[no-untyped-call]
        server.shutdown()
        server.server_close()
        thread.join()


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
    api_client: k8s.ApiClient,
) -> None:
    listing = KubernetesSliceApi(api_client).list_slices(SELECTOR)

    assert listing.resource_version == "7"
    assert [item["metadata"]["name"] for item in listing.items] == ["s1"]
    (request,) = StubApiserver.requests
    assert request["query"]["fieldSelector"] == [SELECTOR.field_selector]


def test_create_collision_surfaces_as_already_exists(api_client: k8s.ApiClient) -> None:
    with pytest.raises(errors.AlreadyExistsError):
        KubernetesSliceApi(api_client).create_slice(slice_body())

    (request,) = StubApiserver.requests
    assert request["method"] == "POST"
    assert request["body"]["metadata"] == {"generateName": "node-a-gpu.example.com-"}


def test_stale_update_surfaces_as_conflict(api_client: k8s.ApiClient) -> None:
    with pytest.raises(errors.ConflictError):
        KubernetesSliceApi(api_client).replace_slice(slice_body("s1", "5"))

    (request,) = StubApiserver.requests
    assert (request["method"], request["path"]) == ("PUT", f"{SLICES}/s1")
    assert request["body"]["metadata"]["resourceVersion"] == "5"


def test_delete_sends_uid_and_version_preconditions(api_client: k8s.ApiClient) -> None:
    KubernetesSliceApi(api_client).delete_slice("s1", uid="uid-s1", resource_version="5")

    (request,) = StubApiserver.requests
    assert (request["method"], request["path"]) == ("DELETE", f"{SLICES}/s1")
    assert request["body"]["preconditions"] == {"uid": "uid-s1", "resourceVersion": "5"}


def test_server_version_is_read_from_slash_version(api_client: k8s.ApiClient) -> None:
    assert read_server_version(api_client) == ("1", "34+")
    assert StubApiserver.requests[-1]["path"].rstrip("/") == "/version"


def test_node_uid_is_read_from_the_node(api_client: k8s.ApiClient) -> None:
    assert KubernetesSliceApi(api_client).node_uid("node-a") == "uid-a"
    with pytest.raises(errors.NotFoundError):
        KubernetesSliceApi(api_client).node_uid("node-z")


def test_watch_streams_events_then_reports_410(api_client: k8s.ApiClient) -> None:
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

    (request,) = StubApiserver.requests
    assert request["query"]["watch"] == ["true"]
    assert request["query"]["resourceVersion"] == ["7"]
    assert request["query"]["allowWatchBookmarks"] == ["true"]
    assert request["query"]["fieldSelector"] == [SELECTOR.field_selector]


def test_close_unblocks_a_read_on_a_connection_close_stream(api_client: k8s.ApiClient) -> None:
    StubApiserver.watch_events = WATCH_EVENTS[:1]
    StubApiserver.hold = True  # only closing the socket ends the read
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


def test_device_class_is_server_side_applied(api_client: k8s.ApiClient) -> None:
    device_class = DeviceClass(
        apiVersion="resource.k8s.io/v1",
        kind="DeviceClass",
        metadata={"name": "gpu.example.com"},
        spec={"selectors": [{"cel": {"expression": "true"}}]},
    )

    KubernetesDeviceClassApi(api_client, field_manager="gpu-dra-controller").apply(device_class)

    (request,) = StubApiserver.requests
    assert (request["method"], request["path"]) == (
        "PATCH",
        "/apis/resource.k8s.io/v1/deviceclasses/gpu.example.com",
    )
    assert request["content_type"] == "application/apply-patch+yaml"
    assert request["query"]["fieldManager"] == ["gpu-dra-controller"]
    assert request["query"]["force"] == ["true"]
    assert request["body"] == device_class
