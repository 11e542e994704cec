"""`InMemorySliceApi`: a `SliceApi` that behaves like the apiserver, for tests.

What it does like the apiserver: resourceVersions from one counter, `generateName`, uid and
resourceVersion preconditions (409), stale updates (409), immutable fields, ResourceSlice
validation of 1.35 (device limits 128/64, split layout), field selectors on `spec.driver`,
`spec.nodeName` and `metadata.name`, and watches that replay history from a resourceVersion,
follow live changes and answer 410 Gone once history was compacted.

What tests control, as "someone else" (not counted as writes): `wipe` (the kubelet deleting the
node's slices), `touch` (a concurrent writer), `compact` (etcd compaction), `fail_next` (injected
errors) and `conflict_next_update` (a concurrent writer right before our next update).
`writes` counts the writes made through the `SliceApi` methods, by verb.
"""

from __future__ import annotations

import collections
import copy
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Literal

from gpu_dra.driver.resourceapi import API_VERSION
from gpu_dra.kube import errors
from gpu_dra.kube.watch import WatchEventType
from gpu_dra.kubelet_plugin.slices.kubeapi import (
    RESOURCE_SLICE_KIND,
    ResourceSlice,
    SliceEvent,
    SliceList,
    SliceSelector,
)

Verb = Literal["list", "create", "update", "delete", "watch", "node"]

_SELECTABLE_FIELDS: dict[str, Callable[[ResourceSlice], str | None]] = {
    "spec.driver": lambda obj: obj["spec"]["driver"],
    "spec.nodeName": lambda obj: obj["spec"].get("nodeName"),
    "metadata.name": lambda obj: obj["metadata"].get("name"),
}


def parse_field_selector(field_selector: str) -> dict[str, str]:
    """`a=b,c==d` into {a: b, c: d}; unsupported fields fail like the apiserver's."""
    terms: dict[str, str] = {}
    for term in filter(None, field_selector.split(",")):
        key, separator, value = term.replace("==", "=").partition("=")
        if not separator or "!" in key:
            raise errors.InvalidError(f"invalid field selector term {term!r}", status=400)
        if key not in _SELECTABLE_FIELDS:
            raise errors.InvalidError(
                f'field label not supported: "{key}" (ResourceSlice)', status=400
            )
        terms[key] = value
    return terms


def _matches(obj: ResourceSlice, terms: Mapping[str, str]) -> bool:
    return all(_SELECTABLE_FIELDS[key](obj) == value for key, value in terms.items())


class FakeSliceWatch:
    """A watch stream fed by `InMemorySliceApi`; `close` unblocks `next_event`."""

    _CLOSED = object()

    def __init__(self, terms: Mapping[str, str], timeout_seconds: int) -> None:
        self.terms = dict(terms)
        self._timeout = timeout_seconds
        self._queue: queue.Queue[object] = queue.Queue()
        self.closed = False

    def push(self, item: SliceEvent | errors.ApiError) -> None:
        self._queue.put(item)

    def next_event(self) -> SliceEvent | None:
        if self.closed:
            return None
        try:
            item = self._queue.get(timeout=self._timeout)
        except queue.Empty:
            return None  # the server-side timeout ended the stream
        if item is self._CLOSED:
            return None
        if isinstance(item, errors.ApiError):
            self.closed = True
            raise item
        assert isinstance(item, SliceEvent)
        return item

    def close(self) -> None:
        self.closed = True
        self._queue.put(self._CLOSED)


