"""`InMemoryClaimApi`: ResourceClaims with GET, list and watch like the apiserver, for tests.

It is an `InMemoryClaimReader` (GET, `read_errors`, `reads`) that also lists and watches, like the
apiserver: resourceVersions from one counter, an event for every change (a claim replaced under the
same name is DELETED, then ADDED), watches that replay history after a resourceVersion and follow
live changes, 410 Gone (an ERROR event, as the apiserver sends it) when that version was compacted,
and streams that end at their `timeout_seconds`.

What tests control, as "someone else": `compact` (etcd compaction), `hold_watches` (the open
streams stop receiving events: a watch that lags), `break_watches` (end the open streams, with an
error or plainly), `bookmark`, and `fail_next` (errors of the next list or watch calls).
`wait_watching` blocks until a watch has taken every event it will get and waits for more: the
cache has applied them. `calls` counts list and watch calls, `call_times[verb]` records when they
came (monotonic), `watch_versions` the version each watch started from.
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from gpu_dra.kube import errors
from gpu_dra.kubelet_plugin.kubeapi import ClaimEvent, ClaimList, ResourceClaim
from tests.fakes.claim_reader import InMemoryClaimReader

Verb = Literal["list", "watch"]
_END = object()
"""Queued into a watch: the stream ends (the server closed it)."""


class FakeClaimWatch:
    """A watch stream fed by `InMemoryClaimApi`; `close` unblocks `next_event`."""

    def __init__(self, cond: threading.Condition, timeout_seconds: int) -> None:
        self._cond = cond
        self._deadline = time.monotonic() + timeout_seconds
        self.pending: collections.deque[object] = collections.deque()
        self.held = False
        self.waiting = False
        self.closed = False

    def next_event(self) -> ClaimEvent | None:
        with self._cond:
            while True:
                if self.closed:
                    return None
                if self.pending:
                    item = self.pending.popleft()
                    if isinstance(item, ClaimEvent):
                        return item
                    self.closed = True
                    if isinstance(item, errors.ApiError):
                        raise item
                    return None  # _END
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    self.closed = True
                    return None  # the server-side timeout ended the stream
                self.waiting = True
                self._cond.notify_all()
                self._cond.wait(remaining)
                self.waiting = False

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    @property
    def caught_up(self) -> bool:
        return self.waiting and not self.pending and not self.closed and not self.held


@dataclass
class InMemoryClaimApi(InMemoryClaimReader):
    """An in-memory apiserver for ResourceClaims: `ClaimApi`. Thread-safe."""

    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    call_times: dict[str, list[float]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    watch_versions: list[str] = field(default_factory=list)
    watches: list[FakeClaimWatch] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _version: int = 100
    _history: list[tuple[int, ClaimEvent]] = field(default_factory=list, repr=False)
    _oldest_watchable: int = 0
    _faults: dict[str, collections.deque[errors.ApiError]] = field(
        default_factory=lambda: collections.defaultdict(collections.deque), repr=False
    )

    # ---- changes, as other clients make them ----------------------------------------------------
    def add(self, *claims: ResourceClaim) -> None:
        """Create or replace claims; another UID under the same name is a new object."""
        with self._cond, self._lock:
            for claim in claims:
                stored = copy.deepcopy(claim)
                metadata = stored["metadata"]
                key = (metadata["namespace"], metadata["name"])
                old = self.claims.get(key)
                if old is not None and old["metadata"].get("uid") != metadata.get("uid"):
                    self._emit("DELETED", old)
                    old = None
                self._version += 1
                metadata["resourceVersion"] = str(self._version)
                self.claims[key] = stored
                self._emit("MODIFIED" if old is not None else "ADDED", stored)

    def delete(self, namespace: str, name: str) -> None:
        with self._cond, self._lock:
            self._emit("DELETED", self.claims.pop((namespace, name)))

    def _emit(self, kind: Literal["ADDED", "MODIFIED", "DELETED"], claim: ResourceClaim) -> None:
        if kind == "DELETED":
            self._version += 1
            claim = copy.deepcopy(claim)
            claim["metadata"]["resourceVersion"] = str(self._version)
        event = ClaimEvent(type=kind, claim=copy.deepcopy(claim))
        self._history.append((self._version, event))
        for watch in self.watches:
            if not watch.closed and not watch.held:
                watch.pending.append(copy.deepcopy(event))
        self._cond.notify_all()

    # ---- ClaimApi (get_claim comes from InMemoryClaimReader) ------------------------------------
    def list_claims(self) -> ClaimList:
        with self._cond, self._lock:
            self._call("list")
            return ClaimList(
                items=tuple(copy.deepcopy(claim) for claim in self.claims.values()),
                resource_version=str(self._version),
            )

    def watch_claims(self, *, resource_version: str, timeout_seconds: int) -> FakeClaimWatch:
        with self._cond:
            self._call("watch")
            self.watch_versions.append(resource_version)
            watch = FakeClaimWatch(self._cond, timeout_seconds)
            start = int(resource_version)
            if start < self._oldest_watchable:
                watch.pending.append(
                    errors.ResourceExpiredError(
                        f"watch ResourceClaims: Expired: too old resource version: {start} "
                        f"({self._oldest_watchable})",
                        status=410,
                        reason="Expired",
                    )
                )
            else:
                watch.pending.extend(
                    copy.deepcopy(event) for version, event in self._history if version > start
                )
            self.watches = [w for w in self.watches if not w.closed]
            self.watches.append(watch)
            self._cond.notify_all()
            return watch

    def _call(self, verb: Verb) -> None:
        self.calls[verb] += 1
        self.call_times[verb].append(time.monotonic())
        self._cond.notify_all()
        if self._faults[verb]:
            raise self._faults[verb].popleft()

    # ---- what tests control ----------------------------------------------------------------------
    @property
    def version(self) -> str:
        with self._cond:
            return str(self._version)

    def fail_next(self, verb: Verb, error: errors.ApiError, times: int = 1) -> None:
        with self._cond:
            self._faults[verb].extend([error] * times)

    def compact(self) -> None:
        """Forget the history: watches from an older version get 410 Gone."""
        with self._cond:
            self._history.clear()
            self._oldest_watchable = self._version

    def hold_watches(self) -> None:
        """The open streams get no further events (their watcher lags behind)."""
        with self._cond:
            for watch in self.watches:
                watch.held = True

    def break_watches(self, error: errors.ApiError | None = None) -> None:
        """End the open streams after what they already got: with `error`, or plainly."""
        with self._cond:
            for watch in self.watches:
                if not watch.closed:
                    watch.pending.append(error if error is not None else _END)
            self._cond.notify_all()

    def bookmark(self) -> str:
        """Other objects changed (the version moves on); open streams get a BOOKMARK with it."""
        with self._cond:
            self._version += 1
            event = ClaimEvent(
                type="BOOKMARK", claim={"metadata": {"resourceVersion": str(self._version)}}
            )
            for watch in self.watches:
                if not watch.closed and not watch.held:
                    watch.pending.append(event)
            self._cond.notify_all()
            return str(self._version)

    def wait_watching(self, timeout_s: float = 5.0) -> None:
        """Wait until a live watch has nothing pending and waits for more."""
        with self._cond:
            if not self._cond.wait_for(lambda: any(w.caught_up for w in self.watches), timeout_s):
                raise AssertionError(f"no watch caught up within {timeout_s} s: {self.calls}")

    def wait_calls(self, verb: Verb, count: int, timeout_s: float = 5.0) -> None:
        """Wait until `verb` was called `count` times."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.calls[verb] >= count, timeout_s):
                raise AssertionError(f"{verb} called {self.calls[verb]} times, not {count}")
