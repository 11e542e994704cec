"""Runs gpu-dra on the e2e cluster's node: the kubelet plugin on a simulated machine profile,
and the controller applying the DeviceClass catalog. Processes are registered with the cluster,
so `down` stops them too; tests stop what they start.

MPS control daemons run as pods (``--mps-daemon-runner=pod``) in `MPS_DAEMON_NAMESPACE`, from a
locally built image of the nvidia-cuda-mps-control TEST DOUBLE (`e2e.cluster.images.
mps_double_image`), imported into the cluster's containerd once per content hash."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.cluster import Cluster, images, versions
from e2e.cluster.paths import REPO_ROOT
from e2e.kube import Kube, wait_for
from e2e.realnode import RealNode
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.mig_policy import DEFAULT as DEFAULT_MIG_POLICY
from gpu_dra.driver.mig_policy import MigPolicy, parse_policy
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2 as dra_v1
from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from gpu_dra.kubelet_plugin.mig import SIMULATED_STATE_FILE
from gpu_dra.kubelet_plugin.mps import shared_daemon_id
from gpu_dra.kubelet_plugin.mps.warm_policy import WarmPolicy
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from tests.doubles.mps_helpers import kill_processes_under

DRIVER = "gpu.nvidia.com"
PLUGIN = "gpu-dra-kubelet-plugin"
CDI_ROOT = Path("/var/run/cdi")
METRICS_PORT = 8081  # the plugin's default
POOL_COMPLETE_S = 10.0
"""How long `Driver.devices` waits for the slices of a pool generation being written."""
BIN = Path(sys.executable).parent
MPS_CONTROL_DOUBLE = REPO_ROOT / "tests" / "doubles" / "bin" / "nvidia-cuda-mps-control"
"""The TEST DOUBLE of nvidia-cuda-mps-control (tests/doubles): the plugin's MPS control binary."""
MPS_DAEMON_NAMESPACE = "gpu-dra"
"""Where the plugin creates its MPS daemon pods (the namespace of deployments/rbac.yaml)."""
MPS_DAEMON_SELECTOR = "app.kubernetes.io/component=mps-control-daemon"
DATA_DIR_LINK = "gd"
"""``<state>/gd`` -> ``kubelet/plugins/gpu.nvidia.com``: the plugin's ``--data-dir``. MPS
control sockets are ``<data-dir>/mps/<id>/pipe/control`` and must fit in 107 bytes; under the
plugin directory of the e2e state dir they would not (113 with the longest id), so the plugin
refuses MPS there. The link keeps every file where it was, under a shorter name."""


