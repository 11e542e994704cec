"""The ResourceSlice API the publisher needs: a `SliceApi` Protocol and its `kubernetes` adapter.

Objects are the raw `resource.k8s.io/v1` dictionaries (typed with `TypedDict`), so the pure core's
`ResourceSliceSpec` goes to the apiserver without conversion. The methods block; the publisher calls
them through `asyncio.to_thread`. Every failure surfaces as an `errors.ApiError` subclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict, cast

from kubernetes import client as k8s

from gpu_dra.driver.resourceapi import API_GROUP, ResourceSliceSpec
from gpu_dra.kube import errors
from gpu_dra.kube.client import RESOURCE_VERSION as _VERSION
from gpu_dra.kube.client import list_objects, translated_errors
from gpu_dra.kube.watch import WatchEventType, open_watch

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


class KubernetesSliceApi:
    """`SliceApi` on the `kubernetes` client, with raw dictionaries (`CustomObjectsApi`)."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 30.0) -> None:
        self._objects = k8s.CustomObjectsApi(api_client)
        self._core = k8s.CoreV1Api(api_client)
        self._timeout = request_timeout_s

    def list_slices(self, selector: SliceSelector) -> SliceList:
        listing = list_objects(
            self._objects,
            RESOURCE_SLICES,
            what="ResourceSlices",
            field_selector=selector.field_selector,
            request_timeout_s=self._timeout,
        )
        items = cast("tuple[ResourceSlice, ...]", listing.items)
        return SliceList(items=items, resource_version=listing.resource_version)

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
        return open_watch(
            self._objects,
            RESOURCE_SLICES,
            slice_event,
            what="ResourceSlices",
            field_selector=selector.field_selector,
            resource_version=resource_version,
            timeout_seconds=timeout_seconds,
            request_timeout_s=self._timeout,
        )

    def node_uid(self, name: str) -> str:
        with translated_errors(f"read Node {name}"):
            node = self._core.read_node(name, _request_timeout=self._timeout)
        if node.metadata is None or not node.metadata.uid:
            raise errors.NotFoundError(f"read Node {name}: the Node has no uid", status=404)
        return node.metadata.uid


def slice_event(kind: WatchEventType, obj: dict[str, Any]) -> SliceEvent:
    return SliceEvent(type=kind, slice=cast("ResourceSlice", obj))


def _describe(body: ResourceSlice) -> str:
    metadata = body["metadata"]
    return metadata.get("name") or f"{metadata.get('generateName', '')}*"
