"""Configuration files and command lines of the cluster's components (pure: paths in, text out)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from e2e.cluster import versions
from e2e.cluster.paths import ClusterPaths

_GATE = re.compile(r"(?:kube:)?([A-Za-z0-9]+)=true\|false \((?:ALPHA|BETA|GA|DEPRECATED)")


def known_feature_gates(binary: Path) -> set[str]:
    """Gates a component accepts, read from its --help (GA-locked gates are not listed)."""
    text = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, check=False
    ).stdout
    return set(_GATE.findall(text))


def feature_gates_flag(binary: Path) -> list[str]:
    gates = sorted(set(versions.WANTED_FEATURE_GATES) & known_feature_gates(binary))
    return [f"--feature-gates={','.join(f'{g}=true' for g in gates)}"] if gates else []


def etcd_command(paths: ClusterPaths) -> list[str]:
    return [
        "etcd",
        "--name=e2e",
        f"--data-dir={paths.state / 'etcd'}",
        "--listen-client-urls=http://127.0.0.1:2379",
        "--advertise-client-urls=http://127.0.0.1:2379",
        "--listen-peer-urls=http://127.0.0.1:2380",
        "--initial-advertise-peer-urls=http://127.0.0.1:2380",
        "--initial-cluster=e2e=http://127.0.0.1:2380",
        "--log-level=warn",
    ]


def apiserver_command(paths: ClusterPaths, bin_dir: Path) -> list[str]:
    pki = paths.pki
    binary = bin_dir / "kube-apiserver"
    return [
        str(binary),
        "--etcd-servers=http://127.0.0.1:2379",
        f"--advertise-address={versions.NODE_IP}",
        f"--secure-port={versions.APISERVER_PORT}",
        # Loopback-style setups have no second apiserver to reconcile endpoints with.
        "--endpoint-reconciler-type=none",
        # No kube-proxy: reach admission webhooks (the chart's) at their Service's pod endpoints.
        "--enable-aggregator-routing=true",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--service-account-issuer=https://kubernetes.default.svc",
        f"--service-cluster-ip-range={versions.SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        # Reach the kubelet by its node IP: no DNS inside the namespace.
        "--kubelet-preferred-address-types=InternalIP",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        "--profiling=false",
        *feature_gates_flag(binary),
    ]


def controller_manager_command(paths: ClusterPaths, bin_dir: Path) -> list[str]:
    pki = paths.pki
    binary = bin_dir / "kube-controller-manager"
    return [
        str(binary),
        f"--kubeconfig={paths.state / 'controller-manager.kubeconfig'}",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        "--controllers=*",
        *feature_gates_flag(binary),
    ]


def scheduler_command(paths: ClusterPaths, bin_dir: Path) -> list[str]:
    binary = bin_dir / "kube-scheduler"
    return [
        str(binary),
        f"--kubeconfig={paths.state / 'scheduler.kubeconfig'}",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
        *feature_gates_flag(binary),
    ]


def containerd_command(paths: ClusterPaths, bin_dir: Path) -> list[str]:
    return [str(bin_dir / "containerd"), f"--config={paths.state / 'containerd.toml'}"]


def kubelet_command(paths: ClusterPaths, bin_dir: Path) -> list[str]:
    return [
        str(bin_dir / "kubelet"),
        f"--config={paths.state / 'kubelet.yaml'}",
        f"--kubeconfig={paths.state / 'kubelet.kubeconfig'}",
        f"--root-dir={paths.kubelet_root}",
        f"--node-ip={versions.NODE_IP}",
        f"--hostname-override={versions.NODE_NAME}",
        "--v=2",
    ]


def containerd_config(paths: ClusterPaths) -> str:
    root = paths.containerd_root
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    images = "plugins.'io.containerd.cri.v1.images'"
    return f"""version = 3
root = "{root / "root"}"
state = "{root / "state"}"

[grpc]
  address = "{paths.containerd_socket}"

[ttrpc]
  address = "{paths.containerd_socket}.ttrpc"

[{runtime}]
  enable_cdi = true
  cdi_spec_dirs = {json.dumps(list(versions.CDI_SPEC_DIRS))}
  # No CAP_SYS_RESOURCE on this VM kind: never lower a score below containerd's own.
  restrict_oom_score_adj = true

[{runtime}.containerd]
  default_runtime_name = "runc"

[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{runtime}.containerd.runtimes.runc.options]
  BinaryName = "/usr/sbin/runc"
  SystemdCgroup = false

[{runtime}.cni]
  bin_dirs = ["/usr/lib/cni"]
  conf_dir = "{paths.state / "cni" / "net.d"}"

[{images}]
  snapshotter = "overlayfs"

[{images}.pinned_images]
  sandbox = "{versions.PAUSE_IMAGE}"
"""


def cni_config(paths: ClusterPaths) -> str:
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "gpu-dra-e2e",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": versions.POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(paths.state / "cni" / "ipam"),
                    },
                },
                {"type": "loopback"},
            ],
        },
        indent=2,
    )


def kubelet_config(paths: ClusterPaths, bin_dir: Path) -> str:
    gates = sorted(set(versions.WANTED_FEATURE_GATES) & known_feature_gates(bin_dir / "kubelet"))
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(paths.pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{paths.containerd_socket}",
        # This VM kind: PID 1 is not systemd, cgroup v1 is mounted, no CAP_SYS_RESOURCE.
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "oomScoreAdj": 0,
        "makeIPTablesUtilChains": False,
        "failSwapOn": False,
        "resolvConf": str(paths.state / "resolv.conf"),
        "podCIDR": versions.POD_CIDR,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "serializeImagePulls": False,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "featureGates": {gate: True for gate in gates},
    }
    return yaml.safe_dump(config, sort_keys=False)
