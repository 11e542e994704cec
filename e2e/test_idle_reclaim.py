"""The idle policy end to end (issue 24, docs/idle-reclaim.md): the chart-installed controller
(``controller.idleReclaim.enabled``, a pass every 2 s) and plugin (claim status every 2 s, idle
after 4 s without activity, sampling every second) on a simulated H100 node. What the GPUs do is
set through the plugin's ``simulated-utilization.json``; namespaces opt in with short windows
(idle 20 s, grace 15 s).

An idle notebook pod is warned (Events, pod condition, ``kubectl describe``, ``gpu-dra inventory
--idle``) and then evicted; a busy pod beside it and an idle pod of a namespace without the label
are untouched, and the controller's own identity may not evict the latter (the chart's admission
policy); a PodDisruptionBudget blocks an eviction, which is reported, until it is removed; a
dry-run namespace is only told; a warned pod whose GPU is used again is cleared and kept."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import CoreV1Api
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from e2e import manifests as m
from e2e.chart import (
    CONTROLLER_SELECTOR,
    NAMESPACE,
    PROFILE,
    RELEASE,
    chart_installed,
    chart_values,
    import_driver_image,
    merged,
    plugin_metrics_url,
    pods,
    ready,
    service_account_client,
    wait_plugin_ready,
)
from e2e.cluster import Cluster
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import allocated_devices, wait_running
from gpu_dra.cli.__main__ import main as gpu_dra
from gpu_dra.driver.cluster.idle_policy import (
    CONDITION_TYPE,
    GRACE_ANNOTATION,
    LABEL,
    WINDOW_ANNOTATION,
)
from gpu_dra.kubelet_plugin.utilization.simulated_file import (
    SIMULATED_UTILIZATION_FILE,
    write_utilization,
)

pytestmark = pytest.mark.e2e

CLAIM_API = "resource.k8s.io/v1"
WINDOW = {WINDOW_ANNOTATION: "20s", GRACE_ANNOTATION: "15s"}
QUICK = {
    "kubeletPlugin": {"claimStatus": {"minInterval": 2, "idleAfter": 4}},
    "metrics": {"utilization": {"interval": 1}},
    "controller": {"idleReclaim": {"enabled": True, "interval": 2}},
}


@pytest.fixture(scope="module")
def installed(
    cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Driver]:
    """The chart with the idle policy on; the node's Driver (its data dir holds the simulated
    utilization file)."""
    image = import_driver_image(cluster)
    values = merged(chart_values(cluster, image.reference), QUICK)
    driver = Driver(cluster, kube, PROFILE)
    with chart_installed(cluster, kube, values, tmp_path_factory.mktemp("chart")):
        try:
            wait_plugin_ready(kube, cluster)
            wait_for("the controller pod to be ready",
                     lambda: any(map(ready, pods(kube, CONTROLLER_SELECTOR))), 120)  # fmt: skip
            yield driver
        finally:
            (driver.state_dir / SIMULATED_UTILIZATION_FILE).unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def all_gpus_idle(installed: Driver) -> Iterator[None]:
    """Each test starts and ends with every simulated GPU idle (no utilization file)."""
    (installed.state_dir / SIMULATED_UTILIZATION_FILE).unlink(missing_ok=True)
    yield
    (installed.state_dir / SIMULATED_UTILIZATION_FILE).unlink(missing_ok=True)


@pytest.fixture
def other_namespace(kube: Kube, deleted_namespaces: list[str]) -> Iterator[str]:
    """A second namespace, never labelled; emptied of pods and claims before the test ends (the
    plugin that unprepares them goes with the module)."""
    name = f"e2e-idle-other-{uuid.uuid4().hex[:5]}"
    kube.create_namespace(name)
    yield name
    kube.delete("v1", "Namespace", name)
    deleted_namespaces.append(name)
    kinds = (("v1", "Pod"), (CLAIM_API, "ResourceClaim"))
    for api_version, kind in kinds:
        for item in kube.list(api_version, kind, namespace=name):
            kube.delete(api_version, kind, item["metadata"]["name"], name)
    wait_for(
        f"the pods and ResourceClaims of namespace {name} to be gone",
        lambda: not any(kube.list(v, k, namespace=name) for v, k in kinds),
        180,
    )


def waited(
    kube: Kube,
    cluster: Cluster,
    what: str,
    probe: Callable[[], bool],
    timeout: float,
    namespace: str,
    name: str,
) -> None:
    """`wait_for`, failing with what the controller logged and what pod `name` and its claim
    (of the same name) say."""
    try:
        wait_for(what, probe, timeout)
    except TimeoutError as error:
        raise AssertionError(f"{error}\n{diagnosis(kube, cluster, namespace, name)}") from error


def diagnosis(kube: Kube, cluster: Cluster, namespace: str, name: str) -> str:
    lines = []
    for pod in pods(kube, CONTROLLER_SELECTOR):
        lines.append(cluster.kubectl("logs", "-n", NAMESPACE, pod["metadata"]["name"],
                                     "--tail=40", check=False))  # fmt: skip
    if kube.exists(CLAIM_API, "ResourceClaim", name, namespace):
        claim = kube.get(CLAIM_API, "ResourceClaim", name, namespace)
        lines.append(f"claim status: {json.dumps(claim.get('status'), default=str)}")
    if kube.exists("v1", "Pod", name, namespace):
        status = kube.get("v1", "Pod", name, namespace).get("status") or {}
        lines.append(f"pod conditions: {json.dumps(status.get('conditions'), default=str)}")
    labels = kube.get("v1", "Namespace", namespace, None)["metadata"].get("labels")
    lines.append(f"namespace labels: {labels}")
    return "\n".join(lines)


def opt_in(kube: Kube, namespace: str, mode: str) -> None:
    body = {"metadata": {"labels": {LABEL: mode}, "annotations": WINDOW}}
    CoreV1Api(kube.api_client).patch_namespace(namespace, body)


def notebook(kube: Kube, name: str, namespace: str, labels: dict[str, str] | None = None) -> None:
    """A claim `name` and a bare pod `name` using it."""
    kube.create(m.claim(name, namespace, m.claim_spec([m.request()])))
    pod = m.gpu_pod(name, namespace, claim=name)
    if labels:
        pod["metadata"]["labels"] = labels
    kube.create(pod)


def gpu_idle(kube: Kube, name: str, namespace: str) -> dict[str, Any]:
    """The pod's ``gpu.nvidia.com/GpuIdle`` condition ({} when it has none or is gone)."""
    if not kube.exists("v1", "Pod", name, namespace):
        return {}
    conditions = kube.get("v1", "Pod", name, namespace).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == CONDITION_TYPE), {})


