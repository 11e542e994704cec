"""`CachedClaimReader`: ResourceClaims from a list+watch cache; from the API server when in doubt.

The kubelet sends only a claim's identity, so every prepare reads the claim. A background thread
lists the ResourceClaims of all namespaces, then watches from the list's resourceVersion: a stream
that ends or breaks is resumed from the last event's (or BOOKMARK's) version, a 410 Gone lists
again, and failures back off exponentially. The cache holds the raw claims, without
`metadata.managedFields`, keyed by (namespace, name): ADDED and MODIFIED replace, DELETED removes,
a list replaces everything.

`get_claim` answers from the cache only while a watch stream is open and the cached claim is
allocated; in every other case (not started yet, watch down or backing off, claim not seen yet,
not allocated yet) it GETs the claim. Even an open watch lags the API server a little: a claim
replaced under the same name still has the old UID here, so the preparer asks the API server again
when the UID does not match (`NodeClaimPreparer(uncached_claims=...)`).

A thread, not an asyncio task: the reads block, and a watch blocks for minutes; a thread of its own
keeps them out of the event loop's default executor, which the preparer's reads share.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from dataclasses import dataclass

from gpu_dra.controller import errors
from gpu_dra.kubelet_plugin.kubeapi import ClaimApi, ClaimEvent, ClaimWatch, ResourceClaim

log = logging.getLogger(__name__)

_Key = tuple[str, str]


@dataclass(frozen=True)
class ClaimCacheSettings:
    """Timing of the cache's list and watch."""

    backoff_initial_s: float = 0.2
    """First wait after a failed list or watch; doubled per failure in a row."""
    backoff_max_s: float = 30.0
    """Longest wait between attempts."""
    watch_timeout_s: int = 300
    """Server-side timeout of one watch request; the watch then resumes where it stopped."""
    min_healthy_watch_s: float = 5.0
    """A watch that ran this long resumes at once when it ends; a shorter one backs off."""
    close_timeout_s: float = 15.0
    """How long `close()` waits for the thread (a list in flight ends with its request timeout)."""

    def __post_init__(self) -> None:
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.watch_timeout_s <= 0:
            raise ValueError("watch_timeout_s must be positive")


class CachedClaimReader:
    """`ClaimReader` over a list+watch cache of all ResourceClaims; `start()`, then `close()`."""

    def __init__(self, api: ClaimApi, settings: ClaimCacheSettings | None = None) -> None:
        self._api = api
        self._settings = settings or ClaimCacheSettings()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Guarded by _lock: the claims, whether they may be served, the open watch.
        self._claims: dict[_Key, ResourceClaim] = {}
        self._serving = False
        self._watch: ClaimWatch | None = None
        # Owned by the thread: where the next watch starts (None: list first).
        self._resource_version: str | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- ClaimReader -----------------------------------------------------------------------------
    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        """A copy of the cached claim when it can be trusted (see the module docs), else a GET."""
        with self._lock:
            cached = self._claims.get((namespace, name)) if self._serving else None
        if cached is not None and cached.get("status", {}).get("allocation"):
            return copy.deepcopy(cached)  # stored claims are replaced, never changed in place
        return self._api.get_claim(namespace, name)

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start listing and watching in a thread of its own. Once."""
        if self._thread is not None:
            raise RuntimeError("CachedClaimReader already started")
        self._thread = threading.Thread(target=self._run, name="claim-cache", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and wait for it: closes the open watch, ends a backoff wait at once.

        Idempotent; final. Blocks up to `close_timeout_s` (a list or watch request in flight
        cannot be interrupted; it ends with its request timeout).
        """
        self._stopping.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            with contextlib.suppress(Exception):
                watch.close()
        thread = self._thread
        if thread is not None:
            thread.join(self._settings.close_timeout_s)
            if thread.is_alive():
                log.warning(
                    "claim cache thread still running after %.0f s (a request in flight); "
                    "it ends with the request",
                    self._settings.close_timeout_s,
                )

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def serving(self) -> bool:
        """Whether a watch is open, so that `get_claim` may answer from the cache."""
        with self._lock:
            return self._serving

    def wait_serving(self, timeout_s: float) -> bool:
        """Wait until the cache serves claims (listed and watching); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._serving, timeout_s)

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        settings = self._settings
        delay = settings.backoff_initial_s
        while not self._stopping.is_set():
            started = time.monotonic()
            problem: str | None = None
            try:
                if self._resource_version is None:
                    self._relist()
                self._watch_once()
            except errors.ResourceExpiredError:
                log.info("claim watch expired (410 Gone); listing again")
                self._resource_version = None
            except errors.ApiError as error:
                problem = str(error)
            except Exception as error:  # a bug: keep serving GETs, start over from a list
                log.exception("claim cache failed; listing again")
                problem = repr(error)
                self._resource_version = None
            if time.monotonic() - started >= settings.min_healthy_watch_s:
                delay = settings.backoff_initial_s  # it ran a while: resume (or list) at once
                pause = delay if problem else 0.0
            else:  # failed or ended at once: back off, so that a repeating failure is no busy loop
                pause, delay = delay, min(delay * 2, settings.backoff_max_s)
            if problem is not None and not self._stopping.is_set():
                log.warning(
                    "listing/watching claims failed: retry_in_s=%.2f error=%s", pause, problem
                )
            if self._stopping.wait(pause):
                break
        log.info("claim cache stopped")

    def _relist(self) -> None:
        listing = self._api.list_claims()
        claims: dict[_Key, ResourceClaim] = {}
        for claim in listing.items:
            key = _key(claim)
            if key is not None:
                claims[key] = _trimmed(claim)
        with self._lock:
            self._claims = claims
        self._resource_version = listing.resource_version
        log.info(
            "listed %d ResourceClaim(s) resource_version=%s", len(claims), listing.resource_version
        )

    def _watch_once(self) -> None:
        """Follow one watch stream, keeping `_resource_version` at the last event applied."""
        assert self._resource_version is not None
        if self._stopping.is_set():
            return
        watch = self._api.watch_claims(
            resource_version=self._resource_version,
            timeout_seconds=self._settings.watch_timeout_s,
        )
        with self._changed:
            if self._stopping.is_set():  # close() ran before it could see this watch
                watch.close()
                return
            self._watch = watch
            self._serving = True
            self._changed.notify_all()
        try:
            while (event := watch.next_event()) is not None:
                self._apply(event)
                self._resource_version = event.resource_version or self._resource_version
        finally:
            with self._lock:
                self._watch = None
                self._serving = False
            watch.close()

    def _apply(self, event: ClaimEvent) -> None:
        if event.type == "BOOKMARK":
            return
        key = _key(event.claim)
        if key is None:
            log.warning("ignoring a %s event of a claim without namespace/name", event.type)
            return
        with self._lock:
            if event.type == "DELETED":
                self._claims.pop(key, None)
            else:
                self._claims[key] = _trimmed(event.claim)


def _key(claim: ResourceClaim) -> _Key | None:
    metadata = claim.get("metadata") or {}
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        return None
    return namespace, name


def _trimmed(claim: ResourceClaim) -> ResourceClaim:
    """The claim without `metadata.managedFields` (most of its size, never read)."""
    metadata = claim.get("metadata") or {}
    if "managedFields" not in metadata:
        return claim
    return {
        **claim,
        "metadata": {key: value for key, value in metadata.items() if key != "managedFields"},
    }
