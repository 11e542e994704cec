"""The Helm chart (deployments/helm/gpu-dra) renders what the code means, checked without a
cluster with the pinned helm: lint and schema, the DaemonSet's and the Deployment's environment
parsed into the plugin's and the controller's settings, the driver root mounts and the wait for
NVML, the catalog ConfigMap against deviceclasses/, least-privilege RBAC, the admission
policy's decisions, and the admission webhook: which requests reach it, its TLS modes, and the
chart's certificate served by the controller's own server. Applying it to a cluster is the e2e
tests' part."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import re
import ssl
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import aiohttp
import pytest
import yaml

from gpu_dra.cli.__main__ import main as cli_main
from gpu_dra.cli.devices import plugin_devices
from gpu_dra.controller.admission import KINDS as ADMITTED_KINDS
from gpu_dra.controller.admission import VERSIONS as ADMITTED_VERSIONS
from gpu_dra.controller.catalog import DeviceClass, load_catalog
from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.controller.webhook import PATH as WEBHOOK_PATH
from gpu_dra.controller.webhook import SHARE_MEMORY_PATH, ReloadingCertificate, WebhookServer
from gpu_dra.driver.cluster import share_memory
from gpu_dra.driver.cluster.idle_policy import DEFAULT_MAX_SAMPLE_AGE_S
from gpu_dra.driver.mig_policy import DEFAULT as DEFAULT_MIG_POLICY
from gpu_dra.driver.mig_policy import parse_policy
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.settings.values import (
    GATE_DYNAMIC_MIG,
    GATE_HEALTH_CHECK,
    GATES_ALWAYS_ON,
    GATES_NOT_IMPLEMENTED,
)
from tests.helmchart import (
    CHART,
    NAMESPACE,
    REPO,
    AdmissionPolicy,
    Decision,
    Rendered,
    env_of,
    run_helm,
    template,
    webhook_called,
)

NODE = "gpu-node-1"
POD_UID = "4f1c2b9e-0000-4000-8000-00000000000a"
DOWNWARD = {"NODE_NAME": NODE, "POD_NAMESPACE": NAMESPACE, "POD_UID": POD_UID}
CONTROLLER_DOWNWARD = {"GPU_DRA_LEADER_ELECTION_IDENTITY": "gpu-dra-controller-5d8f-x2x7q"}
PLUGIN_SA = "gpu-dra-kubelet-plugin"
CONTROLLER_SA = "gpu-dra-controller"
SLICES = "resource.k8s.io/resourceslices"
CLASSES = "resource.k8s.io/deviceclasses"
CLAIMS = "resource.k8s.io/resourceclaims"
TIER_QUOTA_POLICY = "gpu-dra-tier-quota"

HOST_DRIVER: dict[str, Any] = {"gpuResourcesEnabledOverride": True}
"""Chart defaults (a driver installed on the host), with the device plugin acknowledged off."""

GPU_OPERATOR: dict[str, Any] = {
    "gpuResourcesEnabledOverride": True,
    "nvidiaDriverRoot": "/run/nvidia/driver",
    "nvidiaCDIHookPath": "/usr/local/nvidia/toolkit/nvidia-cdi-hook",
    "featureGates": {"DynamicMIG": True, "MPSSupport": True},
    "logVerbosity": 6,
    "image": {"repository": "registry.example/gpu-dra", "tag": "1.2.3"},
    "imagePullSecrets": [{"name": "registry-a"}, {"name": "registry-b"}],
    "kubeletPlugin": {
        "kubeletPluginsDirectoryPath": "/var/lib/k/plugins",
        "kubeletRegistrarDirectoryPath": "/var/lib/k/plugins_registry",
        "priorityClassName": "gpu-critical",
        "dynamicMigProfiles": "H100=1g,1g+me,7g;all",
        "mpsShares": "2,GPU-4f1c2b2e-0d4a-5b6e-8c1d-2a3b4c5d6e7f",
        "mpsShareReplicas": 8,
        "cappedShares": "0,1",
        "mpsSharesOnMig": "1g.10gb,1g.10gb+me,MIG-4f1c2b2e-0d4a-5b6e-8c1d-2a3b4c5d6e7f",
        "mpsSharesOnDynamicMig": "1g.10gb,3g.40gb",
        "containers": {"gpus": {"resources": {"requests": {"cpu": "100m"}}}},
    },
    "metrics": {"kubeletPluginPort": 9401, "controllerPort": 9400},
}
"""What a GPU Operator node (driver container, toolkit under /usr/local/nvidia) looks like,
with every knob the tests look at set away from its default."""


@pytest.fixture(scope="module")
def host_driver(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return Rendered.of(HOST_DRIVER, tmp_path_factory.mktemp("host"))


@pytest.fixture(scope="module")
def gpu_operator(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return Rendered.of(GPU_OPERATOR, tmp_path_factory.mktemp("operator"))


def plugin_settings(rendered: Rendered) -> KubeletPluginSettings:
    container = rendered.container("DaemonSet", "gpus")
    return KubeletPluginSettings.parse([], env_of(container, DOWNWARD))


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in container["volumeMounts"]}


# ---- lint, schema, guards ---------------------------------------------------------------------
@pytest.mark.parametrize("values", [HOST_DRIVER, GPU_OPERATOR], ids=["host-driver", "gpu-operator"])
def test_helm_lint_passes_strict(values: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))

    result = run_helm(["lint", "--strict", str(CHART), "--values", str(path)])

    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_defaults_render_only_once_the_device_plugin_is_acknowledged_off() -> None:
    result = template()

    assert result.returncode != 0
    assert "NVIDIA's device plugin" in result.stderr
    assert "--set gpuResourcesEnabledOverride=true" in result.stderr


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("kubeletPlugin.kubeletPluginsDir=/x", "additional properties 'kubeletPluginsDir'"),
        ("nvidiaDriverRoot=run/nvidia/driver", "'/nvidiaDriverRoot'"),
        ("metrics.kubeletPluginPort=0", "'/metrics/kubeletPluginPort'"),
        ("image.pullPolicy=Sometimes", "'/image/pullPolicy'"),
        ("webhook.failurePolicy=Sometimes", "'/webhook/failurePolicy'"),
        ("webhook.tls.mode=vault", "'/webhook/tls/mode'"),
        ("webhook.containerPort=0", "'/webhook/containerPort'"),
        ("kubeletPlugin.dynamicMigProfiles=1g/7g", "'/kubeletPlugin/dynamicMigProfiles'"),
        (
            "kubeletPlugin.mpsMemoryWatchdog.policy=shoot",
            "'/kubeletPlugin/mpsMemoryWatchdog/policy'",
        ),
        (
            "kubeletPlugin.mpsMemoryWatchdog.interval=0",
            "'/kubeletPlugin/mpsMemoryWatchdog/interval'",
        ),
        ("kubeletPlugin.cappedShares=0;1", "'/kubeletPlugin/cappedShares'"),
        ("kubeletPlugin.mpsShares=0;1", "'/kubeletPlugin/mpsShares'"),
        ("kubeletPlugin.mpsShareReplicas=0", "'/kubeletPlugin/mpsShareReplicas'"),
        ("kubeletPlugin.mpsShareReplicas=101", "'/kubeletPlugin/mpsShareReplicas'"),
        ("kubeletPlugin.mpsSharesOnMig=1g.10gb;3g.40gb", "'/kubeletPlugin/mpsSharesOnMig'"),
        (
            "kubeletPlugin.mpsSharesOnDynamicMig=1g.10gb;3g",
            "'/kubeletPlugin/mpsSharesOnDynamicMig'",
        ),
        # The kubelet's grpc probe needs a fixed port.
        (
            "kubeletPlugin.containers.gpus.healthcheckPort=0",
            "'/kubeletPlugin/containers/gpus/healthcheckPort'",
        ),
    ],
)
def test_the_schema_rejects_misspelt_and_invalid_values(setting: str, complaint: str) -> None:
    result = template(None, "gpuResourcesEnabledOverride=true", setting)

    assert result.returncode != 0
    assert complaint in result.stderr


# ---- kubelet plugin ---------------------------------------------------------------------------
def test_the_daemonset_env_parses_into_the_plugin_settings_it_means(
    host_driver: Rendered,
) -> None:
    spec = host_driver.pod_spec("DaemonSet")
    container = host_driver.container("DaemonSet", "gpus")
    settings = plugin_settings(host_driver)
    mounted = {m["mountPath"]: m for m in container["volumeMounts"]}
    port = next(p for p in container["ports"] if p["name"] == "metrics")

    assert settings.node_name == NODE
    assert settings.simulate is None
    # dynamic MIG publishes the documented default profiles unless told otherwise
    assert settings.dynamic_mig_profiles == DEFAULT_MIG_POLICY
    # The kubelet dials the socket path the plugin registers: host paths, mounted as they are.
    for path in (settings.kubelet_plugins_dir, settings.kubelet_registry_dir, settings.cdi_root):
        volume = host_driver.volume("DaemonSet", mounted[str(path)]["name"])
        assert volume["hostPath"]["path"] == str(path)
    assert mounted[str(settings.kubelet_plugins_dir)]["mountPropagation"] == "Bidirectional"
    assert settings.kubelet_plugins_dir == Path("/var/lib/kubelet/plugins")
    assert settings.metrics_port == port["containerPort"] == 8081
    # MPS control daemons: pods of the plugin's image in its namespace, at its priority.
    assert settings.mps_daemon_runner == "pod"
    assert settings.mps_daemon_image == container["image"] == "localhost/gpu-dra:0.1.0"
    assert settings.mps_daemon_namespace == NAMESPACE
    assert settings.mps_daemon_priority_class == spec["priorityClassName"]
    assert settings.mps_daemon_priority_class == "system-node-critical"
    assert settings.mps_daemon_image_pull_secrets == ()
    assert settings.feature_gates == ()
    # No GPU or MIG device is offered as shares unless a value says so; a share's unnamed
    # amounts are a quarter of its device.
    assert "GPU_DRA_MPS_SHARES" not in env_of(container, DOWNWARD)
    assert settings.mps_shares.empty
    assert settings.mps_share_replicas == 4
    assert "GPU_DRA_MPS_SHARES_ON_MIG" not in env_of(container, DOWNWARD)
    assert settings.mps_shares_on_mig.empty
    assert "GPU_DRA_MPS_SHARES_ON_DYNAMIC_MIG" not in env_of(container, DOWNWARD)
    assert settings.mps_shares_on_dynamic_mig.empty
    assert settings.state_dir == settings.kubelet_plugins_dir / "gpu.nvidia.com"
    # The plugin checks the daemon pods' processes in the host's PID namespace.
    assert spec["hostPID"] is True
    assert spec["serviceAccountName"] == PLUGIN_SA


def test_each_plugin_pod_serves_its_own_sockets_so_a_rolling_update_surges(
    host_driver: Rendered,
) -> None:
    daemonset = host_driver.one("DaemonSet")
    container = host_driver.container("DaemonSet", "gpus")
    uid = next(e for e in container["env"] if e["name"] == "POD_UID")

    assert uid["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert plugin_settings(host_driver).instance_id == POD_UID
    # The new pod of a node starts (and registers) before the old one stops.
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }


def test_gpu_operator_values_reach_the_plugin(gpu_operator: Rendered) -> None:
    spec = gpu_operator.pod_spec("DaemonSet")
    container = gpu_operator.container("DaemonSet", "gpus")
    settings = plugin_settings(gpu_operator)
    env = env_of(container, DOWNWARD)

    assert settings.dynamic_mig_enabled
    assert env["FEATURE_GATES"] == "DynamicMIG=true,MPSSupport=true,"
    assert env["GPU_DRA_DYNAMIC_MIG_PROFILES"] == "H100=1g,1g+me,7g;all"
    assert settings.dynamic_mig_profiles == parse_policy("H100=1g,1g+me,7g;all")
    assert env["GPU_DRA_MPS_SHARES"] == "2,GPU-4f1c2b2e-0d4a-5b6e-8c1d-2a3b4c5d6e7f"
    assert settings.mps_shares.names == ("2", "GPU-4f1c2b2e-0d4a-5b6e-8c1d-2a3b4c5d6e7f")
    assert env["GPU_DRA_MPS_SHARE_REPLICAS"] == "8"
    assert settings.mps_share_replicas == 8
    assert env["GPU_DRA_CAPPED_SHARES"] == "0,1"
    assert settings.capped_shares.names == ("0", "1")
    assert env["GPU_DRA_MPS_SHARES_ON_MIG"] == (
        "1g.10gb,1g.10gb+me,MIG-4f1c2b2e-0d4a-5b6e-8c1d-2a3b4c5d6e7f"
    )
    assert settings.mps_shares_on_mig.profiles == ("1g.10gb", "1g.10gb+me")
    assert settings.mps_shares_on_mig.uuids == ("MIG-4f1c2b2e-0d4a-5b6e-8c1d-2a3b4c5d6e7f",)
    assert env["GPU_DRA_MPS_SHARES_ON_DYNAMIC_MIG"] == "1g.10gb,3g.40gb"
    assert settings.mps_shares_on_dynamic_mig.profiles == ("1g.10gb", "3g.40gb")
    assert env["NVIDIA_CDI_HOOK_PATH"] == "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    assert settings.kubelet_plugins_dir == Path("/var/lib/k/plugins")
    assert settings.kubelet_registry_dir == Path("/var/lib/k/plugins_registry")
    assert mounts(container)["plugins"]["mountPath"] == "/var/lib/k/plugins"
    assert gpu_operator.volume("DaemonSet", "plugins")["hostPath"]["path"] == "/var/lib/k/plugins"
    assert settings.metrics_port == 9401
    assert settings.mps_daemon_image == container["image"] == "registry.example/gpu-dra:1.2.3"
    assert settings.mps_daemon_priority_class == spec["priorityClassName"] == "gpu-critical"
    # imagePullSecrets: the plugin's pod, the controller's pod and the MPS daemon pods.
    secrets = [{"name": "registry-a"}, {"name": "registry-b"}]
    assert spec["imagePullSecrets"] == secrets
    assert gpu_operator.pod_spec("Deployment")["imagePullSecrets"] == secrets
    assert settings.mps_daemon_image_pull_secrets == ("registry-a", "registry-b")
    # A request of one's own replaces that one; the chart's memory request stays.
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"}}


@pytest.mark.parametrize("fixture", ["host_driver", "gpu_operator"])
def test_the_driver_root_is_mounted_at_driver_root_seeing_late_mounts(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    rendered: Rendered = request.getfixturevalue(fixture)
    host_root = "/" if fixture == "host_driver" else "/run/nvidia/driver"
    volume = rendered.volume("DaemonSet", "driver-root")
    plugin = rendered.container("DaemonSet", "gpus")
    wait = rendered.container("DaemonSet", "wait-for-driver", init=True)

    # A driver container that mounts the root after this pod started is seen (HostToContainer);
    # DirectoryOrCreate lets the pod start before that.
    assert volume["hostPath"] == {"path": host_root, "type": "DirectoryOrCreate"}
    for container in (plugin, wait):
        mount = mounts(container)["driver-root"]
        assert mount["mountPath"] == "/driver-root"
        assert mount["mountPropagation"] == "HostToContainer"
        assert mount["readOnly"] is True
        env = env_of(container, DOWNWARD)
        assert env["CONTAINER_DRIVER_ROOT"] == "/driver-root"
        assert env["NVIDIA_DRIVER_ROOT"] == host_root


def test_the_plugin_reads_the_driver_root_and_hook_path_from_nvidias_env(
    host_driver: Rendered, gpu_operator: Rendered
) -> None:
    """NVIDIA's CONTAINER_DRIVER_ROOT, NVIDIA_DRIVER_ROOT and NVIDIA_CDI_HOOK_PATH, as the plugin
    settings of the cdi-userspace work read them."""
    operator = plugin_settings(gpu_operator)
    host = plugin_settings(host_driver)

    assert operator.driver_root == Path("/driver-root")
    assert operator.host_driver_root == PurePosixPath("/run/nvidia/driver")
    assert operator.nvidia_cdi_hook_path == "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    assert host.driver_root == Path("/driver-root")
    assert host.host_driver_root == PurePosixPath("/")
    assert host.nvidia_cdi_hook_path == "/usr/bin/nvidia-cdi-hook"  # the plugin's default


def run_wait(script: str, root: Path) -> subprocess.Popen[str]:
    env = dict(
        os.environ,
        CONTAINER_DRIVER_ROOT=str(root),
        NVIDIA_DRIVER_ROOT="/run/nvidia/driver",
        WAIT_INTERVAL_SECONDS="0.05",
    )
    return subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True
    )


def test_the_init_container_waits_until_the_driver_root_holds_nvml(
    host_driver: Rendered, tmp_path: Path
) -> None:
    wait = host_driver.container("DaemonSet", "wait-for-driver", init=True)
    assert wait["command"][:2] == ["python3", "-c"]
    assert wait["image"] == host_driver.container("DaemonSet", "gpus")["image"]
    process = run_wait(wait["command"][2], tmp_path)
    try:
        time.sleep(1.0)
        assert process.poll() is None  # still waiting: no libnvidia-ml.so.1 yet

        # The driver container's files appear: a versioned library and the soname link.
        libdir = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
        libdir.mkdir(parents=True)
        (libdir / "libnvidia-ml.so.580.95.05").write_bytes(b"\x7fELF")
        (libdir / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.95.05")
        out, _ = process.communicate(timeout=10)
    finally:
        process.kill()

    assert process.returncode == 0
    assert "waiting for libnvidia-ml.so.1 under the driver root /run/nvidia/driver" in out
    assert f"found {libdir / 'libnvidia-ml.so.580.95.05'}" in out


def test_simulated_gpus_need_no_driver_root(tmp_path: Path) -> None:
    rendered = Rendered.of({**HOST_DRIVER, "kubeletPlugin": {"simulate": "hgx-h100"}}, tmp_path)
    spec = rendered.pod_spec("DaemonSet")
    container = rendered.container("DaemonSet", "gpus")

    assert plugin_settings(rendered).simulate == "hgx-h100"
    assert "initContainers" not in spec
    assert "driver-root" not in {v["name"] for v in spec["volumes"]}
    assert "driver-root" not in mounts(container)
    assert "CONTAINER_DRIVER_ROOT" not in env_of(container, DOWNWARD)


@pytest.mark.parametrize(("verbosity", "level"), [("4", "INFO"), ("5", "DEBUG")])
def test_log_verbosity_reaches_the_plugin_as_its_log_level(
    tmp_path: Path, verbosity: str, level: str
) -> None:
    rendered = Rendered.of({**HOST_DRIVER, "logVerbosity": verbosity}, tmp_path)
    assert plugin_settings(rendered).log_level == level


def test_a_data_dir_and_an_mps_daemon_image_of_their_own(tmp_path: Path) -> None:
    """What the e2e node needs: a data dir short enough for MPS sockets, a test-double image."""
    rendered = Rendered.of(
        {
            **HOST_DRIVER,
            "kubeletPlugin": {"dataDir": "/var/lib/e2e/gd", "mpsDaemonImage": "localhost/mps:1"},
        },
        tmp_path,
    )
    container = rendered.container("DaemonSet", "gpus")
    settings = plugin_settings(rendered)

    assert settings.state_dir == Path("/var/lib/e2e/gd")
    assert mounts(container)["data"]["mountPath"] == "/var/lib/e2e/gd"
    assert mounts(container)["data"]["mountPropagation"] == "Bidirectional"
    assert rendered.volume("DaemonSet", "data")["hostPath"]["path"] == "/var/lib/e2e/gd"
    assert settings.mps_daemon_image == "localhost/mps:1"
    assert container["image"] == "localhost/gpu-dra:0.1.0"


def eviction_rules(rendered: Rendered) -> list[dict[str, Any]]:
    """Rules of the plugin's roles that mention pods/eviction."""
    roles = rendered.all("ClusterRole") + rendered.all("Role")
    return [
        rule
        for role in roles
        if role["metadata"]["name"].startswith(PLUGIN_SA)
        for rule in role["rules"]
        if any("eviction" in resource for resource in rule.get("resources", []))
    ]


