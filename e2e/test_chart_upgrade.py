"""Upgrading the chart-installed plugin without draining (issue 11, item 6): `helm upgrade` to a
new image tag while pods with a whole-GPU, a dynamic-MIG and an MPS-share claim run, and new
such pods start during the upgrade.

The node simulates four H100s (dynamic MIG: published as partitions) and an L4 offered as MPS
shares (a profile file in the plugin's data dir); the MPS daemons run as pods of the
nvidia-cuda-mps-control TEST DOUBLE's image, and the plugin container runs the double's client
(copied into the data dir). The new image is the same archive under a second tag, so the
DaemonSet rolls: the new plugin pod starts beside the old one (`maxSurge: 1`, its own sockets),
the old pod is deleted once the new one is Ready. Checked: the old pods keep running (never
restarted), the new pods run, the old plugin pod and its sockets are gone, the node's devices
are still published, and after all pods are deleted nothing is left: no checkpoint entry, CDI
spec, MIG instance or MPS daemon pod.

Uses `e2e.chart`'s image, values, helm and MPS double helpers; installs its own release in
the same namespace (modules run one after the other)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.dynamic.exceptions import DynamicApiError

from e2e import manifests as m
from e2e.chart import (
    CHART,
    NAMESPACE,
    PLUGIN_SELECTOR,
    RELEASE,
    chart_values,
    import_driver_image,
    install_mps_double,
    pods,
    ready,
    remove_mps_double,
    run_helm,
    wait_plugin_ready,
)
from e2e.cluster import Cluster, images
from e2e.driver import DRIVER, MPS_DAEMON_SELECTOR, Driver
from e2e.kube import Kube, wait_for
from e2e.mig import mig_instances, mig_modes, mig_request
from e2e.workloads import claim_uid, delete_pods, wait_running
from gpu_dra.kubelet_plugin.plugin_sockets import socket_paths

pytestmark = pytest.mark.e2e

PROFILE_FILE = "e2e-upgrade-node.yaml"
PROFILE = {
    "name": "e2e-upgrade",
    "description": "4x H100 (dynamic MIG partitions) and an L4 (MPS shares)",
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "gpus": [
        {"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0"},
        {"model": "H100-SXM5-80GB", "busId": "00000000:43:00.0"},
        {"model": "H100-SXM5-80GB", "busId": "00000000:52:00.0"},
        {"model": "H100-SXM5-80GB", "busId": "00000000:61:00.0"},
        {"model": "L4", "busId": "00000000:D1:00.0"},
    ],
}
"""The simulated node: dynamic MIG partitions the H100s; `--mps-shares=all` offers the GPUs it
does not partition, the L4."""
HOPPER = "device.attributes['gpu.nvidia.com'].architecture == 'Hopper'"
MPS_CLASS = "mps.gpu.nvidia.com"
UPGRADE_TAG_SUFFIX = "-upgraded"


def upgrade_values(
    cluster: Cluster, image: str, profile: Path, mps_control: Path, mps_image: str
) -> dict[str, Any]:
    """The e2e node's chart values (`chart_values`) with the profile file, dynamic MIG, the L4
    offered as MPS shares, and the MPS double as control program and daemon image."""
    values = chart_values(cluster, image)
    plugin = values["kubeletPlugin"]
    plugin["simulate"] = str(profile)
    plugin["mpsDaemonImage"] = mps_image
    plugin["containers"]["gpus"]["env"] = [
        *plugin["containers"]["gpus"]["env"],
        {"name": "GPU_DRA_MPS_SHARES", "value": "all"},
        {"name": "GPU_DRA_MPS_CONTROL_BINARY", "value": str(mps_control)},
        # One daemon pod per share GPU in use, gone with its last share (counted below).
        {"name": "GPU_DRA_MPS_SHARE_DAEMON_WARM", "value": "off"},
    ]
    values["featureGates"] = {"DynamicMIG": True}
    return values


@dataclass
class Release:
    image: str
    """The installed image's reference."""
    upgraded: str
    """The same image under a second tag, to upgrade to."""
    driver: Driver
    """Helpers over the node's plugin files (its data dir, CDI specs, simulated MIG state)."""


