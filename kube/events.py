"""Kubernetes Events that gpu-dra's processes record about objects (core/v1, so that ``kubectl
describe`` of the object lists them): `event` builds one about an `InvolvedObject`, an
`EventApi` posts it (`KubernetesEventApi` over the client). The kubelet plugin's MPS Events
(docs/mps.md) and the controller's idle policy (docs/idle-reclaim.md) use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from kubernetes import client as k8s

from gpu_dra.kube.client import translated_errors

MESSAGE_LIMIT: Final = 1024
"""A longer message is cut to this many characters, the last one ``…``."""


class EventApi(Protocol):
    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        """Create ``event``; `gpu_dra.kube.errors.ApiError` when the API server refuses."""
        ...


class KubernetesEventApi:
    """`EventApi` over the Kubernetes client (core/v1 Events)."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 10.0) -> None:
        # Any: raw dictionaries in (_preload_content=False), not the typed models.
        self._core: Any = k8s.CoreV1Api(api_client)
        self._timeout = request_timeout_s

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        with translated_errors(f"create Event in {namespace}"):
            self._core.create_namespaced_event(
                namespace, event, _preload_content=False, _request_timeout=self._timeout
            )


@dataclass(frozen=True)
class InvolvedObject:
    """What an Event is about."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str

    def to_json(self) -> dict[str, str]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
        }


def event(
    target: InvolvedObject,
    reason: str,
    message: str,
    *,
    warning: bool,
    component: str,
    instance: str,
    now: float,
    host: str | None = None,
) -> dict[str, Any]:
    """A core/v1 Event about `target`, recorded by `component` (``source.component``,
    ``reportingComponent``) instance `instance` (``reportingInstance``; a pod or node name) at
    `now` (seconds since the epoch); `host`: the node it happened on (``source.host``)."""
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 1] + "…"
    source = {"component": component} if host is None else {"component": component, "host": host}
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{target.name}.gpu-dra-", "namespace": target.namespace},
        "involvedObject": target.to_json(),
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": source,
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