def test_the_mps_memory_watchdog_kills_by_default_without_eviction_rights(
    host_driver: Rendered,
) -> None:
    settings = plugin_settings(host_driver)

    assert settings.mps_memory_watchdog == "kill"
    assert settings.mps_memory_watchdog_interval_s == 1.0
    assert eviction_rules(host_driver) == []


@pytest.mark.parametrize("policy", ["report", "off"])
def test_only_the_evict_policy_grants_evictions(tmp_path: Path, policy: str) -> None:
    watchdog = {"policy": policy, "interval": 0.5}
    rendered = Rendered.of({**HOST_DRIVER, "kubeletPlugin": {"mpsMemoryWatchdog": watchdog}},
                           tmp_path)  # fmt: skip
    settings = plugin_settings(rendered)

    assert (settings.mps_memory_watchdog, settings.mps_memory_watchdog_interval_s) == (policy, 0.5)
    assert eviction_rules(rendered) == []


def test_the_evict_policy_may_evict_pods_of_any_namespace(tmp_path: Path) -> None:
    watchdog = {"policy": "evict", "interval": 2}
    rendered = Rendered.of({**HOST_DRIVER, "kubeletPlugin": {"mpsMemoryWatchdog": watchdog}},
                           tmp_path)  # fmt: skip

    assert plugin_settings(rendered).mps_memory_watchdog == "evict"
    assert eviction_rules(rendered) == [
        {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}
    ]
    (cluster_role,) = [r for r in rendered.all("ClusterRole") if r["metadata"]["name"] == PLUGIN_SA]
    assert eviction_rules(rendered)[0] in cluster_role["rules"]
    # still no pod writes outside the release namespace
    assert not rendered.may(PLUGIN_SA, "delete", "pods", "default")


def test_no_variable_is_set_twice(gpu_operator: Rendered, tmp_path: Path) -> None:
    """Server-side apply (helm 4's default) refuses a list entry named twice."""
    extra = Rendered.of(
        {**GPU_OPERATOR, "kubeletPlugin": {"dataDir": "/d", "mpsDaemonImage": "i"}}, tmp_path
    )
    for rendered in (gpu_operator, extra):
        for kind, name in (("DaemonSet", "gpus"), ("Deployment", "controller")):
            names = [e["name"] for e in rendered.container(kind, name)["env"]]
            assert len(names) == len(set(names))


def test_the_kubelet_probes_the_plugins_grpc_health_service(host_driver: Rendered) -> None:
    container = host_driver.container("DaemonSet", "gpus")
    settings = plugin_settings(host_driver)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # NVIDIA's port; the plugin serves grpc.health.v1 there (kubelet-plugin/health.py).
    assert settings.healthcheck_port == ports["healthcheck"] == 51516
    services = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert "httpGet" not in container[probe]
        assert container[probe]["grpc"]["port"] == settings.healthcheck_port
        services[probe] = container[probe]["grpc"]["service"]
    assert services == {
        "startupProbe": "liveness",
        "livenessProbe": "liveness",
        "readinessProbe": "readiness",
    }
    # Recovery may take a while on a node with many prepared claims: 10 minutes to start.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600
    assert container["livenessProbe"]["periodSeconds"] == 30


def test_the_start_up_guard_sees_the_device_plugin_sockets_and_records_events(
    host_driver: Rendered, gpu_operator: Rendered
) -> None:
    for rendered, kubelet in ((host_driver, "/var/lib/kubelet"), (gpu_operator, "/var/lib/k")):
        container = rendered.container("DaemonSet", "gpus")
        settings = plugin_settings(rendered)
        mount = mounts(container)["device-plugins"]
        volume = rendered.volume("DaemonSet", "device-plugins")

        assert settings.device_plugins_dir == Path(f"{kubelet}/device-plugins")
        assert mount["mountPath"] == volume["hostPath"]["path"] == str(settings.device_plugins_dir)
        assert mount["readOnly"] is True  # connecting to a socket needs no write access
        assert settings.event_namespace == "default"  # Node Events: default or kube-system
        assert settings.allow_nvidia_device_plugin is False

    assert host_driver.may(PLUGIN_SA, "create", "events", "default")
    # MPS daemon Events go to the claims' and pods' namespaces (docs/mps.md).
    assert host_driver.may(PLUGIN_SA, "create", "events", "team-a")
    assert not host_driver.may(PLUGIN_SA, "delete", "events", NAMESPACE)
    assert not host_driver.may(PLUGIN_SA, "update", "events", "team-a")


