"""`CachedClaimReader`: ResourceClaims from a list+watch cache; from the API server when in doubt.

A `Reflector` lists and watches the claims of all namespaces; the cache keeps them without
`metadata.managedFields`, by (namespace, name). `get_claim` answers from the cache only while a
watch stream is open and the cached claim is allocated; otherwise it GETs the claim. An open watch
still lags a little, so the preparer asks again when the UID differs
(`NodeClaimPreparer(uncached_claims=...)`). See docs/architecture.md#prepare-and-unprepare.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping

from gpu_dra.kube.reflector import Reflector, ReflectorSettings
from gpu_dra.kubelet_plugin.kubeapi import ClaimApi, ClaimEvent, ClaimList, ResourceClaim

log = logging.getLogger(__name__)

_Key = tuple[str, str]


class CachedClaimReader:
    """`ClaimReader` over a list+watch cache of all ResourceClaims; `start()`, then `close()`."""

    def __init__(self, api: ClaimApi, settings: ReflectorSettings | None = None) -> None:
        self._api = api
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Guarded by _lock: the claims, and whether they may be served (a watch is open).
        self._claims: dict[_Key, ResourceClaim] = {}
        self._serving = False
        self._reflector = Reflector[ClaimList, ClaimEvent](
            "ResourceClaims",
            api.list_claims,
            lambda version, timeout: api.watch_claims(
                resource_version=version, timeout_seconds=timeout
            ),
            self._replace,
            self._apply,
            on_watching=self._set_serving,
            settings=settings,
        )

    # ---- ClaimReader -----------------------------------------------------------------------------
    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        """A copy of the cached claim when it can be trusted (see the module docs), else a GET."""
        with self._lock:
            cached = self._claims.get((namespace, name)) if self._serving else None
        if cached is not None and _allocated(cached):
            return copy.deepcopy(cached)  # stored claims are replaced, never changed in place
        return self._api.get_claim(namespace, name)

    def cached(self, namespace: str, name: str) -> ResourceClaim | None:
        """The cached claim (read-only: shared with the cache), never a GET; None when it is
        not cached or no watch is open (the utilization metrics' pod lookup)."""
        with self._lock:
            return self._claims.get((namespace, name)) if self._serving else None

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start listing and watching in a thread of its own. Once."""
        self._reflector.start("claim-cache")

    def close(self) -> None:
        """Stop the thread and wait for it (up to `close_timeout_s`): closes the open watch, ends
        a backoff wait at once. Idempotent; final."""
        self._reflector.close()

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        return self._reflector.running

    @property
    def serving(self) -> bool:
        """Whether a watch is open, so that `get_claim` may answer from the cache."""
        with self._lock:
            return self._serving

    def wait_serving(self, timeout_s: float) -> bool:
        """Wait until the cache serves claims (listed and watching); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._serving, timeout_s)

    # ---- the reflector's callbacks (its thread) -------------------------------------------------
    def _replace(self, listing: ClaimList) -> None:
        claims: dict[_Key, ResourceClaim] = {}
        for claim in listing.items:
            key = _key(claim)
            if key is not None:
                claims[key] = _trimmed(claim)
        with self._lock:
            self._claims = claims
        log.info(
            "listed %d ResourceClaim(s) resource_version=%s", len(claims), listing.resource_version
        )

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

    def _set_serving(self, serving: bool) -> None:
        with self._changed:
            self._serving = serving
            self._changed.notify_all()


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


def _allocated(claim: ResourceClaim) -> bool:
    """Whether ``claim`` has an allocation (a malformed status counts as none: read it anew)."""
    status = claim.get("status")
    return isinstance(status, Mapping) and bool(status.get("allocation"))