def evicted(kube: Kube, name: str, namespace: str) -> bool:
    if not kube.exists("v1", "Pod", name, namespace):
        return True
    return bool(kube.get("v1", "Pod", name, namespace)["metadata"].get("deletionTimestamp"))


def reasons(kube: Kube, namespace: str, name: str) -> set[tuple[str, str]]:
    """(kind, reason) of the Events about objects named `name`."""
    return {(e["involvedObject"]["kind"], e["reason"]) for e in kube.events_for(namespace, name)}


def active(kube: Kube, claim: str, namespace: str) -> dict[str, Any]:
    """The Active condition of the claim's first status.devices entry ({} while none)."""
    status = kube.get(CLAIM_API, "ResourceClaim", claim, namespace).get("status") or {}
    for entry in status.get("devices") or []:
        for condition in entry.get("conditions") or []:
            if condition["type"] == "Active":
                return dict(condition)
    return {}


def controller_metric(kube: Kube, name: str, **labels: str) -> float:
    """A sample of the controller's /metrics (0 when absent), read from its pod IP."""
    (pod,) = [p for p in pods(kube, CONTROLLER_SELECTOR) if ready(p)]
    url = f"http://{pod['status']['podIP']}:8080/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def controller_identity(cluster: Cluster, tmp_path: Path) -> Kube:
    """A client with the controller's ServiceAccount token."""
    return service_account_client(cluster, f"{RELEASE}-controller", tmp_path)


