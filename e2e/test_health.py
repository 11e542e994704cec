"""Device health end to end (issue 12, "Health -> taints"): an XID 79 injected into a simulated
GPU with a running pod taints its device NoExecute in the ResourceSlice; the device-taint
eviction controller evicts the pod whose claim does not tolerate it, a pod whose claim does
stays and its status shows the device Unhealthy (the kubelet's DRA health service); new claims
avoid the device; a recovery clears the taint and the device is allocatable again.

A simulated hgx-h100 node (eight whole H100s) with ``--health-monitor=true``; events reach the
plugin's simulated NVML through its event inbox (`e2e.health.inject`). Needs the
``DRADeviceTaints`` gate (GA in 1.37) in the apiserver, scheduler and controller manager (whose
``device-taint-eviction-controller`` runs with ``--controllers=*``), and ``ResourceHealthStatus``
with ``ResourceHealthStatusMessage`` in the kubelet (`e2e.cluster.versions`)."""

from __future__ import annotations

from typing import Any

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.health import (
    HEALTH_ARGS,
    XID_KEY,
    inject,
    taints,
    wait_resource_health,
    wait_tainted,
    wait_untainted,
)
from e2e.kube import Kube, wait_for
from e2e.workloads import allocated_devices, wait_event, wait_running

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("healthy_node")]

SIMULATED_PROFILE = "hgx-h100"
PLUGIN_ARGS = HEALTH_ARGS
TOLERATE_XID = {"key": XID_KEY, "operator": "Exists", "effect": "NoExecute"}


def request(*, tolerate: bool = False, selectors: list[str] | None = None) -> dict[str, Any]:
    found = m.request(selectors=selectors)
    if tolerate:
        found["exactly"]["tolerations"] = [TOLERATE_XID]
    return found


def by_uuid(driver: Driver, device: str) -> list[str]:
    return [f"device.attributes['gpu.nvidia.com'].uuid == '{driver.uuid_of(device)}'"]


def running_and_not_deleted(kube: Kube, pod: str, namespace: str) -> bool:
    found = kube.get("v1", "Pod", pod, namespace)
    return found["status"].get("phase") == "Running" and not found["metadata"].get(
        "deletionTimestamp"
    )


def test_xid_79_taints_evicts_the_intolerant_pod_and_recovery_clears_it(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    kube.create(m.claim("plain", namespace, m.claim_spec([request()])))
    kube.create(m.claim("tolerant", namespace, m.claim_spec([request(tolerate=True)])))
    for name in ("plain", "tolerant"):
        kube.create(m.gpu_pod(name, namespace, claim=name))
    for name in ("plain", "tolerant"):
        wait_running(kube, name, namespace)
    (plain_gpu,) = allocated_devices(kube, "plain", namespace)
    (tolerant_gpu,) = allocated_devices(kube, "tolerant", namespace)
    wait_resource_health(kube, "tolerant", namespace, "Healthy")

    # XID 79 (fallen off the bus) on both pods' GPUs.
    for device in (plain_gpu, tolerant_gpu):
        inject(driver, {"gpu": driver.uuid_of(device), "event": "xid", "xid": 79})
    wait_tainted(driver, {plain_gpu, tolerant_gpu}, XID_KEY)
    published = taints(driver)
    assert sorted(published) == sorted({plain_gpu, tolerant_gpu})  # no other device
    (taint,) = published[plain_gpu]
    assert (taint["key"], taint["value"], taint["effect"]) == (XID_KEY, "79", "NoExecute")
    assert taint["timeAdded"]

    # The pod without a toleration is evicted; the one with a toleration stays and its status
    # shows the device's health from the plugin's DRAResourceHealth stream.
    kube.wait_gone("v1", "Pod", "plain", namespace, timeout=90)
    assert running_and_not_deleted(kube, "tolerant", namespace)
    shown = wait_resource_health(kube, "tolerant", namespace, "Unhealthy", "XID 79")
    assert tolerant_gpu in shown["resourceID"]
    assert running_and_not_deleted(kube, "tolerant", namespace)

    # New claims avoid the tainted GPUs: one naming the plain pod's GPU cannot be scheduled,
    # one for any GPU gets another.
    kube.create(
        m.claim("picky", namespace, m.claim_spec([request(selectors=by_uuid(driver, plain_gpu))]))
    )
    kube.create(m.gpu_pod("picky", namespace, claim="picky"))
    kube.create(m.claim("any", namespace, m.claim_spec([request()])))
    kube.create(m.gpu_pod("any", namespace, claim="any"))
    wait_running(kube, "any", namespace)
    (other,) = allocated_devices(kube, "any", namespace)
    assert other not in {plain_gpu, tolerant_gpu}
    wait_event(kube, namespace, "picky", "FailedScheduling", 60)
    assert kube.get("v1", "Pod", "picky", namespace)["status"]["phase"] == "Pending"

    # Recovery clears the taints: the waiting pod gets the GPU, the status is Healthy again.
    for device in (plain_gpu, tolerant_gpu):
        inject(driver, {"gpu": driver.uuid_of(device), "event": "recovered"})
    wait_untainted(driver)
    wait_running(kube, "picky", namespace, timeout=120)
    assert allocated_devices(kube, "picky", namespace) == [plain_gpu]
    wait_resource_health(kube, "tolerant", namespace, "Healthy")
    assert running_and_not_deleted(kube, "tolerant", namespace)


def test_application_xids_are_ignored_and_other_critical_xids_only_stop_scheduling(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    kube.create(m.claim("gpu", namespace, m.claim_spec([request()])))
    kube.create(m.gpu_pod("pod", namespace, claim="gpu"))
    wait_running(kube, "pod", namespace)
    (device,) = allocated_devices(kube, "gpu", namespace)
    uuid = driver.uuid_of(device)

    inject(driver, {"gpu": uuid, "event": "xid", "xid": 13})  # an application error
    inject(driver, {"gpu": uuid, "event": "xid", "xid": 48})  # double-bit ECC: degraded
    wait_tainted(driver, {device}, XID_KEY)
    (taint,) = taints(driver)[device]
    assert (taint["value"], taint["effect"]) == ("48", "NoSchedule")
    wait_resource_health(kube, "pod", namespace, "Unhealthy", "XID 48")
    assert running_and_not_deleted(kube, "pod", namespace)  # NoSchedule evicts nobody
    # The plugin's metrics say the same: the device's health and problem, both XIDs counted.
    assert driver.metric("gpu_dra_device_health", device=device, status="Unhealthy") == 1
    problem = {"device": device, "key": "xid", "value": "48", "severity": "degraded"}
    assert driver.metric("gpu_dra_device_problem_since_timestamp_seconds", **problem) > 0
    for xid, outcome in (("13", "ignored"), ("48", "degraded")):
        counted = {"gpu": uuid, "kind": "xid", "xid": xid, "outcome": outcome}
        assert driver.metric("gpu_dra_health_events_total", **counted) >= 1


def test_a_gpu_that_falls_off_the_bus_is_tainted_lost_until_it_is_back(driver: Driver) -> None:
    device = "gpu-6"
    inject(driver, {"gpu": driver.uuid_of(device), "event": "lost"})
    wait_tainted(driver, {device}, "gpu.nvidia.com/gpu-lost")
    (taint,) = taints(driver)[device]
    assert taint["effect"] == "NoExecute"
    assert sorted(taints(driver)) == [device]
    inject(driver, {"gpu": driver.uuid_of(device), "event": "recovered"})
    wait_untainted(driver)
    wait_for("gpu-6 published untainted", lambda: "taints" not in driver.devices()[device], 30)
