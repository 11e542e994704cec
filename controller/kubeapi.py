"""The ResourceSlice API the publisher needs: a `SliceApi` Protocol and its `kubernetes` adapter.

Objects are the raw `resource.k8s.io/v1` dictionaries (typed with `TypedDict`), so the pure core's
`ResourceSliceSpec` goes to the apiserver without conversion. The methods block; the publisher calls
them through `asyncio.to_thread`. Every failure surfaces as an `errors.ApiError` subclass.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, NotRequired, Protocol, TypedDict, TypeVar, cast

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from gpu_dra.controller import errors
from gpu_dra.driver.resourceapi import API_GROUP, API_VERSION, ResourceSliceSpec

log = logging.getLogger(__name__)

EventT = TypeVar("EventT")

_VERSION = API_VERSION.removeprefix(f"{API_GROUP}/")
RESOURCE_SLICES = "resourceslices"
RESOURCE_SLICE_KIND = "ResourceSlice"


class OwnerReference(TypedDict):
    apiVersion: str
    kind: str
    name: str
    uid: str
    controller: NotRequired[bool]
    blockOwnerDeletion: NotRequired[bool]


class ObjectMeta(TypedDict, total=False):
    name: str
    generateName: str
    uid: str
    resourceVersion: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ownerReferences: list[OwnerReference]
    deletionTimestamp: str


class ResourceSlice(TypedDict):
    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: ResourceSliceSpec


@dataclass(frozen=True)
class SliceSelector:
    """Which slices one publisher sees: a driver's slices, on one node for a node-local pool."""

    driver: str
    node_name: str | None = None

    @property
    def field_selector(self) -> str:
        """The apiserver field selector (`spec.driver` and `spec.nodeName` are supported)."""
        terms = [f"spec.driver={self.driver}"]
        if self.node_name is not None:
            terms.append(f"spec.nodeName={self.node_name}")
        return ",".join(terms)


@dataclass(frozen=True)
class SliceList:
    items: tuple[ResourceSlice, ...]
    resource_version: str
    """The list's resourceVersion: start a watch here to miss nothing."""


WatchEventType = Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]


@dataclass(frozen=True)
class SliceEvent:
    type: WatchEventType
    slice: ResourceSlice
    """For BOOKMARK only `metadata.resourceVersion` is meaningful."""

    @property
    def resource_version(self) -> str:
        return self.slice["metadata"].get("resourceVersion", "")

    @property
    def name(self) -> str:
        return self.slice["metadata"].get("name", "")


class SliceWatch(Protocol):
    """One watch stream. `close` may be called from another thread to unblock `next_event`."""

    def next_event(self) -> SliceEvent | None:
        """Block for the next event; None when the stream ended (resume from the last version).

        Raises `errors.ResourceExpiredError` when the start version is too old (410 Gone).
        """
        ...

    def close(self) -> None: ...


class SliceApi(Protocol):
    """The ResourceSlice and Node calls the publisher makes (blocking)."""

    def list_slices(self, selector: SliceSelector) -> SliceList: ...

    def create_slice(self, body: ResourceSlice) -> ResourceSlice:
        """Create (`metadata.generateName` lets the apiserver pick the name); the stored object."""
        ...

    def replace_slice(self, body: ResourceSlice) -> ResourceSlice:
        """PUT `body` over `metadata.name`; `ConflictError` if its resourceVersion is stale."""
        ...

    def delete_slice(self, name: str, *, uid: str, resource_version: str) -> None:
        """Delete with uid and resourceVersion preconditions (`ConflictError` when they fail)."""
        ...

    def watch_slices(
        self, selector: SliceSelector, *, resource_version: str, timeout_seconds: int
    ) -> SliceWatch:
        """Watch from `resource_version`; the server ends the stream after `timeout_seconds`."""
        ...

    def node_uid(self, name: str) -> str:
        """The Node's uid, for the slices' ownerReference."""
        ...


def new_api_client(kubeconfig: Path | None) -> k8s.ApiClient:
    """An ApiClient from a kubeconfig file, or from the pod's service account when None."""
    configuration = k8s.Configuration()
    try:
        if kubeconfig is None:
            k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        else:
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig), client_configuration=configuration
            )
    except (k8s_config.ConfigException, OSError) as error:
        source = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster service account"
        raise errors.ClientConfigError(
            f"cannot configure the Kubernetes client from the {source}: {error}"
        ) from error
    return k8s.ApiClient(configuration)


