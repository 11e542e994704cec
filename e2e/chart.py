"""The shipped install path on the e2e cluster, shared by the chart e2e tests and the demo.

The driver image built from the Dockerfile without a Docker engine (`e2e.cluster.driverimage`,
cached by ``e2e.cluster build``) and imported into the node's containerd (`import_driver_image`);
the Helm chart (deployments/helm/gpu-dra) installed with the pinned ``helm`` (`run_helm`) with
the values the e2e node needs (`chart_values`): the kubelet plugin runs as the chart's DaemonSet
pod, the controller as its Deployment. `install_mps_double` puts the nvidia-cuda-mps-control TEST
DOUBLE where the plugin container sees it. See docs/deployment.md and docs/e2e-cluster.md.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import yaml

from e2e import helm
from e2e.cluster import Cluster, driverimage, images, netns, versions
from e2e.cluster.paths import REPO_ROOT
from e2e.driver import DATA_DIR_LINK, MPS_DAEMON_SELECTOR, Driver, pool_reconciles
from e2e.kube import Kube, wait_for

CHART: Final = REPO_ROOT / "deployments" / "helm" / "gpu-dra"
RELEASE: Final = "gpu-dra"
"""The chart tests' release (one module at a time installs it)."""
NAMESPACE: Final = "gpu-dra-chart"
"""The chart tests' namespace."""
PROFILE: Final = "hgx-h100"
"""The simulated machine of the chart tests' node."""
PLUGIN_SELECTOR: Final = "app.kubernetes.io/component=kubelet-plugin"
CONTROLLER_SELECTOR: Final = "app.kubernetes.io/component=controller"
MPS_DOUBLE_DIR: Final = "e2e-mps-double"


class HelmError(RuntimeError):
    """A ``helm`` command failed; the message has its arguments and stderr."""


def chart_values(cluster: Cluster, image: str, profile: str = PROFILE) -> dict[str, Any]:
    """What the e2e node needs beyond the defaults: the local image, the cluster's kubelet
    directories, a short data dir for MPS sockets, simulated GPUs (`profile`: a profile name, or
    a file the plugin container sees), and the apiserver's node address (the e2e cluster has no
    kube-proxy for the service IP)."""
    repository, tag = image.rsplit(":", 1)
    paths = cluster.paths
    apiserver = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": versions.NODE_IP},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(versions.APISERVER_PORT)},
    ]
    return {
        "gpuResourcesEnabledOverride": True,
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "kubeletPlugin": {
            "kubeletPluginsDirectoryPath": str(paths.plugins_dir),
            "kubeletRegistrarDirectoryPath": str(paths.plugins_registry),
            "dataDir": str(paths.state / DATA_DIR_LINK),
            "simulate": profile,
            "affinity": None,
            "containers": {"gpus": {"env": apiserver}},
        },
        "controller": {"containers": {"controller": {"env": apiserver}}},
    }


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in, key by key (as Helm merges values files)."""
    result = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def driver_image(cluster: Cluster) -> driverimage.DriverImage:
    """The driver image of this tree: cached by `e2e.cluster build` (setup-host); else built
    now, from the host's network namespace (the image build reaches Debian's and PyPI's
    mirrors, which the e2e namespace cannot)."""
    if not driverimage.archive_path(cluster.paths, driverimage.inputs_digest()).is_file():
        command, fds = netns.outside_command([sys.executable, "-m", "e2e.cluster.driverimage"])
        subprocess.run(command, pass_fds=fds, check=True, timeout=600, cwd=REPO_ROOT)
    return driverimage.build(cluster.paths)


def import_driver_image(cluster: Cluster) -> driverimage.DriverImage:
    """`driver_image`, imported into the node's containerd unless it has it already."""
    image = driver_image(cluster)
    ctr, socket = cluster.bin_dir / "ctr", cluster.paths.containerd_socket
    if not images.image_present(ctr, socket, image.reference):
        images.import_images(ctr, socket, [image.archive])
    return image


