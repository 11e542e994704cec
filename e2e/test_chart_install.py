"""The shipped install path: the driver image built from the Dockerfile without a Docker engine
(`e2e.cluster.driverimage`), imported into the node's containerd, and the Helm chart
(deployments/helm/gpu-dra) installed with the pinned ``helm``. The kubelet plugin runs as the
chart's DaemonSet pod on a simulated H100 node and the controller as its Deployment; a whole-GPU
claim runs through them; the controller's admission webhook refuses a claim and a DeviceClass
with an unknown sharing strategy at ``kubectl apply`` with the plugin's message, admits a valid
claim, and keeps its chart-made certificate across ``helm upgrade``; ``helm uninstall`` leaves no
pod of the chart behind. The image, values and helm helpers are `e2e.chart`'s (the demo installs
the chart with them too)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import CustomObjectsApi
from kubernetes.client.exceptions import ApiException

from e2e import manifests as m
from e2e.chart import (
    CHART,
    CONTROLLER_SELECTOR,
    NAMESPACE,
    PLUGIN_SELECTOR,
    RELEASE,
    chart_installed,
    chart_values,
    import_driver_image,
    merged,
    pods,
    ready,
    run_helm,
    service_account_client,
    wait_plugin_ready,
)
from e2e.cluster import Cluster, ClusterError, versions
from e2e.driver import CDI_ROOT, DRIVER
from e2e.kube import Kube, wait_for
from e2e.workloads import allocated_devices, claim_uid, delete_pods, gpus_seen, wait_running

pytestmark = pytest.mark.e2e

CLAIM_API = "resource.k8s.io/v1"


@pytest.fixture(scope="module")
def installed(
    cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    image = import_driver_image(cluster)
    # Claim status and sampling quicker than the defaults, for the claim status test.
    quick = {
        "kubeletPlugin": {"claimStatus": {"minInterval": 2, "idleAfter": 10}},
        "metrics": {"utilization": {"interval": 2}},
    }
    values = merged(chart_values(cluster, image.reference), quick)
    with chart_installed(cluster, kube, values, tmp_path_factory.mktemp("chart")):
        yield image.reference


def test_the_chart_runs_the_plugin_and_controller_from_the_local_image(
    installed: str, kube: Kube, cluster: Cluster
) -> None:
    wait_plugin_ready(kube, cluster)
    wait_for(
        "the controller pod to be ready",
        lambda: any(map(ready, pods(kube, CONTROLLER_SELECTOR))),
        120,
    )
    (plugin,) = pods(kube, PLUGIN_SELECTOR)
    assert plugin["spec"]["containers"][0]["image"] == installed
    assert (
        plugin["spec"]["serviceAccountName"]
        != pods(kube, CONTROLLER_SELECTOR)[0]["spec"]["serviceAccountName"]
    )

    def published() -> set[str]:
        slices = kube.list(
            "resource.k8s.io/v1", "ResourceSlice",
            field_selector=f"spec.driver={DRIVER},spec.nodeName={versions.NODE_NAME}",
        )  # fmt: skip
        return {d["name"] for s in slices for d in s["spec"].get("devices", [])}

    wait_for(
        "the DaemonSet's plugin to publish 8 GPUs",
        lambda: published() == {f"gpu-{i}" for i in range(8)},
        120,
    )
    classes = {c["metadata"]["name"] for c in kube.list("resource.k8s.io/v1", "DeviceClass")}
    assert {"gpu.nvidia.com", "mig.nvidia.com", "mps.gpu.nvidia.com"} <= classes


def test_a_whole_gpu_claim_runs_through_the_chart_installed_plugin(
    installed: str, kube: Kube, cluster: Cluster, namespace: str
) -> None:
    wait_plugin_ready(kube, cluster)
    kube.create(m.claim("gpu", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("pod", namespace, claim="gpu"))
    wait_running(kube, "pod", namespace, timeout=180)
    (device,) = allocated_devices(kube, "gpu", namespace)
    seen = gpus_seen(kube, "pod", namespace)
    assert list(seen) == [f"GPU_{device.removeprefix('gpu-')}"]
    uid = claim_uid(kube, "gpu", namespace)
    assert list(CDI_ROOT.glob(f"*{uid}*"))
    delete_pods(kube, namespace, ["pod"])
    wait_for("the CDI spec to be removed", lambda: not list(CDI_ROOT.glob(f"*{uid}*")), 60)


WEBHOOK = f"{RELEASE}-webhook"
BAD_STRATEGY_DENIED = (
    'admission webhook "{webhook}" denied the request: {path}: parameters.sharing.strategy: '
    "unknown GPU sharing strategy 'Often': supported are TimeSlicing, MPS"
)


def sharing(strategy: str) -> list[dict[str, Any]]:
    return [m.gpu_config({"kind": "GpuConfig", "sharing": {"strategy": strategy}})]


def kubectl_apply(cluster: Cluster, manifest: dict[str, Any]) -> str:
    """`kubectl apply` of one object as the admin; ClusterError with kubectl's stderr if refused."""
    return cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))