def test_a_negative_healthcheck_port_turns_health_and_probes_off(tmp_path: Path) -> None:
    rendered = Rendered.of(
        {**HOST_DRIVER, "kubeletPlugin": {"containers": {"gpus": {"healthcheckPort": -1}}}},
        tmp_path,
    )
    container = rendered.container("DaemonSet", "gpus")

    assert plugin_settings(rendered).healthcheck_port == -1
    assert [p["name"] for p in container["ports"]] == ["metrics"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe not in container


def test_the_plugin_runs_as_root_although_the_image_user_is_not(host_driver: Rendered) -> None:
    """The image's USER is the controller's (65532); the plugin writes the kubelet's plugin
    directories, CDI specs and its checkpoint, which are root's (found by the chart e2e)."""
    context = host_driver.container("DaemonSet", "gpus")["securityContext"]
    assert (context["runAsUser"], context["runAsGroup"], context["privileged"]) == (0, 0, True)
    assert "USER 65532" in (Path(__file__).parents[1] / "Dockerfile").read_text()


# ---- controller -------------------------------------------------------------------------------
def test_the_deployment_env_parses_into_the_controller_settings(
    host_driver: Rendered, gpu_operator: Rendered
) -> None:
    container = host_driver.container("Deployment", "controller")
    settings = ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD))
    ports = {p["name"]: p for p in container["ports"]}
    catalog_mount = {m["mountPath"]: m for m in container["volumeMounts"]}

    assert container["command"] == ["gpu-dra-controller"]
    assert settings.kubeconfig is None  # the pod's service account
    assert settings.metrics_port == ports["metrics"]["containerPort"] == 8080
    assert settings.webhook_port == ports["webhook"]["containerPort"] == 8443
    assert settings.log_level == "INFO"  # NVIDIA's default verbosity 4
    mount = catalog_mount[str(settings.deviceclasses_dir)]
    volume = host_driver.volume("Deployment", mount["name"])
    catalog = host_driver.one("ConfigMap", volume["configMap"]["name"])
    assert catalog["metadata"]["name"] == "gpu-dra-deviceclasses"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # With the webhook (the default), readiness is the webhook answering over TLS.
    assert container["readinessProbe"]["httpGet"] == {
        "path": "/readyz",
        "port": "webhook",
        "scheme": "HTTPS",
    }

    operator = gpu_operator.container("Deployment", "controller")
    operator_settings = ControllerSettings.from_env(env_of(operator, CONTROLLER_DOWNWARD))
    assert operator_settings.log_level == "DEBUG"  # logVerbosity 6
    assert operator_settings.metrics_port == 9400


def test_the_controller_elects_a_leader_on_its_own_lease(host_driver: Rendered) -> None:
    deployment = host_driver.one("Deployment")
    container = host_driver.container("Deployment", "controller")
    settings = ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD))
    identity = next(e for e in container["env"] if e["name"] == "GPU_DRA_LEADER_ELECTION_IDENTITY")

    assert deployment["spec"]["replicas"] == 1
    assert settings.leader_election_enabled is True
    assert settings.leader_election_lease_lock_name == CONTROLLER_SA
    assert settings.leader_election_lease_lock_namespace == NAMESPACE
    assert identity["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}  # the pod
    assert (
        settings.leader_election_lease_duration_s,
        settings.leader_election_renew_deadline_s,
        settings.leader_election_retry_period_s,
    ) == (15.0, 10.0, 2.0)

    def may(verb: str, name: str | None) -> bool:
        return host_driver.may(
            CONTROLLER_SA, verb, "coordination.k8s.io/leases", NAMESPACE, name=name
        )

    # Its own Lease, in the release namespace: read, renew, and create it the first time.
    for verb in ("get", "update"):
        assert may(verb, CONTROLLER_SA)
        assert not may(verb, "kube-scheduler")
    assert may("create", None)
    assert not may("delete", CONTROLLER_SA)
    assert not host_driver.may(
        CONTROLLER_SA, "get", "coordination.k8s.io/leases", "kube-system", name=CONTROLLER_SA
    )


def test_two_replicas_need_leader_election_and_durations_pass_through(tmp_path: Path) -> None:
    election = {"leaseDuration": "30s", "renewDeadline": "20s", "retryPeriod": "500ms"}
    rendered = Rendered.of(
        {**HOST_DRIVER, "controller": {"replicas": 2, "leaderElection": election}}, tmp_path
    )
    container = rendered.container("Deployment", "controller")
    settings = ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD))
    off = Rendered.of(
        {**HOST_DRIVER, "controller": {"leaderElection": {"enabled": False}}}, tmp_path
    )
    refused = template(
        None,
        "gpuResourcesEnabledOverride=true",
        "controller.replicas=2",
        "controller.leaderElection.enabled=false",
    )

    assert rendered.one("Deployment")["spec"]["replicas"] == 2
    assert (
        settings.leader_election_lease_duration_s,
        settings.leader_election_renew_deadline_s,
        settings.leader_election_retry_period_s,
    ) == (30.0, 20.0, 0.5)
    off_settings = ControllerSettings.from_env(
        env_of(off.container("Deployment", "controller"), {})
    )
    assert off_settings.leader_election_enabled is False
    assert all("leader" not in role["metadata"]["name"] for role in off.all("Role"))
    assert not off.may(CONTROLLER_SA, "create", "coordination.k8s.io/leases", NAMESPACE)
    assert refused.returncode != 0
    assert "controller.replicas > 1 needs controller.leaderElection.enabled=true" in refused.stderr


def test_the_controller_runs_without_privileges(host_driver: Rendered) -> None:
    spec = host_driver.pod_spec("Deployment")
    container = host_driver.container("Deployment", "controller")

    assert spec["serviceAccountName"] == CONTROLLER_SA
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert all("hostPath" not in v for v in spec["volumes"])


# ---- the DeviceClass catalog ------------------------------------------------------------------
def test_the_catalog_configmap_is_the_repository_catalog(
    host_driver: Rendered, tmp_path: Path
) -> None:
    data = host_driver.one("ConfigMap", "gpu-dra-deviceclasses")["data"]
    files = sorted((REPO / "deviceclasses").glob("*.yaml"))
    profiles = chart_defaults()["deviceClasses"]["migProfiles"]

    # One source of truth: the chart links the repository's catalog, verbatim by default, and
    # adds one class per MIG profile of deviceClasses.migProfiles.
    assert (CHART / "deviceclasses").is_symlink()
    assert (CHART / "deviceclasses").resolve() == REPO / "deviceclasses"
    generated = {mig_class_file(profile) for profile in profiles}
    assert sorted(data) == sorted([path.name for path in files] + list(generated))
    for path in files:
        assert data[path.name] == path.read_text().rstrip("\n")
    # What the controller loads from the mounted ConfigMap is the whole catalog.
    loaded = {c["metadata"]["name"] for c in configmap_catalog(data, tmp_path)}
    repository = {c["metadata"]["name"] for c in load_catalog(REPO / "deviceclasses")}
    assert loaded == repository | {name.removesuffix(".yaml") for name in generated}
    assert "gpu.nvidia.com" in loaded


def test_catalog_files_can_be_left_out_by_name_and_a_typo_is_refused(tmp_path: Path) -> None:
    rendered = Rendered.of(
        {**HOST_DRIVER, "deviceClasses": {"exclude": ["gpu.nvidia.com.yaml"]}}, tmp_path
    )
    disabled = Rendered.of({**HOST_DRIVER, "deviceClasses": {"enabled": False}}, tmp_path)
    typo = template(None, "gpuResourcesEnabledOverride=true", "deviceClasses.exclude={gpu.yaml}")

    data = rendered.one("ConfigMap", "gpu-dra-deviceclasses")["data"]
    assert "gpu.nvidia.com.yaml" not in data
    assert "mig.nvidia.com.yaml" in data
    assert disabled.one("ConfigMap", "gpu-dra-deviceclasses")["data"] == {}
    assert typo.returncode != 0
    assert "deviceClasses.exclude: gpu.yaml is not a file of the catalog" in typo.stderr


def chart_defaults() -> dict[str, Any]:
    defaults: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return defaults


def mig_class_file(profile: str) -> str:
    return f"mig-{profile.replace('+', '.')}.gpu.nvidia.com.yaml"


def configmap_catalog(data: dict[str, str], directory: Path) -> tuple[DeviceClass, ...]:
    """The classes the controller loads from the ConfigMap `data` mounted at `directory`."""
    for name, text in data.items():
        (directory / name).write_text(text)
    return load_catalog(directory)


def extended_resources(classes: Sequence[DeviceClass]) -> dict[str, list[str]]:
    """{extended resource name: the classes that claim it}."""
    names: dict[str, list[str]] = {}
    for device_class in classes:
        if "extendedResourceName" in device_class["spec"]:
            name = device_class["spec"]["extendedResourceName"]
            names.setdefault(name, []).append(device_class["metadata"]["name"])
    return names


def test_device_plugin_names_are_each_served_by_one_class_by_default(
    host_driver: Rendered, tmp_path: Path
) -> None:
    data = host_driver.one("ConfigMap", "gpu-dra-deviceclasses")["data"]
    served = extended_resources(configmap_catalog(data, tmp_path))

    assert served.pop("nvidia.com/gpu") == ["gpu.nvidia.com"]
    assert served.pop("nvidia.com/gpu.shared") == ["mps.gpu.nvidia.com"]
    # The device plugin's mixed-strategy names, `+` written `.`.
    assert served.pop("nvidia.com/mig-1g.10gb") == ["mig-1g.10gb.gpu.nvidia.com"]
    assert served.pop("nvidia.com/mig-1g.10gb.me") == ["mig-1g.10gb.me.gpu.nvidia.com"]
    assert served.pop("nvidia.com/mig-7g.141gb") == ["mig-7g.141gb.gpu.nvidia.com"]
    assert all(name.startswith("nvidia.com/mig-") for name in served)
    assert all(len(classes) == 1 for classes in served.values()), served


@pytest.mark.parametrize(
    ("tier", "carrier"),
    [("capped", "capped.gpu.nvidia.com"), ("mps", "mps.gpu.nvidia.com"), ("", None)],
)
def test_the_platform_picks_the_share_tier_of_nvidia_com_gpu_shared(
    tier: str, carrier: str | None, tmp_path: Path
) -> None:
    rendered = Rendered.of(
        {**HOST_DRIVER, "deviceClasses": {"sharedResource": tier, "migProfiles": []}}, tmp_path
    )
    (tmp_path / "catalog").mkdir()
    data = rendered.one("ConfigMap", "gpu-dra-deviceclasses")["data"]
    classes = {c["metadata"]["name"]: c for c in configmap_catalog(data, tmp_path / "catalog")}
    served = extended_resources(list(classes.values()))

    assert served.get("nvidia.com/gpu.shared") == ([carrier] if carrier else None)
    assert served["nvidia.com/gpu"] == ["gpu.nvidia.com"]
    # Only the name moves: selectors and configs of both tiers are the repository's.
    repository = {c["metadata"]["name"]: c for c in load_catalog(REPO / "deviceclasses")}
    for tier_class in ("mps.gpu.nvidia.com", "capped.gpu.nvidia.com"):
        mine = dict(classes[tier_class]["spec"])
        theirs = dict(repository[tier_class]["spec"])
        mine.pop("extendedResourceName", None)
        theirs.pop("extendedResourceName", None)
        assert mine == theirs


def test_a_share_tier_that_is_left_out_or_unknown_is_refused() -> None:
    excluded = template(
        None,
        "gpuResourcesEnabledOverride=true",
        "deviceClasses.sharedResource=capped",
        "deviceClasses.exclude={capped.gpu.nvidia.com.yaml}",
    )
    unknown = template(
        None, "gpuResourcesEnabledOverride=true", "deviceClasses.sharedResource=timeslicing"
    )

    assert excluded.returncode != 0
    assert (
        "deviceClasses.sharedResource=capped puts nvidia.com/gpu.shared on "
        "capped.gpu.nvidia.com.yaml, which deviceClasses.exclude leaves out"
    ) in excluded.stderr
    assert unknown.returncode != 0
    assert "'/deviceClasses/sharedResource'" in unknown.stderr


def mig_devices_of(simulated: str, profile: str, *, dynamic_mig: bool = False) -> list[str]:
    """The names of the MIG devices of `profile` the plugin publishes on a simulated node."""
    host = SimulatedHost.load(simulated, "node")
    return [
        device["name"]
        for device in plugin_devices(host.nvml, host.pci, dynamic_mig=dynamic_mig)
        if device["attributes"]["type"]["string"] == "mig"
        and device["attributes"]["profile"]["string"] == profile
    ]


