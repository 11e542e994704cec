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
import os
import ssl
import subprocess
import sys
import tarfile
import time
from pathlib import Path, PurePosixPath
from typing import Any

import aiohttp
import pytest
import yaml

from gpu_dra.controller.admission import KINDS as ADMITTED_KINDS
from gpu_dra.controller.admission import VERSIONS as ADMITTED_VERSIONS
from gpu_dra.controller.catalog import load_catalog
from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.controller.webhook import PATH as WEBHOOK_PATH
from gpu_dra.controller.webhook import ReloadingCertificate, WebhookServer
from gpu_dra.driver.mig_policy import DEFAULT as DEFAULT_MIG_POLICY
from gpu_dra.driver.mig_policy import parse_policy
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from tests.helmchart import (
    CHART,
    NAMESPACE,
    REPO,
    AdmissionPolicy,
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
        ("webhook.containerPort=443", "'/webhook/containerPort'"),
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
    # No GPU or MIG device is offered as shares unless a value says so.
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
    assert container["resources"] == {"requests": {"cpu": "100m"}}


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

    # One source of truth: the chart links the repository's catalog.
    assert (CHART / "deviceclasses").is_symlink()
    assert (CHART / "deviceclasses").resolve() == REPO / "deviceclasses"
    assert sorted(data) == [path.name for path in files]
    for path in files:
        assert data[path.name] == path.read_text().rstrip("\n")
    # What the controller loads from the mounted ConfigMap is the whole catalog.
    for name, text in data.items():
        (tmp_path / name).write_text(text)
    loaded = {c["metadata"]["name"] for c in load_catalog(tmp_path)}
    assert loaded == {c["metadata"]["name"] for c in load_catalog(REPO / "deviceclasses")}
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


@pytest.fixture(scope="module")
def policy(host_driver: Rendered) -> AdmissionPolicy:
    (vap,) = host_driver.all("ValidatingAdmissionPolicy")
    (binding,) = host_driver.all("ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert vap["spec"]["failurePolicy"] == "Fail"
    return AdmissionPolicy(vap)


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


def test_the_policy_can_be_left_out(tmp_path: Path) -> None:
    rendered = Rendered.of({**HOST_DRIVER, "admissionPolicy": {"enabled": False}}, tmp_path)

    assert rendered.all("ValidatingAdmissionPolicy") == []
    assert rendered.all("ValidatingAdmissionPolicyBinding") == []


# ---- admission webhook: the controller judges the driver's opaque configs ---------------------
WEBHOOK = "gpu-dra-webhook"
WEBHOOK_DNS_NAME = f"{WEBHOOK}.{NAMESPACE}.svc"
CONTROLLER_USER = f"system:serviceaccount:{NAMESPACE}:{CONTROLLER_SA}"
CLAIM_CONTROLLER_USER = "system:serviceaccount:kube-system:resource-claim-controller"


def webhooks(rendered: Rendered) -> dict[str, dict[str, Any]]:
    (config,) = rendered.all("ValidatingWebhookConfiguration")
    return {hook["name"]: hook for hook in config["webhooks"]}


def test_the_webhook_is_the_controllers_port_behind_its_service(host_driver: Rendered) -> None:
    service = host_driver.one("Service", WEBHOOK)
    labels = host_driver.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    container = host_driver.container("Deployment", "controller")
    (port,) = service["spec"]["ports"]

    assert service["spec"]["selector"].items() <= labels.items()
    assert port["targetPort"] == "webhook"
    assert "webhook" in {p["name"] for p in container["ports"]}
    assert port["port"] == 443
    for hook in webhooks(host_driver).values():
        assert hook["clientConfig"]["service"] == {
            "namespace": NAMESPACE,
            "name": WEBHOOK,
            "port": 443,
            "path": WEBHOOK_PATH,
        }


def test_the_webhook_judges_every_validated_kind_and_version_fail_closed(
    host_driver: Rendered,
) -> None:
    hooks = webhooks(host_driver)

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
    mine = with_configs(kind, version, [gpu_entry("nic.example.com"), gpu_entry()])
    assert sent_to(mine) == [f"{plural}.gpu.nvidia.com"]
    assert sent_to(with_configs(kind, version, [gpu_entry("nic.example.com")])) == []
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