def test_an_idle_notebook_is_warned_then_evicted_and_nothing_else_is_touched(
    installed: Driver,
    kube: Kube,
    cluster: Cluster,
    namespace: str,
    other_namespace: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    opt_in(kube, namespace, "enabled")
    for name, where in (("idle", namespace), ("busy", namespace), ("elsewhere", other_namespace)):
        notebook(kube, name, where)
    for name, where in (("idle", namespace), ("busy", namespace), ("elsewhere", other_namespace)):
        wait_running(kube, name, where, timeout=180)
    (busy_device,) = allocated_devices(kube, "busy", namespace)
    write_utilization(installed.state_dir / SIMULATED_UTILIZATION_FILE, {busy_device: {"gpu": 90}})

    waited(kube, cluster, "the idle pod to be warned",
           lambda: gpu_idle(kube, "idle", namespace).get("status") == "True", 120,
           namespace, "idle")  # fmt: skip
    warned = gpu_idle(kube, "idle", namespace)
    assert warned["reason"] == "Idle"
    assert "unless its GPU is used" in warned["message"]
    wait_for("the warning Events on the pod and its claim",
             lambda: {("Pod", "GpuClaimIdle"), ("ResourceClaim", "GpuClaimIdle")}
             <= reasons(kube, namespace, "idle"), 30)  # fmt: skip
    described = cluster.kubectl("describe", "pod", "idle", "-n", namespace)
    assert CONDITION_TYPE in described
    assert "GpuClaimIdle" in described
    args = ["inventory", "--idle", "--idle-for", "5s",
            "--plugin-metrics", plugin_metrics_url(kube), "-o", "json"]  # fmt: skip
    assert gpu_dra(args, environ={"KUBECONFIG": str(cluster.kubeconfig)}) == 0
    listed = {c["name"]: c for c in json.loads(capsys.readouterr().out)["idleClaims"]}
    assert listed["idle"]["policy"]["reason"] == "Idle"
    assert listed["idle"]["policy"]["evictsAt"]
    assert listed["elsewhere"]["policy"]["text"] == "not opted in"
    assert "busy" not in listed

    waited(kube, cluster, "the idle pod to be evicted", lambda: evicted(kube, "idle", namespace),
           90, namespace, "idle")  # fmt: skip
    wait_for("the eviction Event on the claim",
             lambda: ("ResourceClaim", "GpuClaimIdleEvicted") in reasons(kube, namespace, "idle"),
             30)  # fmt: skip
    assert controller_metric(kube, "gpu_dra_idle_policy_actions_total",
                             namespace=namespace, action="evicted") == 1  # fmt: skip
    assert controller_metric(kube, "gpu_dra_idle_policy_actions_total",
                             namespace=namespace, action="warned") == 1  # fmt: skip

    # The busy pod and the idle pod of the namespace without the label: untouched.
    for name, where in (("busy", namespace), ("elsewhere", other_namespace)):
        pod = kube.get("v1", "Pod", name, where)
        assert pod["status"]["phase"] == "Running"
        assert not pod["metadata"].get("deletionTimestamp")
        assert gpu_idle(kube, name, where) == {}
    assert active(kube, "busy", namespace)["status"] == "True"
    assert active(kube, "elsewhere", other_namespace)["status"] == "False"  # idle all along
    assert not {r for _, r in reasons(kube, other_namespace, "elsewhere")} & {
        "GpuClaimIdle", "GpuClaimIdleEvicted",
    }  # fmt: skip

    # Not even the controller's own identity may evict there (the chart's admission policy).
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": "elsewhere", "namespace": other_namespace}}  # fmt: skip
    with pytest.raises(ApiException) as refused:
        CoreV1Api(controller_identity(cluster, tmp_path).api_client).create_namespaced_pod_eviction(
            "elsewhere", other_namespace, eviction
        )
    assert refused.value.status == 403
    assert (
        f"gpu-dra idle policy: namespace {other_namespace} is labelled no "
        "gpu.nvidia.com/idle-reclaim: the controller may not evict its pods"
    ) in str(refused.value.body)
    assert kube.get("v1", "Pod", "elsewhere", other_namespace)["status"]["phase"] == "Running"


def test_a_warned_pod_whose_gpu_is_used_again_is_cleared_and_kept(
    installed: Driver, kube: Kube, cluster: Cluster, namespace: str
) -> None:
    opt_in(kube, namespace, "enabled")
    notebook(kube, "back", namespace)
    wait_running(kube, "back", namespace, timeout=180)
    (device,) = allocated_devices(kube, "back", namespace)
    waited(kube, cluster, "the idle pod to be warned",
           lambda: gpu_idle(kube, "back", namespace).get("status") == "True", 120,
           namespace, "back")  # fmt: skip
    warned_at = gpu_idle(kube, "back", namespace)["lastTransitionTime"]

    write_utilization(installed.state_dir / SIMULATED_UTILIZATION_FILE, {device: {"gpu": 60}})
    waited(kube, cluster, "the warning to be cleared",
           lambda: gpu_idle(kube, "back", namespace).get("reason") == "Active", 60,
           namespace, "back")  # fmt: skip
    cleared = gpu_idle(kube, "back", namespace)
    assert cleared["status"] == "False"
    assert cleared["lastTransitionTime"] >= warned_at
    wait_for("the Normal Event", lambda: ("Pod", "GpuClaimActive") in reasons(kube, namespace,
             "back"), 30)  # fmt: skip
    time.sleep(20)  # past the grace period (15 s) the warning gave
    assert not evicted(kube, "back", namespace)
    assert controller_metric(kube, "gpu_dra_idle_policy_actions_total",
                             namespace=namespace, action="cleared") == 1  # fmt: skip


def test_a_disruption_budget_blocks_the_eviction_and_that_is_reported(
    installed: Driver, kube: Kube, cluster: Cluster, namespace: str
) -> None:
    opt_in(kube, namespace, "enabled")
    notebook(kube, "guarded", namespace, labels={"app": "guarded"})
    kube.create({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "keep-one", "namespace": namespace},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
    })  # fmt: skip
    wait_running(kube, "guarded", namespace, timeout=180)

    waited(kube, cluster, "the eviction to be reported blocked",
           lambda: gpu_idle(kube, "guarded", namespace).get("reason") == "EvictionBlocked",
           120, namespace, "guarded")  # fmt: skip
    blocked = gpu_idle(kube, "guarded", namespace)
    assert blocked["status"] == "True"
    assert "disruption budget" in blocked["message"]
    wait_for("the blocked Event",
             lambda: ("Pod", "GpuIdleEvictionBlocked") in reasons(kube, namespace, "guarded"),
             30)  # fmt: skip
    assert controller_metric(kube, "gpu_dra_idle_policy_actions_total",
                             namespace=namespace, action="blocked") >= 1  # fmt: skip
    assert not evicted(kube, "guarded", namespace)

    kube.delete("policy/v1", "PodDisruptionBudget", "keep-one", namespace)
    wait_for("the pod to be evicted once the budget is gone",
             lambda: evicted(kube, "guarded", namespace), 60)  # fmt: skip


def test_a_dry_run_namespace_is_only_told(
    installed: Driver, kube: Kube, cluster: Cluster, namespace: str
) -> None:
    opt_in(kube, namespace, "dry-run")
    notebook(kube, "nb", namespace)
    wait_running(kube, "nb", namespace, timeout=180)

    def reported() -> bool:
        return gpu_idle(kube, "nb", namespace).get("reason") == "WouldEvict"

    waited(kube, cluster, "the dry run to say it would evict", reported, 120, namespace, "nb")
    assert ("Pod", "GpuClaimIdleWouldEvict") in reasons(kube, namespace, "nb")
    assert controller_metric(kube, "gpu_dra_idle_policy_actions_total",
                             namespace=namespace, action="would-evict") == 1  # fmt: skip
    assert controller_metric(kube, "gpu_dra_idle_policy_actions_total",
                             namespace=namespace, action="evicted") == 0  # fmt: skip
    pod = kube.get("v1", "Pod", "nb", namespace)
    assert pod["status"]["phase"] == "Running"
    assert not pod["metadata"].get("deletionTimestamp")
