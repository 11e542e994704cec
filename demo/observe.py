"""What the demo looks at: what each container printed (the devices gpu-dra gave it, its MPS
environment), what the scheduler allocated to each claim, and the plugin's own view of the node
(MIG instances on the simulated GPUs, MPS daemons and per-claim caps from its metrics, time
slices it set). The demo prints these; e2e/test_demo_examples.py asserts on them."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from e2e.driver import Driver
from e2e.kube import Kube
from gpu_dra.kubelet_plugin.mig import SIMULATED_STATE_FILE
from gpu_dra.kubelet_plugin.time_slicer import DEFAULT_INTERVAL, RECORD_FILE

_ENV_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$", re.M)
_DEVICE_KEY = re.compile(r"^GPU_DRA_(\w+?)_(UUID|PARENT_UUID|PROFILE|PRODUCT|SIMULATED)$")
MPS_PID_KEY = "MPS_DAEMON_PID"
"""What the MPS examples' containers print: the PID file of the daemon in their pipe dir."""


@dataclass
class Seen:
    """What one container printed about itself."""

    namespace: str
    pod: str
    container: str
    devices: dict[str, dict[str, str]] = field(default_factory=dict)
    """Device name -> its ``GPU_DRA_<DEVICE>_*`` facts (UUID, PRODUCT, PROFILE, PARENT_UUID)."""
    env: dict[str, str] = field(default_factory=dict)
    """Every other ``KEY=value`` line (``CUDA_MPS_*``, ``MPS_DAEMON_PID``, ...)."""

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.pod}"


def parse_output(namespace: str, pod: str, container: str, log: str) -> Seen:
    seen = Seen(namespace, pod, container)
    for key, value in _ENV_LINE.findall(log):
        device_key = _DEVICE_KEY.match(key)
        if device_key:
            device = device_key[1].lower().replace("_", "-")
            seen.devices.setdefault(device, {})[device_key[2]] = value
        else:
            seen.env[key] = value
    return seen


def containers_seen(
    kube: Kube, namespace: str, pod: dict[str, Any], timeout: float = 30
) -> list[Seen]:
    """What each container of a running pod printed; waits until it printed its devices (and
    its MPS daemon's PID where its command prints one)."""
    name = pod["metadata"]["name"]
    seen = []
    for container in pod["spec"]["containers"]:
        wants_pid = MPS_PID_KEY in " ".join(container.get("command", []))
        deadline = time.monotonic() + timeout
        while True:
            found = parse_output(
                namespace, name, container["name"], kube.pod_log(name, namespace, container["name"])
            )
            if found.devices and (not wants_pid or found.env.get(MPS_PID_KEY)):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{namespace}/{name} {container['name']} printed no devices")
            time.sleep(0.5)
        seen.append(found)
    return seen


def wait_pods_running(kube: Kube, namespace: str, timeout: float = 180) -> list[str]:
    """The names of the namespace's pods once all run; `TimeoutError` naming why each that does
    not run waits (`why_not_running`)."""
    deadline = time.monotonic() + timeout
    while True:
        pods = kube.list("v1", "Pod", namespace=namespace)
        phases = {p["metadata"]["name"]: p["status"].get("phase") for p in pods}
        if pods and all(phase == "Running" for phase in phases.values()):
            return sorted(phases)
        if time.monotonic() > deadline:
            waiting = "; ".join(
                why_not_running(p) for p in pods if p["status"].get("phase") != "Running"
            )
            raise TimeoutError(
                f"pods in {namespace} not running after {timeout:.0f}s: {phases}; {waiting}"
            )
        time.sleep(1)


def why_not_running(pod: dict[str, Any]) -> str:
    """``<pod>: <phase>`` with what its status says against running: each condition not True
    (``PodScheduled: Unschedulable: 0/1 nodes are available ...``) and each container's
    waiting or terminated reason."""
    status = pod.get("status") or {}
    reasons = [
        f"{c['type']}: {c.get('reason', '')}: {c.get('message', '')}".rstrip(": ")
        for c in status.get("conditions") or []
        if c.get("status") != "True"
    ]
    for container in status.get("containerStatuses") or []:
        for state in ("waiting", "terminated"):
            detail = (container.get("state") or {}).get(state)
            if detail:
                reasons.append(
                    f"container {container['name']} {state}: {detail.get('reason', '')} "
                    f"{detail.get('message', '')}".rstrip()
                )
    phase = status.get("phase") or "no phase"
    return f"{pod['metadata']['name']}: {phase}" + "".join(f", {r}" for r in reasons)


@dataclass(frozen=True)
class Result:
    """One device the scheduler allocated to a claim."""

    claim: str
    request: str
    device: str
    share_id: str = ""
    consumed: tuple[tuple[str, str], ...] = ()
    """``consumedCapacity`` (MPS shares), as sorted (name, quantity) pairs."""


