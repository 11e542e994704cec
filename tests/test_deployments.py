"""The shipped manifests (deployments/) fit the code: the DaemonSet's environment parses into the
settings it documents (MPS daemons as pods), the plugin can see the daemon pods' processes, and
the RBAC grants what the pod runner calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings

DEPLOYMENTS = Path(__file__).resolve().parent.parent / "deployments"


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOYMENTS / name).read_text()) if d]


def plugin_pod_spec() -> dict[str, Any]:
    (daemonset,) = documents("kubelet-plugin.yaml")
    assert daemonset["kind"] == "DaemonSet"
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def test_the_daemonset_runs_mps_daemons_as_pods_in_its_own_namespace() -> None:
    (container,) = plugin_pod_spec()["containers"]
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
    # What the downward API fills in:
    env.update(NODE_NAME="gpu-node-1", POD_NAMESPACE="gpu-dra")

    settings = KubeletPluginSettings.parse([], env)

    assert settings.mps_daemon_runner == "pod"
    assert settings.mps_daemon_image == container["image"]
    assert settings.mps_daemon_namespace == "gpu-dra"
    assert settings.mps_exclusive_compute_mode is False
    # The plugin and the daemon pods it starts are the node's last eviction candidates.
    assert plugin_pod_spec()["priorityClassName"] == settings.mps_daemon_priority_class
    assert settings.mps_daemon_priority_class == "system-node-critical"


def test_the_plugin_shares_the_host_pid_namespace_and_propagates_shm_mounts() -> None:
    spec = plugin_pod_spec()
    (container,) = spec["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}

    assert spec["hostPID"] is True
    assert mounts["/var/lib/kubelet/plugins"]["mountPropagation"] == "Bidirectional"


def test_rbac_lets_the_plugin_manage_daemon_pods_in_the_daemonsets_namespace() -> None:
    docs = documents("rbac.yaml")
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    (namespace,) = [d for d in docs if d["kind"] == "Namespace"]
    (daemonset,) = documents("kubelet-plugin.yaml")
    plugin_namespace = daemonset["metadata"]["namespace"]
    verbs = {
        verb
        for rule in role["rules"]
        if "" in rule["apiGroups"] and "pods" in rule["resources"]
        for verb in rule["verbs"]
    }

    # What PodRunner calls: create_pod, get_pod, list_pods, delete_pod.
    assert {"create", "get", "list", "delete"} <= verbs
    assert role["metadata"]["namespace"] == plugin_namespace == namespace["metadata"]["name"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": plugin_pod_spec()["serviceAccountName"],
            "namespace": plugin_namespace,
        }
    ]
    # The daemon pods are privileged with hostPID: the namespace must admit them.
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