@dataclass
class Driver:
    cluster: Cluster
    kube: Kube
    profile: str
    mps_daemon_image: str = ""
    """Reference of the MPS daemon image (`install` builds and imports it)."""
    dynamic_mig: bool = False
    """Run the plugin with ``--dynamic-mig`` (MIG-capable GPUs published as partitions)."""
    plugin_args: tuple[str, ...] = ()
    """Further plugin flags (a test module's ``PLUGIN_ARGS``, e.g. ``--mps-shares=0``)."""
    real: RealNode | None = None
    """Real mode: the plugin runs without ``--simulate`` on this fake driver root, whose
    ``libnvidia-ml.so.1`` is the NVML mock library (`e2e.realnode`); `profile` is unused."""
    metrics_url: str = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    """The plugin's /metrics: the host process's default port; a plugin pod's is on its pod IP
    (`e2e.chart.plugin_metrics_url`)."""

    @property
    def state_dir(self) -> Path:
        return self.cluster.paths.plugins_dir / DRIVER

    def install(self) -> None:
        """RBAC for the driver's identity, the DeviceClass catalog (through the controller) and
        the MPS daemon image."""
        self.cluster.kubectl("apply", "-f", str(REPO_ROOT / "deployments" / "rbac.yaml"))
        self.cluster.kubectl(
            "apply", "-f", "-",
            input=json.dumps(
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": "gpu-dra-mps-daemons-e2e",
                                 "namespace": MPS_DAEMON_NAMESPACE},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "Role",
                        "name": "gpu-dra-mps-daemons",
                    },
                    "subjects": [
                        {
                            "apiGroup": "rbac.authorization.k8s.io",
                            "kind": "User",
                            "name": "gpu-dra-driver",
                        }
                    ],
                }
            ),
        )  # fmt: skip
        self.mps_daemon_image = self.ensure_mps_daemon_image()
        self.cluster.kubectl(
            "apply", "-f", "-",
            input=json.dumps(
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": "gpu-dra-driver-e2e"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "gpu-dra-driver",
                    },
                    "subjects": [
                        {
                            "apiGroup": "rbac.authorization.k8s.io",
                            "kind": "User",
                            "name": "gpu-dra-driver",
                        }
                    ],
                }
            ),
        )  # fmt: skip
        subprocess.run(
            [
                str(BIN / "gpu-dra-controller"),
                "--once",
                f"--kubeconfig={self.kubeconfig}",
                f"--deviceclasses-dir={REPO_ROOT / 'deviceclasses'}",
                "--metrics-port=0",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

    @property
    def data_dir(self) -> Path:
        """The plugin's ``--data-dir`` as the plugin sees it (a link to `state_dir`): MPS
        daemons' ``CUDA_MPS_PIPE_DIRECTORY`` and the CDI mounts use this path."""
        return self.cluster.paths.state / DATA_DIR_LINK

    @property
    def mps_dir(self) -> Path:
        """``<state_dir>/mps``: one directory per MPS control daemon."""
        return self.state_dir / "mps"

    def link_data_dir(self) -> None:
        """Make `data_dir` the link to `state_dir` (before anything creates it as a directory,
        e.g. a chart's hostPath volume of the same path)."""
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        link = self.data_dir
        if link.is_symlink() and link.resolve() == self.state_dir.resolve():
            return
        if link.is_symlink():
            link.unlink()
        link.symlink_to(self.state_dir.relative_to(link.parent))

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.paths.state / "gpu-dra-driver.kubeconfig"

    def start_plugin(self, env: Mapping[str, str] | None = None) -> None:
        """Start the plugin (with `env` added to its environment) and wait until the kubelet
        registered it (a pod that needs the driver before that backs off for over a minute) and
        it reconciled the node's pool (`pool_reconciles`)."""
        paths = self.cluster.paths
        log = paths.logs / f"{PLUGIN}.log"
        offset = log.stat().st_size if log.exists() else 0
        self.link_data_dir()
        if self.real is None:
            hardware = [f"--simulate={self.profile}"]
        else:
            hardware = self.real.plugin_args()
            env = {**self.real.plugin_env(), **(env or {})}
        self.cluster.start_process(
            PLUGIN,
            [
                str(BIN / PLUGIN),
                f"--node-name={versions.NODE_NAME}",
                *hardware,
                f"--kubelet-plugins-dir={paths.plugins_dir}",
                f"--kubelet-registry-dir={paths.plugins_registry}",
                f"--cdi-root={CDI_ROOT}",
                f"--kubeconfig={self.kubeconfig}",
                f"--data-dir={self.data_dir}",
                f"--mps-control-binary={MPS_CONTROL_DOUBLE}",
                "--mps-daemon-runner=pod",
                f"--mps-daemon-image={self.mps_daemon_image}",
                f"--mps-daemon-namespace={MPS_DAEMON_NAMESPACE}",
                *(["--dynamic-mig"] if self.dynamic_mig else []),
                *self.plugin_args,
            ],
            # PYTHON: the interpreter the double's wrapper runs (standard library only).
            env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHON=sys.executable, **(env or {})),
        )

        def registered() -> bool:
            with log.open("rb") as text:
                text.seek(offset)
                return b"kubelet registration succeeded" in text.read()

        wait_for("the kubelet to register the plugin", registered, 60)
        wait_for(
            "the plugin to reconcile its ResourceSlices",
            lambda: pool_reconciles(self.metrics_url) >= 1,
            60,
        )
        # Slices of an earlier plugin run (another profile) stay until the new one republishes.
        expected = self.expected_device_names()
        wait_for(
            f"the node's ResourceSlices to show {self.real or self.profile}",
            lambda: set(self.devices()) == expected,
            60,
        )

    def expected_device_names(self) -> set[str]:
        """What the plugin must publish for this profile (the plugin's own discovery and
        inventory code on the same profile, MIG devices included; in real mode what
        ``gpu-dra devices`` prints for the driver root)."""
        if self.real is not None:
            return self.real.device_names(dynamic_mig=self.dynamic_mig)
        host = SimulatedHost.load(self.profile, versions.NODE_NAME)
        found = discover_devices(host.nvml, host.pci, mig_profiles=self.dynamic_mig)
        inventory = NodeInventory.from_discovery(
            found, simulated=True, dynamic_mig=self.dynamic_mig, mig_policy=self.mig_policy()
        )
        return {device["name"] for device in inventory.published_devices()}

    def mig_policy(self) -> MigPolicy:
        """The ``--dynamic-mig-profiles`` of `plugin_args` (the last one), else the default."""
        prefix = "--dynamic-mig-profiles="
        given = [arg.removeprefix(prefix) for arg in self.plugin_args if arg.startswith(prefix)]
        return parse_policy(given[-1]) if given else DEFAULT_MIG_POLICY

    def stop_plugin(self) -> None:
        self.cluster.stop_component(PLUGIN)

    def kill_plugin(self) -> None:
        """SIGKILL the plugin (a crash: no shutdown code runs) and wait until it is gone."""
        pid = self.cluster.pid(PLUGIN)
        assert pid is not None, "the plugin is not running"
        os.kill(pid, signal.SIGKILL)
        self.cluster.stop_component(PLUGIN)  # reaps it and forgets it
        wait_for("the killed plugin to be gone", lambda: self.cluster.pid(PLUGIN) is None, 10)

    def plugin_arg(self, flag: str) -> str | None:
        """The value of the last ``<flag>=<value>`` of `plugin_args`, None if absent."""
        given = [a.removeprefix(f"{flag}=") for a in self.plugin_args if a.startswith(f"{flag}=")]
        return given[-1] if given else None

    def warm_daemon_ids(self) -> set[str]:
        """Ids of the shared MPS daemons the plugin keeps warm (docs/mps.md, "Warm daemons"):
        those of the GPUs (and static MIG devices) it publishes as MPS shares, unless
        ``--mps-share-daemon-warm`` is ``off`` (given, or the plugin's default when not given).
        Dynamic MIG partitions offered as shares have no UUID, and no daemon until made."""
        given = self.plugin_arg("--mps-share-daemon-warm")
        default = KubeletPluginSettings.mps_share_daemon_warm
        if not (default if given is None else WarmPolicy.parse(given)).warm:
            return set()
        return {
            shared_daemon_id(device["attributes"]["uuid"]["string"])
            for device in self.devices().values()
            if device.get("allowMultipleAllocations") and "uuid" in device["attributes"]
        }

    def recorded_daemon_ids(self) -> set[str]:
        """Ids of the MPS daemons the checkpoint's claims record."""
        return {
            str(handle["daemonId"])
            for entry in self._checkpointed().values()
            for handle in entry.get("state", {}).get("mpsDaemons", [])
        }

    def remove_mps_daemons(self) -> list[str]:
        """Delete every daemon pod and kill every daemon process under the data dir (with the
        plugin stopped: warm daemons outlive it by design); what was removed."""
        removed = sorted(self.mps_daemon_pods())
        for name in removed:
            self.kube.delete("v1", "Pod", name, MPS_DAEMON_NAMESPACE)
        for name in removed:
            self.kube.wait_gone("v1", "Pod", name, MPS_DAEMON_NAMESPACE, timeout=60)
        removed += [f"pid {pid}" for pid in kill_processes_under(self.data_dir / "mps")]
        shutil.rmtree(self.mps_dir, ignore_errors=True)
        return removed

    def ensure_glibc_image(self) -> str:
        """Build the glibc test image (cached by content) and import it if containerd lacks
        it; its reference (`images.glibc_test_image`)."""
        return self._ensure_image(images.glibc_test_image(), "glibc-test")

    def ensure_mps_daemon_image(self) -> str:
        """Build the MPS double image (cached by content) and import it if containerd lacks it;
        its reference."""
        return self._ensure_image(
            images.mps_double_image(REPO_ROOT / "tests" / "doubles"), "mps-double"
        )

    def _ensure_image(self, spec: images.ImageSpec, archive_prefix: str) -> str:
        """Write `spec`'s archive ``<prefix>-<tag>.tar`` unless cached, import it unless
        containerd has it; its reference."""
        tag = spec.reference.rsplit(":", 1)[1]
        archive = self.cluster.paths.images_dir / f"{archive_prefix}-{tag}.tar"
        if not archive.exists():
            images.write_oci_archive(spec, archive)
        ctr, socket = self.cluster.bin_dir / "ctr", self.cluster.paths.containerd_socket
        if not images.image_present(ctr, socket, spec.reference):
            images.import_images(ctr, socket, [archive])
        return spec.reference

    def mps_daemon_pods(self) -> dict[str, dict[str, Any]]:
        """The MPS control daemon pods of the plugin, by name."""
        pods = self.kube.list("v1", "Pod", namespace=MPS_DAEMON_NAMESPACE,
                              label_selector=MPS_DAEMON_SELECTOR)  # fmt: skip
        return {p["metadata"]["name"]: p for p in pods}

    @property
    def registration_socket(self) -> Path:
        return self.cluster.paths.plugins_registry / f"{DRIVER}-reg.sock"

    def slices(self) -> list[dict[str, Any]]:
        return self.kube.list(
            "resource.k8s.io/v1",
            "ResourceSlice",
            field_selector=f"spec.driver={DRIVER},spec.nodeName={versions.NODE_NAME}",
        )

    def devices(self) -> dict[str, dict[str, Any]]:
        """Published devices by name, from the highest pool generation once all its slices are
        there: the plugin writes a new generation's slices one by one (a pool of many, as with
        dynamic MIG, is seen part-written), so a read waits up to `POOL_COMPLETE_S` for the
        rest."""
        deadline = time.monotonic() + POOL_COMPLETE_S
        while True:
            slices = self.slices()
            if not slices:
                return {}
            generation = max(s["spec"]["pool"]["generation"] for s in slices)
            current = [s for s in slices if s["spec"]["pool"]["generation"] == generation]
            expected = current[0]["spec"]["pool"]["resourceSliceCount"]
            if len(current) >= expected:
                return {d["name"]: d for s in current for d in s["spec"].get("devices", [])}
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pool generation {generation} of node {versions.NODE_NAME} has "
                    f"{len(current)} of its {expected} ResourceSlices after {POOL_COMPLETE_S}s"
                )
            time.sleep(0.1)

    def uuid_of(self, device: str) -> str:
        return str(self.devices()[device]["attributes"]["uuid"]["string"])

    def _checkpointed(self) -> dict[str, dict[str, Any]]:
        """The plugin's checkpoint entries by claim UID (none while it has no checkpoint)."""
        path = self.state_dir / "gpu-dra-checkpoint.json"
        if not path.exists():
            return {}
        return dict(json.loads(path.read_text()).get("claims", {}))

    def checkpoint_claims(self) -> set[str]:
        return set(self._checkpointed())

    def checkpoint_phase(self, uid: str) -> str | None:
        """The phase of the claim's checkpoint entry, None while it has none."""
        entry = self._checkpointed().get(uid)
        return None if entry is None else str(entry["phase"])

    def checkpoint_boot_id(self) -> str | None:
        """The boot ID the checkpoint was written in (`nodeBootID`), None without one."""
        path = self.state_dir / "gpu-dra-checkpoint.json"
        if not path.exists():
            return None
        boot_id = json.loads(path.read_text()).get("nodeBootID")
        return None if boot_id is None else str(boot_id)

    @property
    def dra_socket(self) -> Path:
        """The plugin's DRA service socket, where the kubelet calls it."""
        return self.state_dir / "dra.sock"

    def node_prepare(self, namespace: str, uid: str, name: str) -> dict[str, Any]:
        """Call ``NodePrepareResources`` (DRA v1) for one claim on the plugin's socket, as the
        kubelet does: ``{"error": ..., "devices": [{"deviceName", "cdiDeviceIDs", ...}]}``."""
        with grpc.insecure_channel(f"unix:{self.dra_socket}") as channel:
            stub = dra_v1_grpc.DRAPluginStub(channel)  # type: ignore[no-untyped-call]
            response = stub.NodePrepareResources(
                dra_v1.NodePrepareResourcesRequest(
                    claims=[dra_v1.Claim(namespace=namespace, uid=uid, name=name)]
                ),
                timeout=45,
            )
        answer = response.claims[uid]
        return {
            "error": answer.error,
            "devices": [
                {
                    "requestNames": list(d.request_names),
                    "poolName": d.pool_name,
                    "deviceName": d.device_name,
                    "cdiDeviceIDs": list(d.cdi_device_ids),
                }
                for d in answer.devices
            ],
        }

    def checkpoint_entry(self, uid: str) -> dict[str, Any]:
        """The claim's checkpoint entry (its phase and the state prepare recorded)."""
        return dict(self._checkpointed()[uid])

    def wait_unprepared(self, uid: str, timeout: float = 60) -> None:
        """Wait until the claim's checkpoint entry is gone (the plugin unprepared it)."""
        wait_for(
            f"claim {uid} to be unprepared", lambda: uid not in self.checkpoint_claims(), timeout
        )

    def forget_simulated_mig(self) -> None:
        """Remove the simulated GPUs' MIG state: the next plugin starts them without MIG."""
        (self.state_dir / SIMULATED_STATE_FILE).unlink(missing_ok=True)

    def metric(self, name: str, **labels: str) -> float:
        """A sample from the plugin's /metrics endpoint (`metrics_url`)."""
        return read_metric(self.metrics_url, name, **labels)

    def cdi_spec(self, claim_uid: str) -> dict[str, Any]:
        """The claim's CDI spec, parsed."""
        spec: dict[str, Any] = yaml.safe_load(
            (CDI_ROOT / f"k8s.gpu.nvidia.com-claim_{claim_uid}.yaml").read_text()
        )
        return spec

    def cdi_spec_claims(self) -> set[str]:
        prefix = "k8s.gpu.nvidia.com-claim_"
        return {
            p.name[len(prefix) :].rsplit(".", 1)[0]
            for p in CDI_ROOT.glob(f"{prefix}*")
            if p.is_file()
        }


def read_metric(url: str, name: str, **labels: str) -> float:
    """A sample from the /metrics endpoint at `url`; KeyError when it has none such."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise KeyError(f"no sample {name}{labels} in the plugin's metrics")


def pool_reconciles(metrics_url: str) -> float:
    """Pool reconciles (with or without writes) of the plugin process serving `metrics_url`; 0
    while it does not answer. A plugin started beside slices of an earlier run (same device
    names, other flags) owns what is published once this is 1 or more."""
    try:
        return read_metric(metrics_url, "gpu_dra_resourceslice_reconciles_total")
    except (OSError, KeyError):
        return 0