@pytest.fixture(scope="module")
def release(
    cluster: Cluster, kube: Kube, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    image = import_driver_image(cluster)
    ctr, socket = cluster.bin_dir / "ctr", cluster.paths.containerd_socket
    upgraded = image.reference + UPGRADE_TAG_SUFFIX
    images.tag_image(ctr, socket, image.reference, upgraded)
    driver = Driver(cluster, kube, PROFILE["name"])
    driver.link_data_dir()
    driver.forget_simulated_mig()
    profile = driver.state_dir / PROFILE_FILE
    profile.write_text(yaml.safe_dump(PROFILE))
    mps_control = install_mps_double(driver.state_dir)
    values = upgrade_values(
        cluster, image.reference, profile, mps_control, driver.ensure_mps_daemon_image()
    )
    path = tmp_path_factory.mktemp("chart-upgrade") / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    run_helm(
        cluster, "install", RELEASE, str(CHART), f"--namespace={NAMESPACE}", "--create-namespace",
        f"--values={path}",
    )  # fmt: skip
    try:
        yield Release(image.reference, upgraded, driver)
    finally:
        run_helm(cluster, "uninstall", RELEASE, f"--namespace={NAMESPACE}", "--wait")
        wait_for("the plugin's pods to be gone", lambda: not pods(kube, PLUGIN_SELECTOR), 120)
        for left in mps_daemon_pods(kube):
            kube.delete("v1", "Pod", left, NAMESPACE)
        kube.delete("v1", "Namespace", NAMESPACE)
        kube.wait_gone("v1", "Namespace", NAMESPACE, None, timeout=180)
        driver.forget_simulated_mig()
        profile.unlink(missing_ok=True)
        remove_mps_double(driver.state_dir)


def mps_daemon_pods(kube: Kube) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in kube.list("v1", "Pod", namespace=NAMESPACE, label_selector=MPS_DAEMON_SELECTOR)
    ]


def create(kube: Kube, manifest: dict[str, Any]) -> None:
    """Create `manifest`, retrying while the apiserver cannot call the admission webhook (the
    controller's Deployment rolls to the new image too); one that exists already counts."""

    def created() -> bool:
        try:
            kube.create(manifest)
        except DynamicApiError as error:
            if error.status == 409:
                return True
            if "failed calling webhook" in str(error.body):
                return False
            raise
        return True

    wait_for(f"{manifest['kind']} {manifest['metadata']['name']} to be created", created, 120, 2)


def workload_claims(namespace: str, suffix: str) -> list[dict[str, Any]]:
    """A whole H100, a 1g.10gb MIG partition and an MPS share of the L4 (4Gi, 20 %)."""
    share = m.request("share", device_class=MPS_CLASS)
    share["exactly"]["capacity"] = {"requests": {"memory": "4Gi", "compute": "20"}}
    return [
        m.claim(f"whole{suffix}", namespace, m.claim_spec([m.request(selectors=[HOPPER])])),
        m.claim(f"mig{suffix}", namespace, m.claim_spec([mig_request("gpu", "1g.10gb")])),
        m.claim(f"share{suffix}", namespace, m.claim_spec([share])),
    ]


def start_workloads(kube: Kube, namespace: str, suffix: str) -> list[str]:
    """The three claims and a pod for each (named after its claim); the pod names."""
    names = []
    for claim in workload_claims(namespace, suffix):
        name = claim["metadata"]["name"]
        command = m.SHOW_MPS if name.startswith("share") else m.SHOW_GPUS
        create(kube, claim)
        create(kube, m.gpu_pod(name, namespace, claim=name, command=command))
        names.append(name)
    return names


def container_started(kube: Kube, name: str, namespace: str) -> tuple[str, int]:
    """When the pod's container started, and its restart count."""
    (status,) = kube.get("v1", "Pod", name, namespace)["status"]["containerStatuses"]
    return str(status["state"]["running"]["startedAt"]), int(status["restartCount"])


def mig_count(driver: Driver) -> int:
    """GPU instances the simulated GPUs hold."""
    return sum(len(instances) for instances in mig_instances(driver).values())


