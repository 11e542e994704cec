"""KubernetesDeviceClassApi through the real client, against a stub apiserver on localhost."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpu_dra.controller.catalog import DeviceClass, KubernetesDeviceClassApi
from tests.fakes.stub_apiserver import Query, StubApiserver

GPU_CLASS = "/apis/resource.k8s.io/v1/deviceclasses/gpu.example.com"


@pytest.fixture
def stub() -> Iterator[StubApiserver]:
    """A server-side apply of the DeviceClass answers with the applied object."""

    def applied(query: Query, body: Any) -> tuple[int, Any]:
        return 200, body

    with StubApiserver.running() as server:
        server.route("PATCH", GPU_CLASS, applied)
        yield server


def test_device_class_is_server_side_applied(stub: StubApiserver) -> None:
    device_class = DeviceClass(
        apiVersion="resource.k8s.io/v1",
        kind="DeviceClass",
        metadata={"name": "gpu.example.com"},
        spec={"selectors": [{"cel": {"expression": "true"}}]},
    )

    KubernetesDeviceClassApi(stub.client, field_manager="gpu-dra-controller").apply(device_class)

    (request,) = stub.requests
    assert (request["method"], request["path"]) == (
        "PATCH",
        "/apis/resource.k8s.io/v1/deviceclasses/gpu.example.com",
    )
    assert request["content_type"] == "application/apply-patch+yaml"
    assert request["query"]["fieldManager"] == ["gpu-dra-controller"]
    assert request["query"]["force"] == ["true"]
    assert request["body"] == device_class
