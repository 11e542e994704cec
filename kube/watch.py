"""Watch streams: the one watch request gpu-dra makes (`open_watch`) and its decoding.

`open_watch` asks for a cluster-wide watch of ``resource.k8s.io/v1`` objects from a
resourceVersion, with bookmarks and a server-side timeout, and returns a `RawWatchStream`: one
JSON event per line, ERROR events as `errors.ApiError` subclasses (410 Gone:
`ResourceExpiredError`). `close` may be called from another thread to unblock `next_event`.
Lines are decoded bounded (`jsonbounds.loads`): one object of any depth or integer size is an
event with marker strings in it, never an error of the stream.
See docs/architecture.md#list-and-watch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, Literal, TypeVar, cast

import urllib3
from kubernetes import client as k8s

from gpu_dra.driver import jsonbounds
from gpu_dra.driver.jsonbounds import describe
from gpu_dra.driver.resourceapi import API_GROUP
from gpu_dra.kube import errors
from gpu_dra.kube.client import RESOURCE_VERSION, translated_errors

EventT = TypeVar("EventT")

WatchEventType = Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]
_WATCH_EVENT_TYPES: frozenset[str] = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK"})

MakeEvent = Callable[[WatchEventType, dict[str, Any]], EventT]
"""Builds a stream's event from (type, object)."""


def open_watch(
    objects: k8s.CustomObjectsApi,
    plural: str,
    make_event: MakeEvent[EventT],
    *,
    what: str,
    resource_version: str,
    timeout_seconds: int,
    request_timeout_s: float,
    field_selector: str | None = None,
) -> RawWatchStream[EventT]:
    """Watch the objects of `plural` (all namespaces) from `resource_version`, with bookmarks;
    the server ends the stream after `timeout_seconds`. `what` names them in errors."""
    action = f"watch {what}" + (f" ({field_selector})" if field_selector else "")
    with translated_errors(action):
        response = objects.list_cluster_custom_object(
            API_GROUP,
            RESOURCE_VERSION,
            plural,
            field_selector=field_selector,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_seconds,
            watch=True,
            _preload_content=False,
            # connect timeout, then a read timeout past the server's own end of the stream
            _request_timeout=(request_timeout_s, timeout_seconds + request_timeout_s),
        )
    return RawWatchStream(response, what, make_event)


class RawWatchStream(Generic[EventT]):
    """A watch stream over a raw (`_preload_content=False`) HTTP response: one JSON event per line.

    `what` names the watched resource in error messages ("ResourceSlices"); `make_event` builds
    the event from (type, object). `next_event` returns None at the end of the stream (or once
    closed) and raises `errors.ApiError` subclasses for ERROR events and broken streams.
    """

    def __init__(self, response: Any, what: str, make_event: MakeEvent[EventT]) -> None:
        self._response = response
        self._what = what
        self._make_event = make_event
        self._lines = _response_lines(response)
        self._closed = False

    def next_event(self) -> EventT | None:
        try:
            while True:
                line = next(self._lines, None)
                if line is None:
                    return None
                if line.strip():
                    return self._make_event(*parse_raw_watch_event(line, self._what))
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as error:
            if self._closed:
                return None
            raise errors.ApiError(f"watch {self._what}: stream broke: {error}") from error
        except AttributeError:
            if self._closed:  # http.client, when `close` released the response mid-read
                return None
            raise

    def close(self) -> None:
        """Shut the socket down (unblocks a read in another thread), then release the response.

        `HTTPResponse.shutdown` (urllib3 >= 2.3) reaches the socket even where http.client has
        already let go of it (`Connection: close` streams): `connection.sock` is None there.
        """
        self._closed = True
        with contextlib.suppress(Exception):
            self._response.shutdown()
        with contextlib.suppress(Exception):
            self._response.close()
            self._response.release_conn()


def parse_raw_watch_event(line: str, what: str) -> tuple[WatchEventType, dict[str, Any]]:
    """Decode one watch line into (type, object); ERROR events become `ApiError`s (410 Gone:
    `ResourceExpiredError`), and so does a line that is no event object. `what` names the
    watched resource in messages. Decoding is bounded (`jsonbounds.loads`): parts of the object
    nested deeper than 100 levels and integers of more than 4300 digits become marker strings,
    for whoever reads that part to refuse. Invalid JSON raises ``ValueError``."""
    event = jsonbounds.loads(line)
    if not isinstance(event, dict):
        raise errors.ApiError(f"watch {what}: expected an event object, got {describe(event)}")
    kind = event.get("type")
    obj = event.get("object") or {}
    if kind == "ERROR":
        if not isinstance(obj, dict):
            raise errors.ApiError(
                f"watch {what}: ERROR event without a Status object: {describe(obj)}"
            )
        code = obj.get("code")
        status = code if isinstance(code, int) and not isinstance(code, bool) else None
        reason = obj.get("reason")
        reason = reason if isinstance(reason, str) else ""
        message = f"watch {what}: {reason}: {obj.get('message', '')}"
        error_type = errors.ResourceExpiredError if status == 410 else errors.ApiError
        raise error_type(message, status=status, reason=reason)
    if not isinstance(kind, str) or kind not in _WATCH_EVENT_TYPES or not isinstance(obj, dict):
        raise errors.ApiError(f"watch {what}: unexpected event type {describe(kind)}")
    return cast("WatchEventType", kind), obj


def _response_lines(response: Any) -> Iterator[str]:
    buffer = bytearray()
    for chunk in response.stream(amt=None, decode_content=False):
        buffer.extend(chunk if isinstance(chunk, bytes) else str(chunk).encode())
        while (newline := buffer.find(b"\n")) != -1:
            yield buffer[:newline].decode("utf-8", errors="replace")
            del buffer[: newline + 1]
    if buffer:
        yield buffer.decode("utf-8", errors="replace")
