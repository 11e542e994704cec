"""Utilization per claim in the demo (docs/metrics.md): an idle and a busy claim side by side.

On the last stage's examples the simulated GPUs are made to work through the simulator's
``<data-dir>/simulated-utilization.json`` (the plugin pod's data dir is a host path): the whole
H100 of the per-claim MPS claim (08) at 85 %, and on the A100 offered as MPS shares (07) one
process of the ``large`` share's pod (found by its cgroup, as the plugin maps processes to
claims) at 35 % of the SMs; every other claim's devices stay idle. The demo waits until the
plugin's metrics show it, then prints ``gpu-dra inventory --utilization`` (each claim's devices
with utilization, memory and idle time), ``gpu-dra inventory --idle`` and ``gpu-dra rightsize``
for the shares' namespace (the busy share's peaks and a smaller share that holds them, the idle
shares called unused), which read the plugin pod's /metrics through the apiserver's pod proxy.
e2e/test_demo_examples.py asserts the output.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from demo.observe import claim_results
from e2e.driver import BIN, Driver
from e2e.kube import wait_for
from e2e.workloads import pids_of_pod
from gpu_dra.kubelet_plugin.utilization.simulated_file import (
    SIMULATED_UTILIZATION_FILE,
    write_utilization,
)

GIB: Final = 2**30
BUSY_GPU_CLAIM: Final = ("gpu-mps", "mps-gpu")
"""08-per-claim-mps: its whole GPU busy."""
BUSY_GPU: Final = {"gpu": 85, "memory": 40, "memoryUsedBytes": 16 * GIB}
BUSY_SHARE_CLAIM: Final = ("gpu-mps-shares", "large")
"""07-mps-shares: the share whose pod (named as its claim) runs a busy process."""
BUSY_SHARE_SM: Final = 35
BUSY_SHARE_MEMORY: Final = 12 * GIB
IDLE_CLAIMS: Final = (("gpu-mps-shares", "small"), ("gpu-mps-shares", "medium"))
"""Claims that must show idle; besides them, every claim of 09-time-slicing's namespace."""
IDLE_NAMESPACE: Final = "gpu-ts"
IDLE_FOR: Final = "20s"
"""The window of ``gpu-dra inventory --idle`` (the idle claims are idle since they started)."""
RIGHTSIZE_NAMESPACE: Final = BUSY_SHARE_CLAIM[0]
"""``gpu-dra rightsize -n`` this: the busy share and the idle ones beside it."""


