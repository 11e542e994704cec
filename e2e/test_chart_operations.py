"""Operating the chart on the local cluster: every object `helm template` renders, for several
value sets, passes the apiserver's own OpenAPI validation (`kubectl apply --dry-run=server
--validate=strict`); with two controller replicas exactly one holds the Lease and applies the
catalog, and when its pod is deleted the other takes over within the lease duration and keeps the
catalog reconciled; the plugin pod becomes Ready through the kubelet's gRPC probes of its health
service; the plugin refuses a node that advertises NVIDIA's device plugin resource, with an
Event on the Node, until the resource is gone; and a GPU tainted for XID 48 stays tainted when
the DaemonSet replaces the plugin pod, until the operator clears it through the new pod.

Uses `e2e.chart`'s image, values and helm helpers; installs its own release in
the same namespace (modules run one after the other)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import grpc_health_check
from e2e.chart import (
    CHART,
    CONTROLLER_SELECTOR,
    NAMESPACE,
    PLUGIN_SELECTOR,
    PROFILE,
    RELEASE,
    chart_installed,
    chart_values,
    import_driver_image,
    merged,
    pods,
    ready,
    run_helm,
    wait_plugin_ready,
)
from e2e.cluster import Cluster, versions
from e2e.driver import Driver
from e2e.health import XID_KEY, inject, taints, wait_tainted, wait_untainted
from e2e.kube import Kube, wait_for
from gpu_dra.kubelet_plugin.device_health.record import HEALTH_RECORD_FILE

pytestmark = pytest.mark.e2e

LEASE = f"{RELEASE}-controller"
"""The chart's Lease: <fullname>-controller (fullname = the release name, which holds gpu-dra)."""
LEASE_DURATION_S = 15
RESYNC_S = 5
HEALTH_PORT = 51516
OPENAPI_NAMESPACE = "gpu-dra-openapi"
OPENAPI_RELEASE = "openapi-check"


# ---- helm template against the apiserver's OpenAPI -------------------------------------------
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {"gpuResourcesEnabledOverride": True},
    "gpu-operator": {
        "gpuResourcesEnabledOverride": True,
        "nvidiaDriverRoot": "/run/nvidia/driver",
        "nvidiaCDIHookPath": "/usr/local/nvidia/toolkit/nvidia-cdi-hook",
        "featureGates": {"DynamicMIG": True, "MPSSupport": True},
        "logVerbosity": 6,
        "imagePullSecrets": [{"name": "registry-a"}],
        "kubeletPlugin": {"containers": {"gpus": {"resources": {"requests": {"cpu": "100m"}}}}},
    },
    "off-and-moved": {
        "gpuResourcesEnabledOverride": True,
        "admissionPolicy": {"enabled": False},
        "metrics": {"enabled": False},
        "deviceClasses": {"enabled": False},
        "controller": {"leaderElection": {"enabled": False}},
        "kubeletPlugin": {
            "dataDir": "/var/lib/gpu-dra",
            "mpsDaemonImage": "registry.example/gpu-dra-mps:1",
            "containers": {"gpus": {"healthcheckPort": -1}},
        },
    },
    "replicated-with-service-monitors": {
        "gpuResourcesEnabledOverride": True,
        "controller": {
            "replicas": 3,
            "leaderElection": {"leaseDuration": "30s", "renewDeadline": "20s", "retryPeriod": 5},
        },
        "deviceClasses": {"exclude": ["gpu.nvidia.com.yaml"]},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    },
}
"""Besides these, "simulate": the e2e node's own values (chart_values)."""

NOT_INSTALLED_KINDS = {"ServiceMonitor"}
"""Kinds whose CRDs the e2e cluster does not have (the Prometheus Operator's)."""


@pytest.fixture(scope="module")
def openapi_namespace(kube: Kube) -> Iterator[str]:
    kube.create_namespace(OPENAPI_NAMESPACE)
    yield OPENAPI_NAMESPACE
    kube.delete("v1", "Namespace", OPENAPI_NAMESPACE)
    kube.wait_gone("v1", "Namespace", OPENAPI_NAMESPACE, None, timeout=180)


def rendered(cluster: Cluster, values: dict[str, Any], directory: Path) -> list[dict[str, Any]]:
    path = directory / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    text = run_helm(
        cluster, "template", OPENAPI_RELEASE, str(CHART), f"--namespace={OPENAPI_NAMESPACE}",
        f"--values={path}",
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(text) if d]


