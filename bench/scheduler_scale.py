"""Scheduler scale: pods/s, scheduler CPU per pod and control-plane memory per publishing shape.

For each shape (`bench.slice_bytes.SHAPES`, or ``dynamic-mig=<policy>``) and each client-limit
setting, a fresh private control plane (etcd, kube-apiserver, kube-controller-manager with only
the resourceclaim controller, kube-scheduler; loopback ports, a temporary directory, no network
namespace) gets N fake Ready nodes (Node objects, no kubelet) with the ResourceSlices the plugin
renders for each (`node_slices`), then P pods with one claim each (a ResourceClaimTemplate).
Measured: pods/s bound, scheduler CPU seconds per pod (/proc/<pid>/stat), scheduler, apiserver and
etcd RSS with only the slices and at peak (VmHWM), slice bytes per node as the apiserver serves
them; ratios to ``whole`` within the run. Everything started is stopped, also on Ctrl-C.
See docs/performance.md, "Scheduler scale".

    python -m bench.scheduler_scale --nodes 500 --pods 1000 [--limits default scheduler raised]
        [--shapes whole dynamic-mig dynamic-mig=1g,2g,3g,7g ...] [--json]
    python -m bench.scheduler_scale --report RESULTS.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

import yaml

from bench.slice_bytes import SHAPES, node_slices
from e2e.cluster import configs, pki, toolchain
from e2e.cluster.paths import ClusterPaths
from gpu_dra.driver.mig_policy import DEFAULT, MigPolicy, parse_policy

REPO_ROOT: Final = Path(__file__).resolve().parents[1]
NAMESPACE: Final = "bench"
TEMPLATE: Final = "bench-claim"
OWNER_UID_PLACEHOLDER: Final = "00000000-0000-4000-8000-00000000b00d"
RAISED: Final = 1000
"""QPS and burst of the ``raised`` limits (scheduler, and controller manager)."""

LIMITS: Final = {
    # (scheduler qps, burst), (controller-manager qps, burst); None: the binary's default
    # (kube-scheduler 50/100, kube-controller-manager 20/30 in 1.37).
    "default": (None, None),
    "scheduler": ((RAISED, RAISED), None),
    "raised": ((RAISED, RAISED), (RAISED, RAISED)),
}
CLASS_OF_SHAPE: Final = {
    "whole": "gpu.nvidia.com",
    "mps-shares": "mps.gpu.nvidia.com",
    "dynamic-mig-all": "mig-1g.gpu.nvidia.com",
    "dynamic-mig": "mig-1g.gpu.nvidia.com",
}
"""What each pod's claim asks for on a shape: a whole GPU, a 10Gi MPS share, a 1g MIG slice
(on a dynamic-mig policy without 1g profiles: the smallest it offers, see `claim_class`)."""
TOLERATIONS: Final = [
    {"key": key, "operator": "Exists", "effect": effect}
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    for effect in ("NoSchedule", "NoExecute")
]


class BenchError(RuntimeError):
    """The control plane or a measurement failed; the message says which and why."""


# ---- pure parts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A publishing shape (`bench.slice_bytes.SHAPES`) with the policy of a dynamic-mig shape."""

    name: str
    policy: MigPolicy = DEFAULT

    @property
    def label(self) -> str:
        """The name, with the policy for ``dynamic-mig`` (results say which one they measured)."""
        return f"dynamic-mig={self.policy}" if self.name == "dynamic-mig" else self.name


def parse_shape(text: str) -> Shape:
    """A shape name of `SHAPES`, or ``dynamic-mig=<policy>`` (a ``--dynamic-mig-profiles``)."""
    name, _, policy = text.partition("=")
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
    if policy and name != "dynamic-mig":
        raise ValueError(f"shape {name!r} takes no policy")
    return Shape(name, parse_policy(policy) if policy else DEFAULT)


def cpu_ticks(stat: str) -> int:
    """utime + stime (clock ticks) from the text of /proc/<pid>/stat. The command name (field 2)
    is in parentheses and may hold spaces and parentheses, so fields count from its last ')'."""
    close = stat.rfind(")")
    if close < 0:
        raise ValueError(f"not a /proc/<pid>/stat line: {stat[:80]!r}")
    fields = stat[close + 1 :].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    if len(fields) < 13:
        raise ValueError(f"/proc/<pid>/stat has {len(fields) + 2} fields, expected at least 15")
    return int(fields[11]) + int(fields[12])