class InMemorySliceApi:
    """An in-memory apiserver for ResourceSlices (and Node uids). Thread-safe."""

    def __init__(self, nodes: Mapping[str, str] | None = None) -> None:
        self.nodes: dict[str, str] = dict(nodes or {})
        self.writes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.RLock()
        self._objects: dict[str, ResourceSlice] = {}
        self._version = 100
        self._history: list[tuple[int, SliceEvent]] = []
        self._oldest_watchable = 0
        self._watches: list[FakeSliceWatch] = []
        self._faults: dict[str, collections.deque[errors.ApiError]] = collections.defaultdict(
            collections.deque
        )
        self._update_conflicts = 0
        self._names = 0

    # --- SliceApi -------------------------------------------------------------------------------

    def list_slices(self, selector: SliceSelector) -> SliceList:
        with self._lock:
            self._call("list")
            terms = parse_field_selector(selector.field_selector)
            items = tuple(
                copy.deepcopy(obj)
                for name, obj in sorted(self._objects.items())
                if _matches(obj, terms)
            )
            return SliceList(items=items, resource_version=str(self._version))

    def create_slice(self, body: ResourceSlice) -> ResourceSlice:
        with self._lock:
            self._call("create")
            obj = copy.deepcopy(body)
            metadata = obj["metadata"]
            if not metadata.get("name"):
                if not metadata.get("generateName"):
                    raise errors.InvalidError("metadata.name or generateName is required")
                self._names += 1
                metadata["name"] = f"{metadata['generateName']}{self._names:05x}"
            if metadata["name"] in self._objects:
                raise errors.AlreadyExistsError(
                    f'resourceslices "{metadata["name"]}" already exists',
                    status=409,
                    reason="AlreadyExists",
                )
            if metadata.get("resourceVersion"):
                raise errors.InvalidError("resourceVersion should not be set on create")
            validate_slice(obj)
            metadata["uid"] = f"uid-{metadata['name']}"
            self._store(obj, "ADDED")
            self.writes["create"] += 1
            return copy.deepcopy(obj)

    def replace_slice(self, body: ResourceSlice) -> ResourceSlice:
        with self._lock:
            self._call("update")
            name = body["metadata"].get("name", "")
            current = self._objects.get(name)
            if current is None:
                raise errors.NotFoundError(f'resourceslices "{name}" not found', status=404)
            if self._update_conflicts:
                self._update_conflicts -= 1
                self.touch(name)
                current = self._objects[name]
            if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                raise errors.ConflictError(
                    f'Operation cannot be fulfilled on resourceslices "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                    status=409,
                    reason="Conflict",
                )
            _check_immutable(current, body)
            obj = copy.deepcopy(body)
            validate_slice(obj)
            obj["metadata"]["uid"] = current["metadata"]["uid"]
            self._store(obj, "MODIFIED")
            self.writes["update"] += 1
            return copy.deepcopy(obj)

    def delete_slice(self, name: str, *, uid: str, resource_version: str) -> None:
        with self._lock:
            self._call("delete")
            current = self._objects.get(name)
            if current is None:
                raise errors.NotFoundError(f'resourceslices "{name}" not found', status=404)
            metadata = current["metadata"]
            if uid != metadata["uid"] or resource_version != metadata["resourceVersion"]:
                raise errors.ConflictError(
                    f"Precondition failed for resourceslices {name!r}", status=409
                )
            self._remove(name)
            self.writes["delete"] += 1

    def watch_slices(
        self, selector: SliceSelector, *, resource_version: str, timeout_seconds: int
    ) -> FakeSliceWatch:
        with self._lock:
            self._call("watch")
            terms = parse_field_selector(selector.field_selector)
            start = int(resource_version or self._version)
            if start < self._oldest_watchable:
                raise errors.ResourceExpiredError(
                    f"too old resource version: {start} ({self._oldest_watchable})", status=410
                )
            watch = FakeSliceWatch(terms, timeout_seconds)
            for version, event in self._history:
                if version > start and _matches(event.slice, terms):
                    watch.push(event)
            self._watches.append(watch)
            return watch

    def node_uid(self, name: str) -> str:
        with self._lock:
            self._call("node")
            if name not in self.nodes:
                raise errors.NotFoundError(f'nodes "{name}" not found', status=404)
            return self.nodes[name]

    # --- Test controls: someone else acting on the store ---------------------------------------

    def slices(self, selector: SliceSelector | None = None) -> list[ResourceSlice]:
        """Stored slices (copies), sorted by name."""
        with self._lock:
            terms = parse_field_selector(selector.field_selector) if selector else {}
            return [
                copy.deepcopy(obj)
                for name, obj in sorted(self._objects.items())
                if _matches(obj, terms)
            ]

    def wipe(self, selector: SliceSelector) -> int:
        """Delete every matching slice, as the kubelet does at start; returns how many."""
        with self._lock:
            terms = parse_field_selector(selector.field_selector)
            doomed = [name for name, obj in self._objects.items() if _matches(obj, terms)]
            for name in sorted(doomed):
                self._remove(name)
            return len(doomed)

    def touch(self, name: str) -> None:
        """Change a slice's labels, as a concurrent writer would (new resourceVersion)."""
        with self._lock:
            obj = copy.deepcopy(self._objects[name])
            labels = obj["metadata"].setdefault("labels", {})
            labels["touched"] = str(int(labels.get("touched", "0")) + 1)
            self._store(obj, "MODIFIED")

    def put(self, obj: ResourceSlice) -> ResourceSlice:
        """Store a slice as another client would create it (validated, not counted)."""
        with self._lock:
            stored = copy.deepcopy(obj)
            stored["metadata"].setdefault("uid", f"uid-{stored['metadata']['name']}")
            validate_slice(stored)
            self._store(stored, "ADDED")
            return copy.deepcopy(stored)

    def compact(self) -> None:
        """Forget the event history: watches from older versions, and open ones, get 410 Gone."""
        with self._lock:
            self._history.clear()
            self._oldest_watchable = self._version
            for watch in self._watches:
                watch.push(
                    errors.ResourceExpiredError("too old resource version (compacted)", status=410)
                )
            self._watches.clear()

    def fail_next(self, verb: Verb, error: errors.ApiError, times: int = 1) -> None:
        """Raise `error` on the next `times` calls of `verb`, before doing anything."""
        with self._lock:
            self._faults[verb].extend([error] * times)

    def conflict_next_update(self, times: int = 1) -> None:
        """Let a concurrent writer change the object right before our next `times` updates."""
        with self._lock:
            self._update_conflicts += times

    @property
    def open_watches(self) -> int:
        with self._lock:
            self._watches = [watch for watch in self._watches if not watch.closed]
            return len(self._watches)

    # --- internals ------------------------------------------------------------------------------

    def _call(self, verb: Verb) -> None:
        self.calls[verb] += 1
        if self._faults[verb]:
            raise self._faults[verb].popleft()

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _store(self, obj: ResourceSlice, event_type: WatchEventType) -> None:
        obj["metadata"]["resourceVersion"] = self._next_version()
        self._objects[obj["metadata"]["name"]] = obj
        self._emit(event_type, obj)

    def _remove(self, name: str) -> None:
        obj = self._objects.pop(name)
        obj["metadata"]["resourceVersion"] = self._next_version()
        self._emit("DELETED", obj)

    def _emit(self, event_type: WatchEventType, obj: ResourceSlice) -> None:
        event = SliceEvent(type=event_type, slice=copy.deepcopy(obj))
        self._history.append((self._version, event))
        self._watches = [watch for watch in self._watches if not watch.closed]
        for watch in self._watches:
            if _matches(obj, watch.terms):
                watch.push(event)