def test_mig_profile_classes_select_their_profile_static_and_dynamic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rendered = Rendered.of(
        {**HOST_DRIVER, "deviceClasses": {"migProfiles": ["1g.10gb", "1g.10gb+me", "3g.40gb"]}},
        tmp_path,
    )
    data = rendered.one("ConfigMap", "gpu-dra-deviceclasses")["data"]
    (tmp_path / "catalog").mkdir()
    configmap_catalog(data, tmp_path / "catalog")
    names = [mig_class_file(p) for p in ("1g.10gb", "1g.10gb+me", "3g.40gb")]

    # The rendered catalog lints clean (selectors compile and evaluate on every simulated
    # profile, also the +dynamic-mig variants) ...
    capsys.readouterr()
    code = cli_main(["lint", "-o", "json", str(tmp_path / "catalog")], environ={})
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert [f for f in report["findings"] if f["level"] == "ERROR"] == []
    assert not [f for f in report["findings"] if "extendedResourceName" in f["message"]]
    selects = {c["name"]: c["selects"] for c in report["classes"]}
    # ... and each class selects the MIG devices of exactly its profile: static slices
    # (hgx-h100-mig) and dynamic MIG partitions (+dynamic-mig) alike.
    for profile in ("1g.10gb", "3g.40gb"):
        by_profile = selects[mig_class_file(profile).removesuffix(".yaml")]
        assert by_profile["hgx-h100-mig"] == mig_devices_of("hgx-h100-mig", profile)
        dynamic = mig_devices_of("hgx-h100", profile, dynamic_mig=True)
        assert by_profile["hgx-h100+dynamic-mig"] == dynamic
        assert dynamic
    # 1g.10gb+me exists on the H100 (static hgx-h100-mig has one) but the default dynamic MIG
    # policy does not offer it.
    me = selects["mig-1g.10gb.me.gpu.nvidia.com"]
    assert me["hgx-h100-mig"] == mig_devices_of("hgx-h100-mig", "1g.10gb+me")
    assert "hgx-h100+dynamic-mig" not in me
    assert all(name in data for name in names)


@pytest.mark.parametrize(
    "setting",
    [
        "deviceClasses.migProfiles={1c.3g.40gb}",  # a compute-instance profile: no such resource
        "deviceClasses.migProfiles={1g.10gb,1g.10gb}",
        "deviceClasses.migProfiles={MIG 1g.10gb}",
    ],
)
def test_a_mig_profile_that_names_no_device_plugin_resource_is_refused(setting: str) -> None:
    result = template(None, "gpuResourcesEnabledOverride=true", setting)

    assert result.returncode != 0
    assert "'/deviceClasses/migProfiles" in result.stderr


def test_the_packaged_chart_carries_the_catalog_files(tmp_path: Path) -> None:
    result = run_helm(["package", str(CHART), "--destination", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("gpu-dra-*.tgz")

    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}

    for path in (REPO / "deviceclasses").glob("*.yaml"):
        member = members[f"gpu-dra/deviceclasses/{path.name}"]
        assert member.isfile()  # the link resolved, not packed as a link


# ---- RBAC: one identity per component, least privilege ----------------------------------------
def test_plugin_and_controller_have_separate_service_accounts(host_driver: Rendered) -> None:
    accounts = {sa["metadata"]["name"] for sa in host_driver.all("ServiceAccount")}

    assert accounts == {PLUGIN_SA, CONTROLLER_SA}
    assert host_driver.pod_spec("DaemonSet")["serviceAccountName"] == PLUGIN_SA
    assert host_driver.pod_spec("Deployment")["serviceAccountName"] == CONTROLLER_SA


def test_the_plugin_may_do_what_it_calls_and_nothing_of_the_controller(
    host_driver: Rendered,
) -> None:
    def may(verb: str, resource: str, namespace: str = "") -> bool:
        return host_driver.may(PLUGIN_SA, verb, resource, namespace)

    # SlicePublisher: list, watch, create, replace (update), delete; the Node for ownerReferences.
    for verb in ("list", "watch", "create", "update", "delete"):
        assert may(verb, SLICES)
    assert may("get", "nodes")
    # The claim cache and prepares.
    for verb in ("get", "list", "watch"):
        assert may(verb, CLAIMS)
    assert not may("update", CLAIMS)
    # The claim status writer: server-side apply of status only, and this driver's entries of
    # claims on its own node (Kubernetes' resourceclaims/driver check; the rest: admission policy).
    assert may("patch", f"{CLAIMS}/status")
    assert not may("patch", CLAIMS)
    driver = f"{CLAIMS}/driver"
    assert host_driver.may(PLUGIN_SA, "associated-node:patch", driver, name="gpu.nvidia.com")
    assert not host_driver.may(PLUGIN_SA, "arbitrary-node:patch", driver, name="gpu.nvidia.com")
    assert not host_driver.may(PLUGIN_SA, "associated-node:patch", driver, name="net.example")
    # PodRunner: create, get, list, delete daemon pods, in the release namespace only.
    for verb in ("create", "get", "list", "delete"):
        assert may(verb, "pods", NAMESPACE)
    for verb in ("create", "get", "delete"):
        assert not may(verb, "pods", "default")
    # The start-up guard lists its node's pods (spec.nodeName) in every namespace.
    assert may("list", "pods", "default")
    assert not may("watch", "pods", "default")
    # Never the catalog.
    for verb in ("create", "update", "patch", "delete", "get"):
        assert not may(verb, CLASSES)


def test_the_controller_may_apply_the_catalog_and_write_nothing_else(
    host_driver: Rendered,
) -> None:
    def may(verb: str, resource: str, namespace: str = "") -> bool:
        return host_driver.may(CONTROLLER_SA, verb, resource, namespace)

    # Server-side apply of a class: patch, and create for one not there yet.
    assert may("patch", CLASSES)
    assert may("create", CLASSES)
    assert not may("delete", CLASSES)
    # The inventory it exports reads slices, classes and claims.
    for resource in (SLICES, CLASSES, CLAIMS):
        assert may("list", resource)
    for verb in ("create", "update", "patch", "delete"):
        assert not may(verb, SLICES)
        assert not may(verb, CLAIMS)
        assert not may(verb, "pods", NAMESPACE)
    assert not may("get", "nodes")


# ---- admission: each plugin writes only its own node's objects ---------------------------------
PLUGIN_USER = f"system:serviceaccount:{NAMESPACE}:{PLUGIN_SA}"


def slice_of(node: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": "gpu.nvidia.com", "pool": {"name": node or "shared"}}
    if node is not None:
        spec["nodeName"] = node
    else:
        spec["allNodes"] = True
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "spec": spec}


def pod_on(node: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "i"}]}
    if node is not None:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "spec": spec}


def bound_policy(rendered: Rendered, name: str) -> AdmissionPolicy:
    vap = rendered.one("ValidatingAdmissionPolicy", name)
    binding = rendered.one("ValidatingAdmissionPolicyBinding", name)
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert vap["spec"]["failurePolicy"] == "Fail"
    return AdmissionPolicy(vap)


@pytest.fixture(scope="module")
def policy(host_driver: Rendered) -> AdmissionPolicy:
    return bound_policy(host_driver, f"{PLUGIN_SA}-own-node")


@pytest.fixture(scope="module")
def claims_policy(host_driver: Rendered) -> AdmissionPolicy:
    return bound_policy(host_driver, f"{PLUGIN_SA}-own-claims")


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
@pytest.mark.parametrize(
    ("resource", "group", "make"),
    [("resourceslices", "resource.k8s.io", slice_of), ("pods", "", pod_on)],
)
def test_the_plugin_writes_objects_of_its_own_node_only(
    policy: AdmissionPolicy, operation: str, resource: str, group: str, make: Any
) -> None:
    def decide(target_node: str | None) -> Any:
        obj = make(target_node)
        return policy.decide(
            user=PLUGIN_USER,
            node=NODE,
            operation=operation,
            resource=resource,
            obj=None if operation == "DELETE" else obj,
            old=obj if operation != "CREATE" else None,
        )

    kind = "pod" if resource == "pods" else "ResourceSlice"
    assert policy.matches(group, resource, operation)
    assert decide(NODE).allowed
    other = decide("gpu-node-2")
    assert not other.allowed
    assert other.message == (
        f"gpu-dra kubelet plugin on node {NODE} may only {operation.lower()} a {kind} of its "
        "own node, not one of node gpu-node-2"
    )
    unbound = decide(None)
    assert not unbound.allowed
    assert unbound.message.endswith("not one without spec.nodeName")


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_the_plugin_writes_slices_of_its_own_nodes_pool_only(
    policy: AdmissionPolicy, operation: str
) -> None:
    """A pool is identified by driver and name, and the scheduler reads its newest generation
    only: a slice of node A in pool B (generation above B's) would hide node B's devices."""
    shadow = slice_of(NODE)
    shadow["spec"]["pool"] = {"name": "gpu-node-2", "generation": 99, "resourceSliceCount": 1}

    decision = policy.decide(
        user=PLUGIN_USER,
        node=NODE,
        operation=operation,
        resource="resourceslices",
        obj=None if operation == "DELETE" else shadow,
        old=shadow if operation != "CREATE" else None,
    )

    assert not decision.allowed
    assert decision.message == (
        f"gpu-dra kubelet plugin on node {NODE} may only {operation.lower()} ResourceSlices of "
        f"pool {NODE} (its node), not of pool gpu-node-2"
    )


def test_a_plugin_token_without_a_node_is_denied_and_other_users_are_not_judged(
    policy: AdmissionPolicy,
) -> None:
    nodeless = policy.decide(
        user=PLUGIN_USER, node=None, operation="CREATE", resource="resourceslices",
        obj=slice_of(NODE),
    )  # fmt: skip
    controller = policy.decide(
        user=f"system:serviceaccount:{NAMESPACE}:{CONTROLLER_SA}", node="gpu-node-2",
        operation="CREATE", resource="pods", obj=pod_on(NODE),
    )  # fmt: skip

    assert not nodeless.allowed
    assert "authentication.kubernetes.io/node-name" in nodeless.message
    assert controller == controller.__class__(True, "not matched")


def allocated_claim(pool: str, devices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": pool, "device": "gpu-0"}
    status: dict[str, Any] = {
        "allocation": {"devices": {"results": [result]}},
        "reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}],
    }
    if devices is not None:
        status["devices"] = devices
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "status": status}


def device_status(pool: str, driver: str = "gpu.nvidia.com") -> dict[str, Any]:
    return {"driver": driver, "pool": pool, "device": "gpu-0", "data": {"uuid": "GPU-1"}}


def test_the_plugin_writes_status_devices_of_its_own_nodes_claims_only(
    claims_policy: AdmissionPolicy,
) -> None:
    def decide(old: dict[str, Any], new: dict[str, Any]) -> Any:
        return claims_policy.decide(
            user=PLUGIN_USER, node=NODE, operation="UPDATE", resource="resourceclaims/status",
            obj=new, old=old,
        )  # fmt: skip

    assert claims_policy.matches("resource.k8s.io", "resourceclaims/status", "UPDATE")
    assert not claims_policy.matches("resource.k8s.io", "resourceclaims", "UPDATE")
    other = {"driver": "net.example.com", "pool": "x", "device": "eth1", "data": {}}
    mine = allocated_claim(NODE, [other])
    assert decide(mine, allocated_claim(NODE, [other, device_status(NODE)])).allowed
    # A claim of another node.
    elsewhere = decide(
        allocated_claim("gpu-node-2"), allocated_claim("gpu-node-2", [device_status(NODE)])
    )
    assert not elsewhere.allowed
    assert elsewhere.message == (
        f"gpu-dra kubelet plugin on node {NODE} may only write the status of claims allocated a "
        "gpu.nvidia.com device of its own node"
    )
    # An entry of another node's pool, the allocation, reservedFor, another driver's entry.
    foreign = decide(mine, allocated_claim(NODE, [other, device_status("gpu-node-2")]))
    assert not foreign.allowed
    assert foreign.message.endswith(
        f"may only write status.devices entries of pool {NODE} (its node)"
    )
    unreserved = allocated_claim(NODE, [other, device_status(NODE)])
    unreserved["status"]["reservedFor"] = []
    moved = allocated_claim(NODE, [other, device_status(NODE)])
    moved["status"]["allocation"]["devices"]["results"].append(
        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-1"}
    )
    for tampered in (unreserved, moved, allocated_claim(NODE, [device_status(NODE)])):
        decision = decide(mine, tampered)
        assert not decision.allowed
        assert "not the allocation, reservedFor or another driver's entries" in decision.message
    nodeless = claims_policy.decide(
        user=PLUGIN_USER, node=None, operation="UPDATE", resource="resourceclaims/status",
        obj=mine, old=mine,
    )  # fmt: skip
    assert not nodeless.allowed


