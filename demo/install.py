"""How the demo installs gpu-dra: the shipped way, with `e2e.chart`'s helpers (as the chart e2e
tests do). The driver image built from the Dockerfile with buildah (cached by e2e/setup-host) is
imported into the node's containerd, and the Helm chart is installed as release `RELEASE` in
namespace `NAMESPACE`: the kubelet plugin runs as the chart's DaemonSet pod, the controller as
its Deployment (which applies the DeviceClass catalog and serves the admission webhook). Each
stage is a ``helm upgrade --install`` with the stage's values (`stage_values`); the simulated
node's profile (demo/node.yaml) and the nvidia-cuda-mps-control TEST DOUBLE are copied into the
plugin's data dir, which the plugin container sees. `demo/run --real` keeps a host process.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from demo.stages import PROFILE, STAGES, Stage, namespace_of, published_devices
from e2e.chart import (
    CHART,
    CONTROLLER_SELECTOR,
    PLUGIN_SELECTOR,
    chart_values,
    import_driver_image,
    install_mps_double,
    merged,
    plugin_metrics_url,
    pods,
    ready,
    release_installed,
    remove_mps_double,
    run_helm,
    wait_plugin_ready,
)
from e2e.cluster import Cluster, ClusterError
from e2e.cluster.paths import REPO_ROOT
from e2e.driver import DRIVER, MPS_DAEMON_NAMESPACE, Driver
from e2e.kube import Kube, wait_for
from gpu_dra.kubelet_plugin.utilization.simulated_file import SIMULATED_UTILIZATION_FILE

RELEASE: Final = "gpu-dra"
NAMESPACE: Final = MPS_DAEMON_NAMESPACE
"""The release namespace, where the plugin also creates its MPS daemon pods (the namespace the
e2e `Driver` helpers read them from)."""
PROFILE_FILE: Final = "demo-node.yaml"
"""demo/node.yaml as the plugin container sees it: a copy in its data dir."""
UTILIZATION_INTERVAL_S: Final = 1
"""The plugin samples utilization every second (the chart's default is 10 s)."""
IDLE_RECLAIM: Final = {
    "controller": {"idleReclaim": {"enabled": True, "interval": 5}},
    "kubeletPlugin": {"claimStatus": {"minInterval": 5, "idleAfter": 10}},
}
"""A stage with `Stage.idle_reclaim`: the controller's idle policy on, a pass every 5 s (the
chart's default: off, 30 s); each claim's status written at most every 5 s and Active=False
after 10 s without activity (30 s, 300 s). The namespace's window and grace are its own
annotations (demo/examples/10-idle-notebook)."""
VALUES_FILE: Final = "demo-values.yaml"


def plugin_env(flags: tuple[str, ...]) -> list[dict[str, str]]:
    """Plugin flags as the environment variables that are their twins (``--mps-shares=4`` is
    ``GPU_DRA_MPS_SHARES=4``; a bare ``--flag`` is ``true``), for the chart's
    ``kubeletPlugin.containers.gpus.env``."""
    env = []
    for flag in flags:
        if not flag.startswith("--"):
            raise ValueError(f"not a plugin flag: {flag!r}")
        name, _, value = flag.removeprefix("--").partition("=")
        env.append({"name": "GPU_DRA_" + name.upper().replace("-", "_"), "value": value or "true"})
    return env


def stage_values(
    cluster: Cluster, image: str, stage: Stage, *, profile: str, mps_control: Path, mps_image: str
) -> dict[str, Any]:
    """The chart values of a stage: the e2e node's (`chart_values`) on the demo's profile, the
    MPS double as control program and daemon image, dynamic MIG as NVIDIA's feature gate, the
    stage's other flags as the plugin's environment, utilization sampled every second; and for
    an idle-reclaim stage `IDLE_RECLAIM`."""
    values = chart_values(cluster, image, profile)
    plugin = values["kubeletPlugin"]
    plugin["mpsDaemonImage"] = mps_image
    gpus = plugin["containers"]["gpus"]
    gpus["env"] = [
        *gpus["env"],
        {"name": "GPU_DRA_MPS_CONTROL_BINARY", "value": str(mps_control)},
        *plugin_env(stage.plugin_args),
    ]
    if stage.dynamic_mig:
        values["featureGates"] = {"DynamicMIG": True}
    values["metrics"] = {"utilization": {"interval": UTILIZATION_INTERVAL_S}}
    return merged(values, IDLE_RECLAIM) if stage.idle_reclaim else values


def catalog_classes() -> set[str]:
    """The DeviceClass names of the catalog (deviceclasses/) the chart's controller applies."""
    return {
        str(document["metadata"]["name"])
        for path in (REPO_ROOT / "deviceclasses").glob("*.yaml")
        for document in yaml.safe_load_all(path.read_text())
        if document
    }


@dataclass
class DemoRelease:
    """The demo's chart release on the e2e node, and a `Driver` over its plugin's files."""

    cluster: Cluster
    kube: Kube
    driver: Driver
    image: str
    """The driver image's reference (``localhost/gpu-dra:<digest of its inputs>``)."""
    mps_control: Path

    @classmethod
    def prepare(cls, cluster: Cluster, kube: Kube) -> DemoRelease:
        """Import the driver image and the MPS double's image into containerd, copy the demo
        profile and the MPS double into the data dir; installs nothing yet."""
        image = import_driver_image(cluster)
        driver = demo_driver(cluster, kube)
        driver.link_data_dir()  # before the chart's hostPath volume could make a directory
        shutil.copyfile(PROFILE, driver.profile)
        # Every simulated GPU idle until the utilization step says otherwise.
        (driver.state_dir / SIMULATED_UTILIZATION_FILE).unlink(missing_ok=True)
        mps_control = install_mps_double(driver.state_dir)
        driver.mps_daemon_image = driver.ensure_mps_daemon_image()
        return cls(cluster, kube, driver, image.reference, mps_control)

    def installed(self) -> bool:
        return release_installed(self.cluster, RELEASE, NAMESPACE)

    def values(self, stage: Stage) -> dict[str, Any]:
        return stage_values(
            self.cluster,
            self.image,
            stage,
            profile=self.driver.profile,
            mps_control=self.mps_control,
            mps_image=self.driver.mps_daemon_image,
        )

    def ensure(self, stage: Stage) -> None:
        """``helm upgrade --install`` with the stage's values (a changed plugin configuration
        rolls the DaemonSet: the new pod starts beside the old one); returns once one plugin pod
        is ready, the controller is ready and has applied the catalog, and the node's
        ResourceSlices show what the plugin publishes with the stage's flags."""
        path = self.cluster.paths.state / VALUES_FILE
        path.write_text(yaml.safe_dump(self.values(stage)))
        run_helm(
            self.cluster, "upgrade", "--install", RELEASE, str(CHART),
            f"--namespace={NAMESPACE}", "--create-namespace", f"--values={path}",
        )  # fmt: skip
        wait_plugin_ready(self.kube, self.cluster, NAMESPACE)
        wait_for(
            "the controller pod to be ready",
            lambda: any(map(ready, pods(self.kube, CONTROLLER_SELECTOR, NAMESPACE))),
            180,
        )
        classes = catalog_classes()
        wait_for(
            "the controller to apply the DeviceClass catalog",
            lambda: (
                classes
                <= {
                    c["metadata"]["name"]
                    for c in self.kube.list("resource.k8s.io/v1", "DeviceClass")
                }
            ),
            120,
        )
        driver = self.driver
        driver.dynamic_mig = stage.dynamic_mig
        driver.plugin_args = stage.plugin_args
        driver.metrics_url = plugin_metrics_url(self.kube, NAMESPACE)
        published = published_devices(stage)
        expected = {d["name"] for d in published}
        shared = {d["name"] for d in published if d.get("allowMultipleAllocations")}

        def shows_stage() -> bool:
            devices = driver.devices()
            offered = {n for n, d in devices.items() if d.get("allowMultipleAllocations")}
            return set(devices) == expected and offered == shared

        wait_for(f"the node's ResourceSlices to show stage {stage.title!r}", shows_stage, 120)

    def plugin_pod(self) -> dict[str, Any]:
        (pod,) = pods(self.kube, PLUGIN_SELECTOR, NAMESPACE)
        return pod


def demo_driver(cluster: Cluster, kube: Kube) -> Driver:
    """A `Driver` over the files of the demo release's plugin (its profile is the copy in the
    data dir, the ``--simulate`` it runs with)."""
    return Driver(cluster, kube, str(cluster.paths.plugins_dir / DRIVER / PROFILE_FILE))


def remove_release(driver: Driver) -> None:
    """Delete the demo's examples while the plugin still runs (it unprepares their claims),
    uninstall the release, delete the MPS daemon pods it left, and remove what the demo put in
    the data dir: the copied profile and MPS double, the simulated utilization and MIG state."""
    cluster, kube = driver.cluster, driver.kube
    delete_examples(driver)
    if release_installed(cluster, RELEASE, NAMESPACE):
        run_helm(cluster, "uninstall", RELEASE, f"--namespace={NAMESPACE}", "--wait")
        wait_for(
            "the chart's pods to be gone",
            lambda: (
                not pods(kube, PLUGIN_SELECTOR, NAMESPACE)
                and not pods(kube, CONTROLLER_SELECTOR, NAMESPACE)
            ),
            120,
        )
    driver.remove_mps_daemons()  # warm daemons outlive the plugin by design
    remove_mps_double(driver.state_dir)
    for name in (PROFILE_FILE, SIMULATED_UTILIZATION_FILE):
        (driver.state_dir / name).unlink(missing_ok=True)
    driver.forget_simulated_mig()


def delete_examples(driver: Driver) -> list[str]:
    """Delete the namespaces of the demo's examples that exist and wait until they are gone
    and the plugin unprepared every claim; the namespaces deleted."""
    kube = driver.kube
    present = {n["metadata"]["name"] for n in kube.list("v1", "Namespace")}
    examples = [namespace_of(e) for stage in STAGES for e in stage.example_dirs()]
    deleted = [n for n in examples if n in present]
    for namespace in deleted:
        kube.delete("v1", "Namespace", namespace)
    for namespace in deleted:
        kube.wait_gone("v1", "Namespace", namespace, None, timeout=180)
    if deleted:
        wait_for("every claim to be unprepared", lambda: not driver.checkpoint_claims(), 120)
    return deleted


def remove_leftover_release(cluster: Cluster, kube: Kube) -> bool:
    """A `demo/run` leaves its release running: remove it (with its examples, `remove_release`)
    so that no other kubelet plugin runs on the node; whether there was one."""
    if not release_installed(cluster, RELEASE, NAMESPACE):
        return False
    remove_release(demo_driver(cluster, kube))
    return True


def apply_example(cluster: Cluster, example: Path) -> None:
    """``kubectl apply`` of an example, retried while the apiserver cannot call the admission
    webhook yet (the controller's address reaches its Service a moment after it is ready)."""
    complaint = ""

    def applied() -> bool:
        nonlocal complaint
        try:
            cluster.kubectl("apply", "-f", str(example / "example.yaml"))
        except ClusterError as error:
            complaint = str(error)
            if "failed calling webhook" in complaint:
                return False
            raise
        return True

    try:
        wait_for(f"{example.name} to be applied", applied, 60, interval=2)
    except TimeoutError as error:
        raise ClusterError(f"{error}: {complaint}") from error
