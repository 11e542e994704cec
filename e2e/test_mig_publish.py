"""Dynamic MIG publication end to end (issue 4): a simulated hgx-h100 node (eight H100s) with
``--dynamic-mig``. The real apiserver takes the partitionable form (counter slices and device
slices of the split layout, Kubernetes 1.35+), and the real scheduler allocates from it: MIG
placements of one GPU that do not overlap, never a placement twice, never the whole GPU next to a
slice of it; the default ``--dynamic-mig-profiles`` offers ``4g`` (one placement per GPU), and a
profile it leaves out (``1g.10gb+me``) is not offered. What the pods do once scheduled (the MIG
device made at prepare) is the lifecycle's e2e (test_mig_dynamic.py); these tests look at
allocations."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest

from e2e import manifests as m
from e2e.cluster import Cluster, versions
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import allocated_devices
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.model import MigPartition
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.slices import MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
from gpu_dra.kubelet_plugin.node_devices import NodeInventory

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = "hgx-h100"


@pytest.fixture(scope="module")
def driver(cluster: Cluster, kube: Kube) -> Iterator[Driver]:
    """gpu-dra on the node with ``--dynamic-mig``."""
    running = Driver(cluster, kube, SIMULATED_PROFILE, dynamic_mig=True)
    running.install()
    running.start_plugin()
    yield running
    running.stop_plugin()


@cache
def inventory() -> NodeInventory:
    """What the plugin publishes: its own discovery and inventory code on the same profile."""
    host = SimulatedHost.load(SIMULATED_PROFILE, versions.NODE_NAME)
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    return NodeInventory.from_discovery(found, simulated=True, dynamic_mig=True)


def partition(name: str) -> MigPartition:
    found = inventory().by_name(name)
    assert isinstance(found, MigPartition), name
    return found


def wait_allocated(kube: Kube, claim: str, namespace: str, timeout: float = 90) -> list[str]:
    def allocated() -> bool:
        status = kube.get("resource.k8s.io/v1", "ResourceClaim", claim, namespace).get("status")
        return bool(status and status.get("allocation"))

    wait_for(f"claim {namespace}/{claim} to be allocated", allocated, timeout)
    return allocated_devices(kube, claim, namespace)


def scheduling_failures(kube: Kube, namespace: str, pod: str) -> list[str]:
    return [
        e["message"] for e in kube.events_for(namespace, pod) if e["reason"] == "FailedScheduling"
    ]


def claim_pod(namespace: str, name: str, claim: str) -> dict[str, Any]:
    return m.gpu_pod(name, namespace, claim=claim)


def test_apiserver_takes_counter_slices_and_device_slices_as_the_core_builds_them(
    driver: Driver,
) -> None:
    slices = driver.slices()
    generation = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s["spec"] for s in slices if s["spec"]["pool"]["generation"] == generation]
    counter_slices = [s for s in current if "sharedCounters" in s]
    device_slices = [s for s in current if s.get("devices")]

    # split layout: counter sets apart from devices, at most 64 devices with counters per slice
    assert all(not s.get("devices") for s in counter_slices)
    sets = {c["name"]: c for s in counter_slices for c in s["sharedCounters"]}
    assert sets == {c["name"]: c for c in inventory().counter_sets()}
    assert sorted(sets) == sorted(f"gpu-{minor}-counter-set" for minor in range(8))
    assert all(
        len(s.get("devices", [])) <= MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS for s in current
    )
    assert {s["pool"]["resourceSliceCount"] for s in current} == {len(current)}

    # every device, as the pure core renders it (names, attributes, capacities, consumption)
    published = {d["name"]: d for s in device_slices for d in s["devices"]}
    expected = {d["name"]: d for d in inventory().published_devices()}
    # the default --dynamic-mig-profiles (1g, 2g, 3g, 4g, 7g): 14 placements and the whole GPU
    assert len(published) == len(expected) == 8 * 15
    assert published == expected
    slice_3g = published["gpu-2-mig-3g40gb-9-4"]
    assert "uuid" not in slice_3g["attributes"]
    assert slice_3g["attributes"]["profile"] == {"string": "3g.40gb"}
    assert slice_3g["consumesCounters"][0]["counterSet"] == "gpu-2-counter-set"


def test_scheduler_puts_two_1g_slices_on_one_gpu_on_placements_that_do_not_overlap(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    request = m.request("slices", "mig-1g.gpu.nvidia.com", count=2)
    spec = m.claim_spec([request])
    spec["devices"]["constraints"] = [{"matchAttribute": "gpu.nvidia.com/parentUUID"}]
    kube.create(m.claim("two-slices", namespace, spec))
    kube.create(claim_pod(namespace, "two-slices-pod", "two-slices"))

    names = wait_allocated(kube, "two-slices", namespace)

    assert len(names) == 2
    first, second = (partition(name) for name in names)
    assert first.parent == second.parent  # matchAttribute parentUUID
    assert first.profile.slice_count == second.profile.slice_count == 1  # the 1g family
    assert not set(first.memory_slices) & set(second.memory_slices), names
    claim = kube.get("resource.k8s.io/v1", "ResourceClaim", "two-slices", namespace)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert {(r["driver"], r["pool"]) for r in results} == {("gpu.nvidia.com", versions.NODE_NAME)}


def test_whole_gpu_is_refused_while_a_slice_of_it_is_allocated(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    kube.create(
        m.claim("half", namespace, m.claim_spec([m.request("half", "mig-3g.gpu.nvidia.com")]))
    )
    kube.create(claim_pod(namespace, "half-pod", "half"))
    (slice_name,) = wait_allocated(kube, "half", namespace)
    parent = partition(slice_name).parent

    # The whole of that same GPU: the scheduler must refuse it (its memory slices are taken).
    same_gpu = [f"device.attributes['gpu.nvidia.com'].uuid == '{parent.uuid}'"]
    whole = m.claim_spec([m.request("whole", "gpu.nvidia.com", selectors=same_gpu)])
    kube.create(m.claim("whole", namespace, whole))
    kube.create(claim_pod(namespace, "whole-pod", "whole"))
    wait_for(
        "a FailedScheduling event for the whole GPU",
        lambda: bool(scheduling_failures(kube, namespace, "whole-pod")),
        90,
    )
    pod = kube.get("v1", "Pod", "whole-pod", namespace)
    assert pod["status"].get("phase") == "Pending"
    assert not pod["spec"].get("nodeName")
    claim = kube.get("resource.k8s.io/v1", "ResourceClaim", "whole", namespace)
    assert not (claim.get("status") or {}).get("allocation")

    # ... and the same slice is not handed out twice: a second 3g request gets the other half.
    kube.create(m.claim("other-half", namespace, m.claim_spec([m.request(
        "half", "mig-3g.gpu.nvidia.com",
        selectors=[f"device.attributes['gpu.nvidia.com'].parentUUID == '{parent.uuid}'"],
    )])))  # fmt: skip
    kube.create(claim_pod(namespace, "other-half-pod", "other-half"))
    (other_name,) = wait_allocated(kube, "other-half", namespace)
    assert other_name != slice_name
    assert not set(partition(other_name).memory_slices) & set(partition(slice_name).memory_slices)

    # Once both slices are gone, the whole GPU fits.
    for pod_name, claim_name in (("half-pod", "half"), ("other-half-pod", "other-half")):
        kube.delete("v1", "Pod", pod_name, namespace)
        kube.wait_gone("v1", "Pod", pod_name, namespace, timeout=90)
        kube.delete("resource.k8s.io/v1", "ResourceClaim", claim_name, namespace)
        kube.wait_gone("resource.k8s.io/v1", "ResourceClaim", claim_name, namespace, timeout=90)
    assert wait_allocated(kube, "whole", namespace, timeout=120) == [f"gpu-{parent.minor}"]


def test_a_profile_outside_the_default_policy_is_not_offered(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    """Issue 15: the default policy publishes no +me partition, so a claim for one stays pending."""
    assert not any("-me-" in name for name in driver.devices())
    media = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb+me'"
    kube.create(
        m.claim(
            "media",
            namespace,
            m.claim_spec([m.request("media", "mig-1g.gpu.nvidia.com", selectors=[media])]),
        )
    )
    kube.create(claim_pod(namespace, "media-pod", "media"))
    wait_for(
        "a FailedScheduling event for the 1g.10gb+me claim",
        lambda: bool(scheduling_failures(kube, namespace, "media-pod")),
        90,
    )
    assert kube.get("v1", "Pod", "media-pod", namespace)["status"].get("phase") == "Pending"
    claim = kube.get("resource.k8s.io/v1", "ResourceClaim", "media", namespace)
    assert not (claim.get("status") or {}).get("allocation")


def test_the_default_policy_offers_the_catalogs_4g_class(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    """Issue 15: 4g is in the default policy, one placement per H100 (4g.40gb at slice 0)."""
    fours = sorted(n for n in driver.devices() if n.split("-mig-")[-1].startswith("4g"))
    assert fours == sorted(f"gpu-{minor}-mig-4g40gb-5-0" for minor in range(8))
    kube.create(
        m.claim("four", namespace, m.claim_spec([m.request("four", "mig-4g.gpu.nvidia.com")]))
    )
    kube.create(claim_pod(namespace, "four-pod", "four"))
    (device,) = wait_allocated(kube, "four", namespace, timeout=120)
    assert device in fours
