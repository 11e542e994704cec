"""The `kubernetes` adapter's pure parts: selectors, error translation, watch stream decoding."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from kubernetes.client.exceptions import ApiException

from gpu_dra.controller import errors
from gpu_dra.controller.kubeapi import (
    KubernetesSliceWatch,
    SliceSelector,
    parse_watch_event,
    translate_api_exception,
)


def status_body(reason: str, message: str = "") -> str:
    return json.dumps({"kind": "Status", "reason": reason, "message": message})


def test_node_pool_selector_filters_by_driver_and_node() -> None:
    selector = SliceSelector(driver="gpu.example.com", node_name="node-a")

    assert selector.field_selector == "spec.driver=gpu.example.com,spec.nodeName=node-a"


def test_cluster_selector_filters_by_driver_only() -> None:
    assert SliceSelector(driver="gpu.example.com").field_selector == "spec.driver=gpu.example.com"


@pytest.mark.parametrize(
    ("status", "reason", "expected"),
    [
        (409, "Conflict", errors.ConflictError),
        (409, "AlreadyExists", errors.AlreadyExistsError),
        (404, "NotFound", errors.NotFoundError),
        (410, "Expired", errors.ResourceExpiredError),
        (422, "Invalid", errors.InvalidError),
        (403, "Forbidden", errors.ForbiddenError),
        (500, "InternalError", errors.ApiError),
    ],
)
def test_api_exceptions_become_typed_errors(
    status: int, reason: str, expected: type[errors.ApiError]
) -> None:
    error = translate_api_exception(
        "update ResourceSlice s1",
        ApiException(status=status, reason=reason, body=status_body(reason, "details here")),
    )

    assert type(error) is expected
    assert error.status == status
    assert "update ResourceSlice s1" in str(error)
    assert "details here" in str(error)


def test_invalid_and_forbidden_errors_are_not_retryable() -> None:
    assert not errors.InvalidError("x").retryable
    assert not errors.ForbiddenError("x").retryable
    assert errors.ConflictError("x").retryable


def test_watch_event_carries_the_slice_and_its_version() -> None:
    line = json.dumps(
        {"type": "DELETED", "object": {"metadata": {"name": "s1", "resourceVersion": "42"}}}
    )

    event = parse_watch_event(line)

    assert (event.type, event.name, event.resource_version) == ("DELETED", "s1", "42")


def test_watch_error_410_means_list_again() -> None:
    line = json.dumps(
        {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}
    )

    with pytest.raises(errors.ResourceExpiredError, match="too old"):
        parse_watch_event(line)


class ChunkedResponse:
    """The part of urllib3's response the watch reads: `stream` and `close`."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.closed = False

    def stream(self, amt: int | None = None, decode_content: bool = False) -> Iterator[bytes]:
        yield from self.chunks

    def close(self) -> None:
        self.closed = True

    def release_conn(self) -> None:
        pass


def test_watch_stream_decodes_events_split_across_chunks() -> None:
    first = json.dumps({"type": "ADDED", "object": {"metadata": {"resourceVersion": "1"}}})
    second = json.dumps({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "2"}}})
    payload = f"{first}\n\n{second}\n".encode()
    response = ChunkedResponse([payload[:10], payload[10:50], payload[50:]])
    watch = KubernetesSliceWatch(response)

    events = [watch.next_event(), watch.next_event(), watch.next_event()]

    assert [(e.type, e.resource_version) if e else None for e in events] == [
        ("ADDED", "1"),
        ("BOOKMARK", "2"),
        None,
    ]
    watch.close()
    assert response.closed