def refused_by_the_webhook(cluster: Cluster, manifest: dict[str, Any]) -> str:
    """kubectl's complaint about applying `manifest`, once the webhook itself answers: while the
    controller's address is not yet in its Service, the apiserver fails to call it (and refuses,
    failurePolicy Fail) with another message; that is waited out."""
    complaint = ""

    def webhook_answered() -> bool:
        nonlocal complaint
        try:
            kubectl_apply(cluster, manifest)
        except ClusterError as error:
            complaint = str(error)
            return "failed calling webhook" not in complaint
        raise AssertionError(f"applied, not refused: {manifest['metadata']['name']}")

    try:
        wait_for("the webhook to answer the apiserver", webhook_answered, 120, interval=2)
    except TimeoutError as error:
        # E.g. an e2e cluster started before --enable-aggregator-routing: restart it.
        raise AssertionError(f"{error}; the last refusal: {complaint}") from error
    return complaint


def test_the_webhook_refuses_an_unknown_sharing_strategy_at_apply(
    installed: str, kube: Kube, cluster: Cluster, namespace: str
) -> None:
    wait_for(
        "the controller pod to be ready",
        lambda: any(map(ready, pods(kube, CONTROLLER_SELECTOR))),
        120,
    )
    bad = m.claim("bad-sharing", namespace, m.claim_spec([m.request()], sharing("Often")))
    good = m.claim("time-sliced", namespace, m.claim_spec([m.request()], sharing("TimeSlicing")))

    complaint = refused_by_the_webhook(cluster, bad)

    webhook = f"resourceclaims.{DRIVER}"
    assert BAD_STRATEGY_DENIED.format(webhook=webhook, path="spec.devices.config[0]") in complaint
    claims = {c["metadata"]["name"] for c in kube.list(CLAIM_API, "ResourceClaim", namespace)}
    assert "bad-sharing" not in claims
    kubectl_apply(cluster, good)
    claims = {c["metadata"]["name"] for c in kube.list(CLAIM_API, "ResourceClaim", namespace)}
    assert "time-sliced" in claims


def test_the_webhook_refuses_a_device_class_with_a_bad_config(
    installed: str, kube: Kube, cluster: Cluster
) -> None:
    name = "webhook-test.gpu.nvidia.com"
    bad = {
        "apiVersion": CLAIM_API,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"config": sharing("Often")},
    }
    try:
        complaint = refused_by_the_webhook(cluster, bad)
    finally:
        kube.delete(CLAIM_API, "DeviceClass", name)

    webhook = f"deviceclasses.{DRIVER}"
    assert BAD_STRATEGY_DENIED.format(webhook=webhook, path="spec.config[0]") in complaint
    # The controller applied its catalog (mps.gpu.nvidia.com carries a config of the driver)
    # at start, before it could answer: the webhook leaves its own applies alone, so none failed.
    (controller,) = pods(kube, CONTROLLER_SELECTOR)
    log = cluster.kubectl(
        "logs", "-n", NAMESPACE, controller["metadata"]["name"], "-c", "controller"
    )
    assert "serving the admission webhook on port 8443" in log
    assert "applying DeviceClass failed" not in log
    assert kube.get(CLAIM_API, "DeviceClass", "mps.gpu.nvidia.com")["spec"]["config"]


