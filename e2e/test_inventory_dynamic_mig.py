"""`gpu-dra inventory` on a simulated hgx-h100 node with --dynamic-mig: once a pod holds five
1g.10gb slices of one H100, the scheduler cannot allocate that GPU whole (its shared counters are
used up), and inventory says so: the GPU is ``blocked`` with the claim using its counters, and
the classes count only what can still be allocated; ``--devices`` puts each GPU's 14 placements
(the default MIG policy) on one line."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from e2e import manifests as m
from e2e.cluster import Cluster, versions
from e2e.driver import BIN, Driver
from e2e.kube import Kube
from e2e.mig import mig_request
from e2e.workloads import allocated_devices, delete_pods, wait_running

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mig_left")]

SIMULATED_PROFILE = "hgx-h100"
DYNAMIC_MIG = True
SLICES = [f"slice-{n}" for n in range(5)]


def inventory(cluster: Cluster, *args: str) -> str:
    done = subprocess.run(
        [str(BIN / "gpu-dra"), "inventory", *args, f"--kubeconfig={cluster.kubeconfig}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def inventory_json(cluster: Cluster) -> Any:
    return json.loads(inventory(cluster, "-o", "json"))


def test_five_slices_of_one_h100_block_it_whole_in_the_inventory(
    driver: Driver, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    spec = m.claim_spec([mig_request(name, "1g.10gb") for name in SLICES])
    spec["devices"]["constraints"] = [{"matchAttribute": "gpu.nvidia.com/parentUUID"}]
    kube.create(m.claim("five", namespace, spec))
    kube.create(m.gpu_pod("pod-five", namespace, claim="five"))
    wait_running(kube, "pod-five", namespace, timeout=120)
    held = allocated_devices(kube, "five", namespace)
    parents = {name.split("-mig-")[0] for name in held}
    assert len(held) == 5
    assert len(parents) == 1, held
    (parent,) = parents

    data = inventory_json(cluster)
    rows = {row["device"]: row for row in data["devices"]}
    assert len(rows) == 8 * 15  # default policy: 1g x7, 2g x3, 3g x2, 4g, 7g and the whole GPU
    assert rows[parent]["state"] == "blocked"
    assert rows[parent]["reason"] == f"counters of {parent}-counter-set used by {namespace}/five"
    assert {rows[name]["state"] for name in held} == {"allocated"}
    others = [r for name, r in rows.items() if not name.startswith(f"{parent}-") and name != parent]
    assert {r["state"] for r in others} == {"free"}
    placements = [r for name, r in rows.items() if name.startswith(f"{parent}-mig-")]
    blocked = [r for r in placements if r["state"] == "blocked"]
    assert {r["reason"] for r in blocked} == {rows[parent]["reason"]}
    assert [r for r in placements if r["device"].startswith(f"{parent}-mig-7g")] == [
        r for r in blocked if r["device"].startswith(f"{parent}-mig-7g")
    ]
    node = data["nodes"][versions.NODE_NAME]
    free_on_parent = sum(r["state"] == "free" for r in placements)
    assert (node["allocated"], node["blocked"]) == (5, 1 + len(blocked))
    assert node["free"] == 7 * 15 + free_on_parent
    classes = {c["name"]: (c["total"], c["free"], c["blocked"]) for c in data["classes"]}
    assert classes["gpu.nvidia.com"] == (8, 7, 1)
    assert classes["hopper.gpu.nvidia.com"] == (8, 7, 1)
    assert classes["mig-7g.gpu.nvidia.com"] == (8, 7, 1)
    assert classes["mig-4g.gpu.nvidia.com"] == (8, 7, 1)  # five of seven 1g slices reach 0-3
    assert classes["mig.nvidia.com"] == (112, 7 * 14 + free_on_parent, len(blocked))

    # The table: a GPU's 14 placements on one line each, the holder counted once per device.
    table = inventory(cluster, "--devices").splitlines()
    group = next(line for line in table if f" {parent}-mig-* (14) " in line)
    assert f"{free_on_parent} free, 5 allocated, {len(blocked)} blocked (" in group
    assert f"{namespace}/five x5" in group  # one claim, five requests, five devices
    assert sum("-mig-* (14) " in line for line in table) == 8
    assert sum(" 14 free " in line for line in table) == 7
    assert not any(f" {parent}-mig-1g" in line for line in table)

    delete_pods(kube, namespace, ["pod-five"])
    kube.delete("resource.k8s.io/v1", "ResourceClaim", "five", namespace)
    kube.wait_gone("resource.k8s.io/v1", "ResourceClaim", "five", namespace)
    after = inventory_json(cluster)
    assert {row["state"] for row in after["devices"]} == {"free"}