def apply_dry_run(
    cluster: Cluster, objects: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    """`kubectl apply --dry-run=server --validate=strict` of `objects`: the apiserver decodes
    each against its OpenAPI schema (an unknown or duplicate field is an error) and runs
    admission, persisting nothing."""
    manifest = "---\n".join(yaml.safe_dump(o) for o in objects)
    return subprocess.run(
        [
            str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}",
            "apply", "--dry-run=server", "--validate=strict", "-f", "-",
        ],
        input=manifest, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("name", [*VALUE_SETS, "simulate"])
def test_every_rendered_object_passes_the_apiservers_openapi_validation(
    name: str, cluster: Cluster, openapi_namespace: str, tmp_path: Path
) -> None:
    if name == "simulate":
        values = chart_values(cluster, "localhost/gpu-dra:openapi")
    else:
        values = VALUE_SETS[name]
    objects = rendered(cluster, values, tmp_path)
    checked = [o for o in objects if o["kind"] not in NOT_INSTALLED_KINDS]
    if name == "replicated-with-service-monitors":
        assert len(objects) - len(checked) == 2  # the two ServiceMonitors, not checkable here

    result = apply_dry_run(cluster, checked)

    assert result.returncode == 0, f"{name}: {result.stderr}"
    applied = [line for line in result.stdout.splitlines() if "(server dry run)" in line]
    assert len(applied) == len(checked), result.stdout


def test_the_validation_rejects_a_field_the_schema_does_not_have(
    cluster: Cluster, openapi_namespace: str, tmp_path: Path
) -> None:
    """The check above can fail: a misspelt field in the rendered Deployment is refused."""
    objects = rendered(cluster, VALUE_SETS["defaults"], tmp_path)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}

    result = apply_dry_run(cluster, [deployment])

    assert result.returncode != 0
    assert 'unknown field "spec.template.spec.containers[0].livenessProbes"' in result.stderr


# ---- the installed chart: two controllers, the plugin's health, the start-up guard ----------
@pytest.fixture(scope="module")
def installed(
    cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    image = import_driver_image(cluster)
    values = merged(
        chart_values(cluster, image.reference),
        {"controller": {"replicas": 2, "resyncInterval": RESYNC_S}},
    )
    with chart_installed(cluster, kube, values, tmp_path_factory.mktemp("chart-operations")):
        yield image.reference


def controllers_ready(kube: Kube) -> list[dict[str, Any]]:
    """The two controller pods once both are Ready (pods being deleted left out), else []."""
    running = [
        p for p in pods(kube, CONTROLLER_SELECTOR) if "deletionTimestamp" not in p["metadata"]
    ]
    return running if len(running) == 2 and all(map(ready, running)) else []


def lease(kube: Kube) -> dict[str, Any]:
    return kube.get("coordination.k8s.io/v1", "Lease", LEASE, NAMESPACE)


def controller_log(kube: Kube, pod: str) -> str:
    return kube.pod_log(pod, NAMESPACE, container="controller")


APPLIED = "applied DeviceClass catalog"


def test_exactly_one_of_two_controllers_leads_and_the_other_takes_over(
    installed: str, kube: Kube
) -> None:
    wait_for("both controller pods to be ready", lambda: bool(controllers_ready(kube)), 180)
    names = {p["metadata"]["name"] for p in controllers_ready(kube)}
    wait_for("a Lease holder", lambda: lease(kube)["spec"].get("holderIdentity") in names, 60)
    first = lease(kube)["spec"]
    leader = first["holderIdentity"]
    (standby,) = names - {leader}

    # Only the leader applies; the standby is a candidate (and Ready: it answers its probes).
    wait_for("the leader to apply the catalog", lambda: APPLIED in controller_log(kube, leader), 60)
    assert APPLIED not in controller_log(kube, standby)
    assert "leader election: candidate" in controller_log(kube, standby)

    # The leader keeps the catalog reconciled.
    kube.delete("resource.k8s.io/v1", "DeviceClass", "hopper.gpu.nvidia.com")
    wait_for(
        "the leader to restore a deleted DeviceClass",
        lambda: has_class(kube, "hopper.gpu.nvidia.com"),
        3 * RESYNC_S + 10,
    )

    # Deleting the leader's pod: it releases the Lease; another replica holds it well within
    # the lease duration and applies the catalog.
    deleted = time.monotonic()
    kube.delete("v1", "Pod", leader, NAMESPACE)
    wait_for(
        "another controller to hold the Lease",
        lambda: lease(kube)["spec"].get("holderIdentity") not in (None, "", leader),
        LEASE_DURATION_S + 5,
    )
    took_over_s = time.monotonic() - deleted
    after = lease(kube)["spec"]
    successor = after["holderIdentity"]
    assert after["leaseTransitions"] > first.get("leaseTransitions", 0)
    assert took_over_s < LEASE_DURATION_S, f"took over after {took_over_s:.1f}s"
    wait_for("the successor to apply", lambda: APPLIED in controller_log(kube, successor), 60)

    kube.delete("resource.k8s.io/v1", "DeviceClass", "mig.nvidia.com")
    wait_for(
        "the successor to restore a deleted DeviceClass",
        lambda: has_class(kube, "mig.nvidia.com"),
        3 * RESYNC_S + 10,
    )
    wait_for("both controller pods to be ready again", lambda: bool(controllers_ready(kube)), 180)
    names = {p["metadata"]["name"] for p in controllers_ready(kube)}
    assert lease(kube)["spec"]["holderIdentity"] in names
    other_logs = [controller_log(kube, n) for n in names - {successor}]
    assert all(APPLIED not in log for log in other_logs)


def has_class(kube: Kube, name: str) -> bool:
    return name in {c["metadata"]["name"] for c in kube.list("resource.k8s.io/v1", "DeviceClass")}


def test_the_plugin_pod_is_ready_through_its_grpc_health_probes(
    installed: str, kube: Kube, cluster: Cluster
) -> None:
    wait_plugin_ready(kube, cluster)
    (pod,) = pods(kube, PLUGIN_SELECTOR)
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "gpus"]

    # The kubelet's own gRPC probes, and nothing else, decide the pod's readiness.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert set(container[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}
        assert container[probe]["grpc"]["port"] == HEALTH_PORT
    assert container["readinessProbe"]["grpc"]["service"] == "readiness"
    (status,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "gpus"]
    assert status["ready"] is True
    assert status["restartCount"] == 0  # the liveness probe never failed

    # What the kubelet asks, asked from here (the pod IP is on the cluster's bridge).
    address = f"{pod['status']['podIP']}:{HEALTH_PORT}"
    for service in ("", "liveness", "readiness"):
        assert grpc_health_check.check(address, service) == "SERVING", service
    assert grpc_health_check.check(address, "gpu") == "NOT_FOUND"


