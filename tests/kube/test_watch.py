"""Watch stream decoding: events split across chunks, ERROR events as typed errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from gpu_dra.kube import errors
from gpu_dra.kube.watch import RawWatchStream, WatchEventType, parse_raw_watch_event


@dataclass(frozen=True)
class Event:
    type: WatchEventType
    resource_version: str


def event(kind: WatchEventType, obj: dict[str, Any]) -> Event:
    return Event(kind, obj["metadata"]["resourceVersion"])


def test_watch_error_410_means_list_again() -> None:
    line = json.dumps(
        {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}
    )

    with pytest.raises(errors.ResourceExpiredError, match="too old"):
        parse_raw_watch_event(line, "ResourceSlices")


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
    watch = RawWatchStream(response, "ResourceSlices", event)

    events = [watch.next_event(), watch.next_event(), watch.next_event()]

    assert [(e.type, e.resource_version) if e else None for e in events] == [
        ("ADDED", "1"),
        ("BOOKMARK", "2"),
        None,
    ]
    watch.close()
    assert response.closed
