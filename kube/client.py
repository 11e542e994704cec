"""The `kubernetes` client as every gpu-dra process builds and uses it.

`new_api_client` (kubeconfig or in-cluster), `translated_errors` (client exceptions become
`errors.ApiError` subclasses that say what failed), `list_objects` (a paged list of raw
``resource.k8s.io/v1`` objects, one consistent snapshot) and `read_server_version`. Objects
are decoded bounded (`decoded_object`): one object of any depth or integer size reads, with
marker strings in it, and never fails the list. Every call blocks. See
docs/architecture.md#layers.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from gpu_dra.driver import jsonbounds
from gpu_dra.driver.jsonbounds import describe
from gpu_dra.driver.resourceapi import API_GROUP, API_VERSION
from gpu_dra.kube import errors

RESOURCE_VERSION = API_VERSION.removeprefix(f"{API_GROUP}/")
CLAIMS_API = API_VERSION
"""``resource.k8s.io/v1``: the API version `list_namespaced_objects` reads claims in."""
"""The version part of ``resource.k8s.io/v1``, as `CustomObjectsApi` calls take it."""

RawObject = dict[str, Any]
"""An object as the apiserver serves it (JSON decoded, not the client's models)."""


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


@dataclass(frozen=True)
class ObjectList:
    items: tuple[RawObject, ...]
    resource_version: str
    """The list's resourceVersion: start a watch here to miss nothing."""


def list_objects(
    objects: k8s.CustomObjectsApi,
    plural: str,
    *,
    what: str,
    field_selector: str | None = None,
    page_size: int = 500,
    request_timeout_s: float = 30.0,
) -> ObjectList:
    """Every cluster-wide (all namespaces) ``resource.k8s.io/v1`` object of `plural`, following
    pages; `what` names them in errors. An expired continue token is `ResourceExpiredError`."""
    action = f"list {what}" + (f" ({field_selector})" if field_selector else "")
    items, version = _all_pages(
        action,
        lambda token: objects.list_cluster_custom_object(
            API_GROUP,
            RESOURCE_VERSION,
            plural,
            field_selector=field_selector,
            limit=page_size,
            _continue=token,
            _request_timeout=request_timeout_s,
            _preload_content=False,
        ),
    )
    return ObjectList(items=tuple(items), resource_version=version)


def _all_pages(action: str, fetch: Callable[[str | None], Any]) -> tuple[list[RawObject], str]:
    """Every item of a paged list, where ``fetch(token)`` returns the raw response of the page
    after continue token `token` (None: the first), and the last page's resourceVersion;
    `errors.ApiError` naming `action` for a failed call or a malformed page."""
    items: list[RawObject] = []
    token: str | None = None
    while True:
        with translated_errors(action):
            body: bytes = fetch(token).data
        page = decoded_object(body, action)
        items.extend(list_items(page, action))
        metadata = page.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise errors.ApiError(f"{action}: metadata is {describe(metadata)}, not an object")
        token = metadata.get("continue") or None
        if token is not None and not isinstance(token, str):
            raise errors.ApiError(f"{action}: metadata.continue is {describe(token)}")
        if token is None:
            return items, str(metadata.get("resourceVersion") or "")


def list_resource_objects(
    api_client: k8s.ApiClient, plural: str, *, request_timeout_s: float = 30.0
) -> list[RawObject]:
    """Every ``resource.k8s.io/v1`` object of `plural` (``resourceslices``, ``deviceclasses``,
    ``resourceclaims``: all namespaces), raw; read-only, for `gpu-dra explain` / ``inventory``
    and the controller's inventory gauges."""
    listing = list_objects(
        k8s.CustomObjectsApi(api_client), plural, what=plural, request_timeout_s=request_timeout_s
    )
    return list(listing.items)


def read_resource_claim(
    api_client: k8s.ApiClient, namespace: str, name: str, *, request_timeout_s: float = 30.0
) -> RawObject:
    """The raw ResourceClaim `namespace`/`name` (`errors.NotFoundError` when there is none)."""
    objects = k8s.CustomObjectsApi(api_client)
    action = f"read ResourceClaim {namespace}/{name}"
    with translated_errors(action):
        response: Any = objects.get_namespaced_custom_object(
            API_GROUP,
            RESOURCE_VERSION,
            namespace,
            "resourceclaims",
            name,
            _request_timeout=request_timeout_s,
            _preload_content=False,
        )
        body: bytes = response.data
    return decoded_object(body, action)


def list_namespaced_objects(
    api_client: k8s.ApiClient,
    api_version: str,
    plural: str,
    namespace: str,
    *,
    page_size: int = 500,
    request_timeout_s: float = 30.0,
) -> list[RawObject]:
    """Every object of `plural` in `namespace` from API group version `api_version`
    (``batch/v1`` jobs, ``kueue.x-k8s.io/v1beta2`` workloads: any but the core group), raw,
    following pages; read-only, for `gpu-dra explain`. `errors.NotFoundError` when the
    apiserver does not serve that resource (e.g. Kueue is not installed)."""
    group, _, version = api_version.partition("/")
    objects = k8s.CustomObjectsApi(api_client)
    action = f"list {plural}.{group} in namespace {namespace}"
    items, _ = _all_pages(
        action,
        lambda token: objects.list_namespaced_custom_object(
            group,
            version,
            namespace,
            plural,
            limit=page_size,
            _continue=token,
            _request_timeout=request_timeout_s,
            _preload_content=False,
        ),
    )
    return items


def read_namespaced_object(
    api_client: k8s.ApiClient,
    api_version: str,
    plural: str,
    namespace: str,
    name: str,
    *,
    request_timeout_s: float = 30.0,
) -> RawObject:
    """The raw object `namespace`/`name` of `plural` in `api_version` (any but the core group;
    `errors.NotFoundError` when there is none)."""
    group, _, version = api_version.partition("/")
    objects = k8s.CustomObjectsApi(api_client)
    action = f"read {plural}.{group} {namespace}/{name}"
    with translated_errors(action):
        response: Any = objects.get_namespaced_custom_object(
            group,
            version,
            namespace,
            plural,
            name,
            _request_timeout=request_timeout_s,
            _preload_content=False,
        )
        body: bytes = response.data
    return decoded_object(body, action)


def decoded_object(body: bytes, action: str) -> RawObject:
    """The JSON object in a response body, decoded bounded (`jsonbounds.loads`: parts nested
    deeper than 100 levels and integers of more than 4300 digits become marker strings, never
    RecursionError or ValueError); `errors.ApiError` naming `action` when it is no JSON object."""
    try:
        value = jsonbounds.loads(body)
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
        raise errors.ApiError(f"{action}: the response is not JSON: {error}") from error
    if not isinstance(value, dict):
        raise errors.ApiError(f"{action}: expected a JSON object, got {describe(value)}")
    return value


def decoded_items(body: bytes, action: str) -> list[RawObject]:
    """The ``items`` of a list response body (`decoded_object`, `list_items`)."""
    return list_items(decoded_object(body, action), action)


def list_items(page: RawObject, action: str) -> list[RawObject]:
    """The ``items`` of a decoded list; `errors.ApiError` naming `action` when they are not a
    list of objects (never read as an empty list)."""
    items = page.get("items") or []
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise errors.ApiError(f"{action}: items is not a list of objects")
    return items


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
