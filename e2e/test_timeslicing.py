"""Time-slicing end to end: NVIDIA's `GpuConfig` `sharing.strategy: TimeSlicing` on a simulated
hgx-h100 node. Simulated nodes run no nvidia-smi; the plugin's recorded time slicer writes what it
would have set to ``<data-dir>/time-slicing.json`` (``intervals`` per GPU UUID and the calls in
order), so the test reads the interval the claim's GPU got and sees it reset."""

from __future__ import annotations

import json
from typing import Any

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import allocated_devices, gpus_seen, wait_running
from gpu_dra.kubelet_plugin.time_slicer import DEFAULT_INTERVAL, INTERVAL_NAMES, RECORD_FILE

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = "hgx-h100"
LONG = next(value for value, name in INTERVAL_NAMES.items() if name == "Long")


def time_slicing(interval: str) -> dict[str, Any]:
    """`GpuConfig` parameters with `sharing.strategy: TimeSlicing` and the given interval."""
    return {
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}},
    }


def record(driver: Driver) -> dict[str, Any]:
    path = driver.state_dir / RECORD_FILE
    if not path.exists():
        return {"intervals": {}, "calls": []}
    return dict(json.loads(path.read_text()))


def failed_prepare_message(kube: Kube, namespace: str, pod: str) -> str:
    messages: list[str] = []

    def failed() -> bool:
        messages[:] = [
            e["message"]
            for e in kube.events_for(namespace, pod)
            if e["reason"] == "FailedPrepareDynamicResources"
        ]
        return bool(messages)

    wait_for("a FailedPrepareDynamicResources event", failed, 90)
    return messages[0]


def test_long_interval_is_set_while_the_pod_runs_and_reset_when_it_is_deleted(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    config = m.gpu_config(time_slicing("Long"), requests=["gpu"])
    kube.create(m.claim("sliced", namespace, m.claim_spec([m.request()], config=[config])))
    calls_before = len(record(driver)["calls"])
    kube.create(m.gpu_pod("sliced-pod", namespace, claim="sliced"))
    wait_running(kube, "sliced-pod", namespace)

    (device,) = allocated_devices(kube, "sliced", namespace)
    uuid = driver.uuid_of(device)
    assert list(gpus_seen(kube, "sliced-pod", namespace).values()) == [uuid]
    now = record(driver)
    assert now["intervals"][uuid] == LONG == 3
    assert now["calls"][calls_before:] == [{"call": "set_interval", "uuid": uuid, "interval": 3}]
    others = {u: v for u, v in now["intervals"].items() if u != uuid}
    assert set(others.values()) <= {DEFAULT_INTERVAL}  # no other GPU was touched

    kube.delete("v1", "Pod", "sliced-pod", namespace)
    kube.wait_gone("v1", "Pod", "sliced-pod", namespace, timeout=90)
    kube.delete("resource.k8s.io/v1", "ResourceClaim", "sliced", namespace)
    wait_for(
        "the GPU's interval to be reset to Default",
        lambda: record(driver)["intervals"].get(uuid) == DEFAULT_INTERVAL,
        90,
    )
    assert record(driver)["calls"][-1] == {"call": "reset", "uuid": uuid}
    wait_for(
        "the claim to leave the checkpoint",
        lambda: not driver.checkpoint_claims(),
        60,
    )


def test_invalid_interval_is_a_pod_event_naming_the_field_and_sets_nothing(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    config = m.gpu_config(time_slicing("Huge"), requests=["gpu"])
    kube.create(m.claim("bad-interval", namespace, m.claim_spec([m.request()], config=[config])))
    calls_before = record(driver)["calls"]
    kube.create(m.gpu_pod("bad-pod", namespace, claim="bad-interval"))

    message = failed_prepare_message(kube, namespace, "bad-pod")

    assert "timeSlicingConfig.interval" in message, message
    assert "unknown time-slice interval 'Huge': supported are Default, Short, Medium, Long" in (
        message
    )
    pod = kube.get("v1", "Pod", "bad-pod", namespace)
    assert pod["status"].get("phase") == "Pending"
    assert record(driver)["calls"] == calls_before  # nothing was set
    claim = kube.get("resource.k8s.io/v1", "ResourceClaim", "bad-interval", namespace)
    assert claim["metadata"]["uid"] not in driver.checkpoint_claims()
