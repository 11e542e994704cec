"""A values file written for NVIDIA's chart (dra-driver-nvidia-gpu) installs gpu-dra: GPU
Operator style (driver root /run/nvidia/driver, gpuResourcesEnabledOverride, resources.gpus on
and resources.computeDomains off), NVIDIA's names for the metrics endpoints, leader election,
tolerations, ServiceAccount annotations and the webhook (NVIDIA's port 443), plus what the local
test bed needs (its image, kubelet directories, simulated GPUs, the apiserver address). A
whole-GPU claim runs; the webhook answers with the certificate the controller made
(webhook.tls.mode=controller), which neither ``helm upgrade`` nor a ``kubectl apply`` of
``helm template``'s output changes; the two controller replicas have their PodDisruptionBudget.
See docs/deployment.md, "Values of NVIDIA's chart"."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import helm
from e2e import manifests as m
from e2e.chart import (
    CHART,
    CONTROLLER_SELECTOR,
    NAMESPACE,
    PROFILE,
    RELEASE,
    chart_installed,
    import_driver_image,
    plugin_metrics_url,
    pods,
    ready,
    run_helm,
    wait_plugin_ready,
)
from e2e.cluster import Cluster, versions
from e2e.driver import DATA_DIR_LINK, DRIVER
from e2e.kube import Kube, wait_for
from e2e.test_chart_install import BAD_STRATEGY_DENIED, refused_by_the_webhook, sharing
from e2e.workloads import allocated_devices, delete_pods, gpus_seen, wait_running

pytestmark = pytest.mark.e2e

WEBHOOK = f"{RELEASE}-webhook"
PLUGIN_METRICS_PORT = 8090
ROLE_ANNOTATION = "iam.example.com/role"


def nvidia_values(cluster: Cluster, image: str) -> dict[str, Any]:
    """NVIDIA's value names for everything NVIDIA's chart has; gpu-dra's own names only where
    the local test bed needs them (dataDir, simulate, the apiserver env)."""
    repository, tag = image.rsplit(":", 1)
    apiserver = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": versions.NODE_IP},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(versions.APISERVER_PORT)},
    ]
    paths = cluster.paths
    return {
        # --- NVIDIA's names (GPU Operator style) ---
        "nvidiaDriverRoot": "/run/nvidia/driver",
        "gpuResourcesEnabledOverride": True,
        "resources": {"gpus": {"enabled": True}, "computeDomains": {"enabled": False}},
        "featureGates": {"TimeSlicingSettings": True, "MPSSupport": True,
                         "ContextualLogging": True, "PassthroughSupport": False},
        "logVerbosity": "4",
        "allowDefaultNamespace": False,
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "serviceAccount": {"create": True, "annotations": {ROLE_ANNOTATION: "gpu-dra"}},
        "kubeletPlugin": {
            "kubeletPluginsDirectoryPath": str(paths.plugins_dir),
            "kubeletRegistrarDirectoryPath": str(paths.plugins_registry),
            "metrics": {"enabled": True, "gpuHttpEndpoint": f":{PLUGIN_METRICS_PORT}",
                        "computeDomainHttpEndpoint": ":8081", "metricsPath": "/metrics"},
            "priorityClassName": "system-node-critical",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                             "effect": "NoSchedule"}],
            # The e2e node carries no GPU labels.
            "affinity": None,
            "networkPolicy": {"enabled": False},
            "containers": {"gpus": {"env": apiserver}},
            # --- gpu-dra's names: the test bed ---
            "dataDir": str(paths.state / DATA_DIR_LINK),
            "simulate": PROFILE,
        },
        "controller": {
            "replicas": 2,
            "leaderElection": {"enabled": True, "leaseDuration": "15s",
                               "renewDeadline": "10s", "retryPeriod": "2s"},
            "metrics": {"enabled": True, "httpEndpoint": ":8085", "metricsPath": "/metrics"},
            "networkPolicy": {"enabled": False},
            # gpu-dra's container name (NVIDIA's is its ComputeDomain controller's).
            "containers": {"controller": {"env": apiserver}},
        },
        "webhook": {
            "enabled": True,
            "servicePort": 443,
            "containerPort": 443,
            "failurePolicy": "Fail",
            # gpu-dra's GitOps-stable mode under NVIDIA's name (cert-manager is not on the bed).
            "tls": {"mode": "controller"},
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def installed(
    cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    image = import_driver_image(cluster)
    values = nvidia_values(cluster, image.reference)
    with chart_installed(cluster, kube, values, tmp_path_factory.mktemp("nvidia")) as path:
        yield path


def certificate(kube: Kube) -> tuple[dict[str, str], set[str]]:
    """The Secret the controller keeps, and the caBundles of the webhook configuration."""
    secret = kube.get("v1", "Secret", f"{WEBHOOK}-tls", NAMESPACE)
    config = kube.get("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration", WEBHOOK)
    bundles = {hook.get("clientConfig", {}).get("caBundle", "") for hook in config["webhooks"]}
    return secret["data"], bundles


def test_nvidia_values_install_gpu_dra_and_a_gpu_claim_runs(
    installed: Path, kube: Kube, cluster: Cluster, namespace: str
) -> None:
    wait_plugin_ready(kube, cluster)
    assert plugin_metrics_url(kube).endswith(f":{PLUGIN_METRICS_PORT}/metrics")
    wait_for(
        "both controller pods to be ready",
        lambda: sum(map(ready, pods(kube, CONTROLLER_SELECTOR))) == 2,
        180,
    )
    for component in ("controller", "kubelet-plugin"):
        account = kube.get("v1", "ServiceAccount", f"{RELEASE}-{component}", NAMESPACE)
        assert account["metadata"]["annotations"][ROLE_ANNOTATION] == "gpu-dra"
    budget = kube.get("policy/v1", "PodDisruptionBudget", f"{RELEASE}-controller", NAMESPACE)
    assert budget["spec"]["maxUnavailable"] == 1
    wait_for(
        "the budget to count both controller pods",
        lambda: (
            kube.get("policy/v1", "PodDisruptionBudget", f"{RELEASE}-controller", NAMESPACE)
            .get("status", {})
            .get("currentHealthy")
            == 2
        ),
        60,
    )

    kube.create(m.claim("gpu", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("pod", namespace, claim="gpu"))
    wait_running(kube, "pod", namespace, timeout=180)
    (device,) = allocated_devices(kube, "gpu", namespace)
    assert list(gpus_seen(kube, "pod", namespace)) == [f"GPU_{device.removeprefix('gpu-')}"]
    delete_pods(kube, namespace, ["pod"])


def test_the_controller_made_certificate_answers_and_survives_upgrade_and_apply(
    installed: Path, kube: Kube, cluster: Cluster, namespace: str
) -> None:
    bad = m.claim("bad-sharing", namespace, m.claim_spec([m.request()], sharing("Often")))
    complaint = refused_by_the_webhook(cluster, bad)
    webhook = f"resourceclaims.{DRIVER}"
    assert BAD_STRATEGY_DENIED.format(webhook=webhook, path="spec.devices.config[0]") in complaint

    data, bundles = certificate(kube)
    assert bundles == {data["ca.crt"]}

    # GitOps: the rendered manifests applied again, then a helm upgrade with the same values.
    rendered = subprocess.run(
        [str(helm.binary(cluster.paths)), "template", RELEASE, str(CHART),
         f"--namespace={NAMESPACE}", f"--values={installed}"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    (config,) = [
        d
        for d in yaml.safe_load_all(rendered)
        if d and d["kind"] == "ValidatingWebhookConfiguration"
    ]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(config))
    run_helm(
        cluster, "upgrade", RELEASE, str(CHART), f"--namespace={NAMESPACE}",
        f"--values={installed}",
    )  # fmt: skip

    assert certificate(kube) == (data, bundles)
    bad_again = m.claim("bad-again", namespace, m.claim_spec([m.request()], sharing("Often")))
    assert "denied the request" in refused_by_the_webhook(cluster, bad_again)