def test_the_plugin_may_patch_claim_status_only_with_the_claim_status_on(tmp_path: Path) -> None:
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    on = Rendered.of(HOST_DRIVER, tmp_path / "on")
    off = Rendered.of({**HOST_DRIVER, "kubeletPlugin": {"claimStatus": {"enabled": False}}},
                      tmp_path / "off")  # fmt: skip
    assert on.may(PLUGIN_SA, "patch", f"{CLAIMS}/status")
    assert not off.may(PLUGIN_SA, "patch", f"{CLAIMS}/status")
    driver = f"{CLAIMS}/driver"
    assert on.may(PLUGIN_SA, "associated-node:patch", driver, name="gpu.nvidia.com")
    assert not off.may(PLUGIN_SA, "associated-node:patch", driver, name="gpu.nvidia.com")
    assert [p["metadata"]["name"] for p in off.all("ValidatingAdmissionPolicy")] == [
        f"{PLUGIN_SA}-own-node",
        TIER_QUOTA_POLICY,
    ]
    env = {e["name"]: e.get("value") for e in off.container("DaemonSet", "gpus")["env"]}
    assert env["GPU_DRA_CLAIM_STATUS"] == "false"
    settings = KubeletPluginSettings.parse(["--node-name=n"], env={
        k: v for k, v in env.items() if v is not None and k.startswith("GPU_DRA_CLAIM")
    })  # fmt: skip
    assert not settings.claim_status


def test_the_policy_can_be_left_out(tmp_path: Path) -> None:
    """The tier-quota policy has its own value (tierQuota.enabled)."""
    rendered = Rendered.of({**HOST_DRIVER, "admissionPolicy": {"enabled": False}}, tmp_path)

    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        assert [p["metadata"]["name"] for p in rendered.all(kind)] == [TIER_QUOTA_POLICY]


# ---- admission webhook: the controller judges the driver's opaque configs ---------------------
WEBHOOK = "gpu-dra-webhook"
WEBHOOK_DNS_NAME = f"{WEBHOOK}.{NAMESPACE}.svc"
CONTROLLER_USER = f"system:serviceaccount:{NAMESPACE}:{CONTROLLER_SA}"
CLAIM_CONTROLLER_USER = "system:serviceaccount:kube-system:resource-claim-controller"


SHARE_HOOK = "share-memory.gpu.nvidia.com"


def webhooks(rendered: Rendered) -> dict[str, dict[str, Any]]:
    (config,) = rendered.all("ValidatingWebhookConfiguration")
    return {hook["name"]: hook for hook in config["webhooks"]}


def config_webhooks(rendered: Rendered) -> dict[str, dict[str, Any]]:
    """The webhooks that judge opaque configs (not the share-memory quota's)."""
    return {name: hook for name, hook in webhooks(rendered).items() if name != SHARE_HOOK}


def test_the_webhook_is_the_controllers_port_behind_its_service(host_driver: Rendered) -> None:
    service = host_driver.one("Service", WEBHOOK)
    labels = host_driver.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    container = host_driver.container("Deployment", "controller")
    (port,) = service["spec"]["ports"]

    assert service["spec"]["selector"].items() <= labels.items()
    assert port["targetPort"] == "webhook"
    assert "webhook" in {p["name"] for p in container["ports"]}
    assert port["port"] == 443
    for hook in config_webhooks(host_driver).values():
        assert hook["clientConfig"]["service"] == {
            "namespace": NAMESPACE,
            "name": WEBHOOK,
            "port": 443,
            "path": WEBHOOK_PATH,
        }


def test_the_webhook_judges_every_validated_kind_and_version_fail_closed(
    host_driver: Rendered,
) -> None:
    hooks = config_webhooks(host_driver)

    assert sorted(hooks) == sorted(f"{plural}.gpu.nvidia.com" for plural in ADMITTED_KINDS)
    for name, hook in hooks.items():
        (rule,) = hook["rules"]
        plural = name.split(".")[0]
        assert rule == {
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": list(ADMITTED_VERSIONS),
            "operations": ["CREATE", "UPDATE"],
            "resources": [plural],
            "scope": "Cluster" if plural == "deviceclasses" else "Namespaced",
        }
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["sideEffects"] == "None"
        assert hook["failurePolicy"] == "Fail"


def gpu_entry(driver: str = "gpu.nvidia.com") -> dict[str, Any]:
    parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
    return {"opaque": {"driver": driver, "parameters": parameters}}


def with_configs(kind: str, version: str, configs: list[dict[str, Any]] | None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [{"name": "gpu"}]}
    if configs is not None:
        devices["config"] = configs
    spec: dict[str, Any] = {
        "ResourceClaim": {"devices": devices},
        "ResourceClaimTemplate": {"spec": {"devices": devices}},
        "DeviceClass": {} if configs is None else {"config": configs},
    }[kind]
    return {"apiVersion": f"resource.k8s.io/{version}", "kind": kind, "spec": spec}


@pytest.mark.parametrize("version", ADMITTED_VERSIONS)
@pytest.mark.parametrize("kind", ["ResourceClaim", "ResourceClaimTemplate", "DeviceClass"])
def test_only_objects_with_a_config_of_the_driver_are_sent_to_the_webhook(
    host_driver: Rendered, kind: str, version: str
) -> None:
    hooks = webhooks(host_driver)

    def sent_to(obj: dict[str, Any], user: str = "alice") -> list[str]:
        return [name for name, hook in hooks.items() if webhook_called(hook, user=user, obj=obj)]

    plural = kind.lower() + ("es" if kind.endswith("s") else "s")
    nic = {"opaque": {"driver": "nic.example.com", "parameters": {"mtu": 9000}}}
    mine = with_configs(kind, version, [nic, gpu_entry()])
    assert sent_to(mine) == [f"{plural}.gpu.nvidia.com"]
    assert sent_to(with_configs(kind, version, [nic])) == []
    # This driver's config under another name (gpu.nvidai.com): the webhook judges whether it is
    # a misspelling. Other kinds of the same API group (NVIDIA's compute domains) are not sent.
    assert sent_to(with_configs(kind, version, [gpu_entry("gpu.nvidai.com")])) == [
        f"{plural}.gpu.nvidia.com"
    ]
    domain = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig"}
    other_kind = {"opaque": {"driver": "compute-domain.nvidia.com", "parameters": domain}}
    odd = {"opaque": {"driver": "x.example.com", "parameters": {"apiVersion": 1, "kind": []}}}
    assert sent_to(with_configs(kind, version, [other_kind, odd])) == []
    assert sent_to(with_configs(kind, version, [])) == []
    assert sent_to(with_configs(kind, version, None)) == []
    # The controller applies the catalog before it can answer: its own applies are not sent.
    expected = [] if kind == "DeviceClass" else [f"{plural}.gpu.nvidia.com"]
    assert sent_to(mine, user=CONTROLLER_USER) == expected
    # Claims made for pods from a template copy the template's spec, judged when it was written.
    expected = [] if kind == "ResourceClaim" else [f"{plural}.gpu.nvidia.com"]
    for user in (CLAIM_CONTROLLER_USER, "system:kube-controller-manager"):
        assert sent_to(mine, user=user) == expected


def test_the_charts_certificate_serves_the_services_name_under_the_injected_ca(
    host_driver: Rendered, tmp_path: Path
) -> None:
    (secret,) = host_driver.all("Secret")
    data = {key: base64.b64decode(value) for key, value in secret["data"].items()}
    volume = host_driver.volume("Deployment", "webhook-tls")

    assert secret["type"] == "kubernetes.io/tls"
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    for hook in webhooks(host_driver).values():
        assert base64.b64decode(hook["clientConfig"]["caBundle"]) == data["ca.crt"]
    # The controller's own server, with the rendered pair, verified as the apiserver does: the
    # CA bundle and the Service's DNS name.
    (tmp_path / "tls.crt").write_bytes(data["tls.crt"])
    (tmp_path / "tls.key").write_bytes(data["tls.key"])
    trust = ssl.create_default_context(cadata=data["ca.crt"].decode())
    trust.verify_flags &= ~ssl.VERIFY_X509_STRICT

    async def fetch(server_hostname: str) -> int:
        server = WebhookServer(
            ReloadingCertificate(tmp_path / "tls.crt", tmp_path / "tls.key"),
            port=0,
            driver="gpu.nvidia.com",
            host="127.0.0.1",
        )
        await server.start()
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    f"https://127.0.0.1:{server.port}/readyz",
                    ssl=trust,
                    server_hostname=server_hostname,
                ) as reply,
            ):
                return reply.status
        finally:
            await server.stop()

    assert asyncio.run(fetch(WEBHOOK_DNS_NAME)) == 200
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        asyncio.run(fetch(f"{WEBHOOK}.elsewhere.svc"))


def test_cert_manager_makes_the_certificate_and_injects_its_ca(tmp_path: Path) -> None:
    tls = {"mode": "cert-manager", "certManager": {"dnsNames": ["webhook.example"]}}
    rendered = Rendered.of({**HOST_DRIVER, "webhook": {"tls": tls}}, tmp_path)
    issuer = rendered.one("Issuer")
    cert = rendered.one("Certificate")
    (config,) = rendered.all("ValidatingWebhookConfiguration")

    assert issuer["spec"] == {"selfSigned": {}}
    assert cert["spec"]["issuerRef"] == {
        "group": "cert-manager.io",
        "kind": "Issuer",
        "name": issuer["metadata"]["name"],
    }
    assert cert["spec"]["dnsNames"] == [
        WEBHOOK,
        f"{WEBHOOK}.{NAMESPACE}",
        WEBHOOK_DNS_NAME,
        "webhook.example",
    ]
    volume = rendered.volume("Deployment", "webhook-tls")
    assert volume["secret"]["secretName"] == cert["spec"]["secretName"]
    assert config["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{NAMESPACE}/{cert['metadata']['name']}"
    }
    assert all("caBundle" not in hook["clientConfig"] for hook in config["webhooks"])
    assert rendered.all("Secret") == []


def test_cert_manager_can_use_a_named_cluster_issuer_and_a_nameless_one_is_refused(
    tmp_path: Path,
) -> None:
    tls = {
        "mode": "cert-manager",
        "certManager": {"issuerType": "clusterissuer", "issuerName": "corp-ca"},
    }
    rendered = Rendered.of({**HOST_DRIVER, "webhook": {"tls": tls}}, tmp_path)
    nameless = template(
        None,
        "gpuResourcesEnabledOverride=true",
        "webhook.tls.mode=cert-manager",
        "webhook.tls.certManager.issuerType=issuer",
    )

    assert rendered.all("Issuer") == []
    assert rendered.one("Certificate")["spec"]["issuerRef"] == {
        "group": "cert-manager.io",
        "kind": "ClusterIssuer",
        "name": "corp-ca",
    }
    assert nameless.returncode != 0
    assert "issuerType=issuer needs webhook.tls.certManager.issuerName" in nameless.stderr


def test_a_secret_of_ones_own_with_its_ca_bundle(tmp_path: Path) -> None:
    tls = {"mode": "secret", "secret": {"name": "my-webhook-tls", "caBundle": "Q0EK"}}
    rendered = Rendered.of({**HOST_DRIVER, "webhook": {"tls": tls}}, tmp_path)
    no_bundle = template(
        None,
        "gpuResourcesEnabledOverride=true",
        "webhook.tls.mode=secret",
        "webhook.tls.secret.name=my-webhook-tls",
    )

    volume = rendered.volume("Deployment", "webhook-tls")
    assert volume["secret"]["secretName"] == "my-webhook-tls"
    assert {h["clientConfig"]["caBundle"] for h in webhooks(rendered).values()} == {"Q0EK"}
    for kind in ("Secret", "Certificate", "Issuer"):
        assert rendered.all(kind) == []
    assert no_bundle.returncode != 0
    assert "webhook.tls.mode=secret needs webhook.tls.secret.name" in no_bundle.stderr


def test_the_webhook_can_be_left_out_or_fail_open(tmp_path: Path) -> None:
    off = Rendered.of({**HOST_DRIVER, "webhook": {"enabled": False}}, tmp_path)
    fail_open = Rendered.of({**HOST_DRIVER, "webhook": {"failurePolicy": "Ignore"}}, tmp_path)

    container = off.container("Deployment", "controller")
    assert ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD)).webhook_port == 0
    assert [p["name"] for p in container["ports"]] == ["metrics"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert "webhook-tls" not in {v["name"] for v in off.pod_spec("Deployment")["volumes"]}
    for kind in ("ValidatingWebhookConfiguration", "Secret"):
        assert off.all(kind) == []
    assert WEBHOOK not in {s["metadata"]["name"] for s in off.all("Service")}
    assert {h["failurePolicy"] for h in webhooks(fail_open).values()} == {"Ignore"}


def share_claim(request: dict[str, Any], version: str = "v1") -> dict[str, Any]:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "spec": {"devices": {"requests": [request]}},
    }


