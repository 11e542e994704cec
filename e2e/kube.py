"""A small typed helper over the Kubernetes dynamic client for the e2e tests (dict in, dict out)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import config, dynamic
from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.dynamic.exceptions import NotFoundError

Obj = dict[str, Any]


class Kube:
    """Create, read, wait for and delete objects given as plain manifests."""

    def __init__(self, kubeconfig: Path) -> None:
        self.api_client: ApiClient = config.new_client_from_config(config_file=str(kubeconfig))
        self.client = dynamic.DynamicClient(self.api_client)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.client.resources.get(api_version=api_version, kind=kind)

    def create(self, manifest: Obj, *, dry_run: bool = False) -> Obj:
        """Create `manifest` (with `dry_run`, through every admission check, storing nothing)."""
        resource = self._resource(manifest["apiVersion"], manifest["kind"])
        namespace = manifest.get("metadata", {}).get("namespace")
        options = {"dry_run": "All"} if dry_run else {}
        return dict(resource.create(body=manifest, namespace=namespace, **options).to_dict())

    def create_namespace(self, name: str, timeout: float = 120) -> None:
        """Create Namespace `name` and wait for its ``default`` ServiceAccount: the apiserver
        refuses pods in the namespace until kube-controller-manager made it, which after an
        apiserver outage waits for that manager's watches to resume (tens of seconds)."""
        self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        wait_for(
            f"the default ServiceAccount of namespace {name}",
            lambda: self.exists("v1", "ServiceAccount", "default", name),
            timeout,
        )

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> Obj:
        resource = self._resource(api_version, kind)
        return dict(resource.get(name=name, namespace=namespace).to_dict())

    def exists(self, api_version: str, kind: str, name: str, namespace: str | None) -> bool:
        try:
            self.get(api_version, kind, name, namespace)
        except NotFoundError:
            return False
        return True

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        field_selector: str | None = None,
        label_selector: str | None = None,
    ) -> list[Obj]:
        resource = self._resource(api_version, kind)
        result = resource.get(
            namespace=namespace, field_selector=field_selector, label_selector=label_selector
        )
        return [dict(item) for item in result.to_dict()["items"]]

    def delete(
        self,
        api_version: str,
        kind: str,
        name: str,
        namespace: str | None = None,
        grace_period_seconds: int | None = None,
    ) -> None:
        resource = self._resource(api_version, kind)
        body = (
            {"gracePeriodSeconds": grace_period_seconds}
            if grace_period_seconds is not None
            else None
        )
        with contextlib.suppress(NotFoundError):
            resource.delete(name=name, namespace=namespace, body=body)

    def wait_gone(
        self, api_version: str, kind: str, name: str, namespace: str | None, timeout: float = 120
    ) -> None:
        wait_for(
            f"{kind} {name} to be deleted",
            lambda: not self.exists(api_version, kind, name, namespace),
            timeout,
        )

    def pod_log(self, name: str, namespace: str, container: str | None = None) -> str:
        core = CoreV1Api(self.api_client)
        if container is None:
            return str(core.read_namespaced_pod_log(name, namespace))
        return str(core.read_namespaced_pod_log(name, namespace, container=container))

    def events_for(self, namespace: str, name: str) -> list[Obj]:
        events = self.list("v1", "Event", namespace=namespace)
        return [e for e in events if e.get("involvedObject", {}).get("name") == name]


def wait_for(
    what: str, probe: Callable[[], bool], timeout: float = 120, interval: float = 0.5
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if probe():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