def validate_slice(obj: ResourceSlice) -> None:
    """The ResourceSlice validation rules of a 1.35 apiserver that gpu-dra can run into."""
    problems: list[str] = []
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != RESOURCE_SLICE_KIND:
        problems.append(f"apiVersion/kind must be {API_VERSION}/{RESOURCE_SLICE_KIND}")
    spec = obj["spec"]
    pool = spec["pool"]
    if not spec.get("driver"):
        problems.append("spec.driver: Required value")
    if not pool.get("name"):
        problems.append("spec.pool.name: Required value")
    if pool.get("generation", -1) < 0:
        problems.append("spec.pool.generation: must be >= 0")
    if pool.get("resourceSliceCount", 0) <= 0:
        problems.append("spec.pool.resourceSliceCount: must be > 0")
    node_selection = [key for key in ("nodeName", "nodeSelector", "allNodes") if spec.get(key)]
    if len(node_selection) != 1:
        problems.append("spec: exactly one of nodeName, nodeSelector, allNodes is required")
    devices = spec.get("devices", [])
    counter_sets = spec.get("sharedCounters", [])
    if devices and counter_sets:
        problems.append("spec: sharedCounters and devices must not be in the same slice (1.35+)")
    limited = any(device.get("taints") or device.get("consumesCounters") for device in devices)
    limit = 64 if limited else 128
    if len(devices) > limit:
        problems.append(f"spec.devices: Too many: {len(devices)}: must have at most {limit} items")
    if len(counter_sets) > 8:
        problems.append("spec.sharedCounters: Too many: must have at most 8 items")
    names = [device["name"] for device in devices]
    if len(names) != len(set(names)):
        problems.append("spec.devices: duplicate device names")
    if problems:
        name = obj["metadata"].get("name") or obj["metadata"].get("generateName", "")
        raise errors.InvalidError(
            f"ResourceSlice {name!r} is invalid: {'; '.join(problems)}", status=422
        )


def _check_immutable(current: ResourceSlice, body: ResourceSlice) -> None:
    old, new = current["spec"], body["spec"]
    for field, before, after in (
        ("spec.driver", old["driver"], new["driver"]),
        ("spec.pool.name", old["pool"]["name"], new["pool"]["name"]),
        ("spec.nodeName", old.get("nodeName"), new.get("nodeName")),
    ):
        if before != after:
            raise errors.InvalidError(f"{field}: field is immutable", status=422)