def test_every_claim_asking_for_a_share_class_is_sent_to_the_share_memory_quota(
    host_driver: Rendered,
) -> None:
    hook = webhooks(host_driver)[SHARE_HOOK]
    data = host_driver.one("ConfigMap", "gpu-dra-deviceclasses")["data"]
    catalog = [yaml.safe_load(text) for text in data.values()]

    assert hook["clientConfig"]["service"]["path"] == SHARE_MEMORY_PATH
    assert hook["sideEffects"] == "NoneOnDryRun"  # the ledger is not written for dry runs
    assert hook["failurePolicy"] == "Fail"
    assert hook["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["resourceclaims"],
            "scope": "Namespaced",
        }
    ]
    assert hook["matchPolicy"] == "Equivalent"  # v1beta1/v1beta2 writes are sent as v1
    share_classes = share_memory.share_classes(catalog)
    assert share_classes == {"mps.gpu.nvidia.com", "mps.mig.nvidia.com", "capped.gpu.nvidia.com"}
    users = ("alice", CLAIM_CONTROLLER_USER, "system:kube-scheduler")
    for name in share_classes:
        for user in users:  # claims from templates and the scheduler's claims count too
            share = {"name": "s", "exactly": {"deviceClassName": name}}
            assert webhook_called(hook, user=user, obj=share_claim(share)), (name, user)
        alternatives = {
            "name": "any",
            "firstAvailable": [
                {"name": "whole", "deviceClassName": "gpu.nvidia.com"},
                {"name": "share", "deviceClassName": name},
            ],
        }
        assert webhook_called(hook, user="alice", obj=share_claim(alternatives))
    whole = {"name": "g", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
    assert not webhook_called(hook, user="alice", obj=share_claim(whole))
    assert not webhook_called(hook, user="alice", obj=share_claim({"name": "x"}))
    share = {"name": "s", "exactly": {"deviceClassName": "mps.gpu.nvidia.com"}}
    assert not webhook_called(hook, user="alice", obj=share_claim(share), operation="UPDATE")


def test_the_share_memory_quota_needs_quota_reads_and_ledgers_in_the_release_namespace(
    host_driver: Rendered, tmp_path: Path
) -> None:
    settings = ControllerSettings.from_env(
        env_of(host_driver.container("Deployment", "controller"), CONTROLLER_DOWNWARD)
    )
    cluster_rules = [
        rule
        for role in host_driver.all("ClusterRole")
        if role["metadata"]["name"] == CONTROLLER_SA
        for rule in role["rules"]
    ]
    ledgers = host_driver.one("Role", f"{CONTROLLER_SA}-share-memory")
    binding = host_driver.one("RoleBinding", f"{CONTROLLER_SA}-share-memory")

    assert settings.share_memory_quota
    assert settings.share_memory_ledger_namespace == NAMESPACE
    assert {"apiGroups": [""], "resources": ["resourcequotas"], "verbs": ["list"]} in cluster_rules
    assert ledgers["metadata"]["namespace"] == NAMESPACE
    assert ledgers["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "update"]}
    ]
    assert binding["subjects"][0]["name"] == CONTROLLER_SA

    off = Rendered.of(
        {**HOST_DRIVER, "webhook": {"shareMemoryQuota": {"enabled": False}}}, tmp_path
    )
    container = off.container("Deployment", "controller")
    assert not ControllerSettings.from_env(
        env_of(container, CONTROLLER_DOWNWARD)
    ).share_memory_quota
    assert SHARE_HOOK not in webhooks(off)
    assert f"{CONTROLLER_SA}-share-memory" not in {r["metadata"]["name"] for r in off.all("Role")}
    assert not any(
        "resourcequotas" in rule.get("resources", [])
        for role in off.all("ClusterRole")
        for rule in role["rules"]
    )


def test_the_controller_mode_renders_the_same_every_time_and_no_certificate(
    tmp_path: Path,
) -> None:
    values = {**HOST_DRIVER, "webhook": {"tls": {"mode": "controller"}}}
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    first, second = template(path), template(path)
    helm_mode = [template(None, "gpuResourcesEnabledOverride=true") for _ in range(2)]
    rendered = Rendered.of(values, tmp_path)

    # helm template (GitOps) has no lookup: the helm mode makes a new pair on every render.
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert helm_mode[0].stdout != helm_mode[1].stdout
    assert rendered.all("Secret") == []
    assert all("caBundle" not in h["clientConfig"] for h in webhooks(rendered).values())
    container = rendered.container("Deployment", "controller")
    settings = ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD))
    assert settings.webhook_tls_secret == f"{NAMESPACE}/{WEBHOOK}-tls"
    assert settings.webhook_service == f"{NAMESPACE}/{WEBHOOK}"
    assert (
        settings.webhook_configuration
        == rendered.one("ValidatingWebhookConfiguration")["metadata"]["name"]
    )
    # The controller writes the pair it keeps into a volume of its own, where it reads it.
    mount = next(m for m in container["volumeMounts"] if m["name"] == "webhook-tls")
    assert settings.webhook_tls_cert_file.parent == PurePosixPath(mount["mountPath"])
    assert mount["readOnly"] is False
    assert "emptyDir" in rendered.volume("Deployment", "webhook-tls")


def test_the_controller_mode_may_keep_its_own_secret_and_webhook_only(
    host_driver: Rendered, tmp_path: Path
) -> None:
    rendered = Rendered.of({**HOST_DRIVER, "webhook": {"tls": {"mode": "controller"}}}, tmp_path)
    secret, config = f"{WEBHOOK}-tls", WEBHOOK
    hooks = "admissionregistration.k8s.io/validatingwebhookconfigurations"

    for verb in ("get", "update"):
        assert rendered.may(CONTROLLER_SA, verb, "secrets", NAMESPACE, secret)
        assert not rendered.may(CONTROLLER_SA, verb, "secrets", NAMESPACE, "other")
        assert not rendered.may(CONTROLLER_SA, verb, "secrets", "kube-system", secret)
    assert rendered.may(CONTROLLER_SA, "create", "secrets", NAMESPACE)
    assert not rendered.may(CONTROLLER_SA, "list", "secrets", NAMESPACE)
    for verb in ("get", "patch"):
        assert rendered.may(CONTROLLER_SA, verb, hooks, "", config)
        assert not rendered.may(CONTROLLER_SA, verb, hooks, "", "someone-elses")
    # The other modes: no Secret and no webhook configuration may be touched.
    for verb in ("get", "update", "create"):
        assert not host_driver.may(CONTROLLER_SA, verb, "secrets", NAMESPACE, secret)
    assert not host_driver.may(CONTROLLER_SA, "patch", hooks, "", config)


# ---- NVIDIA's values --------------------------------------------------------------------------
NVIDIA_DEFAULTS: dict[str, Any] = {
    "nvidiaDriverRoot": "/",
    "nvidiaCDIHookPath": "",
    "altProcDevices": "",
    "nameOverride": "",
    "fullnameOverride": "",
    "namespaceOverride": "",
    "selectorLabelsOverride": {},
    "gpuResourcesEnabledOverride": False,
    "allowDefaultNamespace": False,
    "resourceApiVersion": "",
    "imagePullSecrets": [],
    "image": {
        "repository": "registry.k8s.io/dra-driver-nvidia/dra-driver-nvidia-gpu",
        "pullPolicy": "IfNotPresent",
        "tag": "",
    },
    "serviceAccount": {"create": True, "annotations": {}, "name": ""},
    "resources": {"gpus": {"enabled": True}, "computeDomains": {"enabled": True}},
    "featureGates": {},
    "logVerbosity": "4",
    "webhook": {
        "enabled": False,
        "replicas": 1,
        "servicePort": 443,
        "containerPort": 443,
        "priorityClassName": "system-cluster-critical",
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}},
        "podAnnotations": {},
        "podSecurityContext": {},
        "nodeSelector": {},
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
        "affinity": {},
        "containers": {"webhook": {"securityContext": {"privileged": False}, "resources": {}}},
        "serviceAccount": {"create": True, "name": ""},
        "failurePolicy": "Fail",
        "tls": {
            "mode": "cert-manager",
            "certManager": {"issuerType": "selfsigned", "issuerName": "", "dnsNames": []},
            "secret": {"name": "", "caBundle": ""},
        },
    },
    "controller": {
        "replicas": 1,
        "leaderElection": {
            "enabled": False,
            "leaseDuration": "15s",
            "renewDeadline": "10s",
            "retryPeriod": "2s",
        },
        "metrics": {
            "enabled": True,
            "httpEndpoint": ":8080",
            "metricsPath": "/metrics",
            "profilePath": "",
        },
        "priorityClassName": "system-node-critical",
        "podAnnotations": {},
        "podSecurityContext": {},
        "nodeSelector": {},
        "tolerations": [
            {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
             "effect": "NoSchedule"},
            {"key": "node-role.kubernetes.io/master", "operator": "Exists",
             "effect": "NoSchedule"},
            {"key": "CriticalAddonsOnly", "operator": "Exists"},
        ],
        "containers": {"computeDomain": {"securityContext": {}, "env": [], "resources": {}}},
        "affinity": {
            "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100,
                "preference": {"matchExpressions": [
                    {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}
                ]},
            }]},
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 100,
                "podAffinityTerm": {
                    "labelSelector": {
                        "matchLabels": {"dra-driver-nvidia-gpu-component": "controller"}
                    },
                    "topologyKey": "kubernetes.io/hostname",
                },
            }]},
        },
        "networkPolicy": {"enabled": False},
    },
    "kubeletPlugin": {
        "metrics": {
            "enabled": True,
            "gpuHttpEndpoint": ":8080",
            "computeDomainHttpEndpoint": ":8081",
            "metricsPath": "/metrics",
        },
        "priorityClassName": "system-node-critical",
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}},
        "podAnnotations": {},
        "podSecurityContext": {},
        "nodeSelector": {},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "kubeletRegistrarDirectoryPath": "/var/lib/kubelet/plugins_registry",
        "kubeletPluginsDirectoryPath": "/var/lib/kubelet/plugins",
        "containers": {
            "init": {"securityContext": {}, "resources": {}},
            "computeDomains": {
                "env": [],
                "securityContext": {"privileged": True},
                "resources": {},
                "healthcheckPort": 51515,
            },
            "gpus": {
                "env": [],
                "securityContext": {"privileged": True},
                "resources": {},
                "healthcheckPort": 51516,
            },
        },
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}
                for key, value in (
                    ("feature.node.kubernetes.io/pci-10de.present", "true"),
                    ("feature.node.kubernetes.io/pci-0302_10de.present", "true"),
                    ("feature.node.kubernetes.io/pci-0300_10de.present", "true"),
                    ("feature.node.kubernetes.io/cpu-model.vendor_id", "NVIDIA"),
                    ("nvidia.com/gpu.present", "true"),
                )
            ]
        }}},
        "networkPolicy": {"enabled": False},
    },
}  # fmt: skip
"""Every key of NVIDIA's chart's values.yaml (dra-driver-nvidia-gpu, deployments/helm/
dra-driver-nvidia-gpu/values.yaml at the mirrored HEAD) with its default, written out here
from its documented names (the file itself is not vendored)."""

NVIDIA_ACKNOWLEDGED: dict[str, Any] = {
    "gpuResourcesEnabledOverride": True,
    "resources": {"computeDomains": {"enabled": False}},
}
"""What NVIDIA's defaults need for gpu-dra: the device plugin acknowledged off (NVIDIA's chart
refuses without it too) and no ComputeDomains."""

NVIDIA_GPU_OPERATOR: dict[str, Any] = {
    "nvidiaDriverRoot": "/run/nvidia/driver",
    "gpuResourcesEnabledOverride": True,
    "resources": {"gpus": {"enabled": True}, "computeDomains": {"enabled": False}},
}
"""NVIDIA's documented GPU Operator install (helm install ... --set nvidiaDriverRoot=... )."""


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    result = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def render_failure(values: dict[str, Any], tmp_path: Path, *sets: str) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = template(path, *sets)
    assert result.returncode != 0, "rendered"
    return result.stderr


def test_nvidias_default_values_pass_the_schema_and_are_refused_only_for_what_gpu_dra_lacks(
    tmp_path: Path,
) -> None:
    complaint = render_failure(NVIDIA_DEFAULTS, tmp_path)

    assert "values don't meet the specifications of the schema" not in complaint
    assert "additional properties" not in complaint
    assert "2 problems with the values" in complaint
    assert "--set gpuResourcesEnabledOverride=true" in complaint
    assert "resources.computeDomains.enabled=true: gpu-dra has no ComputeDomains" in complaint


