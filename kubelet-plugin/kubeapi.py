"""The kubelet plugin's Kubernetes API for claims and MPS daemon pods, and its adapters.

ResourceClaims: `ClaimReader` (GET) and `ClaimApi` (GET, list, watch: what the claim cache
needs). `get_claim` fails with `ClaimNotFoundError` / `ClaimReadError`, which the preparer turns
into the claim's error; `list_claims` and `watch_claims` fail with `gpu_dra.kube.errors.ApiError`
subclasses (`ResourceExpiredError`: 410 Gone, list again). Pods: `PodApi` (create, get, list by
label, delete with a UID precondition), failing with `ApiError` subclasses.
See docs/architecture.md#prepare-and-unprepare and docs/mps.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, cast

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from gpu_dra.driver.resourceapi import API_GROUP
from gpu_dra.kube import errors
from gpu_dra.kube.client import RESOURCE_VERSION as _VERSION
from gpu_dra.kube.client import decoded_object, list_objects, translated_errors
from gpu_dra.kube.watch import WatchEventType, open_watch

ResourceClaim = dict[str, Any]
"""A raw `resource.k8s.io/v1` ResourceClaim as the API server serves it."""

RESOURCE_CLAIMS = "resourceclaims"


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
        """The claim, decoded bounded (`kube.client.decoded_object`): a part nested too deeply
        or an integer too long is a marker string, refused where prepare reads that part."""
        try:
            response: Any = self._objects.get_namespaced_custom_object(
                API_GROUP,
                _VERSION,
                namespace,
                RESOURCE_CLAIMS,
                name,
                _request_timeout=self._timeout,
                _preload_content=False,
            )
            body: bytes = response.data
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
        try:
            return decoded_object(body, f"cannot read ResourceClaim {namespace}/{name}")
        except errors.ApiError as error:
            raise ClaimReadError(str(error)) from error

    def list_claims(self) -> ClaimList:
        listing = list_objects(
            self._objects,
            RESOURCE_CLAIMS,
            what="ResourceClaims",
            page_size=self._page_size,
            request_timeout_s=self._timeout,
        )
        return ClaimList(items=listing.items, resource_version=listing.resource_version)

    def watch_claims(self, *, resource_version: str, timeout_seconds: int) -> ClaimWatch:
        return open_watch(
            self._objects,
            RESOURCE_CLAIMS,
            claim_event,
            what="ResourceClaims",
            resource_version=resource_version,
            timeout_seconds=timeout_seconds,
            request_timeout_s=self._timeout,
        )


def claim_event(kind: WatchEventType, obj: ResourceClaim) -> ClaimEvent:
    return ClaimEvent(type=kind, claim=obj)


Pod = dict[str, Any]
"""A raw `v1` Pod as the API server serves it."""


class PodApi(Protocol):
    """Pods of one namespace (blocking); errors are `errors.ApiError` subclasses."""

    def create_pod(self, namespace: str, pod: Pod) -> Pod:
        """Create ``pod``; `errors.AlreadyExistsError` when its name is taken."""
        ...

    def get_pod(self, namespace: str, name: str) -> Pod | None:
        """The pod, or None when there is none."""
        ...

    def list_pods(self, namespace: str, label_selector: str, field_selector: str = "") -> list[Pod]:
        """The pods matching ``label_selector`` (``k=v,k2=v2``) and ``field_selector``
        (``spec.nodeName=<node>``)."""
        ...

    def delete_pod(
        self, namespace: str, name: str, *, uid: str | None, grace_period_s: int | None = None
    ) -> None:
        """Delete the pod (only if it has ``uid``, unless None). A pod that is gone is no
        error; another pod of that name is `errors.ConflictError`."""
        ...


class KubernetesPodApi:
    """`PodApi` on the `kubernetes` client, with raw dictionaries."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 10.0) -> None:
        # Any: raw dictionaries in and out (_preload_content=False), not the typed models.
        self._core: Any = k8s.CoreV1Api(api_client)
        self._timeout = request_timeout_s

    def create_pod(self, namespace: str, pod: Pod) -> Pod:
        name = pod.get("metadata", {}).get("name", "")
        with translated_errors(f"create Pod {namespace}/{name}"):
            response = self._core.create_namespaced_pod(
                namespace, pod, _preload_content=False, _request_timeout=self._timeout
            )
        return cast("Pod", json.loads(response.data))

    def get_pod(self, namespace: str, name: str) -> Pod | None:
        try:
            with translated_errors(f"get Pod {namespace}/{name}"):
                response = self._core.read_namespaced_pod(
                    name, namespace, _preload_content=False, _request_timeout=self._timeout
                )
        except errors.NotFoundError:
            return None
        return cast("Pod", json.loads(response.data))

    def list_pods(self, namespace: str, label_selector: str, field_selector: str = "") -> list[Pod]:
        with translated_errors(f"list Pods {namespace} {label_selector}"):
            response = self._core.list_namespaced_pod(
                namespace,
                label_selector=label_selector,
                field_selector=field_selector,
                _preload_content=False,
                _request_timeout=self._timeout,
            )
        return list(json.loads(response.data).get("items") or [])

    def delete_pod(
        self, namespace: str, name: str, *, uid: str | None, grace_period_s: int | None = None
    ) -> None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        try:
            with translated_errors(f"delete Pod {namespace}/{name}"):
                self._core.delete_namespaced_pod(
                    name, namespace, body=body, _request_timeout=self._timeout
                )
        except errors.NotFoundError:
            return


class EvictionApi(Protocol):
    """The Eviction API (``pods/eviction``): disruption budgets are honoured."""

    def evict_pod(self, namespace: str, name: str, *, uid: str) -> None:
        """Evict the pod if it still has ``uid``; `errors.ApiError` when the API server
        refuses (a budget that allows no disruption is a 429: `errors.ApiError`). A pod that
        is gone is no error."""
        ...


class KubernetesEvictionApi:
    """`EvictionApi` on the `kubernetes` client."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 10.0) -> None:
        self._core: Any = k8s.CoreV1Api(api_client)
        self._timeout = request_timeout_s

    def evict_pod(self, namespace: str, name: str, *, uid: str) -> None:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        try:
            with translated_errors(f"evict Pod {namespace}/{name}"):
                self._core.create_namespaced_pod_eviction(
                    name, namespace, body, _request_timeout=self._timeout
                )
        except errors.NotFoundError:
            return