def plugin_identity(cluster: Cluster, kube: Kube, tmp_path: Path) -> Kube:
    """A client with the plugin's own identity: a token of its ServiceAccount bound to its pod
    (so the apiserver puts the pod's node into the token, as for the running plugin)."""
    (pod,) = pods(kube, PLUGIN_SELECTOR)
    return service_account_client(
        cluster, pod["spec"]["serviceAccountName"], tmp_path, bound_pod=pod["metadata"]["name"]
    )


def slice_for(node: str, pool: str | None = None) -> dict[str, Any]:
    """An empty slice of ``node`` in ``pool`` (default: the node's own, at generation 0, below
    the plugin's, so the scheduler never reads it)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"generateName": f"{node}-policy-test-"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": pool or node, "generation": 0, "resourceSliceCount": 1},
            "devices": [],
        },
    }


def test_the_plugins_identity_may_write_only_its_own_nodes_slices(
    installed: str, kube: Kube, cluster: Cluster, tmp_path: Path
) -> None:
    wait_plugin_ready(kube, cluster)
    plugin = plugin_identity(cluster, kube, tmp_path)

    with pytest.raises(ApiException) as denied:
        plugin.create(slice_for("other-node"))
    assert denied.value.status == 403
    assert (
        f"gpu-dra kubelet plugin on node {versions.NODE_NAME} may only create a ResourceSlice "
        "of its own node, not one of node other-node" in str(denied.value.body)
    )
    with pytest.raises(ApiException) as shadowing:  # its node, another node's pool
        plugin.create(slice_for(versions.NODE_NAME, pool="other-node"))
    assert shadowing.value.status == 403
    assert (
        f"gpu-dra kubelet plugin on node {versions.NODE_NAME} may only create ResourceSlices "
        f"of pool {versions.NODE_NAME} (its node), not of pool other-node"
        in str(shadowing.value.body)
    )
    own = plugin.create(slice_for(versions.NODE_NAME))  # its own node and pool: allowed
    kube.delete("resource.k8s.io/v1", "ResourceSlice", own["metadata"]["name"])

    with pytest.raises(ApiException) as forbidden:  # RBAC: DeviceClasses are the controller's
        plugin.create({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": "policy-test.gpu.nvidia.com"}, "spec": {},
        })  # fmt: skip
    assert forbidden.value.status == 403


def test_an_upgrade_keeps_the_webhooks_certificate(
    installed: str, kube: Kube, cluster: Cluster
) -> None:
    # Last in the module: it upgrades the shared release (with the same values).
    def certificate() -> tuple[dict[str, str], set[str]]:
        secret = kube.get("v1", "Secret", f"{WEBHOOK}-tls", NAMESPACE)
        config = kube.get(
            "admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration", WEBHOOK
        )
        return secret["data"], {hook["clientConfig"]["caBundle"] for hook in config["webhooks"]}

    before = certificate()
    run_helm(
        cluster, "upgrade", RELEASE, str(CHART), f"--namespace={NAMESPACE}", "--reuse-values",
    )  # fmt: skip
    after = certificate()

    assert set(before[0]) == {"tls.crt", "tls.key", "ca.crt"}
    assert before[1] == {before[0]["ca.crt"]}
    assert after == before


def status_entries(kube: Kube, claim: str, namespace: str) -> list[dict[str, Any]]:
    status = kube.get(CLAIM_API, "ResourceClaim", claim, namespace).get("status") or {}
    return [d for d in status.get("devices") or [] if d.get("driver") == DRIVER]


def condition(entry: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [c for c in entry.get("conditions") or [] if c["type"] == kind]
    return found[0] if found else {}


def apply_status(client: Kube, claim: dict[str, Any], devices: list[dict[str, Any]]) -> None:
    """Server-side apply of `devices` into the claim's status.devices, as the plugin does."""
    meta = claim["metadata"]
    body = {
        "apiVersion": CLAIM_API, "kind": "ResourceClaim",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "status": {"devices": devices},
    }  # fmt: skip
    CustomObjectsApi(client.api_client).patch_namespaced_custom_object_status(
        "resource.k8s.io", "v1", meta["namespace"], "resourceclaims", meta["name"], body,
        field_manager="e2e-policy-test", force=True,
        _content_type="application/apply-patch+yaml",
    )  # fmt: skip


