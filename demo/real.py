"""The demo's real-mode stage (`demo/run --real`): gpu-dra's kubelet plugin WITHOUT
``--simulate``, on a fake DGX H100 driver root whose ``libnvidia-ml.so.1`` is the NVML mock
library built from NVIDIA's go-nvml mock servers (`e2e.realnode`), with ``--dynamic-mig``.
Three pods of a glibc image (one GPU, two GPUs, a 1g.10gb MIG slice made at prepare) get the
driver's userspace through the CDI spec, and the demo prints each container's ``nvidia-smi -L``:
exactly its claim's GPUs. They keep running, with the cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from e2e import manifests as m
from e2e.cluster import Cluster
from e2e.driver import CDI_ROOT, PLUGIN, Driver
from e2e.kube import Kube, wait_for
from e2e.mig import mig_request
from e2e.realnode import RealNode, finished_log, section
from e2e.workloads import allocated_devices, claim_uid, wait_running

NAMESPACE = "gpu-real-node"
# nvidia-smi -L between markers, then the container waits (its log stays readable).
COMMAND = "trap 'exit 0' TERM; echo '--- smi'; nvidia-smi -L; echo '--- end'; sleep 3600 & wait"
CLAIMS: dict[str, m.Obj] = {
    "one-gpu": m.claim_spec([m.request()]),
    "two-gpus": m.claim_spec([m.request(count=2)]),
    "mig-1g": m.claim_spec([mig_request("mig", "1g.10gb")]),
}


def _smi_output(kube: Kube, pod: str) -> str:
    wait_running(kube, pod, NAMESPACE, timeout=120)
    return section(finished_log(kube, pod, NAMESPACE), "smi").rstrip()


def _spec_summary(uid: str) -> str:
    """What the claim's CDI spec carries: counts of libraries, binaries, nodes, hooks."""
    (path,) = CDI_ROOT.glob(f"*{uid}*")
    spec: dict[str, Any] = yaml.safe_load(path.read_text())
    common = spec.get("containerEdits", {})
    mounts = [mo["containerPath"] for mo in common.get("mounts", [])]
    libs = [p for p in mounts if ".so" in Path(p).name]
    bins = [p for p in mounts if "/bin/" in p]
    hooks = sorted({h["args"][1] for h in common.get("hooks", []) if len(h.get("args", [])) > 1})
    nodes = [n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])]
    return (
        f"{len(libs)} libraries, {len(bins)} programs, "
        f"{len(mounts) - len(libs) - len(bins)} other files (firmware, sockets); "
        f"device nodes {', '.join(nodes)}; hooks {', '.join(hooks)}"
    )


def remove_real_stage(driver: Driver) -> None:
    """Delete the namespace of an earlier real-mode run while its plugin still runs (so it
    unprepares the claims: MIG instances destroyed, CDI specs removed), then stop the plugin.
    The driver root stays until `RealNode.create` rebuilds it (or `e2e.cluster down`)."""
    kube = driver.kube
    if any(n["metadata"]["name"] == NAMESPACE for n in kube.list("v1", "Namespace")):
        kube.delete("v1", "Namespace", NAMESPACE)
        kube.wait_gone("v1", "Namespace", NAMESPACE, None, timeout=180)
        wait_for(
            "the real-mode claims to be unprepared", lambda: not driver.checkpoint_claims(), 120
        )
    if driver.cluster.pid(PLUGIN):
        driver.stop_plugin()


def run_real_stage(cluster: Cluster, kube: Kube, say: Callable[[str], None]) -> Driver:
    """Start the real-mode plugin, run the three pods, print each container's nvidia-smi -L."""
    remove_real_stage(Driver(cluster, kube, "dgxh100"))
    say("==> building the fake DGX H100 driver root (NVML mock from NVIDIA's go-nvml data)")
    real = RealNode.create(cluster.paths, "dgxh100")
    driver = Driver(cluster, kube, "dgxh100", dynamic_mig=True, real=real)
    driver.install()
    say(f"==> kubelet plugin: {' '.join(real.plugin_args())} --dynamic-mig")
    driver.start_plugin()
    image = driver.ensure_glibc_image()
    kube.create_namespace(NAMESPACE)
    for name, spec in CLAIMS.items():
        kube.create(m.claim(name, NAMESPACE, spec))
        kube.create(real.pod(name, NAMESPACE, name, image, COMMAND))
    for name in CLAIMS:
        output = _smi_output(kube, name)
        devices = ", ".join(allocated_devices(kube, name, NAMESPACE))
        say(f"\n--- pod {NAMESPACE}/{name}: claim allocated {devices}")
        say(f"  CDI spec: {_spec_summary(claim_uid(kube, name, NAMESPACE))}")
        say("  $ nvidia-smi -L")
        for line in output.splitlines():
            say(f"  {line}")
    return driver