def status_kib(status: str, key: str) -> int:
    """A ``kB`` value (``VmRSS``, ``VmHWM``) from the text of /proc/<pid>/status."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            number, _, unit = value.strip().partition(" ")
            if unit != "kB":
                raise ValueError(f"/proc/<pid>/status {key}: unexpected unit in {value!r}")
            return int(number)
    raise ValueError(f"/proc/<pid>/status has no {key}")


def fake_node(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "gpu-dra.bench/fake": "true"},
        },
    }


def node_status() -> dict[str, Any]:
    """A merge patch for a Node's status: Ready, room for 110 pods."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    return {
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "fake node of bench.scheduler_scale",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
        }
    }


def claim_class(shape: Shape) -> str:
    """The DeviceClass of the pods' claims: `CLASS_OF_SHAPE`, except on a dynamic-mig policy
    that offers no 1g profile, where it is the catalog class of the smallest profile a node
    publishes (``mig-<n>g``), so that every pod can be placed."""
    if shape.name != "dynamic-mig":
        return CLASS_OF_SHAPE[shape.name]
    slices = set()
    for body in node_slices("bench-node-000", shape.name, policy=shape.policy):
        for device in body["spec"].get("devices", []):
            profile = device.get("attributes", {}).get("profile", {}).get("string", "")
            match = re.match(r"(\d+)g\.", profile)
            if match:
                slices.add(int(match.group(1)))
    if not slices:
        raise BenchError(f"{shape.label} publishes no MIG partition")
    return f"mig-{min(slices)}g.gpu.nvidia.com"