def test_nvidias_default_values_render_gpu_dra_with_their_meaning(tmp_path: Path) -> None:
    values = merged(NVIDIA_DEFAULTS, NVIDIA_ACKNOWLEDGED)
    path = tmp_path / "nvidia.yaml"
    path.write_text(yaml.safe_dump(values))
    lint = run_helm(["lint", "--strict", str(CHART), "--values", str(path)])
    rendered = Rendered.of(values, tmp_path)
    plugin = plugin_settings(rendered)
    controller = ControllerSettings.from_env(
        env_of(rendered.container("Deployment", "controller"), CONTROLLER_DOWNWARD)
    )

    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert plugin.metrics_port == 8080  # kubeletPlugin.metrics.gpuHttpEndpoint
    assert controller.metrics_port == 8080  # controller.metrics.httpEndpoint
    assert plugin.healthcheck_port == 51516
    assert controller.leader_election_enabled is False
    assert controller.webhook_port == 0  # webhook.enabled: false
    assert rendered.all("ValidatingWebhookConfiguration") == []
    assert rendered.all("PodDisruptionBudget") == []  # one replica
    daemonset = rendered.one("DaemonSet")["spec"]
    assert daemonset["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": "100%"}
    terms = daemonset["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert len(terms) == 5
    assert rendered.container("DaemonSet", "gpus")["securityContext"]["privileged"] is True
    assert rendered.container("DaemonSet", "gpus")["securityContext"]["runAsUser"] == 0
    assert rendered.container("DaemonSet", "gpus")["image"] == (
        "registry.k8s.io/dra-driver-nvidia/dra-driver-nvidia-gpu:0.1.0"
    )
    assert rendered.pod_spec("Deployment")["priorityClassName"] == "system-node-critical"


def test_nvidias_webhook_defaults_make_a_cert_manager_certificate_on_port_443(
    tmp_path: Path,
) -> None:
    values = merged(NVIDIA_DEFAULTS, {**NVIDIA_ACKNOWLEDGED, "webhook": {"enabled": True}})
    rendered = Rendered.of(values, tmp_path)
    container = rendered.container("Deployment", "controller")
    settings = ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD))

    assert rendered.one("Issuer")["spec"] == {"selfSigned": {}}
    assert rendered.one("Certificate")["spec"]["secretName"] == f"{WEBHOOK}-tls"
    assert settings.webhook_port == 443
    assert {"name": "net.ipv4.ip_unprivileged_port_start", "value": "443"} in rendered.pod_spec(
        "Deployment"
    )["securityContext"]["sysctls"]
    assert rendered.all("Secret") == []


def test_nvidias_gpu_operator_values_mount_the_driver_container_root(tmp_path: Path) -> None:
    rendered = Rendered.of(NVIDIA_GPU_OPERATOR, tmp_path)
    settings = plugin_settings(rendered)

    assert rendered.volume("DaemonSet", "driver-root")["hostPath"]["path"] == "/run/nvidia/driver"
    assert settings.host_driver_root == PurePosixPath("/run/nvidia/driver")
    assert settings.driver_root == Path("/driver-root")


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (
            {"resources": {"computeDomains": {"enabled": True}}},
            "resources.computeDomains.enabled=true: gpu-dra has no ComputeDomains",
        ),
        (
            {"resources": {"gpus": {"enabled": False}}},
            "resources.gpus.enabled=false: gpu-dra is the GPU driver",
        ),
        (
            {"serviceAccount": {"create": False}},
            "serviceAccount.create=false: gpu-dra makes its own two ServiceAccounts",
        ),
        ({"serviceAccount": {"name": "shared"}}, "serviceAccount.name=shared: gpu-dra names"),
        ({"namespaceOverride": "gpu"}, "install with --namespace gpu instead"),
        ({"selectorLabelsOverride": {"app": "x"}}, "selectorLabelsOverride: gpu-dra's selectors"),
        (
            {"controller": {"networkPolicy": {"enabled": True}}},
            "controller.networkPolicy.enabled=true: gpu-dra's chart renders no NetworkPolicy",
        ),
        (
            {"kubeletPlugin": {"networkPolicy": {"enabled": True}}},
            "kubeletPlugin.networkPolicy.enabled=true",
        ),
        (
            {"controller": {"metrics": {"profilePath": "/debug/pprof"}}},
            "controller.metrics.profilePath=/debug/pprof: gpu-dra's controller serves no profiling",
        ),
        (
            {"kubeletPlugin": {"metrics": {"metricsPath": "/m"}}},
            "'/kubeletPlugin/metrics/metricsPath'",
        ),
        (
            {"controller": {"metrics": {"httpEndpoint": "10.0.0.1:8080"}}},
            "'/controller/metrics/httpEndpoint'",
        ),
        ({"featureGates": {"SomeoneElsesGate": True}}, "additional properties 'SomeoneElsesGate'"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, dict) else "",
)
def test_nvidia_values_gpu_dra_cannot_honour_are_refused_with_the_reason(
    values: dict[str, Any], complaint: str, tmp_path: Path
) -> None:
    assert complaint in render_failure(merged(HOST_DRIVER, values), tmp_path)


@pytest.mark.parametrize("gate", sorted(GATES_NOT_IMPLEMENTED))
def test_a_feature_gate_gpu_dra_lacks_is_refused_when_true_and_accepted_when_false(
    gate: str, tmp_path: Path
) -> None:
    complaint = render_failure(merged(HOST_DRIVER, {"featureGates": {gate: True}}), tmp_path)
    off = Rendered.of(merged(HOST_DRIVER, {"featureGates": {gate: False}}), tmp_path)

    assert f"featureGates.{gate}=true: gpu-dra does not implement NVIDIA's {gate} gate" in (
        complaint
    )
    assert plugin_settings(off).feature_gates == ()  # the plugin starts with it


def test_the_schema_knows_every_gate_of_the_plugin_and_kubernetes_logging_gates() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    gates = set(schema["properties"]["featureGates"]["properties"])

    known = {GATE_DYNAMIC_MIG, GATE_HEALTH_CHECK, *GATES_ALWAYS_ON, *GATES_NOT_IMPLEMENTED}
    assert gates == known | {"ContextualLogging", "LoggingAlphaOptions", "LoggingBetaOptions"}


def test_logging_gates_are_accepted_and_not_passed_to_the_plugin(tmp_path: Path) -> None:
    gates = {"ContextualLogging": True, "LoggingBetaOptions": False, "DynamicMIG": True}
    rendered = Rendered.of(merged(HOST_DRIVER, {"featureGates": gates}), tmp_path)
    env = env_of(rendered.container("DaemonSet", "gpus"), DOWNWARD)

    assert env["FEATURE_GATES"] == "DynamicMIG=true,"
    assert plugin_settings(rendered).feature_gates == ("DynamicMIG",)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    values = {
        "resources": {"computeDomains": {"enabled": True}},
        "featureGates": {"PassthroughSupport": True},
        "namespaceOverride": "x",
    }
    complaint = render_failure(values, tmp_path)

    assert "4 problems with the values" in complaint
    for part in (
        "gpuResourcesEnabledOverride",
        "computeDomains",
        "PassthroughSupport",
        "--namespace",
    ):
        assert part in complaint


def test_nvidias_metrics_values_set_the_ports_or_turn_the_plugins_off(tmp_path: Path) -> None:
    endpoints = {
        "kubeletPlugin": {"metrics": {"gpuHttpEndpoint": "0.0.0.0:9500"}},
        "controller": {"metrics": {"httpEndpoint": "[::]:9600"}},
    }
    moved = Rendered.of(merged(HOST_DRIVER, endpoints), tmp_path)
    off = Rendered.of(
        merged(HOST_DRIVER, {"kubeletPlugin": {"metrics": {"enabled": False}},
                             "controller": {"metrics": {"enabled": False}}}),
        tmp_path,
    )  # fmt: skip
    services = {s["metadata"]["name"]: s for s in moved.all("Service")}

    assert plugin_settings(moved).metrics_port == 9500
    assert services["gpu-dra-kubelet-plugin-metrics"]["spec"]["ports"][0]["port"] == 9500
    controller = moved.container("Deployment", "controller")
    assert ControllerSettings.from_env(env_of(controller, CONTROLLER_DOWNWARD)).metrics_port == (
        9600
    )
    assert services["gpu-dra-controller-metrics"]["spec"]["ports"][0]["port"] == 9600
    # Off: the plugin serves no metrics; the controller's port stays for its health probes.
    assert plugin_settings(off).metrics_port == 0
    assert "metrics" not in {p["name"] for p in off.container("DaemonSet", "gpus")["ports"]}
    assert "metrics" in {p["name"] for p in off.container("Deployment", "controller")["ports"]}
    names = {s["metadata"]["name"] for s in off.all("Service")}
    assert not names & {"gpu-dra-kubelet-plugin-metrics", "gpu-dra-controller-metrics"}


def test_service_account_annotations_go_on_both_accounts(tmp_path: Path) -> None:
    annotations = {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/gpu"}
    rendered = Rendered.of(
        merged(HOST_DRIVER, {"serviceAccount": {"annotations": annotations}}), tmp_path
    )

    for account in (PLUGIN_SA, CONTROLLER_SA):
        assert rendered.one("ServiceAccount", account)["metadata"]["annotations"] == annotations


def test_nvidias_webhook_port_443_is_bound_by_the_non_root_controller(tmp_path: Path) -> None:
    low = Rendered.of(merged(HOST_DRIVER, {"webhook": {"containerPort": 443}}), tmp_path)
    container = low.container("Deployment", "controller")
    settings = ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD))
    pod = low.pod_spec("Deployment")

    assert settings.webhook_port == 443
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["sysctls"] == [
        {"name": "net.ipv4.ip_unprivileged_port_start", "value": "443"}
    ]
    assert (
        "sysctls"
        not in Rendered.of(HOST_DRIVER, tmp_path).pod_spec("Deployment")["securityContext"]
    )


NVIDIA_NO_OPS: dict[str, Any] = {
    "altProcDevices": "/var/lib/nvml-mock/imex/proc-devices",
    "allowDefaultNamespace": True,
    "resourceApiVersion": "resource.k8s.io/v1beta1",
    "webhook": {k: NVIDIA_DEFAULTS["webhook"][k] for k in (
        "replicas", "priorityClassName", "strategy", "podAnnotations", "podSecurityContext",
        "nodeSelector", "tolerations", "affinity", "containers", "serviceAccount",
    )},
    "controller": {"containers": {"computeDomain": {"env": [{"name": "X", "value": "1"}],
                                                    "resources": {"requests": {"cpu": "1"}}}}},
    "kubeletPlugin": {
        "metrics": {"computeDomainHttpEndpoint": ":9999"},
        "containers": {"computeDomains": {"env": [], "healthcheckPort": 51515}},
    },
    "featureGates": {"ContextualLogging": True},
}  # fmt: skip
"""NVIDIA's values that configure what gpu-dra does not have (its separate webhook Deployment,
its ComputeDomain programs, install-time choices gpu-dra makes itself)."""


def test_nvidias_values_without_a_gpu_dra_meaning_change_nothing(tmp_path: Path) -> None:
    with_them = Rendered.of(merged(HOST_DRIVER, NVIDIA_NO_OPS), tmp_path)
    without = Rendered.of(HOST_DRIVER, tmp_path)

    def comparable(rendered: Rendered) -> list[dict[str, Any]]:
        objects = [o for o in rendered.objects if o["kind"] != "Secret"]  # a new pair each time
        for o in objects:
            if o["kind"] == "ValidatingWebhookConfiguration":
                for hook in o["webhooks"]:
                    hook["clientConfig"].pop("caBundle")
        return objects

    assert comparable(with_them) == comparable(without)


# ---- disruption budget and resources ----------------------------------------------------------
def test_a_budget_keeps_controller_replicas_through_drains_but_never_blocks_one(
    tmp_path: Path, host_driver: Rendered
) -> None:
    three = Rendered.of(merged(HOST_DRIVER, {"controller": {"replicas": 3}}), tmp_path)
    off = Rendered.of(
        merged(HOST_DRIVER, {"controller": {"replicas": 3, "podDisruptionBudget": {
            "enabled": False}}}),
        tmp_path,
    )  # fmt: skip
    budget = three.one("PodDisruptionBudget")
    labels = three.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    plugin_labels = three.one("DaemonSet")["spec"]["template"]["metadata"]["labels"]

    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert not budget["spec"]["selector"]["matchLabels"].items() <= plugin_labels.items()
    assert host_driver.all("PodDisruptionBudget") == []  # one replica: nothing to keep
    assert off.all("PodDisruptionBudget") == []


