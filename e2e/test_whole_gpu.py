"""Whole GPUs end to end: NVIDIA-style manifests on a simulated mixed node (2x A100 80GB PCIe,
2x L4), through the real scheduler, kubelet and containerd with our CDI specs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from e2e import manifests as m
from e2e.cluster import Cluster
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import allocated_devices, gpus_seen, wait_running

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = "mixed"


def pod_claim_name(kube: Kube, pod: str, namespace: str) -> str:
    statuses = kube.get("v1", "Pod", pod, namespace)["status"]["resourceClaimStatuses"]
    return str(statuses[0]["resourceClaimName"])


def test_slice_publishes_nvidia_compatible_attributes(driver: Driver, cluster: Cluster) -> None:
    devices = driver.devices()
    assert sorted(devices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    products = sorted(d["attributes"]["productName"]["string"] for d in devices.values())
    assert products == ["NVIDIA A100 80GB PCIe"] * 2 + ["NVIDIA L4"] * 2
    a100 = next(
        d
        for d in devices.values()
        if d["attributes"]["productName"]["string"].startswith("NVIDIA A")
    )
    attrs = a100["attributes"]
    assert attrs["type"] == {"string": "gpu"}
    assert attrs["architecture"] == {"string": "Ampere"}
    assert attrs["brand"] == {"string": "Nvidia"}
    assert attrs["cudaComputeCapability"] == {"version": "8.0.0"}
    assert set(attrs["driverVersion"]) == {"version"}
    assert re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", attrs["uuid"]["string"])
    assert re.fullmatch(
        r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]",
        attrs["resource.kubernetes.io/pciBusID"]["string"],
    )
    assert a100["capacity"]["memory"]["value"] == "80Gi"
    slices = driver.slices()
    assert all(s["spec"]["pool"]["name"] == "gpu-dra-node" for s in slices)
    assert all(s["metadata"]["ownerReferences"][0]["kind"] == "Node" for s in slices)
    described = cluster.kubectl("describe", "resourceslice", slices[0]["metadata"]["name"])
    assert "NVIDIA A100 80GB PCIe" in described
    assert "Cuda Compute Capability" in described or "cudaComputeCapability" in described


def test_one_gpu_per_pod_and_two_pods_get_different_gpus(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    kube.create(m.claim_template("single-gpu", namespace, m.claim_spec([m.request()])))
    for name in ("pod1", "pod2"):
        kube.create(m.gpu_pod(name, namespace, template="single-gpu"))
    seen = {}
    for name in ("pod1", "pod2"):
        wait_running(kube, name, namespace)
        gpus = gpus_seen(kube, name, namespace)
        assert len(gpus) == 1, gpus
        (device,) = allocated_devices(kube, pod_claim_name(kube, name, namespace), namespace)
        assert list(gpus.values()) == [driver.uuid_of(device)]
        seen[name] = device
    assert seen["pod1"] != seen["pod2"]


def test_two_containers_share_one_claim(driver: Driver, kube: Kube, namespace: str) -> None:
    kube.create(m.claim_template("single-gpu", namespace, m.claim_spec([m.request()])))
    kube.create(
        m.pod(
            "pod",
            namespace,
            [
                m.container("ctr0", claims=[{"name": "gpu"}]),
                m.container("ctr1", claims=[{"name": "gpu"}]),
            ],
            [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}],
        )
    )
    wait_running(kube, "pod", namespace)
    first = gpus_seen(kube, "pod", namespace, "ctr0")
    second = gpus_seen(kube, "pod", namespace, "ctr1")
    assert first == second
    assert len(first) == 1


def test_one_claim_shared_by_two_pods(driver: Driver, kube: Kube, namespace: str) -> None:
    kube.create(m.claim("shared-gpu", namespace, m.claim_spec([m.request()])))
    for name in ("pod1", "pod2"):
        kube.create(m.gpu_pod(name, namespace, claim="shared-gpu"))
    for name in ("pod1", "pod2"):
        wait_running(kube, name, namespace)
    (device,) = allocated_devices(kube, "shared-gpu", namespace)
    assert gpus_seen(kube, "pod1", namespace) == gpus_seen(kube, "pod2", namespace)
    assert list(gpus_seen(kube, "pod1", namespace).values()) == [driver.uuid_of(device)]
    claim = kube.get("resource.k8s.io/v1", "ResourceClaim", "shared-gpu", namespace)
    assert sorted(r["name"] for r in claim["status"]["reservedFor"]) == ["pod1", "pod2"]


@pytest.mark.parametrize(
    ("selector", "expected_product"),
    [
        ("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA L4'", "NVIDIA L4"),
        (
            "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')",
            "NVIDIA A100 80GB PCIe",
        ),
        (
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
            "NVIDIA A100 80GB PCIe",
        ),
        (
            "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('580.0.0')) >= 0"
            " && device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('40Gi'))",
            "NVIDIA L4",
        ),
    ],
    ids=["productName", "productName-regex", "memory", "driverVersion-and-memory"],
)
def test_cel_selectors_pick_the_matching_gpu(
    driver: Driver, kube: Kube, namespace: str, selector: str, expected_product: str
) -> None:
    kube.create(m.claim("picked", namespace, m.claim_spec([m.request(selectors=[selector])])))
    kube.create(m.gpu_pod("pod", namespace, claim="picked"))
    wait_running(kube, "pod", namespace)
    (device,) = allocated_devices(kube, "picked", namespace)
    assert driver.devices()[device]["attributes"]["productName"]["string"] == expected_product
    assert list(gpus_seen(kube, "pod", namespace).values()) == [driver.uuid_of(device)]


def test_a_claim_no_gpu_satisfies_stays_pending_with_a_scheduling_event(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    selector = "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('999.0.0')) >= 0"
    kube.create(m.claim("impossible", namespace, m.claim_spec([m.request(selectors=[selector])])))
    kube.create(m.gpu_pod("pod", namespace, claim="impossible"))

    def unschedulable() -> bool:
        return any(e["reason"] == "FailedScheduling" for e in kube.events_for(namespace, "pod"))

    wait_for("a FailedScheduling event", unschedulable, 60)
    assert kube.get("v1", "Pod", "pod", namespace)["status"]["phase"] == "Pending"


def test_deleting_pods_unprepares_their_claims(driver: Driver, kube: Kube, namespace: str) -> None:
    kube.create(m.claim("gpu", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("pod", namespace, claim="gpu"))
    wait_running(kube, "pod", namespace)
    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "gpu", namespace)["metadata"]["uid"]
    assert uid in driver.checkpoint_claims()
    assert uid in driver.cdi_spec_claims()
    # The simulated GPU's facts come from its shared file; the claim has no files of its own.
    (device,) = driver.cdi_spec(uid)["devices"]
    (mount,) = device["containerEdits"]["mounts"]
    assert Path(mount["hostPath"]).parent == driver.data_dir / "simulated-facts"
    assert not (driver.state_dir / "claims" / uid).exists()

    kube.delete("v1", "Pod", "pod", namespace)
    kube.wait_gone("v1", "Pod", "pod", namespace)
    wait_for("the claim to be unprepared", lambda: uid not in driver.checkpoint_claims(), 60)
    assert uid not in driver.cdi_spec_claims()
    assert not (driver.state_dir / "claims" / uid).exists()
    claims = "gpu_dra_kubelet_plugin_claims_total"
    assert driver.metric(claims, operation="prepare", result="ok") >= 1
    assert driver.metric(claims, operation="unprepare", result="ok") >= 1


def test_invalid_config_becomes_a_pod_event_and_leaks_nothing(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    bad = m.gpu_config({"kind": "GpuConfig", "sharing": {"strategy": "MPS"}, "colour": "blue"})
    kube.create(m.claim("bad", namespace, m.claim_spec([m.request()], config=[bad])))
    kube.create(m.gpu_pod("pod", namespace, claim="bad"))
    message = ""

    def failed_prepare() -> bool:
        nonlocal message
        for event in kube.events_for(namespace, "pod"):
            if event["reason"] == "FailedPrepareDynamicResources":
                message = event["message"]
                return True
        return False

    wait_for("a FailedPrepareDynamicResources event", failed_prepare, 90)
    assert f"{namespace}/bad" in message
    assert "spec.devices.config[0]" in message
    assert "colour" in message
    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "bad", namespace)["metadata"]["uid"]
    assert uid not in driver.checkpoint_claims()
    assert uid not in driver.cdi_spec_claims()
    assert kube.get("v1", "Pod", "pod", namespace)["status"]["phase"] == "Pending"


def test_kubelet_restart_keeps_running_pods_and_republishes_slices(
    driver: Driver, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    kube.create(m.claim("gpu", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("pod", namespace, claim="gpu"))
    wait_running(kube, "pod", namespace)
    before = gpus_seen(kube, "pod", namespace)
    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "gpu", namespace)["metadata"]["uid"]

    cluster.restart_kubelet()  # the kubelet wipes the node's slices when it starts

    wait_for("slices to be republished", lambda: len(driver.devices()) == 4, 60)
    wait_running(kube, "pod", namespace)
    assert gpus_seen(kube, "pod", namespace) == before
    assert uid in driver.checkpoint_claims()
    kube.delete("v1", "Pod", "pod", namespace)
    kube.wait_gone("v1", "Pod", "pod", namespace)
    wait_for("the claim to be unprepared", lambda: uid not in driver.checkpoint_claims(), 90)
    assert uid not in driver.cdi_spec_claims()


def test_plugin_restart_keeps_prepared_claims_and_unprepares_them_later(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    kube.create(m.claim("gpu", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("pod", namespace, claim="gpu"))
    wait_running(kube, "pod", namespace)
    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "gpu", namespace)["metadata"]["uid"]
    (held,) = allocated_devices(kube, "gpu", namespace)

    driver.stop_plugin()
    driver.start_plugin()

    assert uid in driver.checkpoint_claims()
    assert uid in driver.cdi_spec_claims()
    wait_running(kube, "pod", namespace)
    # The restarted plugin still prepares new claims, on another GPU.
    kube.create(m.claim("other", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("pod2", namespace, claim="other"))
    wait_running(kube, "pod2", namespace)
    (other,) = allocated_devices(kube, "other", namespace)
    assert other != held
    # ... and unprepares the claim the earlier instance prepared.
    kube.delete("v1", "Pod", "pod", namespace)
    kube.wait_gone("v1", "Pod", "pod", namespace)
    wait_for("the claim to be unprepared", lambda: uid not in driver.checkpoint_claims(), 90)
    assert uid not in driver.cdi_spec_claims()


def test_extended_resource_nvidia_com_gpu_gets_a_dra_gpu(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    """`nvidia.com/gpu: 1` (device-plugin style) is served via the class's extendedResourceName."""
    container = m.container()
    container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    kube.create(m.pod("legacy", namespace, [container]))
    wait_running(kube, "legacy", namespace)
    gpus = gpus_seen(kube, "legacy", namespace)
    ((_, uuid),) = gpus.items()
    assert uuid in {driver.uuid_of(d) for d in driver.devices()}