def claim_results(kube: Kube, namespace: str) -> dict[str, list[Result]]:
    """Allocated devices of every claim in the namespace, by claim name."""
    results: dict[str, list[Result]] = {}
    for claim in kube.list("resource.k8s.io/v1", "ResourceClaim", namespace=namespace):
        name = claim["metadata"]["name"]
        allocation = (claim.get("status") or {}).get("allocation") or {}
        results[name] = [
            Result(
                name,
                r["request"],
                r["device"],
                r.get("shareID") or "",
                tuple(sorted((r.get("consumedCapacity") or {}).items())),
            )
            for r in allocation.get("devices", {}).get("results", [])
        ]
    return results


def container_claims(pod: dict[str, Any], container: str) -> list[str]:
    """Names of the ResourceClaims a container uses: its pod claims (from the pod's status), or
    the claim the scheduler made for its extended resources (``nvidia.com/gpu: 1``)."""
    status = pod.get("status") or {}
    by_pod_claim = {
        s["name"]: s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or []
    }
    for entry in pod["spec"].get("resourceClaims") or []:
        if entry.get("resourceClaimName"):
            by_pod_claim[entry["name"]] = entry["resourceClaimName"]
    spec = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    names = [by_pod_claim[c["name"]] for c in (spec.get("resources") or {}).get("claims") or []]
    extended = status.get("extendedResourceClaimStatus") or {}
    if extended.get("resourceClaimName"):
        names.append(extended["resourceClaimName"])
    return names


# ---- the plugin's view of the node ---------------------------------------------------------


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance with its compute instance on a simulated GPU (made by dynamic MIG)."""

    parent_uuid: str
    profile_id: int
    start: int
    uuid: str
    """The MIG device's UUID (its compute instance's)."""


def simulated_gpus(driver: Driver) -> dict[str, dict[str, Any]]:
    """MIG mode and instances of every MIG-capable simulated GPU, by UUID: the plugin's
    ``simulated-nvml.json``, the simulated node's "hardware"."""
    path = driver.state_dir / SIMULATED_STATE_FILE
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    if saved.get("profile") != driver.profile:  # left by a run on another profile: not ours
        return {}
    return dict(saved["gpus"])


def mig_instances(driver: Driver) -> list[MigInstance]:
    return [
        MigInstance(parent, gi["profileId"], gi["start"], ci["uuid"])
        for parent, state in sorted(simulated_gpus(driver).items())
        for gi in state["gpuInstances"]
        for ci in gi["computeInstances"]
    ]


def mig_mode_on(driver: Driver) -> list[str]:
    """UUIDs of the simulated GPUs whose MIG mode is on (now or pending)."""
    return [u for u, s in sorted(simulated_gpus(driver).items()) if s["current"] or s["pending"]]


def time_slices(driver: Driver) -> dict[str, int]:
    """GPU UUID -> compute time slice the plugin set, for GPUs not at Default."""
    path = driver.state_dir / RECORD_FILE
    if not path.exists():
        return {}
    intervals = json.loads(path.read_text())["intervals"]
    return {uuid: value for uuid, value in intervals.items() if value != DEFAULT_INTERVAL}


@dataclass
class MpsDaemon:
    """An MPS control daemon as the plugin's metrics report it, with its claims' caps."""

    daemon_id: str
    claims: dict[str, dict[str, float]] = field(default_factory=dict)
    """``<ns>/<claim>`` -> ``{"threads": percent, "memory:<GPU UUID>": bytes}``."""


def mps_daemons(driver: Driver) -> dict[str, MpsDaemon]:
    """The MPS daemons of prepared claims by id, from the plugin's /metrics (read from its
    checkpoint at each scrape; `Driver.metrics_url`)."""
    with urllib.request.urlopen(driver.metrics_url, timeout=5) as response:  # noqa: S310 (http)
        text = response.read().decode()
    daemons: dict[str, MpsDaemon] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gpu_dra_mps_daemon_claims":
                daemons.setdefault(labels["daemon"], MpsDaemon(labels["daemon"]))
            elif sample.name == "gpu_dra_mps_claim_active_thread_percentage":
                daemon = daemons.setdefault(labels["daemon"], MpsDaemon(labels["daemon"]))
                daemon.claims.setdefault(labels["claim"], {})["threads"] = sample.value
            elif sample.name == "gpu_dra_mps_claim_pinned_memory_limit_bytes":
                daemon = daemons.setdefault(labels["daemon"], MpsDaemon(labels["daemon"]))
                caps = daemon.claims.setdefault(labels["claim"], {})
                caps[f"memory:{labels['gpu']}"] = sample.value
    return daemons