def plugin_pod(kube: Kube) -> dict[str, Any]:
    (pod,) = [p for p in pods(kube, PLUGIN_SELECTOR) if "deletionTimestamp" not in p["metadata"]]
    return pod


def sockets_of(cluster: Cluster, pod: dict[str, Any]) -> tuple[Path, Path]:
    """The DRA and registration sockets the plugin pod serves (named by its UID)."""
    paths = cluster.paths
    return socket_paths(DRIVER, paths.plugins_dir, paths.plugins_registry, pod["metadata"]["uid"])


def test_a_helm_upgrade_keeps_running_pods_and_starts_new_ones_and_leaves_nothing(
    release: Release, kube: Kube, cluster: Cluster, namespace: str
) -> None:
    driver = release.driver
    wait_plugin_ready(kube, cluster)
    wait_for("the node's devices to be published", lambda: bool(driver.devices()), 120)
    published = set(driver.devices())
    assert any("-mig-" in name for name in published)  # the H100s' partitions
    old_plugin = plugin_pod(kube)
    old_sockets = sockets_of(cluster, old_plugin)
    assert all(path.exists() for path in old_sockets), old_sockets

    old_pods = start_workloads(kube, namespace, "")
    for name in old_pods:
        wait_running(kube, name, namespace, timeout=180)
    started = {name: container_started(kube, name, namespace) for name in old_pods}
    uids = {name: claim_uid(kube, name, namespace) for name in old_pods}
    assert mig_count(driver) == 1
    assert len(mps_daemon_pods(kube)) == 1

    repository, tag = release.upgraded.rsplit(":", 1)
    run_helm(
        cluster, "upgrade", RELEASE, str(CHART), f"--namespace={NAMESPACE}", "--reuse-values",
        f"--set=image.repository={repository}", f"--set=image.tag={tag}",
    )  # fmt: skip
    # The new plugin pod starts beside the old one (maxSurge 1): new pods start meanwhile.
    wait_for(
        "the new plugin pod to start beside the old one",
        lambda: len(pods(kube, PLUGIN_SELECTOR)) == 2,
        120,
        interval=0.2,
    )
    new_pods = start_workloads(kube, namespace, "-during")

    kube.wait_gone("v1", "Pod", old_plugin["metadata"]["name"], NAMESPACE, timeout=300)
    wait_plugin_ready(kube, cluster)
    new_plugin = plugin_pod(kube)
    assert new_plugin["spec"]["containers"][0]["image"] == release.upgraded
    assert ready(new_plugin)
    for name in new_pods:
        wait_running(kube, name, namespace, timeout=180)
    uids.update({name: claim_uid(kube, name, namespace) for name in new_pods})

    # The old pods ran on through the upgrade; the old plugin took only its own sockets along.
    for name in old_pods:
        assert container_started(kube, name, namespace) == started[name], name
    assert not any(path.exists() for path in old_sockets), old_sockets
    assert all(path.exists() for path in sockets_of(cluster, new_plugin))
    wait_for("the node's devices to be published", lambda: set(driver.devices()) == published, 60)
    assert set(uids.values()) <= driver.checkpoint_claims()
    assert set(uids.values()) <= driver.cdi_spec_claims()
    assert mig_count(driver) == 2
    assert len(mps_daemon_pods(kube)) == 1  # both shares of the L4 on its one daemon

    delete_pods(kube, namespace, [*old_pods, *new_pods])
    for name in old_pods + new_pods:
        kube.delete("resource.k8s.io/v1", "ResourceClaim", name, namespace)
    wait_for(
        "every claim to be unprepared",
        lambda: not set(uids.values()) & driver.checkpoint_claims(),
        120,
    )
    assert driver.checkpoint_claims() == set()
    assert driver.cdi_spec_claims() == set()
    assert mig_instances(driver) == {}
    assert all(mode == [0, 0] for mode in mig_modes(driver).values()), mig_modes(driver)
    wait_for("the MPS daemon pod to be gone", lambda: not mps_daemon_pods(kube), 60)
    assert not driver.mps_dir.exists() or not any(driver.mps_dir.iterdir())