def patch_node_status(
    cluster: Cluster, operations: list[dict[str, Any]], check: bool = True
) -> None:
    cluster.kubectl(
        "patch", "node", versions.NODE_NAME, "--subresource=status", "--type=json",
        f"--patch={json.dumps(operations)}", check=check,
    )  # fmt: skip


def node_gpus(kube: Kube) -> str | None:
    node = kube.get("v1", "Node", versions.NODE_NAME)
    allocatable: dict[str, str] = node["status"].get("allocatable") or {}
    return allocatable.get("nvidia.com/gpu")


def test_the_plugin_waits_on_a_node_with_nvidias_device_plugin_resource(
    installed: str, kube: Kube, cluster: Cluster
) -> None:
    """As if NVIDIA's device plugin advertised a GPU: the extended resource is patched into the
    Node's status (the kubelet carries it into allocatable), the plugin pod is restarted. The new
    pod waits, Running but not Ready, and becomes Ready by itself, never restarted, once the
    resource is gone."""
    wait_plugin_ready(kube, cluster)
    # Events of earlier tests (e2e/test_migration.py records the same reason) do not count.
    seen = {e["metadata"]["name"] for e in kube.events_for("default", versions.NODE_NAME)}
    resource = "/status/capacity/nvidia.com~1gpu"
    patch_node_status(cluster, [{"op": "add", "path": resource, "value": "1"}])
    try:
        wait_for("allocatable nvidia.com/gpu", lambda: node_gpus(kube) == "1", 60)
        (old,) = pods(kube, PLUGIN_SELECTOR)
        kube.delete("v1", "Pod", old["metadata"]["name"], NAMESPACE)

        def refusal_events() -> list[dict[str, Any]]:
            return [
                e
                for e in kube.events_for("default", versions.NODE_NAME)
                if e.get("reason") == "NvidiaDevicePluginPresent"
                and e["metadata"]["name"] not in seen
            ]

        wait_for("the refusal Event on the Node", lambda: bool(refusal_events()), 120)
        event = refusal_events()[0]
        assert event["involvedObject"]["kind"] == "Node"
        assert event["type"] == "Warning"
        assert "allocatable nvidia.com/gpu=1" in event["message"]
        (pod,) = [
            p
            for p in pods(kube, PLUGIN_SELECTOR)
            if p["metadata"]["name"] != old["metadata"]["name"]
        ]
        assert not ready(pod)
        refusal = f"not serving node {versions.NODE_NAME}"

        def logged() -> bool:
            log = cluster.kubectl(
                "logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", "gpus", check=False
            )  # fmt: skip
            return refusal in log

        wait_for(f"{refusal!r} in the plugin pod's log", logged, 60)
    finally:
        patch_node_status(cluster, [{"op": "remove", "path": resource}])
        # The kubelet may have dropped it from allocatable already: then this patch fails.
        patch_node_status(
            cluster, [{"op": "remove", "path": "/status/allocatable/nvidia.com~1gpu"}], check=False
        )
    wait_for("nvidia.com/gpu to be gone", lambda: node_gpus(kube) is None, 60)
    wait_plugin_ready(kube, cluster)
    (started,) = pods(kube, PLUGIN_SELECTOR)
    assert started["metadata"]["name"] == pod["metadata"]["name"]
    (gpus,) = [c for c in started["status"]["containerStatuses"] if c["name"] == "gpus"]
    assert gpus["restartCount"] == 0