def claim_template(shape: Shape) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": claim_class(shape)}
    if shape.name == "mps-shares":
        exactly["capacity"] = {"requests": {"memory": "10Gi"}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": TEMPLATE, "namespace": NAMESPACE},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }


def bench_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "automountServiceAccountToken": False,
            "tolerations": TOLERATIONS,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": TEMPLATE}],
            "containers": [
                {
                    "name": "c",
                    "image": "localhost/gpu-dra/never-runs:bench",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def owned_slices(template_json: str, node_uid: str) -> list[dict[str, Any]]:
    """The rendered slices of a node (JSON with `OWNER_UID_PLACEHOLDER`) owned by `node_uid`."""
    return list(json.loads(template_json.replace(OWNER_UID_PLACEHOLDER, node_uid)))


def scheduler_config(
    kubeconfig: Path, qps_burst: tuple[int, int] | None, nodes_to_score: int
) -> dict[str, Any]:
    """A KubeSchedulerConfiguration with `percentageOfNodesToScore` (the share of the nodes the
    scheduler filters for each pod before it stops looking; 0 is its adaptive default, 50 % less
    1 % per 125 nodes, at least 5 %), the client limits and no leader election."""
    connection: dict[str, Any] = {"kubeconfig": str(kubeconfig)}
    if qps_burst is not None:
        connection["qps"], connection["burst"] = qps_burst
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": connection,
        "leaderElection": {"leaderElect": False},
        "percentageOfNodesToScore": nodes_to_score,
    }


def limits_label(limits: str, nodes_to_score: int | None) -> str:
    """How results name a limit setting: ``raised``, or ``raised,score=10%`` with
    ``--nodes-to-score`` (ratios divide by whole GPUs under the same label)."""
    return limits if nodes_to_score is None else f"{limits},score={nodes_to_score}%"


def limit_flags(qps_burst: tuple[int, int] | None) -> list[str]:
    if qps_burst is None:
        return []
    qps, burst = qps_burst
    return [f"--kube-api-qps={qps}", f"--kube-api-burst={burst}"]


@dataclass(frozen=True)
class Memory:
    """RSS in MiB of one process: with only the slices (before pods), and its peak (VmHWM)."""

    slices_only: float
    peak: float


@dataclass(frozen=True)
class Result:
    shape: str
    limits: str
    nodes: int
    pods: int
    devices_per_node: int
    slice_bytes_per_node: int
    pods_per_s: float
    scheduler_cpu_ms_per_pod: float
    memory: dict[str, Memory] = field(default_factory=dict)
    """By component: ``kube-scheduler``, ``kube-apiserver``, ``etcd``."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": "result", **asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Result:
        """The inverse of `to_json` (a ``--json`` result line)."""
        fields = {k: v for k, v in data.items() if k not in ("kind", "memory")}
        memory = {name: Memory(**value) for name, value in data["memory"].items()}
        return cls(**fields, memory=memory)


def read_results(lines: Sequence[str]) -> list[Result]:
    """The result lines of ``--json`` output (ratio and other lines are skipped)."""
    found = []
    for line in lines:
        if line.strip():
            data = json.loads(line)
            if data.get("kind") == "result":
                found.append(Result.from_json(data))
    return found


RATIO_METRICS: Final = (
    "pods_per_s",
    "scheduler_cpu_ms_per_pod",
    "scheduler_rss_slices_only",
    "scheduler_rss_peak",
    "apiserver_rss_peak",
    "etcd_rss_peak",
    "slice_bytes_per_node",
)


def metrics(result: Result) -> dict[str, float]:
    memory = result.memory
    return {
        "pods_per_s": result.pods_per_s,
        "scheduler_cpu_ms_per_pod": result.scheduler_cpu_ms_per_pod,
        "scheduler_rss_slices_only": memory["kube-scheduler"].slices_only,
        "scheduler_rss_peak": memory["kube-scheduler"].peak,
        "apiserver_rss_peak": memory["kube-apiserver"].peak,
        "etcd_rss_peak": memory["etcd"].peak,
        "slice_bytes_per_node": float(result.slice_bytes_per_node),
    }


def ratios(
    results: Sequence[Result], baseline: str = "whole"
) -> dict[tuple[str, str], dict[str, float]]:
    """Per (limits, shape) other than `baseline`: each metric divided by the baseline's under
    the same limits in the same run. Shapes without a baseline result get none."""
    base = {r.limits: metrics(r) for r in results if r.shape == baseline}
    out: dict[tuple[str, str], dict[str, float]] = {}
    for result in results:
        if result.shape == baseline or result.limits not in base:
            continue
        ours = metrics(result)
        out[(result.limits, result.shape)] = {
            name: ours[name] / base[result.limits][name]
            if base[result.limits][name]
            else float("nan")
            for name in RATIO_METRICS
        }
    return out


GOAL: Final = {
    # metric: (bound, True when the ratio must be at least the bound)
    "pods_per_s": (0.5, True),
    "scheduler_cpu_ms_per_pod": (2.0, False),
    "scheduler_rss_slices_only": (2.0, False),
    "scheduler_rss_peak": (2.0, False),
}
"""Issue 15's goal for dynamic MIG with the default policy, against whole GPUs."""


def goal_verdicts(ratio: Mapping[str, float]) -> dict[str, bool]:
    return {
        name: (ratio[name] >= bound) if at_least else (ratio[name] <= bound)
        for name, (bound, at_least) in GOAL.items()
    }


def table(results: Sequence[Result]) -> str:
    lines = [
        "| limits | shape | devices / node | slice KB / node | pods/s | scheduler CPU ms / pod "
        "| scheduler RSS MiB (slices / peak) | apiserver RSS MiB | etcd RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mem = r.memory
        lines.append(
            f"| {r.limits} | {r.shape} | {r.devices_per_node} "
            f"| {r.slice_bytes_per_node / 1000:.1f} "
            f"| {r.pods_per_s:.1f} | {r.scheduler_cpu_ms_per_pod:.1f} "
            f"| {mem['kube-scheduler'].slices_only:.0f} / {mem['kube-scheduler'].peak:.0f} "
            f"| {mem['kube-apiserver'].slices_only:.0f} / {mem['kube-apiserver'].peak:.0f} "
            f"| {mem['etcd'].slices_only:.0f} / {mem['etcd'].peak:.0f} |"
        )
    return "\n".join(lines)


def ratio_table(results: Sequence[Result]) -> str:
    lines = [
        "| limits | shape | pods/s | sched CPU / pod | sched RSS slices | sched RSS peak "
        "| apiserver peak | etcd peak | slice bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (limits, shape), ratio in ratios(results).items():
        cells = " | ".join(f"{ratio[name]:.2f}x" for name in RATIO_METRICS)
        lines.append(f"| {limits} | {shape} | {cells} |")
    return "\n".join(lines)


# ---- processes ------------------------------------------------------------------------------


def read_cpu_ticks(pid: int) -> int:
    return cpu_ticks(Path(f"/proc/{pid}/stat").read_text())


def read_kib(pid: int, key: str) -> int:
    return status_kib(Path(f"/proc/{pid}/status").read_text(), key)


def scheduler_port_flags(port: int | None) -> list[str]:
    """No secure port, or (profiling) one on loopback whose pprof handlers need no credentials."""
    if port is None:
        return ["--secure-port=0"]
    return [
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--authorization-always-allow-paths=/healthz,/debug/pprof/profile",
        "--profiling=true",
    ]


def fetch_cpu_profile(port: int, seconds: int, target: Path) -> None:
    """Write the scheduler's CPU profile over the next `seconds` to `target` (pprof format)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the scheduler's self-signed serving certificate
    connection = http.client.HTTPSConnection(
        "127.0.0.1", port, context=context, timeout=seconds + 60
    )
    try:
        connection.request("GET", f"/debug/pprof/profile?seconds={seconds}")
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise BenchError(f"scheduler CPU profile: HTTP {response.status}: {body[:300]!r}")
        target.write_bytes(body)
    finally:
        connection.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def find_binaries() -> tuple[Path, Path]:
    """(directory of the cached Kubernetes binaries, etcd): those `e2e/setup-host` provides."""
    paths = ClusterPaths.from_env()
    missing = [
        name
        for name in toolchain.missing_binaries(paths)
        if name in ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
    ]
    if missing:
        raise BenchError(
            f"{', '.join(missing)} not in {toolchain.bin_dir(paths)}; run e2e/setup-host "
            "(or .venv/bin/python -m e2e.cluster build)"
        )
    etcd = shutil.which("etcd")
    if etcd is None:
        raise BenchError("etcd is not on PATH; run e2e/setup-host (Debian package etcd-server)")
    return toolchain.bin_dir(paths), Path(etcd)


class Api:
    """A small JSON client for the private apiserver (admin client certificate); one HTTPS
    connection per thread."""

    def __init__(self, port: int, pki: Path) -> None:
        self.port = port
        self.context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPSConnection:
        connection: http.client.HTTPSConnection | None = getattr(self._local, "connection", None)
        if connection is None:
            connection = http.client.HTTPSConnection(
                "127.0.0.1", self.port, context=self.context, timeout=120
            )
            self._local.connection = connection
        return connection

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        for attempt in range(2):
            connection = self._connection()
            try:
                connection.request(method, path, body=payload, headers=headers)
                response = connection.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                self._local.connection = None
                if attempt:
                    raise
                continue
            if response.status >= 300:
                raise BenchError(f"{method} {path}: HTTP {response.status}: {data[:500]!r}")
            return json.loads(data) if data else None
        raise AssertionError("unreachable")

    def raw_get(self, path: str) -> bytes:
        connection = self._connection()
        try:
            connection.request("GET", path, headers={"Accept": "application/json"})
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            connection.close()  # a failed request leaves it unusable
            self._local.connection = None
            raise
        if response.status != 200:
            raise BenchError(f"GET {path}: HTTP {response.status}: {data[:500]!r}")
        return data

    def ready(self) -> bool:
        try:
            return self.raw_get("/readyz") == b"ok"
        except (OSError, http.client.HTTPException, BenchError):
            return False

    def watch(self, path: str) -> Iterator[dict[str, Any]]:
        """The events of a watch on `path` (``...?watch=1&resourceVersion=...``) until the
        server ends it. Reads block: the caller's thread is a daemon."""
        connection = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context)
        try:
            connection.request("GET", path, headers={"Accept": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise BenchError(f"watch {path}: HTTP {response.status}: {response.read(500)!r}")
            while line := response.readline():
                yield json.loads(line)
        finally:
            connection.close()


class ControlPlane:
    """etcd, kube-apiserver, kube-controller-manager (resourceclaim controller only) and
    kube-scheduler on free loopback ports under `workdir`; `stop` ends every process started."""

    def __init__(
        self,
        workdir: Path,
        bin_dir: Path,
        etcd: Path,
        limits: str,
        profiling: bool = False,
        nodes_to_score: int | None = None,
    ) -> None:
        self.workdir = workdir
        self.nodes_to_score = nodes_to_score
        self.bin_dir = bin_dir
        self.etcd = etcd
        self.limits = limits
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.pki = workdir / "pki"
        self.port = free_port()
        # The scheduler's secure port, serving only /debug/pprof/* to anyone, when profiling.
        self.scheduler_port = free_port() if profiling else None

    def _spawn(self, name: str, argv: list[str]) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        with open(logs / f"{name}.log", "ab") as logfile:
            self.processes[name] = subprocess.Popen(
                argv,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def pid(self, name: str) -> int:
        return self.processes[name].pid

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _wait(self, what: str, probe: Callable[[], bool], name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.processes[name].poll() is not None:
                raise BenchError(f"{name} exited while waiting for {what}:\n{self.log_tail(name)}")
            if probe():
                return
            time.sleep(0.3)
        raise BenchError(f"timed out waiting for {what}:\n{self.log_tail(name)}")

    def start(self) -> Api:
        pki.create(self.pki)
        server = f"https://127.0.0.1:{self.port}"
        for identity in ("admin", "scheduler"):
            pki.write_kubeconfig(
                self.workdir / f"{identity}.kubeconfig", self.pki, identity, server=server
            )
        api = Api(self.port, self.pki)
        client, peer = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                str(self.etcd),
                "--name=bench",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=bench=http://127.0.0.1:{peer}",
                "--log-level=warn",
            ],
        )
        apiserver = self.bin_dir / "kube-apiserver"
        self._spawn(
            "kube-apiserver",
            [
                str(apiserver),
                f"--etcd-servers=http://127.0.0.1:{client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                "--endpoint-reconciler-type=none",
                f"--client-ca-file={self.pki / 'ca.crt'}",
                f"--tls-cert-file={self.pki / 'apiserver.crt'}",
                f"--tls-private-key-file={self.pki / 'apiserver.key'}",
                f"--service-account-key-file={self.pki / 'sa.pub'}",
                f"--service-account-signing-key-file={self.pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--authorization-mode=Node,RBAC",
                "--profiling=false",
                *configs.feature_gates_flag(apiserver),
            ],
        )
        self._wait("kube-apiserver /readyz", api.ready, "kube-apiserver", 120)
        scheduler_limits, manager_limits = LIMITS[self.limits]
        manager = self.bin_dir / "kube-controller-manager"
        self._spawn(
            "kube-controller-manager",
            [
                str(manager),
                f"--kubeconfig={self.workdir / 'admin.kubeconfig'}",
                "--secure-port=0",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                "--controllers=resourceclaim-controller",
                *limit_flags(manager_limits),
                *configs.feature_gates_flag(manager),
            ],
        )
        scheduler = self.bin_dir / "kube-scheduler"
        kubeconfig = self.workdir / "scheduler.kubeconfig"
        if self.nodes_to_score is None:
            client = [
                f"--kubeconfig={kubeconfig}",
                "--leader-elect=false",
                *limit_flags(scheduler_limits),
            ]
        else:  # a config file; the flags it replaces would be ignored beside it
            config = self.workdir / "scheduler-config.yaml"
            config.write_text(
                yaml.safe_dump(scheduler_config(kubeconfig, scheduler_limits, self.nodes_to_score))
            )
            client = [f"--config={config}"]
        self._spawn(
            "kube-scheduler",
            [
                str(scheduler),
                *client,
                *scheduler_port_flags(self.scheduler_port),
                *configs.feature_gates_flag(scheduler),
            ],
        )
        time.sleep(1)
        for name in ("kube-controller-manager", "kube-scheduler"):
            if self.processes[name].poll() is not None:
                raise BenchError(f"{name} exited at start:\n{self.log_tail(name)}")
        return api

    def check_running(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise BenchError(f"{name} exited ({process.returncode}):\n{self.log_tail(name)}")

    def stop(self) -> None:
        """SIGTERM each process, newest first (etcd last), SIGKILL one that is still running
        after 10 s; whatever interrupts this, every process is killed and reaped."""
        try:
            for name in reversed(list(self.processes)):
                process = self.processes[name]
                if process.poll() is None:
                    process.terminate()
                    try:
                        process.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        process.kill()
        finally:
            for process in self.processes.values():
                if process.poll() is None:
                    process.kill()
                process.wait()
            self.processes.clear()


@contextlib.contextmanager
def control_plane(
    bin_dir: Path,
    etcd: Path,
    limits: str,
    keep: Path | None,
    profiling: bool = False,
    nodes_to_score: int | None = None,
) -> Iterator[tuple[ControlPlane, Api]]:
    workdir = Path(tempfile.mkdtemp(prefix="gpu-dra-sched-bench-"))
    plane = ControlPlane(workdir, bin_dir, etcd, limits, profiling, nodes_to_score)
    try:
        api = plane.start()
        yield plane, api
    finally:
        plane.stop()
        if keep is not None:
            shutil.copytree(
                workdir / "logs", keep / f"logs-{limits}-{time.monotonic_ns()}", dirs_exist_ok=True
            )
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def client_pool(threads: int) -> Iterator[ThreadPoolExecutor]:
    """A thread pool whose queued work is dropped when the block fails (Ctrl-C, an error), so
    the control plane is stopped at once rather than after every queued request."""
    pool = ThreadPoolExecutor(threads)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def wait_quiet(pids: Sequence[int], *, settle_s: float = 2.0, timeout_s: float = 120.0) -> None:
    """Wait until `pids` together use under 5 % of a core over `settle_s` (informers synced);
    after `timeout_s` the caller measures anyway (a busy shared machine may never look idle)."""
    deadline = time.monotonic() + timeout_s
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    before = sum(read_cpu_ticks(pid) for pid in pids)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        after = sum(read_cpu_ticks(pid) for pid in pids)
        if (after - before) / ticks_per_s < 0.05 * settle_s:
            return
        before = after


def create_fleet(api: Api, shape: Shape, nodes: int, threads: int) -> tuple[int, int]:
    """Create `nodes` Ready fake nodes with their slices; (devices per node, slice bytes per
    node as served for the first node)."""
    api.request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
    )
    api.request(
        "POST",
        f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
    )
    for path in sorted((REPO_ROOT / "deviceclasses").glob("*.yaml")):
        api.request(
            "POST", "/apis/resource.k8s.io/v1/deviceclasses", yaml.safe_load(path.read_text())
        )

    def one(name: str, rendered: str) -> None:
        node = api.request("POST", "/api/v1/nodes", fake_node(name))
        api.request(
            "PATCH", f"/api/v1/nodes/{name}/status", node_status(), "application/merge-patch+json"
        )
        for body in owned_slices(rendered, node["metadata"]["uid"]):
            api.request("POST", "/apis/resource.k8s.io/v1/resourceslices", body)

    devices = 0
    with client_pool(threads) as pool:
        futures = []
        for index in range(nodes):
            name = f"bench-node-{index:04d}"
            slices = node_slices(
                name, shape.name, policy=shape.policy, node_uid=OWNER_UID_PLACEHOLDER
            )
            if index == 0:
                devices = sum(len(s["spec"].get("devices", [])) for s in slices)
            futures.append(pool.submit(one, name, json.dumps(slices)))
        for future in futures:
            future.result()
    selector = urllib.parse.quote("spec.nodeName=bench-node-0000")
    served = api.request("GET", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector={selector}")
    size = sum(len(json.dumps(item, separators=(",", ":")).encode()) for item in served["items"])
    return devices, size


def run_pods(
    api: Api,
    plane: ControlPlane,
    pods: int,
    threads: int,
    timeout_s: float,
    profile: tuple[Path, int] | None = None,
) -> tuple[float, float]:
    """Create `pods` pods and wait until all are bound: (pods/s, scheduler CPU ms per pod).
    `profile` (file, seconds): also record the scheduler's CPU profile from the first create."""
    listing = api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")
    version = listing["metadata"]["resourceVersion"]
    bound: dict[str, float] = {}
    stop = threading.Event()
    done = threading.Event()
    failure: list[BaseException] = []

    def watch() -> None:
        nonlocal version
        try:
            while len(bound) < pods and not stop.is_set():
                path = f"/api/v1/namespaces/{NAMESPACE}/pods?watch=1&resourceVersion={version}"
                for event in api.watch(path):
                    pod = event.get("object", {})
                    if event.get("type") == "ERROR":
                        raise BenchError(f"pod watch: {pod}")
                    version = pod["metadata"]["resourceVersion"]
                    name = pod["metadata"]["name"]
                    if pod.get("spec", {}).get("nodeName") and name not in bound:
                        bound[name] = time.monotonic()
                        if len(bound) == pods:
                            return
        except BaseException as error:  # reported by the waiting thread
            failure.append(error)
        finally:
            done.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    profiler: threading.Thread | None = None
    profile_failure: list[BaseException] = []
    if profile is not None and plane.scheduler_port is not None:
        port, (target, seconds) = plane.scheduler_port, profile

        def record_profile() -> None:
            try:
                fetch_cpu_profile(port, seconds, target)
            except BaseException as error:  # reported by the waiting thread
                profile_failure.append(error)

        profiler = threading.Thread(target=record_profile, daemon=True)
        profiler.start()
    scheduler = plane.pid("kube-scheduler")
    ticks_before = read_cpu_ticks(scheduler)
    started = time.monotonic()
    with client_pool(threads) as pool:
        list(
            pool.map(
                lambda i: api.request(
                    "POST", f"/api/v1/namespaces/{NAMESPACE}/pods", bench_pod(f"pod-{i:05d}")
                ),
                range(pods),
            )
        )
    deadline = started + timeout_s
    while not done.wait(1.0):
        plane.check_running()
        if time.monotonic() > deadline:
            stop.set()
            raise BenchError(
                f"{len(bound)} of {pods} pods bound after {timeout_s:.0f}s; scheduler log:\n"
                f"{plane.log_tail('kube-scheduler')}"
            )
    stop.set()
    if failure:
        raise BenchError(f"pod watch failed: {failure[0]}")
    ticks = read_cpu_ticks(scheduler) - ticks_before  # the pod phase only, not the profile's tail
    elapsed = max(bound.values()) - started
    if profiler is not None:
        profiler.join()
        if profile_failure:
            raise BenchError(f"scheduler CPU profile not recorded: {profile_failure[0]}")
    cpu_ms = ticks / os.sysconf("SC_CLK_TCK") * 1000 / pods
    return pods / elapsed, cpu_ms


COMPONENTS: Final = ("kube-scheduler", "kube-apiserver", "etcd")


def run_one(
    shape: Shape,
    limits: str,
    nodes: int,
    pods: int,
    binaries: tuple[Path, Path],
    threads: int,
    timeout_s: float,
    keep: Path | None,
    profile: tuple[Path, int] | None = None,
    nodes_to_score: int | None = None,
) -> Result:
    bin_dir, etcd = binaries
    with control_plane(bin_dir, etcd, limits, keep, profile is not None, nodes_to_score) as (
        plane,
        api,
    ):
        devices, size = create_fleet(api, shape, nodes, threads)
        api.request(
            "POST",
            f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaimtemplates",
            claim_template(shape),
        )
        wait_quiet([plane.pid(name) for name in plane.processes])
        plane.check_running()
        slices_only = {name: read_kib(plane.pid(name), "VmRSS") / 1024 for name in COMPONENTS}
        pods_per_s, cpu_ms = run_pods(api, plane, pods, threads, timeout_s, profile)
        memory = {
            name: Memory(
                round(slices_only[name], 1), round(read_kib(plane.pid(name), "VmHWM") / 1024, 1)
            )
            for name in COMPONENTS
        }
        return Result(
            shape=shape.label,
            limits=limits_label(limits, nodes_to_score),
            nodes=nodes,
            pods=pods,
            devices_per_node=devices,
            slice_bytes_per_node=size,
            pods_per_s=round(pods_per_s, 2),
            scheduler_cpu_ms_per_pod=round(cpu_ms, 2),
            memory=memory,
        )


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scheduler_scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=[parse_shape(s) for s in ("whole", "mps-shares", "dynamic-mig-all", "dynamic-mig")],
        help="shapes to run, 'whole' first for the ratios; dynamic-mig=<policy> for another policy",
    )
    parser.add_argument(
        "--limits", nargs="+", choices=sorted(LIMITS), default=["default", "raised"]
    )
    parser.add_argument("--threads", type=int, default=8, help="client threads creating objects")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for all pods to bind")
    parser.add_argument("--keep-logs", type=Path, help="copy the components' logs here")
    parser.add_argument(
        "--cpu-profile",
        type=Path,
        metavar="DIR",
        help="write the scheduler's CPU profile of each run's pod phase to DIR/<shape>-<limits>"
        ".pprof (read with `go tool pprof -top`)",
    )
    parser.add_argument(
        "--cpu-profile-seconds", type=int, default=30, help="length of each CPU profile"
    )
    parser.add_argument(
        "--nodes-to-score",
        type=int,
        metavar="PERCENT",
        help="the scheduler's percentageOfNodesToScore (through a KubeSchedulerConfiguration "
        "file); default: its adaptive default",
    )
    parser.add_argument("--json", action="store_true", help="JSON lines instead of tables")
    parser.add_argument(
        "--report",
        type=Path,
        metavar="JSONL",
        help="run nothing: print the tables and ratios of the result lines of an earlier --json "
        "run (also of one that was interrupted)",
    )
    args = parser.parse_args(argv)
    if args.report is not None:
        report(read_results(args.report.read_text().splitlines()))
        return 0
    if args.pods > args.nodes * 8:
        parser.error("at most 8 pods per node (one GPU each on 8-GPU nodes)")
    if args.nodes_to_score is not None and not 0 <= args.nodes_to_score <= 100:
        parser.error("--nodes-to-score is a percentage, 0 (adaptive) to 100")
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    binaries = find_binaries()
    results: list[Result] = []
    for limits in args.limits:
        for shape in args.shapes:
            print(
                f"scheduler_scale: {shape.label}, limits {limits}, "
                f"{args.nodes} nodes, {args.pods} pods"
                f"{'' if args.nodes_to_score is None else f', {args.nodes_to_score}% scored'} ...",
                file=sys.stderr,
                flush=True,
            )
            started = time.monotonic()
            profile = None
            if args.cpu_profile is not None:
                args.cpu_profile.mkdir(parents=True, exist_ok=True)
                name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{shape.label}-{limits}.pprof")
                profile = (args.cpu_profile / name, args.cpu_profile_seconds)
            result = run_one(
                shape,
                limits,
                args.nodes,
                args.pods,
                binaries,
                args.threads,
                args.timeout,
                args.keep_logs,
                profile,
                args.nodes_to_score,
            )
            print(
                f"  {result.pods_per_s} pods/s, {result.scheduler_cpu_ms_per_pod} ms CPU/pod "
                f"({time.monotonic() - started:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
            results.append(result)
            if args.json:
                print(json.dumps(result.to_json()), flush=True)
    if args.json:
        for (limits, shape), ratio in ratios(results).items():
            print(json.dumps({"kind": "ratio", "limits": limits, "shape": shape, **ratio}))
        return 0
    report(results)
    return 0


def report(results: Sequence[Result]) -> None:
    print(table(results))
    print()
    print("Ratios to whole GPUs under the same limits, this run:")
    print(ratio_table(results))
    goals = {key: goal_verdicts(r) for key, r in ratios(results).items()}
    for (limits, shape), verdicts in goals.items():
        if shape.startswith("dynamic-mig") and not shape.startswith("dynamic-mig-all"):
            failed = [name for name, ok in verdicts.items() if not ok]
            verdict = "met" if not failed else f"not met ({', '.join(failed)})"
            print(f"issue 15 goal, {shape} under {limits} limits: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
