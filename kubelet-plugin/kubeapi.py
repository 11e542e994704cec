"""Reading ResourceClaims: a small Protocol and its adapter on the `kubernetes` client."""

from __future__ import annotations

from typing import Any, Protocol, cast

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

ResourceClaim = dict[str, Any]
"""A raw `resource.k8s.io/v1` ResourceClaim as the API server serves it."""


class ClaimNotFoundError(LookupError):
    """The claim does not exist (any more)."""


class ClaimReadError(RuntimeError):
    """The API server could not be asked; worth retrying."""


class ClaimReader(Protocol):
    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        """The claim, or ClaimNotFoundError / ClaimReadError. Blocking."""
        ...


class KubernetesClaimReader:
    """GETs claims from the API server (the kubelet sends only namespace, name and UID)."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 10.0) -> None:
        self._objects = k8s.CustomObjectsApi(api_client)
        self._timeout = request_timeout_s

    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        try:
            claim = self._objects.get_namespaced_custom_object(
                "resource.k8s.io",
                "v1",
                namespace,
                "resourceclaims",
                name,
                _request_timeout=self._timeout,
            )
        except ApiException as error:
            if error.status == 404:
                raise ClaimNotFoundError(f"ResourceClaim {namespace}/{name} not found") from error
            raise ClaimReadError(
                f"cannot read ResourceClaim {namespace}/{name}: {error.status} {error.reason}"
            ) from error
        except OSError as error:
            raise ClaimReadError(
                f"cannot read ResourceClaim {namespace}/{name}: {error}"
            ) from error
        return cast("ResourceClaim", claim)