def read_server_version(api_client: k8s.ApiClient, *, timeout_s: float = 30.0) -> tuple[str, str]:
    """(major, minor) from the apiserver's ``/version``, as it reports them (``1``, ``35+``)."""
    action = "read the apiserver version (/version)"
    with translated_errors(action):
        response: Any = k8s.VersionApi(api_client).get_code(
            _request_timeout=timeout_s, _preload_content=False
        )
        body: bytes = response.data
    # raw JSON: vendor builds leave out fields the client's model insists on
    try:
        info = json.loads(body)
    except ValueError as error:
        raise errors.ApiError(f"{action}: not JSON: {body[:200]!r}") from error
    if not isinstance(info, dict):
        raise errors.ApiError(f"{action}: expected an object, got {body[:200]!r}")
    return str(info.get("major") or ""), str(info.get("minor") or "")


class KubernetesSliceApi:
    """`SliceApi` on the `kubernetes` client, with raw dictionaries (`CustomObjectsApi`)."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 30.0) -> None:
        self._objects = k8s.CustomObjectsApi(api_client)
        self._core = k8s.CoreV1Api(api_client)
        self._timeout = request_timeout_s

    def list_slices(self, selector: SliceSelector) -> SliceList:
        with translated_errors(f"list ResourceSlices ({selector.field_selector})"):
            listing = cast(
                "dict[str, Any]",
                self._objects.list_cluster_custom_object(
                    API_GROUP,
                    _VERSION,
                    RESOURCE_SLICES,
                    field_selector=selector.field_selector,
                    _request_timeout=self._timeout,
                ),
            )
        items = tuple(cast("list[ResourceSlice]", listing.get("items") or []))
        return SliceList(items=items, resource_version=listing["metadata"]["resourceVersion"])

    def create_slice(self, body: ResourceSlice) -> ResourceSlice:
        with translated_errors(f"create ResourceSlice {_describe(body)}"):
            created = self._objects.create_cluster_custom_object(
                API_GROUP, _VERSION, RESOURCE_SLICES, dict(body), _request_timeout=self._timeout
            )
        return cast("ResourceSlice", created)

    def replace_slice(self, body: ResourceSlice) -> ResourceSlice:
        name = body["metadata"]["name"]
        with translated_errors(f"update ResourceSlice {name}"):
            replaced = self._objects.replace_cluster_custom_object(
                API_GROUP,
                _VERSION,
                RESOURCE_SLICES,
                name,
                dict(body),
                _request_timeout=self._timeout,
            )
        return cast("ResourceSlice", replaced)

    def delete_slice(self, name: str, *, uid: str, resource_version: str) -> None:
        options = k8s.V1DeleteOptions(
            preconditions=k8s.V1Preconditions(uid=uid, resource_version=resource_version)
        )
        with translated_errors(f"delete ResourceSlice {name}"):
            self._objects.delete_cluster_custom_object(
                API_GROUP,
                _VERSION,
                RESOURCE_SLICES,
                name,
                body=options,
                _request_timeout=self._timeout,
            )

    def watch_slices(
        self, selector: SliceSelector, *, resource_version: str, timeout_seconds: int
    ) -> SliceWatch:
        with translated_errors(f"watch ResourceSlices ({selector.field_selector})"):
            response = self._objects.list_cluster_custom_object(
                API_GROUP,
                _VERSION,
                RESOURCE_SLICES,
                field_selector=selector.field_selector,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds,
                watch=True,
                _preload_content=False,
                # connect timeout, then a read timeout past the server's own end of the stream
                _request_timeout=(self._timeout, timeout_seconds + self._timeout),
            )
        return KubernetesSliceWatch(response)

    def node_uid(self, name: str) -> str:
        with translated_errors(f"read Node {name}"):
            node = self._core.read_node(name, _request_timeout=self._timeout)
        if node.metadata is None or not node.metadata.uid:
            raise errors.NotFoundError(f"read Node {name}: the Node has no uid", status=404)
        return node.metadata.uid


def slice_event(kind: WatchEventType, obj: dict[str, Any]) -> SliceEvent:
    return SliceEvent(type=kind, slice=cast("ResourceSlice", obj))


def parse_watch_event(line: str) -> SliceEvent:
    """Decode one ResourceSlice watch line (see `parse_raw_watch_event`)."""
    return slice_event(*parse_raw_watch_event(line, "ResourceSlices"))


class RawWatchStream(Generic[EventT]):
    """A watch stream over a raw (`_preload_content=False`) HTTP response: one JSON event per line.

    `what` names the watched resource in error messages ("ResourceSlices"); `make_event` builds
    the event from (type, object). `next_event` returns None at the end of the stream (or once
    closed) and raises `errors.ApiError` subclasses for ERROR events and broken streams. `close`
    may be called from another thread to unblock a `next_event` waiting on the socket.
    """

    def __init__(
        self,
        response: Any,
        what: str,
        make_event: Callable[[WatchEventType, dict[str, Any]], EventT],
    ) -> None:
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


class KubernetesSliceWatch(RawWatchStream[SliceEvent]):
    """A `SliceWatch` over the raw HTTP response of a ResourceSlice watch."""

    def __init__(self, response: Any) -> None:
        super().__init__(response, "ResourceSlices", slice_event)


_WATCH_EVENT_TYPES: frozenset[str] = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK"})


def parse_raw_watch_event(line: str, what: str) -> tuple[WatchEventType, dict[str, Any]]:
    """Decode one watch line into (type, object); ERROR events become `ApiError`s (410 Gone:
    `ResourceExpiredError`). `what` names the watched resource in messages."""
    event = json.loads(line)
    kind = event.get("type")
    obj = event.get("object") or {}
    if kind == "ERROR":
        code = obj.get("code")
        message = f"watch {what}: {obj.get('reason', '')}: {obj.get('message', '')}"
        error_type = errors.ResourceExpiredError if code == 410 else errors.ApiError
        raise error_type(message, status=code, reason=obj.get("reason", ""))
    if kind not in _WATCH_EVENT_TYPES or not isinstance(obj, dict):
        raise errors.ApiError(f"watch {what}: unexpected event type {kind!r}")
    return cast("WatchEventType", kind), obj


@contextlib.contextmanager
def translated_errors(action: str) -> Iterator[None]:
    """Turn client exceptions into `errors.ApiError` subclasses that say what failed."""
    try:
        yield
    except ApiException as error:
        raise translate_api_exception(action, error) from error
    except (urllib3.exceptions.HTTPError, OSError) as error:
        raise errors.ApiError(f"{action}: {error}") from error


def translate_api_exception(action: str, error: ApiException) -> errors.ApiError:
    status = error.status if isinstance(error.status, int) else None
    reason, message = _status_reason(error.body)
    text = f"{action}: {status} {reason or error.reason}: {message}".rstrip(": ")
    error_type: type[errors.ApiError] = errors.ApiError
    if status == 409 and reason == "AlreadyExists":
        error_type = errors.AlreadyExistsError
    elif status == 409:
        error_type = errors.ConflictError
    elif status == 404:
        error_type = errors.NotFoundError
    elif status == 410:
        error_type = errors.ResourceExpiredError
    elif status in (400, 422):
        error_type = errors.InvalidError
    elif status in (401, 403):
        error_type = errors.ForbiddenError
    return error_type(text, status=status, reason=reason)


def _status_reason(body: object) -> tuple[str, str]:
    """(reason, message) from a `Status` response body, or empty strings."""
    if not isinstance(body, str | bytes):
        return "", ""
    try:
        status = json.loads(body)
    except ValueError:
        return "", str(body)[:200]
    if not isinstance(status, dict):
        return "", ""
    return str(status.get("reason", "")), str(status.get("message", ""))


def _response_lines(response: Any) -> Iterator[str]:
    buffer = bytearray()
    for chunk in response.stream(amt=None, decode_content=False):
        buffer.extend(chunk if isinstance(chunk, bytes) else str(chunk).encode())
        while (newline := buffer.find(b"\n")) != -1:
            yield buffer[:newline].decode("utf-8", errors="replace")
            del buffer[: newline + 1]
    if buffer:
        yield buffer.decode("utf-8", errors="replace")


def _describe(body: ResourceSlice) -> str:
    metadata = body["metadata"]
    return metadata.get("name") or f"{metadata.get('generateName', '')}*"


def list_resource_objects(
    api_client: k8s.ApiClient, plural: str, *, request_timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Every ``resource.k8s.io/v1`` object of `plural` (``resourceslices``, ``deviceclasses``,
    ``resourceclaims``: all namespaces), raw; read-only, for `gpu-dra explain` / ``inventory``."""
    objects = k8s.CustomObjectsApi(api_client)
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        with translated_errors(f"list {plural}"):
            listing = cast(
                "dict[str, Any]",
                objects.list_cluster_custom_object(
                    API_GROUP,
                    _VERSION,
                    plural,
                    limit=500,
                    _continue=token,
                    _request_timeout=request_timeout_s,
                ),
            )
        items.extend(cast("list[dict[str, Any]]", listing.get("items") or []))
        token = (listing.get("metadata") or {}).get("continue") or None
        if token is None:
            return items


def read_resource_claim(
    api_client: k8s.ApiClient, namespace: str, name: str, *, request_timeout_s: float = 30.0
) -> dict[str, Any]:
    """The raw ResourceClaim `namespace`/`name` (`errors.NotFoundError` when there is none)."""
    objects = k8s.CustomObjectsApi(api_client)
    with translated_errors(f"read ResourceClaim {namespace}/{name}"):
        claim = objects.get_namespaced_custom_object(
            API_GROUP,
            _VERSION,
            namespace,
            "resourceclaims",
            name,
            _request_timeout=request_timeout_s,
        )
    return cast("dict[str, Any]", claim)
