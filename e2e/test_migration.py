"""Moving the e2e node from NVIDIA's device plugin to gpu-dra, as docs/migration.md says, without
losing a pod: NVIDIA's ``k8s-device-plugin`` (built from its Go module, a host process on the NVML
mock library, `e2e.nvidiadp`) serves ``nvidia.com/gpu`` and a pod runs on one; the chart installed
with ``kubeletPlugin.migrationNodeLabel`` puts no plugin on the unlabelled node; once the node is
labelled the plugin pod waits, Running but not Ready, with an Event naming why, while the device
plugin serves and then while the pod it served runs; that pod is never stopped; once it has
finished, the same plugin pod (no restart) takes the node and a new ``nvidia.com/gpu: 1`` pod
gets its GPU through DRA (the DeviceClass's extendedResourceName).

Uses `e2e.chart`'s image, values and helm helpers; installs its own release in the chart tests'
namespace (modules run one after the other). Runs after every other e2e module (`runs_last`): the
kubelet remembers the device plugin it stopped (its device manager checkpoint, 5 minutes of
grace, docs/migration.md), and a later test that restarts the kubelet found allocatable
``nvidia.com/gpu=8`` again, so the start-up guard (rightly) kept its plugin from serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import manifests as m
from e2e.chart import (
    NAMESPACE,
    PLUGIN_SELECTOR,
    chart_installed,
    chart_values,
    import_driver_image,
    pods,
    ready,
    wait_plugin_ready,
)
from e2e.cluster import Cluster, versions
from e2e.kube import Kube, wait_for
from e2e.nvidiadp import GPU_COUNT, DevicePlugin
from e2e.workloads import wait_running

pytestmark = [pytest.mark.e2e, pytest.mark.runs_last]

SWITCH = "nvidia.com/gpu.deploy.device-plugin"
"""The GPU Operator's per-node switch for its device plugin, the chart's migration label here."""
WAITING = "NvidiaDevicePluginPresent"
PODS_RUNNING = "NvidiaDevicePluginPodsRunning"
WORK_DONE = "/tmp/work-done"
# Prints what the device plugin (or DRA) gave the container, then works until told it is done.
WORKLOAD = (
    "trap 'exit 0' TERM; env | grep -E '^(NVIDIA_VISIBLE_DEVICES|GPU_DRA_)' | sort; "
    f"until [ -f {WORK_DONE} ]; do sleep 0.5; done"
)


def node_gpus(kube: Kube) -> str | None:
    node = kube.get("v1", "Node", versions.NODE_NAME)
    return (node["status"].get("allocatable") or {}).get("nvidia.com/gpu")


def node_label(cluster: Cluster, value: str | None) -> None:
    setting = f"{SWITCH}-" if value is None else f"{SWITCH}={value}"
    cluster.kubectl("label", "node", versions.NODE_NAME, setting, "--overwrite")


def gpu_pod(name: str, namespace: str) -> dict[str, Any]:
    container = m.container(command=WORKLOAD)
    container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    return m.pod(name, namespace, [container])


@pytest.fixture(scope="module")
def device_plugin(
    cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevicePlugin]:
    plugin = DevicePlugin(cluster.paths, tmp_path_factory.mktemp("dp") / "device-plugin.log")
    plugin.start()
    try:
        wait_for(
            f"the device plugin's nvidia.com/gpu={GPU_COUNT} on the node",
            lambda: node_gpus(kube) == str(GPU_COUNT) or not plugin.running(),
            120,
        )
        assert plugin.running(), plugin.log()
        yield plugin
    finally:
        plugin.stop()


@pytest.fixture
def migration_release(cluster: Cluster, kube: Kube, tmp_path: Path) -> Iterator[None]:
    image = import_driver_image(cluster)
    values = chart_values(cluster, image.reference)
    plugin = values["kubeletPlugin"]
    plugin["migrationNodeLabel"] = f"{SWITCH}=false"
    plugin["containers"]["gpus"]["env"].append(
        {"name": "GPU_DRA_GUARD_RECHECK_INTERVAL", "value": "2"}
    )
    with chart_installed(cluster, kube, values, tmp_path):
        try:
            yield
        finally:
            node_label(cluster, None)


def test_a_node_moves_from_nvidias_device_plugin_to_gpu_dra_without_losing_a_pod(
    cluster: Cluster,
    kube: Kube,
    device_plugin: DevicePlugin,
    migration_release: None,
    namespace: str,  # after the release: its pods go while the plugin can still unprepare
) -> None:
    seen = {e["metadata"]["name"] for e in kube.events_for("default", versions.NODE_NAME)}

    def new_events(reason: str) -> list[dict[str, Any]]:
        return [
            e
            for e in kube.events_for("default", versions.NODE_NAME)
            if e.get("reason") == reason and e["metadata"]["name"] not in seen
        ]

    # A pod gets its GPU from NVIDIA's device plugin.
    kube.create(gpu_pod("old", namespace))
    wait_running(kube, "old", namespace)
    wait_for("the old pod's output", lambda: "NVIDIA_VISIBLE_DEVICES=GPU-" in
             kube.pod_log("old", namespace), 60)  # fmt: skip
    assert "extendedResourceClaimStatus" not in kube.get("v1", "Pod", "old", namespace)["status"]

    # gpu-dra installed for the migration label: no node carries it, no plugin pod.
    (daemonset,) = kube.list("apps/v1", "DaemonSet", namespace=NAMESPACE,
                             label_selector=PLUGIN_SELECTOR)  # fmt: skip
    name = daemonset["metadata"]["name"]

    def scheduled() -> int | None:
        status = kube.get("apps/v1", "DaemonSet", name, NAMESPACE).get("status") or {}
        return status.get("desiredNumberScheduled")

    wait_for("the DaemonSet's status", lambda: scheduled() is not None, 60)
    assert scheduled() == 0

    # docs/migration.md, standalone device plugin, step 3: label the node. The plugin pod comes
    # and waits, not Ready, while the device plugin serves.
    node_label(cluster, "false")
    wait_for(f"a {WAITING} Event on the node", lambda: bool(new_events(WAITING)), 180)
    message = new_events(WAITING)[0]["message"]
    assert f"allocatable nvidia.com/gpu={GPU_COUNT}" in message
    assert f"{SWITCH}=false): wait for the Operator to remove its pod; if a device plugin " \
        "stays, it is another one" in message  # fmt: skip
    (waiting,) = pods(kube, PLUGIN_SELECTOR)
    assert waiting["status"]["phase"] == "Running"
    assert not ready(waiting)

    # Keep the device plugin off the node (here: stop its host process). The kubelet zeroes
    # the allocatable; the pod it served runs on and keeps the node from gpu-dra.
    device_plugin.stop()
    wait_for("allocatable nvidia.com/gpu=0", lambda: node_gpus(kube) in ("0", None), 60)
    wait_for(f"a {PODS_RUNNING} Event", lambda: bool(new_events(PODS_RUNNING)), 60)
    assert f"{namespace}/old (nvidia.com/gpu=1)" in new_events(PODS_RUNNING)[0]["message"]
    assert kube.get("v1", "Pod", "old", namespace)["status"]["phase"] == "Running"
    (still,) = pods(kube, PLUGIN_SELECTOR)
    assert still["metadata"]["uid"] == waiting["metadata"]["uid"]
    assert not ready(still)

    # The old pod finishes its work; gpu-dra takes the node, in the same plugin pod.
    cluster.kubectl("exec", "-n", namespace, "old", "--", "touch", WORK_DONE)
    wait_for(
        "the old pod to succeed",
        lambda: kube.get("v1", "Pod", "old", namespace)["status"].get("phase") == "Succeeded",
        60,
    )
    wait_plugin_ready(kube, cluster)
    (serving,) = pods(kube, PLUGIN_SELECTOR)
    assert serving["metadata"]["uid"] == waiting["metadata"]["uid"]
    (gpus,) = [c for c in serving["status"]["containerStatuses"] if c["name"] == "gpus"]
    assert gpus["restartCount"] == 0

    # A new pod asking for nvidia.com/gpu gets its GPU through DRA.
    kube.create(gpu_pod("new", namespace))
    wait_running(kube, "new", namespace, timeout=120)
    status = kube.get("v1", "Pod", "new", namespace)["status"]
    assert status.get("extendedResourceClaimStatus", {}).get("resourceClaimName")
    wait_for("the new pod's output", lambda: "GPU_DRA_" in kube.pod_log("new", namespace), 60)
    old = kube.get("v1", "Pod", "old", namespace)["status"]
    (terminated,) = [c["state"]["terminated"] for c in old["containerStatuses"]]
    assert terminated["exitCode"] == 0