# ---- device health across a rollout of the chart-installed plugin (issue 25, item 1) ----------
def plugin_daemonset(kube: Kube) -> str:
    (daemonset,) = kube.list("apps/v1", "DaemonSet", namespace=NAMESPACE,
                             label_selector=PLUGIN_SELECTOR)  # fmt: skip
    return str(daemonset["metadata"]["name"])


def plugin_pod_name(kube: Kube) -> str:
    (pod,) = pods(kube, PLUGIN_SELECTOR)
    return str(pod["metadata"]["name"])


def test_a_gpu_tainted_for_xid_48_stays_tainted_across_a_rollout_until_cleared(
    installed: str, kube: Kube, cluster: Cluster, tmp_path: Path
) -> None:
    # The health monitor is off on simulated nodes by default: turn it on (a rollout).
    values = merged(
        chart_values(cluster, installed),
        {"controller": {"replicas": 2, "resyncInterval": RESYNC_S}},
    )
    gpus = values["kubeletPlugin"]["containers"]["gpus"]
    gpus["env"] = [*gpus["env"], {"name": "GPU_DRA_HEALTH_MONITOR", "value": "true"}]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    run_helm(cluster, "upgrade", RELEASE, str(CHART), f"--namespace={NAMESPACE}",
             f"--values={path}")  # fmt: skip
    wait_plugin_ready(kube, cluster)
    driver = Driver(cluster, kube, PROFILE)
    try:
        xid_48_across_a_rollout(kube, cluster, driver)
    finally:  # the record outlives the release; the modules after this one start healthy
        (driver.data_dir / HEALTH_RECORD_FILE).unlink(missing_ok=True)


def xid_48_across_a_rollout(kube: Kube, cluster: Cluster, driver: Driver) -> None:
    uuid = driver.uuid_of("gpu-3")
    inject(driver, {"gpu": uuid, "event": "xid", "xid": 48})
    wait_tainted(driver, {"gpu-3"}, XID_KEY)
    (before,) = taints(driver)["gpu-3"]
    old_pod = plugin_pod_name(kube)

    # The DaemonSet replaces the plugin pod; the new one knows the fault from its record only.
    cluster.kubectl("rollout", "restart", f"daemonset/{plugin_daemonset(kube)}", "-n", NAMESPACE)
    wait_for("the old plugin pod to be gone", lambda: old_pod not in
             {p["metadata"]["name"] for p in pods(kube, PLUGIN_SELECTOR)}, 180)  # fmt: skip
    wait_plugin_ready(kube, cluster)
    new_pod = plugin_pod_name(kube)
    assert new_pod != old_pod
    log = kube.pod_log(new_pod, NAMESPACE, "gpus")
    assert "device gpu-3 starts tainted from the health record" in log
    assert taints(driver)["gpu-3"] == [before]  # same taint, same timeAdded
    assert sorted(taints(driver)) == ["gpu-3"]

    # The operator's clear, through the plugin pod, untaints it.
    out = cluster.kubectl("exec", "-n", NAMESPACE, new_pod, "-c", "gpus", "--",
                          "gpu-dra-kubelet-plugin", "clear-health", "--gpu", uuid)  # fmt: skip
    assert f"clear requested for {uuid}" in out
    wait_untainted(driver)
    assert "recorded problems cleared by the operator" in kube.pod_log(new_pod, NAMESPACE, "gpus")
