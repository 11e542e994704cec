"""Reading a live cluster for `gpu-dra explain` and `gpu-dra inventory` (read-only): the
``--kubeconfig`` flag, the client, the reads, and their failures as `CliError`s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from kubernetes.client import CoreV1Api

from gpu_dra.cli.command import EXIT_USAGE, CliError, add_env_argument, add_output_argument
from gpu_dra.cli.queueing import KUEUE_API
from gpu_dra.driver.cluster.idle_policy import LABEL as IDLE_POLICY_LABEL
from gpu_dra.kube import errors
from gpu_dra.kube.client import (
    decoded_items,
    decoded_object,
    list_namespaced_objects,
    list_resource_objects,
    new_api_client,
    read_namespaced_object,
    read_resource_claim,
    translated_errors,
)

Obj = dict[str, Any]


def add_cluster_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_output_argument(parser)
    add_env_argument(
        parser,
        environ,
        "--kubeconfig",
        env=("KUBECONFIG",),
        metavar="FILE",
        help="kubeconfig of the cluster to read",
        shown_default="~/.kube/config if it exists, else the pod's service account",
    )


def api_client(kubeconfig: str | None) -> Any:
    if kubeconfig:
        path: Path | None = Path(kubeconfig.split(os.pathsep)[0])
    else:
        default = Path.home() / ".kube" / "config"
        path = default if default.exists() else None
    return new_api_client(path)


def read_claim(client: Any, namespace: str, name: str) -> Obj:
    """The ResourceClaim `namespace`/`name`."""
    return read_resource_claim(client, namespace, name)


def read_objects(client: Any) -> tuple[list[Obj], list[Obj], list[Obj]]:
    """Every DeviceClass, ResourceSlice and ResourceClaim, in that order."""
    classes = list_resource_objects(client, "deviceclasses")
    slices = list_resource_objects(client, "resourceslices")
    claims = list_resource_objects(client, "resourceclaims")
    return classes, slices, claims


def read_kueue(client: Any, namespace: str) -> tuple[list[Obj], list[Obj]] | None:
    """Kueue's Workloads and LocalQueues in `namespace` (docs/kueue.md); None when the
    apiserver does not serve Kueue's API (Kueue is not installed). Raises `errors.ApiError`."""
    try:
        workloads = list_namespaced_objects(client, KUEUE_API, "workloads", namespace)
    except errors.NotFoundError:
        return None
    return workloads, list_namespaced_objects(client, KUEUE_API, "localqueues", namespace)


def read_pods(client: Any, namespace: str) -> list[Obj]:
    """The Pods of `namespace`. Raises `errors.ApiError`."""
    core: Any = CoreV1Api(client)
    return _core_items(
        f"list Pods in namespace {namespace}",
        lambda: core.list_namespaced_pod(namespace, _preload_content=False),
    )


def _core_items(action: str, call: Callable[[], Any]) -> list[Obj]:
    """The objects of the core API list `call` returns (raw, not preloaded); `errors.ApiError`
    naming `action` when it fails."""
    with translated_errors(action):
        response = call()
    return decoded_items(response.data, action)


def read_jobs(client: Any, namespace: str) -> list[Obj]:
    """The batch/v1 Jobs of `namespace`. Raises `errors.ApiError`."""
    return list_namespaced_objects(client, "batch/v1", "jobs", namespace)


def read_job(client: Any, namespace: str, name: str) -> Obj:
    """The batch/v1 Job `namespace`/`name`. Raises `errors.ApiError` (`NotFoundError`)."""
    return read_namespaced_object(client, "batch/v1", "jobs", namespace, name)


def read_claim_template(client: Any, namespace: str, name: str) -> Obj:
    """The ResourceClaimTemplate `namespace`/`name`. Raises `errors.ApiError`."""
    return read_namespaced_object(
        client, "resource.k8s.io/v1", "resourceclaimtemplates", namespace, name
    )


def read_pod(client: Any, namespace: str, name: str) -> Obj:
    """The Pod `namespace`/`name`. Raises `errors.ApiError` (`NotFoundError`)."""
    core: Any = CoreV1Api(client)
    action = f"read Pod {namespace}/{name}"
    with translated_errors(action):
        response = core.read_namespaced_pod(name, namespace, _preload_content=False)
    return decoded_object(response.data, action)


def read_pod_events(client: Any, namespace: str, name: str) -> list[Obj]:
    """The Events about Pod `namespace`/`name`. Raises `errors.ApiError`."""
    core: Any = CoreV1Api(client)
    selector = f"involvedObject.kind=Pod,involvedObject.name={name}"
    return _core_items(
        f"list Events of Pod {namespace}/{name}",
        lambda: core.list_namespaced_event(
            namespace, field_selector=selector, _preload_content=False
        ),
    )


def read_quotas(client: Any, namespace: str) -> list[Obj]:
    """The ResourceQuotas of `namespace` (docs/quotas.md). Raises `errors.ApiError`."""
    core: Any = CoreV1Api(client)
    return _core_items(
        f"list ResourceQuotas in namespace {namespace}",
        lambda: core.list_namespaced_resource_quota(namespace, _preload_content=False),
    )


def read_idle_policy(
    client: Any, pods: Iterable[tuple[str, str]]
) -> tuple[dict[str, Obj], dict[tuple[str, str], Obj]]:
    """The namespaces labelled for the idle policy (docs/idle-reclaim.md) by name, and those of
    `pods` (namespace, name) that live in them and exist. Raises `errors.ApiError`."""
    core: Any = CoreV1Api(client)
    action = f"list Namespaces labelled {IDLE_POLICY_LABEL}"
    with translated_errors(action):
        response = core.list_namespace(label_selector=IDLE_POLICY_LABEL, _preload_content=False)
    namespaces = {
        str(item["metadata"]["name"]): item
        for item in decoded_object(response.data, action).get("items") or []
    }
    found = {}
    for namespace, name in sorted(set(pods)):
        if namespace not in namespaces:
            continue
        action = f"read Pod {namespace}/{name}"
        try:
            with translated_errors(action):
                response = core.read_namespaced_pod(name, namespace, _preload_content=False)
        except errors.NotFoundError:
            continue
        found[(namespace, name)] = decoded_object(response.data, action)
    return namespaces, found


@contextlib.contextmanager
def cluster_errors() -> Iterator[None]:
    """Turns client configuration and API failures into `CliError`s."""
    try:
        yield
    except errors.ClientConfigError as error:
        raise CliError(str(error), EXIT_USAGE) from error
    except errors.ApiError as error:
        raise CliError(str(error)) from error
