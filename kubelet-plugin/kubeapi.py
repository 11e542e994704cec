"""Reading ResourceClaims: the `ClaimReader` Protocol, the list and watch a cache of claims needs
(`ClaimApi`), and their adapter on the `kubernetes` client.

`get_claim` fails with this module's `ClaimNotFoundError` / `ClaimReadError`, which the preparer
turns into the claim's error. `list_claims` and `watch_claims` fail like the controller's slice API,
with `gpu_dra.controller.errors.ApiError` subclasses (`ResourceExpiredError`: 410 Gone, list again);
only the claim cache calls them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from gpu_dra.controller import errors
from gpu_dra.controller.kubeapi import WatchEventType, translated_errors
from gpu_dra.driver.resourceapi import API_GROUP, API_VERSION

ResourceClaim = dict[str, Any]
"""A raw `resource.k8s.io/v1` ResourceClaim as the API server serves it."""

_VERSION = API_VERSION.removeprefix(f"{API_GROUP}/")
RESOURCE_CLAIMS = "resourceclaims"
_WATCH_EVENT_TYPES: frozenset[str] = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK"})


class ClaimNotFoundError(LookupError):
    """The claim does not exist (any more)."""


class ClaimReadError(RuntimeError):
    """The API server could not be asked; worth retrying."""


class ClaimReader(Protocol):
    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        """The claim, or ClaimNotFoundError / ClaimReadError. Blocking."""
        ...


@dataclass(frozen=True)
class ClaimList:
    items: tuple[ResourceClaim, ...]
    resource_version: str
    """The list's resourceVersion: start a watch here to miss nothing."""


@dataclass(frozen=True)
class ClaimEvent:
    type: WatchEventType
    claim: ResourceClaim
    """For BOOKMARK only `metadata.resourceVersion` is meaningful."""

    @property
    def resource_version(self) -> str:
        return str(self.claim.get("metadata", {}).get("resourceVersion", ""))


class ClaimWatch(Protocol):
    """One watch stream. `close` may be called from another thread to unblock `next_event`."""

    def next_event(self) -> ClaimEvent | None:
        """Block for the next event; None when the stream ended (resume from the last version).

        Raises `errors.ResourceExpiredError` when the start version is too old (410 Gone), another
        `errors.ApiError` when the stream broke.
        """
        ...

    def close(self) -> None: ...


class ClaimApi(ClaimReader, Protocol):
    """GET, list and watch ResourceClaims of all namespaces (blocking)."""

    def list_claims(self) -> ClaimList:
        """Every claim, as one consistent snapshot (pages are followed)."""
        ...

    def watch_claims(self, *, resource_version: str, timeout_seconds: int) -> ClaimWatch:
        """Watch from `resource_version`, with bookmarks; the server ends the stream after
        `timeout_seconds`."""
        ...


class KubernetesClaimReader:
    """`ClaimApi` on the `kubernetes` client, with raw dictionaries (`CustomObjectsApi`)."""

    def __init__(
        self, api_client: k8s.ApiClient, *, request_timeout_s: float = 10.0, page_size: int = 500
    ) -> None:
        self._objects = k8s.CustomObjectsApi(api_client)
        self._timeout = request_timeout_s
        self._page_size = page_size

    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        try:
            claim = self._objects.get_namespaced_custom_object(
                API_GROUP,
                _VERSION,
                namespace,
                RESOURCE_CLAIMS,
                name,
                _request_timeout=self._timeout,
            )
        except ApiException as error:
            if error.status == 404:
                raise ClaimNotFoundError(f"ResourceClaim {namespace}/{name} not found") from error
            raise ClaimReadError(
                f"cannot read ResourceClaim {namespace}/{name}: {error.status} {error.reason}"
            ) from error
        except (urllib3.exceptions.HTTPError, OSError) as error:
            # urllib3's errors (MaxRetryError when the API server is unreachable) are no OSError
            raise ClaimReadError(
                f"cannot read ResourceClaim {namespace}/{name}: {error}"
            ) from error
        return cast("ResourceClaim", claim)

    def list_claims(self) -> ClaimList:
        items: list[ResourceClaim] = []
        token: str | None = None
        while True:
            # An expired continue token is a 410 (ResourceExpiredError): the caller lists again.
            with translated_errors("list ResourceClaims"):
                page = cast(
                    "dict[str, Any]",
                    self._objects.list_cluster_custom_object(
                        API_GROUP,
                        _VERSION,
                        RESOURCE_CLAIMS,
                        limit=self._page_size,
                        _continue=token,
                        _request_timeout=self._timeout,
                    ),
                )
            items.extend(page.get("items") or [])
            metadata = page.get("metadata") or {}
            token = metadata.get("continue") or None
            if token is None:
                return ClaimList(items=tuple(items), resource_version=metadata["resourceVersion"])

    def watch_claims(self, *, resource_version: str, timeout_seconds: int) -> ClaimWatch:
        with translated_errors("watch ResourceClaims"):
            response = self._objects.list_cluster_custom_object(
                API_GROUP,
                _VERSION,
                RESOURCE_CLAIMS,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_seconds,
                watch=True,
                _preload_content=False,
                # connect timeout, then a read timeout past the server's own end of the stream
                _request_timeout=(self._timeout, timeout_seconds + self._timeout),
            )
        return KubernetesClaimWatch(response)


class KubernetesClaimWatch:
    """A watch stream over the raw HTTP response: one JSON event per line."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self._lines = _response_lines(response)
        self._closed = False

    def next_event(self) -> ClaimEvent | None:
        try:
            while True:
                line = next(self._lines, None)
                if line is None:
                    return None
                if line.strip():
                    return parse_claim_event(line)
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as error:
            if self._closed:
                return None
            raise errors.ApiError(f"watch ResourceClaims: stream broke: {error}") from error
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


def parse_claim_event(line: str) -> ClaimEvent:
    """Decode one watch line; ERROR events become `ApiError`s (410 Gone: `ResourceExpiredError`)."""
    event = json.loads(line)
    kind = event.get("type")
    obj = event.get("object") or {}
    if kind == "ERROR":
        code = obj.get("code")
        message = f"watch ResourceClaims: {obj.get('reason', '')}: {obj.get('message', '')}"
        error_type = errors.ResourceExpiredError if code == 410 else errors.ApiError
        raise error_type(message, status=code, reason=obj.get("reason", ""))
    if kind not in _WATCH_EVENT_TYPES or not isinstance(obj, dict):
        raise errors.ApiError(f"watch ResourceClaims: unexpected event type {kind!r}")
    return ClaimEvent(type=kind, claim=obj)


def _response_lines(response: Any) -> Iterator[str]:
    buffer = bytearray()
    for chunk in response.stream(amt=None, decode_content=False):
        buffer.extend(chunk if isinstance(chunk, bytes) else str(chunk).encode())
        while (newline := buffer.find(b"\n")) != -1:
            yield buffer[:newline].decode("utf-8", errors="replace")
            del buffer[: newline + 1]
    if buffer:
        yield buffer.decode("utf-8", errors="replace")