def documented_requests() -> dict[str, dict[str, str]]:
    """The default requests of docs/deployment.md's sizing table, by container value path."""
    doc = (REPO / "docs" / "deployment.md").read_text()
    section = doc[doc.index("### Resource requests") :]
    rows = re.findall(r"^\| `([a-zA-Z.]+)\.resources` \|.*\| `cpu: (\w+)`, `memory: (\w+)` \|$",
                      section, re.MULTILINE)  # fmt: skip
    return {path: {"cpu": cpu, "memory": memory} for path, cpu, memory in rows}


def test_containers_request_what_the_sizing_table_measured_and_have_no_limits(
    host_driver: Rendered, tmp_path: Path
) -> None:
    documented = documented_requests()
    own = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    overridden = Rendered.of(
        merged(HOST_DRIVER, {"controller": {"containers": {"controller": {"resources": own}}}}),
        tmp_path,
    )

    assert set(documented) == {
        "kubeletPlugin.containers.gpus",
        "controller.containers.controller",
    }
    plugin = host_driver.container("DaemonSet", "gpus")["resources"]
    controller = host_driver.container("Deployment", "controller")["resources"]
    assert plugin == {"requests": documented["kubeletPlugin.containers.gpus"]}
    assert controller == {"requests": documented["controller.containers.controller"]}
    assert overridden.container("Deployment", "controller")["resources"] == own


# ---- metrics ----------------------------------------------------------------------------------
def test_metrics_services_select_the_pods_ports(gpu_operator: Rendered) -> None:
    services = {s["metadata"]["name"]: s for s in gpu_operator.all("Service")}
    plugin = services["gpu-dra-kubelet-plugin-metrics"]
    controller = services["gpu-dra-controller-metrics"]
    plugin_labels = gpu_operator.one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    controller_labels = gpu_operator.one("Deployment")["spec"]["template"]["metadata"]["labels"]

    assert plugin["spec"]["clusterIP"] == "None"  # one address per node's plugin
    assert plugin["spec"]["selector"].items() <= plugin_labels.items()
    assert controller["spec"]["selector"].items() <= controller_labels.items()
    assert not plugin["spec"]["selector"].items() <= controller_labels.items()
    assert plugin["spec"]["ports"][0]["port"] == 9401
    assert controller["spec"]["ports"][0]["port"] == 9400
    assert gpu_operator.all("ServiceMonitor") == []


# ---- the idle policy (docs/idle-reclaim.md) ---------------------------------------------------
CONTROLLER_USER = f"system:serviceaccount:{NAMESPACE}:{CONTROLLER_SA}"
IDLE_SCOPE = f"{CONTROLLER_SA}-idle-reclaim-scope"
IDLE_VALUES = {
    "controller": {
        "idleReclaim": {"enabled": True, "interval": 15, "defaultWindow": "4h",
                        "defaultGrace": "1h30m"},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def idle_reclaim(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return Rendered.of({**HOST_DRIVER, **IDLE_VALUES}, tmp_path_factory.mktemp("idle"))


def test_the_idle_policy_is_off_by_default_with_no_pod_rights(host_driver: Rendered) -> None:
    container = host_driver.container("Deployment", "controller")
    settings = ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD))

    assert settings.idle_reclaim is False
    for verb, resource in (("create", "pods/eviction"), ("patch", "pods/status"),
                           ("list", "pods"), ("list", "namespaces")):  # fmt: skip
        assert not host_driver.may(CONTROLLER_SA, verb, resource, "ml")
    assert all(
        p["metadata"]["name"] != IDLE_SCOPE for p in host_driver.all("ValidatingAdmissionPolicy")
    )


def test_enabled_it_passes_its_settings_and_grants_what_it_calls(idle_reclaim: Rendered) -> None:
    container = idle_reclaim.container("Deployment", "controller")
    settings = ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD))

    assert settings.idle_reclaim is True
    assert settings.idle_reclaim_interval_s == 15
    assert settings.idle_reclaim_default_window_s == 4 * 3600
    assert settings.idle_reclaim_default_grace_s == 5400
    assert settings.idle_reclaim_plugin_selector == (
        "app.kubernetes.io/instance=gpu-dra,app.kubernetes.io/component=kubelet-plugin"
    )
    # 3 x (claim status every 30 s + a sample every 10 s + 2 s): the chart's defaults
    assert settings.idle_reclaim_max_sample_age_s == 126 == DEFAULT_MAX_SAMPLE_AGE_S
    plugin_labels = idle_reclaim.one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    for pair in settings.idle_reclaim_plugin_selector.split(","):
        key, _, value = pair.partition("=")
        assert plugin_labels[key] == value

    def may(verb: str, resource: str, namespace: str = "ml") -> bool:
        return idle_reclaim.may(CONTROLLER_SA, verb, resource, namespace)

    assert may("list", "namespaces", "")
    assert may("list", "pods")
    assert may("patch", "pods/status")
    assert may("create", "pods/eviction")
    assert may("create", "events")
    assert may("get", CLAIMS)
    # Evictions only: no pod is deleted, changed or made by it.
    for verb in ("delete", "update", "patch", "create"):
        assert not may(verb, "pods")
    assert not may("update", "pods/status")
    assert not may("update", "namespaces", "")


def test_the_idle_policys_freshness_bound_follows_the_plugins_intervals(tmp_path: Path) -> None:
    """The bound is three times the longest a live plugin's report waits: a write per claim
    status interval of a sample per utilization interval (rounded up), plus a writer pass."""
    quick = {
        "kubeletPlugin": {"claimStatus": {"minInterval": 5}},
        "metrics": {"utilization": {"interval": 0.5}},
    }
    rendered = Rendered.of(merged({**HOST_DRIVER, **IDLE_VALUES}, quick), tmp_path)
    container = rendered.container("Deployment", "controller")
    settings = ControllerSettings.from_env(env_of(container, CONTROLLER_DOWNWARD))
    assert settings.idle_reclaim_max_sample_age_s == 3 * (5 + 1 + 2)
    plugin = plugin_settings(rendered)
    assert settings.idle_reclaim_max_sample_age_s >= 3 * (
        plugin.claim_status_min_interval_s + plugin.utilization_interval_s + 2
    )

    given = merged(IDLE_VALUES, {"controller": {"idleReclaim": {"maxSampleAge": "10m"}}})
    (tmp_path / "given").mkdir()
    container = Rendered.of({**HOST_DRIVER, **given}, tmp_path / "given").container(
        "Deployment", "controller"
    )
    assert (
        ControllerSettings.from_env(
            env_of(container, CONTROLLER_DOWNWARD)
        ).idle_reclaim_max_sample_age_s
        == 600
    )


def test_an_invalid_idle_duration_is_refused_at_install() -> None:
    refused = template(None, "gpuResourcesEnabledOverride=true",
                       "controller.idleReclaim.defaultWindow=two hours")  # fmt: skip

    assert refused.returncode != 0
    assert "defaultWindow" in refused.stderr


def labelled(mode: str | None) -> dict[str, Any]:
    labels = {} if mode is None else {"gpu.nvidia.com/idle-reclaim": mode}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml", "labels": labels}}


@pytest.mark.parametrize(
    ("mode", "dry_run", "allowed"),
    [
        ("enabled", False, True),
        ("enabled", True, True),
        ("dry-run", True, True),
        ("dry-run", False, False),
        ("disabled", False, False),
        (None, False, False),
    ],
)
def test_the_controller_evicts_only_in_namespaces_labelled_for_it(
    idle_reclaim: Rendered, mode: str | None, dry_run: bool, allowed: bool
) -> None:
    policy = bound_policy(idle_reclaim, IDLE_SCOPE)
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "nb"}}

    decision = policy.decide(
        user=CONTROLLER_USER, node=None, operation="CREATE", resource="pods",
        sub_resource="eviction", obj=eviction, namespace=labelled(mode), dry_run=dry_run,
    )  # fmt: skip

    assert policy.matches("", "pods/eviction", "CREATE")
    assert decision.allowed is allowed
    if not allowed:
        label = f"gpu.nvidia.com/idle-reclaim={mode}" if mode else "no gpu.nvidia.com/idle-reclaim"
        assert decision.message == (
            f"gpu-dra idle policy: namespace ml is labelled {label}: the controller may not "
            "evict its pods"
        )


@pytest.mark.parametrize(("mode", "allowed"), [("enabled", True), ("dry-run", True),
                                               ("Enabled", False), (None, False)])  # fmt: skip
def test_the_controller_writes_pod_status_only_in_labelled_namespaces(
    idle_reclaim: Rendered, mode: str | None, allowed: bool
) -> None:
    policy = bound_policy(idle_reclaim, IDLE_SCOPE)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "nb"}}

    decision = policy.decide(
        user=CONTROLLER_USER, node=None, operation="UPDATE", resource="pods",
        sub_resource="status", obj=pod, old=pod, namespace=labelled(mode),
    )  # fmt: skip

    assert policy.matches("", "pods/status", "UPDATE")
    assert decision.allowed is allowed
    if not allowed:
        assert decision.message.endswith("the controller may not write its pods' status")


def test_the_idle_scope_binds_no_one_but_the_controller(idle_reclaim: Rendered) -> None:
    policy = bound_policy(idle_reclaim, IDLE_SCOPE)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}}  # no labels

    for user in (PLUGIN_USER, "kubernetes-admin", "system:serviceaccount:ml:default"):
        decision = policy.decide(user=user, node=None, operation="CREATE", resource="pods",
                                 sub_resource="eviction", obj={}, namespace=namespace)  # fmt: skip
        assert decision == Decision(True, "not matched")
    denied = policy.decide(user=CONTROLLER_USER, node=None, operation="CREATE", resource="pods",
                           sub_resource="eviction", obj={}, namespace=namespace)  # fmt: skip
    assert not denied.allowed


def test_the_idle_scope_goes_with_the_admission_policies(tmp_path: Path) -> None:
    off = Rendered.of({**HOST_DRIVER, **IDLE_VALUES, "admissionPolicy": {"enabled": False}},
                      tmp_path)  # fmt: skip

    assert [p["metadata"]["name"] for p in off.all("ValidatingAdmissionPolicy")] == [
        TIER_QUOTA_POLICY
    ]
    assert off.may(CONTROLLER_SA, "create", "pods/eviction", "ml")


def test_model_classes_select_the_whole_gpus_of_their_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """deviceClasses.models: one whole-GPU class per product name, for quotas per model
    (docs/quotas.md); never a MIG device or a GPU offered as shares."""
    models = [
        {"name": "h100", "productName": "NVIDIA H100 80GB HBM3"},
        {"name": "a100", "productName": "NVIDIA A100 80GB PCIe"},
    ]
    rendered = Rendered.of({**HOST_DRIVER, "deviceClasses": {"models": models}}, tmp_path)
    data = rendered.one("ConfigMap", "gpu-dra-deviceclasses")["data"]
    (tmp_path / "catalog").mkdir()
    configmap_catalog(data, tmp_path / "catalog")

    capsys.readouterr()
    code = cli_main(["lint", "-o", "json", str(tmp_path / "catalog")], environ={})
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    selects = {c["name"]: c["selects"] for c in report["classes"]}
    h100, a100 = selects["h100.gpu.nvidia.com"], selects["a100.gpu.nvidia.com"]
    assert h100["hgx-h100"] == [f"gpu-{i}" for i in range(8)]
    assert h100["hgx-h100-mig"] == ["gpu-7"]  # the one GPU with MIG off
    assert "hgx-h100+mps-shares" not in h100  # offered as shares: share-only
    assert a100 == {"mixed": ["gpu-0", "gpu-1"]}
    assert "dgx-a100" not in a100  # an A100-SXM4-80GB is another product


@pytest.mark.parametrize(
    ("models", "complaint"),
    [
        ("deviceClasses.models[0].name=hopper", "/deviceClasses/models/0/name"),
        ("deviceClasses.models[0].name=H100", "/deviceClasses/models/0/name"),
        ("deviceClasses.models[0].productName=it's", "/deviceClasses/models/0/productName"),
        ("deviceClasses.models[1].name=h100", "already a class of the catalog or of another"),
    ],
)
def test_a_model_class_that_would_clash_or_break_its_selector_is_refused(
    models: str, complaint: str
) -> None:
    first = ("deviceClasses.models[0].name=h100", "deviceClasses.models[0].productName=H100")
    second = ("deviceClasses.models[1].productName=Other",) if "[1]" in models else ()
    result = template(None, "gpuResourcesEnabledOverride=true", *first, *second, models)

    assert result.returncode != 0
    assert complaint in result.stderr
