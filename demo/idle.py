"""Getting idle GPUs back in the demo (docs/idle-reclaim.md, docs/metrics.md#right-sizing).

On the last stage the controller's idle policy is on with short intervals (demo/install.py,
``IDLE_RECLAIM``) and the notebook of 10-idle-notebook holds a whole H100 in namespace
``gpu-idle``, which opted in with a 20 s window. Through the simulator's
``<data-dir>/simulated-utilization.json`` the notebook works for a moment (`BURST_GPU` percent,
`CONTEXT_MEMORY` in a process of its pod, found by its cgroup) and then sits idle holding that
context and memory, as a forgotten notebook does. Once the plugin's metrics hold the burst, the
demo waits until the policy has warned the pod, then prints what a user would look at: the
claim's ``status.devices`` as the kubelet plugin wrote it (``Active=False``, ``idleSince``,
``sampledAt``), the pod's condition ``gpu.nvidia.com/GpuIdle``, the policy's Events (``kubectl
get events``), ``gpu-dra inventory --idle`` (its POLICY column) and ``gpu-dra rightsize -n
gpu-idle``: a 1g.10gb MIG slice would have held the notebook's peak. The pod keeps running
until its grace period ends. e2e/test_demo_examples.py asserts the output.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from demo.observe import claim_results
from demo.utilization import GIB, gpu_dra_cli
from e2e.driver import Driver
from e2e.kube import wait_for
from e2e.workloads import pids_of_pod
from gpu_dra.driver.cluster.idle_policy import CONDITION_TYPE, parse_time
from gpu_dra.kubelet_plugin.utilization.simulated_file import (
    SIMULATED_UTILIZATION_FILE,
    write_utilization,
)

NOTEBOOK: Final = ("gpu-idle", "notebook")
"""10-idle-notebook's claim, and its pod of the same name."""
BURST_GPU: Final = 10
"""The notebook's GPU utilization (and its process's SM percent) while it works."""
CONTEXT_MEMORY: Final = 6 * GIB
"""What its process holds, working and idle."""
IDLE_FOR: Final = "20s"
"""``gpu-dra inventory --idle --idle-for``: the namespace's window."""
ADVICE: Final = "a 1g.10gb MIG slice"
"""What ``gpu-dra rightsize`` recommends for 6 GiB at 10 % of an H100 with 10 % headroom."""
POLICY_REASONS: Final = ("GpuClaimIdle", "GpuClaimActive", "GpuClaimIdleEvicted")


@dataclass(frozen=True)
class IdleShown:
    """What `show_idle_reclaim` found, besides what it printed."""

    device: str
    """The notebook's device (a whole H100)."""
    status: list[dict[str, Any]]
    """The claim's ``status.devices`` entries of gpu.nvidia.com, when the demo printed them."""
    status_read_at: float
    """When `status` was read (seconds since the epoch)."""
    condition: dict[str, Any]
    """The pod's condition ``gpu.nvidia.com/GpuIdle``."""
    events: list[tuple[str, str, str, str]]
    """(type, kind, name, reason) of the policy's Events in the namespace."""
    idle: dict[str, Any]
    """The notebook's entry in ``gpu-dra inventory --idle -o json``."""
    advice: dict[str, Any]
    """Its device's entry in ``gpu-dra rightsize -o json``."""
    pod_phase: str
    """The pod's phase at the end: it is warned, not evicted (the grace period is 10 min)."""


def notebook_activity(pid: int, device: str, percent: float) -> dict[str, dict[str, Any]]:
    """The simulated-utilization.json picture: the notebook's GPU at `percent`, its process
    holding `CONTEXT_MEMORY` (every other device idle)."""
    process = {"pid": pid, "sm": percent, "usedMemoryBytes": CONTEXT_MEMORY}
    return {device: {"gpu": percent, "processes": [process]}}


def _advice(driver: Driver) -> dict[str, Any] | None:
    namespace, name = NOTEBOOK
    data = json.loads(gpu_dra_cli(driver, "rightsize", "-n", namespace, "-o", "json"))
    for claim in data["claims"]:
        if claim["name"] == name:
            (device,) = claim["devices"]
            return dict(device)
    return None


def _idle_entry(driver: Driver) -> dict[str, Any] | None:
    data = json.loads(gpu_dra_cli(driver, "inventory", "--idle", "--idle-for", IDLE_FOR,
                                  "-o", "json"))  # fmt: skip
    for claim in data["idleClaims"]:
        if (claim["namespace"], claim["name"]) == NOTEBOOK:
            return dict(claim)
    return None


