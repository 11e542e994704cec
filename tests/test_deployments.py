"""deployments/rbac.yaml, the RBAC of the host-process mode (both processes outside the cluster
under one identity, as the e2e tests run them), grants what the code calls: the slice publisher,
the claim reader, the catalog, and the MPS daemon pods in the namespace the plugin uses by
default. The chart's RBAC is tested in test_helm_chart.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpu_dra.kubelet_plugin.settings import DEFAULT_MPS_DAEMON_NAMESPACE

RBAC = Path(__file__).resolve().parent.parent / "deployments" / "rbac.yaml"


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(RBAC.read_text()) if d]


def verbs(role: dict[str, Any], group: str, resource: str) -> set[str]:
    return {
        verb
        for rule in role["rules"]
        if group in rule["apiGroups"] and resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_rbac_lets_the_start_up_guard_list_the_pods_of_its_node() -> None:
    (role,) = [d for d in documents() if d["kind"] == "ClusterRole"]

    # KubernetesGuardApi.list_node_pods: list_pod_for_all_namespaces (spec.nodeName=<node>).
    assert verbs(role, "", "pods") == {"list"}


def test_rbac_lets_the_plugin_manage_daemon_pods_in_its_default_namespace() -> None:
    docs = documents()
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]

    # What PodRunner calls: create_pod, get_pod, list_pods, delete_pod.
    assert {"create", "get", "list", "delete"} <= verbs(role, "", "pods")
    assert role["metadata"]["namespace"] == namespace["metadata"]["name"]
    assert namespace["metadata"]["name"] == DEFAULT_MPS_DAEMON_NAMESPACE
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    # The daemon pods are privileged with hostPID: the namespace must admit them.
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_rbac_covers_slices_claims_and_the_catalog() -> None:
    (cluster_role,) = [d for d in documents() if d["kind"] == "ClusterRole"]

    assert {"list", "watch", "create", "update", "delete"} <= verbs(
        cluster_role, "resource.k8s.io", "resourceslices"
    )
    assert {"get", "list", "watch"} <= verbs(cluster_role, "resource.k8s.io", "resourceclaims")
    assert {"create", "patch"} <= verbs(cluster_role, "resource.k8s.io", "deviceclasses")
    assert "get" in verbs(cluster_role, "", "nodes")
    # The start-up guard's refusal Event, in the plugin's default --event-namespace.
    assert "create" in verbs(cluster_role, "", "events")