def test_a_claims_status_says_what_it_holds_and_only_its_nodes_plugin_writes_it(
    installed: str, kube: Kube, cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    wait_plugin_ready(kube, cluster)
    kube.create(m.claim("held", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("pod", namespace, claim="held"))
    wait_running(kube, "pod", namespace, timeout=180)
    (device,) = allocated_devices(kube, "held", namespace)

    # What the claim holds, written by the plugin: the device, its UUID, Ready.
    def written() -> bool:
        entries = status_entries(kube, "held", namespace)
        return bool(entries) and condition(entries[0], "Ready").get("status") == "True"

    try:
        wait_for("the plugin to write the claim's status.devices", written, 60)
    except TimeoutError as error:
        (plugin_pod,) = pods(kube, PLUGIN_SELECTOR)
        log = kube.pod_log(plugin_pod["metadata"]["name"], NAMESPACE, "gpus")
        raise AssertionError(f"{error}; the plugin's log ends:\n{log[-3000:]}") from error
    (entry,) = status_entries(kube, "held", namespace)
    assert (entry["pool"], entry["device"]) == (versions.NODE_NAME, device)
    assert entry["data"]["tier"] == "gpu"
    assert entry["data"]["uuid"].startswith("GPU-")
    assert "H100" in entry["data"]["productName"]
    # Nothing runs on the simulated GPU: after idleAfter (10 s here) it says Idle.
    wait_for("the claim's device to be reported idle",
             lambda: condition(status_entries(kube, "held", namespace)[0], "Active").get("reason")
             == "Idle", 90)  # fmt: skip
    idle = condition(status_entries(kube, "held", namespace)[0], "Active")
    assert idle["status"] == "False"
    assert "no GPU activity since" in idle["message"]

    plugin = plugin_identity(cluster, kube, tmp_path)
    # It may not take part in anything else of the claim: who may use it (reservedFor) stays.
    # Kubernetes 1.37 refuses it itself (resourceclaims/binding, which the plugin lacks); the
    # chart's admission policy would refuse it too (tests/test_helm_chart.py).
    reserved = kube.get(CLAIM_API, "ResourceClaim", "held", namespace)["status"]["reservedFor"]
    intruder = {"resource": "pods", "name": "intruder", "uid": str(uuid.uuid4())}
    with pytest.raises(ApiException) as denied:
        CustomObjectsApi(plugin.api_client).patch_namespaced_custom_object_status(
            "resource.k8s.io", "v1", namespace, "resourceclaims", "held",
            {"status": {"reservedFor": [*reserved, intruder]}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
    assert denied.value.status == 422, denied.value.body
    assert "requires resource=" in str(denied.value.body)
    assert "resourceclaims/binding" in str(denied.value.body)
    after = kube.get(CLAIM_API, "ResourceClaim", "held", namespace)["status"]["reservedFor"]
    assert after == reserved
    # A claim allocated on another node: its status is not this plugin's to write.
    kube.create(m.claim("elsewhere", namespace, m.claim_spec([m.request()])))
    elsewhere = kube.get(CLAIM_API, "ResourceClaim", "elsewhere", namespace)
    elsewhere["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRIVER, "pool": "other-node", "device": "gpu-0"},
    ]}}}  # fmt: skip
    CustomObjectsApi(kube.api_client).replace_namespaced_custom_object_status(
        "resource.k8s.io", "v1", namespace, "resourceclaims", "elsewhere", elsewhere
    )
    entry_elsewhere = {"driver": DRIVER, "pool": "other-node", "device": "gpu-0", "data": {}}
    with pytest.raises(ApiException) as not_here:
        apply_status(plugin, elsewhere, [entry_elsewhere])
    # Kubernetes itself refuses it: the plugin may write its driver's entries of claims
    # associated with its own node only (resourceclaims/driver, associated-node:patch).
    assert not_here.value.status == 422
    assert "requires resource=" in str(not_here.value.body)
    assert "resourceclaims/driver" in str(not_here.value.body)
    assert "devices" not in kube.get(CLAIM_API, "ResourceClaim", "elsewhere", namespace)["status"]
    delete_pods(kube, namespace, ["pod"])