def idle_condition(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == CONDITION_TYPE:
            return dict(condition)
    return None


def status_lines(entries: list[dict[str, Any]]) -> list[str]:
    """One line per ``status.devices`` entry: its Active condition and the data it rests on."""
    lines = []
    for entry in entries:
        data = entry.get("data") or {}
        facts = ", ".join(f"{k} {data[k]}" for k in ("idleSince", "sampledAt") if k in data)
        for condition in entry.get("conditions") or []:
            if condition.get("type") == "Active":
                lines.append(
                    f"{entry['pool']}/{entry['device']}: Active={condition['status']} "
                    f"({condition['reason']}), {facts}: {condition['message']}"
                )
    return lines


def _work_then_idle(driver: Driver, device: str, pid: int, say: Callable[[str], None]) -> float:
    """The notebook's burst until the plugin's peaks hold it, then 0 % with its memory held;
    when it went idle."""
    path = driver.state_dir / SIMULATED_UTILIZATION_FILE
    working = notebook_activity(pid, device, BURST_GPU)
    say(f"==> the notebook works for a moment ({path.name} in the plugin's data dir):")
    say(f"  {json.dumps(working)}")
    write_utilization(path, working)
    advice: dict[str, Any] | None = None

    def burst_seen() -> bool:
        nonlocal advice
        advice = _advice(driver)
        peak = (advice or {}).get("peak") or {}
        return (peak.get("memoryUsedBytes"), peak.get("gpuUtilizationPercent")) == (
            CONTEXT_MEMORY, BURST_GPU,
        )  # fmt: skip

    try:
        wait_for("the notebook's peak in the plugin's metrics", burst_seen, 60, 1)
    except TimeoutError as error:
        raise TimeoutError(f"{error}: rightsize says {advice}") from error
    idle = notebook_activity(pid, device, 0)
    say("==> then it sits idle, its CUDA context and memory still held (0 %, 6 GiB):")
    say(f"  {json.dumps(idle)}")
    write_utilization(path, idle)
    return time.time()


def _warning(driver: Driver, idle_from: float) -> dict[str, Any]:
    """The pod's condition once the policy warned it for the idle time from `idle_from` (not
    for the minutes before the burst, when it was idle too: that warning the burst clears)."""
    namespace, name = NOTEBOOK
    condition: dict[str, Any] | None = None

    def warned() -> bool:
        nonlocal condition
        condition = idle_condition(driver.kube.get("v1", "Pod", name, namespace))
        if condition is None or condition.get("status") != "True":
            return False
        at = parse_time(condition.get("lastTransitionTime"))
        return at is not None and at >= int(idle_from)

    try:
        wait_for(f"the idle policy to warn pod {namespace}/{name}", warned, 180, 2)
    except TimeoutError as error:
        raise TimeoutError(f"{error}: condition {condition}") from error
    assert condition is not None
    return condition


def _events(driver: Driver) -> list[tuple[str, str, str, str]]:
    """The policy's Events in the namespace, once the warning's are there on pod and claim."""
    namespace = NOTEBOOK[0]
    events: list[tuple[str, str, str, str]] = []

    def recorded() -> bool:  # posted right after the condition
        nonlocal events
        events = [
            (e.get("type", ""), e["involvedObject"]["kind"], e["involvedObject"]["name"],
             e["reason"])
            for e in driver.kube.list("v1", "Event", namespace=namespace)
            if e.get("reason") in POLICY_REASONS
        ]  # fmt: skip
        return {kind for _, kind, _, reason in events if reason == "GpuClaimIdle"} == {
            "Pod", "ResourceClaim",
        }  # fmt: skip

    wait_for("the idle policy's Events on the pod and the claim", recorded, 30, 1)
    return events


def _claim_status(driver: Driver) -> list[dict[str, Any]]:
    namespace, name = NOTEBOOK
    claim = driver.kube.get("resource.k8s.io/v1", "ResourceClaim", name, namespace)
    entries = (claim.get("status") or {}).get("devices") or []
    return [dict(e) for e in entries if e.get("driver") == "gpu.nvidia.com"]


def show_idle_reclaim(driver: Driver, say: Callable[[str], None]) -> IdleShown:
    """Make the notebook work, then idle; wait for the policy's warning and print it with the
    claim's status, the Events, ``gpu-dra inventory --idle`` and ``gpu-dra rightsize``."""
    kube, cluster = driver.kube, driver.cluster
    namespace, name = NOTEBOOK
    (device,) = [r.device for r in claim_results(kube, namespace)[name]]
    pids = pids_of_pod(kube.get("v1", "Pod", name, namespace)["metadata"]["uid"])
    if not pids:
        raise RuntimeError(f"no process of pod {namespace}/{name} on the node")
    idle_from = _work_then_idle(driver, device, pids[-1], say)
    say(f"  waiting for the idle policy: Active=False after 10 s, warned {IDLE_FOR} after the "
        "last activity (namespace annotation gpu.nvidia.com/idle-window)")  # fmt: skip
    condition = _warning(driver, idle_from)
    events = _events(driver)
    status = _claim_status(driver)
    status_read_at = time.time()

    say(f"\n==> the claim's status, written by the kubelet plugin (kubectl get resourceclaim "
        f"{name} -n {namespace} -o yaml: status.devices)")  # fmt: skip
    for line in status_lines(status):
        say(f"  {line}")
    say(f"==> the pod's condition {CONDITION_TYPE}, written by the controller's idle policy")
    say(f"  {condition['status']}, reason {condition['reason']}, since "
        f"{condition['lastTransitionTime']}: {condition['message']}")  # fmt: skip
    say(f"==> kubectl get events -n {namespace} --field-selector reason=GpuClaimIdle")
    say(cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                        "reason=GpuClaimIdle"))  # fmt: skip
    entry: dict[str, Any] | None = None

    def listed() -> bool:
        nonlocal entry
        entry = _idle_entry(driver)
        return entry is not None

    wait_for(f"{namespace}/{name} in gpu-dra inventory --idle", listed, 30, 1)
    assert entry is not None
    say(f"==> gpu-dra inventory --idle --idle-for {IDLE_FOR}")
    say(gpu_dra_cli(driver, "inventory", "--idle", "--idle-for", IDLE_FOR))
    say(f"==> gpu-dra rightsize -n {namespace}")
    say(gpu_dra_cli(driver, "rightsize", "-n", namespace))
    advice = _advice(driver)
    if advice is None:
        raise RuntimeError(f"gpu-dra rightsize gave no advice for {namespace}/{name}")
    phase = str((kube.get("v1", "Pod", name, namespace).get("status") or {}).get("phase"))
    say(f"(pod {namespace}/{name} is {phase}: evicted when its grace period ends, unless its GPU "
        "is used again)")  # fmt: skip
    return IdleShown(device, status, status_read_at, condition, events, entry, advice, phase)
