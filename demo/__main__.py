"""The gpu-dra demo: a real local cluster, the driver on a simulated 8-GPU node, NVIDIA-style
claims from demo/examples, and what each pod received. Run through `demo/run` (as root).

The cluster is left running so you can look around; `.venv/bin/python -m e2e.cluster down`
removes it.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import yaml

from e2e.cluster import Cluster, ClusterError
from e2e.driver import PLUGIN, Driver
from e2e.kube import Kube

DEMO = Path(__file__).resolve().parent
EXAMPLES = DEMO / "examples"
PROFILE = DEMO / "node.yaml"
_GPU_LINE = re.compile(r"^GPU_DRA_(GPU_\d+)_(UUID|PRODUCT)=(.*)$", re.M)


def say(text: str) -> None:
    print(text, flush=True)


def namespace_of(example: Path) -> str:
    for document in yaml.safe_load_all((example / "example.yaml").read_text()):
        if document and document.get("kind") == "Namespace":
            return str(document["metadata"]["name"])
    raise ValueError(f"{example} has no Namespace")


def wait_pods_running(kube: Kube, namespace: str, timeout: float = 180) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        pods = kube.list("v1", "Pod", namespace=namespace)
        phases = {p["metadata"]["name"]: p["status"].get("phase") for p in pods}
        if pods and all(phase == "Running" for phase in phases.values()):
            return sorted(phases)
        if time.monotonic() > deadline:
            raise TimeoutError(f"pods in {namespace} not running after {timeout:.0f}s: {phases}")
        time.sleep(1)


def received(kube: Kube, namespace: str, pod: dict[str, object]) -> list[tuple[str, str, str]]:
    """(container, device, 'UUID product') for each GPU the container printed."""
    rows = []
    name = pod["metadata"]["name"]  # type: ignore[index]
    for container in pod["spec"]["containers"]:  # type: ignore[index]
        log = kube.pod_log(name, namespace, container["name"])
        found: dict[str, dict[str, str]] = {}
        for device, key, value in _GPU_LINE.findall(log):
            found.setdefault(device, {})[key] = value
        for device, facts in sorted(found.items()):
            rows.append(
                (
                    container["name"],
                    device.lower().replace("_", "-"),
                    f"{facts.get('UUID', '?')}  {facts.get('PRODUCT', '?')}",
                )
            )
    return rows


def main() -> int:
    cluster = Cluster()
    say("==> bringing up the local Kubernetes cluster (e2e/cluster)")
    try:
        cluster.up()
    except ClusterError as error:
        say(f"error: {error}")
        return 1
    kube = Kube(cluster.kubeconfig)
    driver = Driver(cluster, kube, str(PROFILE))
    say(f"==> installing gpu-dra (RBAC, DeviceClasses) and its kubelet plugin on {PROFILE.name}")
    driver.install()
    if cluster.pid(PLUGIN):
        driver.stop_plugin()
    driver.start_plugin()

    say("\n==> kubectl get deviceclasses")
    say(cluster.kubectl("get", "deviceclasses"))
    say("==> kubectl get resourceslices")
    say(cluster.kubectl("get", "resourceslices", "-o", "wide"))
    slice_name = driver.slices()[0]["metadata"]["name"]
    say(f"==> kubectl describe resourceslice {slice_name}")
    say(cluster.kubectl("describe", "resourceslice", slice_name))

    table: list[tuple[str, str, str, str]] = []
    for example in sorted(p for p in EXAMPLES.iterdir() if p.is_dir()):
        title = (example / "README.md").read_text().splitlines()[0].lstrip("# ")
        say(f"==> example {example.name}: {title}")
        cluster.kubectl("apply", "-f", str(example / "example.yaml"))
        namespace = namespace_of(example)
        for pod_name in wait_pods_running(kube, namespace):
            pod = kube.get("v1", "Pod", pod_name, namespace)
            for container, device, what in received(kube, namespace, pod):
                table.append((f"{namespace}/{pod_name}", container, device, what))

    say("\n==> what each pod received (from the containers' own environment)")
    rows = [("POD", "CONTAINER", "DEVICE", "GPU"), *table]
    widths = [max(len(row[i]) for row in rows) for i in range(3)] + [0]
    for row in rows:
        say("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    say("\n==> kubectl get resourceclaims -A")
    say(cluster.kubectl("get", "resourceclaims", "-A"))
    say(
        "The cluster keeps running (as root, from the repo root):\n"
        "  look around:  .venv/bin/python -m e2e.cluster kubectl get pods -A\n"
        "  remove it:    .venv/bin/python -m e2e.cluster down"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