def run_helm(cluster: Cluster, *args: str) -> str:
    """``helm <args>`` against the cluster; its stdout, or `HelmError` with its stderr."""
    done = subprocess.run(
        [str(helm.binary(cluster.paths)), f"--kubeconfig={cluster.kubeconfig}", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise HelmError(f"helm {' '.join(args)}: {done.stderr}")
    return done.stdout


def rendered_classes(cluster: Cluster, *sets: str) -> dict[str, Any]:
    """{name: DeviceClass} of the catalog the chart renders with `sets` (``--set`` values)."""
    rendered = run_helm(
        cluster, "template", RELEASE, str(CHART), "--set=gpuResourcesEnabledOverride=true",
        *(f"--set={value}" for value in sets),
    )  # fmt: skip
    (configmap,) = [
        doc
        for doc in yaml.safe_load_all(rendered)
        if doc and doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-deviceclasses")
    ]
    classes = (yaml.safe_load(text) for text in configmap["data"].values())
    return {c["metadata"]["name"]: c for c in classes}


@contextmanager
def chart_class(cluster: Cluster, kube: Kube, name: str, *sets: str) -> Iterator[dict[str, Any]]:
    """DeviceClass `name` as the chart renders it with `sets`, created for the block (the e2e
    controller applies the repository's catalog, which has no generated classes; one that an
    earlier chart install left in the cluster is replaced)."""
    device_class = rendered_classes(cluster, *sets)[name]
    kube.delete("resource.k8s.io/v1", "DeviceClass", name)
    kube.wait_gone("resource.k8s.io/v1", "DeviceClass", name, None)
    kube.create(device_class)
    try:
        yield device_class
    finally:
        kube.delete("resource.k8s.io/v1", "DeviceClass", name)
        kube.wait_gone("resource.k8s.io/v1", "DeviceClass", name, None)


@contextmanager
def chart_installed(
    cluster: Cluster, kube: Kube, values: dict[str, Any], directory: Path
) -> Iterator[Path]:
    """The chart installed as release `RELEASE` in `NAMESPACE` with `values` (written to
    ``<directory>/values.yaml``, which it yields) for the block, the node's short data dir linked
    first (the link must exist before the chart's hostPath volume, DirectoryOrCreate, would make
    a directory in its place); then `uninstall_release`."""
    path = directory / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    Driver(cluster, kube, PROFILE).link_data_dir()
    run_helm(
        cluster, "install", RELEASE, str(CHART), f"--namespace={NAMESPACE}", "--create-namespace",
        f"--values={path}",
    )  # fmt: skip
    try:
        yield path
    finally:
        uninstall_release(cluster, kube)


def uninstall_release(cluster: Cluster, kube: Kube) -> None:
    """``helm uninstall --wait`` of `RELEASE`, then wait until the chart's pods are gone and
    delete `NAMESPACE`."""
    run_helm(cluster, "uninstall", RELEASE, f"--namespace={NAMESPACE}", "--wait")
    wait_for(
        "the chart's pods to be gone",
        lambda: not pods(kube, PLUGIN_SELECTOR) and not pods(kube, CONTROLLER_SELECTOR),
        120,
    )
    kube.delete("v1", "Namespace", NAMESPACE)
    kube.wait_gone("v1", "Namespace", NAMESPACE, None, timeout=180)


def service_account_client(
    cluster: Cluster, account: str, directory: Path, *, bound_pod: str | None = None
) -> Kube:
    """A client with a token of ServiceAccount `account` of `NAMESPACE` (its kubeconfig in
    `directory`): the identity of the chart's controller or plugin. `bound_pod`: the token is
    bound to that pod of the namespace, so the apiserver puts the pod's node into it, as for the
    running plugin."""
    bound = [] if bound_pod is None else ["--bound-object-kind=Pod",
                                          f"--bound-object-name={bound_pod}"]  # fmt: skip
    token = cluster.kubectl("create", "token", account, "-n", NAMESPACE, *bound).strip()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {
            "server": f"https://{versions.NODE_IP}:{versions.APISERVER_PORT}",
            "certificate-authority": str(cluster.paths.pki / "ca.crt"),
        }}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": account}}],
        "current-context": "e2e",
    }  # fmt: skip
    path = directory / f"{account}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return Kube(path)


def release_installed(cluster: Cluster, release: str, namespace: str) -> bool:
    """Whether `release` is installed in `namespace` (in any state: helm 4 lists them all)."""
    listed = run_helm(cluster, "list", f"--namespace={namespace}", "--short")
    return release in listed.split()