def gpu_dra_cli(driver: Driver, *args: str) -> str:
    """``gpu-dra <args>`` against the cluster (the installed CLI, as a user runs it); its
    output, or a RuntimeError with its exit status and stderr."""
    done = subprocess.run(
        [str(BIN / "gpu-dra"), *args, f"--kubeconfig={driver.cluster.kubeconfig}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"gpu-dra {' '.join(args)}: exit {done.returncode}: {done.stderr}")
    return done.stdout


@dataclass(frozen=True)
class Shown:
    """What `show_utilization` found, besides what it printed."""

    busy: dict[str, float]
    """``<ns>/<claim>`` -> GPU utilization percent, for the two busy claims."""
    idle: set[str]
    """``<ns>/<claim>`` of every claim ``gpu-dra inventory --idle`` listed."""
    devices: dict[str, dict[str, Any]]
    """What was written into simulated-utilization.json, by device name."""
    advice: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``<ns>/<claim>`` -> its device's entry in ``gpu-dra rightsize -o json``, for the claims
    of `RIGHTSIZE_NAMESPACE`."""


def simulated_activity(driver: Driver) -> dict[str, dict[str, Any]]:
    """The simulated-utilization.json picture, by device name: the busy claim's GPU, and the
    shared GPU with one process of the busy share's pod."""
    kube = driver.kube
    (gpu,) = [r.device for r in claim_results(kube, BUSY_GPU_CLAIM[0])[BUSY_GPU_CLAIM[1]]]
    (share,) = claim_results(kube, BUSY_SHARE_CLAIM[0])[BUSY_SHARE_CLAIM[1]]
    pod = kube.get("v1", "Pod", BUSY_SHARE_CLAIM[1], BUSY_SHARE_CLAIM[0])
    pids = pids_of_pod(pod["metadata"]["uid"])
    if not pids:
        raise RuntimeError(f"no process of pod {'/'.join(BUSY_SHARE_CLAIM)} on the node")
    process = {"pid": pids[-1], "sm": BUSY_SHARE_SM, "usedMemoryBytes": BUSY_SHARE_MEMORY}
    return {
        gpu: dict(BUSY_GPU),
        share.device: {"gpu": BUSY_SHARE_SM, "processes": [process]},
    }


def _claim_gpu_percent(driver: Driver) -> tuple[dict[str, float], list[str]]:
    """GPU utilization by ``<ns>/<claim>`` (claims with one device reporting it) and the CLI's
    warnings, from ``gpu-dra inventory --utilization -o json``."""
    data = json.loads(gpu_dra_cli(driver, "inventory", "--utilization", "-o", "json"))
    percents = {
        f"{use['namespace']}/{use['claim']}": float(use["gpuUtilizationPercent"])
        for use in data.get("claimUtilization", [])
        if use.get("gpuUtilizationPercent") is not None
    }
    return percents, list(data.get("warnings", []))


def _idle_claims(driver: Driver) -> tuple[set[str], list[str]]:
    args = ("inventory", "--idle", "--idle-for", IDLE_FOR, "-o", "json")
    data = json.loads(gpu_dra_cli(driver, *args))
    idle = {f"{c['namespace']}/{c['name']}" for c in data["idleClaims"]}
    return idle, list(data["warnings"])


def show_utilization(driver: Driver, say: Callable[[str], None]) -> Shown:
    """Make the busy claims busy, wait until the plugin's metrics and the idle view show it,
    print ``gpu-dra inventory --utilization`` and ``--idle``."""
    devices = simulated_activity(driver)
    path = driver.state_dir / SIMULATED_UTILIZATION_FILE
    say(f"==> simulated GPU activity: {path.name} in the plugin's data dir ({driver.data_dir})")
    busy_gpu, busy_share = "/".join(BUSY_GPU_CLAIM), "/".join(BUSY_SHARE_CLAIM)
    for device, activity in sorted(devices.items()):
        whose = f"a process of the pod of {busy_share}" if "processes" in activity else busy_gpu
        say(f"  {device}, busy for {whose}: {json.dumps(activity)}")
    say("  (every other device idle: the file names only the busy ones)")
    write_utilization(path, devices)

    busy = {busy_gpu: BUSY_GPU["gpu"], busy_share: BUSY_SHARE_SM}
    seen: dict[str, float] = {}
    warnings: list[str] = []

    def busy_shown() -> bool:
        nonlocal seen, warnings
        percents, warnings = _claim_gpu_percent(driver)
        seen = {claim: percents[claim] for claim in busy if claim in percents}
        return seen == busy

    try:
        wait_for("the busy claims' utilization in the plugin's metrics", busy_shown, 60, 1)
    except TimeoutError as error:
        raise TimeoutError(f"{error}: shown {seen}, warnings {warnings}") from error

    expected_idle = {"/".join(claim) for claim in IDLE_CLAIMS}
    idle: set[str] = set()

    def idle_shown() -> bool:
        nonlocal idle, warnings
        idle, warnings = _idle_claims(driver)
        in_namespace = any(claim.startswith(f"{IDLE_NAMESPACE}/") for claim in idle)
        return expected_idle <= idle and in_namespace and not set(busy) & idle

    try:
        wait_for(f"the idle claims to be idle for {IDLE_FOR}", idle_shown, 90, 2)
    except TimeoutError as error:
        raise TimeoutError(f"{error}: idle {sorted(idle)}, warnings {warnings}") from error

    say("\n==> gpu-dra inventory --utilization")
    say(gpu_dra_cli(driver, "inventory", "--utilization"))
    say(f"==> gpu-dra inventory --idle --idle-for {IDLE_FOR}")
    say(gpu_dra_cli(driver, "inventory", "--idle", "--idle-for", IDLE_FOR))
    say(f"==> gpu-dra rightsize -n {RIGHTSIZE_NAMESPACE}")
    say(gpu_dra_cli(driver, "rightsize", "-n", RIGHTSIZE_NAMESPACE))
    return Shown(seen, idle, devices, _advice(driver))


def _advice(driver: Driver) -> dict[str, dict[str, Any]]:
    data = json.loads(gpu_dra_cli(driver, "rightsize", "-n", RIGHTSIZE_NAMESPACE, "-o", "json"))
    return {
        f"{claim['namespace']}/{claim['name']}": device
        for claim in data["claims"]
        for device in claim["devices"]
    }