def pods(kube: Kube, selector: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    return kube.list("v1", "Pod", namespace=namespace, label_selector=selector)


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def wait_plugin_ready(kube: Kube, cluster: Cluster, namespace: str = NAMESPACE) -> None:
    """Wait until the node has exactly one plugin pod, it is ready (a rolling update with
    maxSurge 1 runs two for a while) and it reconciled the node's pool (`pool_reconciles`); on
    time-out of the first two, fail with the containers' last log lines."""

    def settled() -> bool:
        (daemonset,) = kube.list("apps/v1", "DaemonSet", namespace=namespace,
                                 label_selector=PLUGIN_SELECTOR)  # fmt: skip
        status = daemonset.get("status") or {}
        rolled_out = (
            status.get("observedGeneration") == daemonset["metadata"]["generation"]
            and status.get("updatedNumberScheduled") == status.get("desiredNumberScheduled") == 1
            and status.get("numberAvailable") == 1
        )
        current = pods(kube, PLUGIN_SELECTOR, namespace)
        return rolled_out and len(current) == 1 and ready(current[0])

    try:
        wait_for("the kubelet plugin pod to be ready, alone", settled, 180)
    except TimeoutError as error:
        logs = "".join(
            cluster.kubectl("logs", "-n", namespace, p["metadata"]["name"], "-c", "gpus",
                            "--tail=30", *extra, check=False)
            for p in pods(kube, PLUGIN_SELECTOR, namespace)
            for extra in ((), ("--previous",))
        )  # fmt: skip
        raise AssertionError(f"{error}; plugin log:\n{logs}") from error
    # Slices of an earlier plugin (same names, other flags) stay until this one reconciled.
    url = plugin_metrics_url(kube, namespace)
    wait_for("the plugin pod to reconcile its pool", lambda: pool_reconciles(url) >= 1, 60)


def plugin_metrics_url(kube: Kube, namespace: str = NAMESPACE) -> str:
    """The /metrics URL of the node's plugin pod (its pod IP, its port named ``metrics``), which
    the e2e network namespace reaches directly; one pod must run (`wait_plugin_ready`)."""
    (pod,) = [
        p
        for p in pods(kube, PLUGIN_SELECTOR, namespace)
        if "deletionTimestamp" not in p["metadata"]
    ]
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "gpus"]
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "metrics"]
    return f"http://{pod['status']['podIP']}:{port}/metrics"


def install_mps_double(state_dir: Path) -> Path:
    """The nvidia-cuda-mps-control TEST DOUBLE (standard library only) copied into the data dir,
    which the plugin container sees at the same path: the control client the plugin runs (with
    the image's python3). Returns the program's path."""
    root = state_dir / MPS_DOUBLE_DIR
    (root / "bin").mkdir(parents=True, exist_ok=True)
    doubles = REPO_ROOT / "tests" / "doubles"
    for name in ("nvidia_cuda_mps_control.py", "mps_double_daemon.py"):
        shutil.copy2(doubles / name, root / name)
    binary = root / "bin" / "nvidia-cuda-mps-control"
    shutil.copy2(doubles / "bin" / "nvidia-cuda-mps-control", binary)
    return binary


def remove_mps_double(state_dir: Path) -> None:
    shutil.rmtree(state_dir / MPS_DOUBLE_DIR, ignore_errors=True)


@contextmanager
def share_node(
    cluster: Cluster,
    kube: Kube,
    directory: Path,
    *,
    mps_shares: str,
    profile: dict[str, Any] | None = None,
) -> Iterator[Driver]:
    """The chart on a simulated node whose GPUs `mps_shares` (``GPU_DRA_MPS_SHARES``: indexes)
    are offered as MPS shares, their daemons run from the nvidia-cuda-mps-control TEST DOUBLE
    (`install_mps_double`, not kept warm); `profile` a machine profile (written to the data dir,
    which the plugin container sees), or None for `PROFILE`. Yields the node's `Driver` once the
    plugin and the controller are ready; afterwards the release, its MPS daemon pods, the
    profile file, the simulated MIG state and the double are gone."""
    image = import_driver_image(cluster)
    driver = Driver(cluster, kube, PROFILE if profile is None else str(profile["name"]))
    driver.link_data_dir()
    driver.forget_simulated_mig()
    path = None if profile is None else driver.state_dir / f"e2e-{profile['name']}-node.yaml"
    if path is not None:
        path.write_text(yaml.safe_dump(profile))
    mps_control = install_mps_double(driver.state_dir)
    values = chart_values(cluster, image.reference, PROFILE if path is None else str(path))
    plugin = values["kubeletPlugin"]
    plugin["mpsDaemonImage"] = driver.ensure_mps_daemon_image()
    plugin["containers"]["gpus"]["env"] += [
        {"name": "GPU_DRA_MPS_SHARES", "value": mps_shares},
        {"name": "GPU_DRA_MPS_CONTROL_BINARY", "value": str(mps_control)},
        {"name": "GPU_DRA_MPS_SHARE_DAEMON_WARM", "value": "off"},
    ]
    try:
        with chart_installed(cluster, kube, values, directory):
            wait_plugin_ready(kube, cluster)
            wait_for("the controller pod to be ready",
                     lambda: any(map(ready, pods(kube, CONTROLLER_SELECTOR))), 120)  # fmt: skip
            try:
                yield driver
            finally:
                for left in pods(kube, MPS_DAEMON_SELECTOR):
                    kube.delete("v1", "Pod", left["metadata"]["name"], NAMESPACE)
    finally:
        driver.forget_simulated_mig()
        if path is not None:
            path.unlink(missing_ok=True)
        remove_mps_double(driver.state_dir)
