"""Device health as the e2e tests drive and read it: events for the simulated GPUs (files in the
plugin's ``<data-dir>/simulated-nvml-events/``, taken in by its health monitor), the taints the
plugin publishes, and the device health the kubelet shows in pod status."""

from __future__ import annotations

import itertools
from typing import Any

from e2e import manifests as m
from e2e.driver import MPS_DAEMON_NAMESPACE, Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import claim_uid, wait_running
from gpu_dra.kubelet_plugin.device_health.inbox import SIMULATED_EVENTS_DIR, write_event

HEALTH_ARGS = ("--health-monitor=true",)
"""Plugin flags of the health modules: the monitor is off by default on simulated nodes."""
XID_KEY = "gpu.nvidia.com/xid"
MPS_DAEMON_KEY = "gpu.nvidia.com/mps-daemon"

_names = itertools.count()


def inject(driver: Driver, event: dict[str, Any], timeout: float = 10) -> None:
    """Hand `event` to the plugin's simulated NVML and wait until it took it; a refused event
    fails with the plugin's reason."""
    inbox = driver.data_dir / SIMULATED_EVENTS_DIR
    name = f"e2e-{next(_names):04d}"
    path = write_event(inbox, name, event)
    refused = inbox / f"{name}.error"
    wait_for(f"the plugin to take {event}", lambda: not path.exists(), timeout)
    assert not refused.exists(), f"{event} refused: {refused.read_text()}"


def taints(driver: Driver) -> dict[str, list[dict[str, Any]]]:
    """Published devices with taints: name -> taints."""
    return {name: d["taints"] for name, d in driver.devices().items() if d.get("taints")}


def taint_keys(driver: Driver, device: str) -> set[str]:
    return {taint["key"] for taint in driver.devices()[device].get("taints", [])}


def wait_tainted(driver: Driver, devices: set[str], key: str, timeout: float = 60) -> None:
    wait_for(
        f"{key} on {sorted(devices)}",
        lambda: all(key in taint_keys(driver, device) for device in devices),
        timeout,
    )


def wait_untainted(driver: Driver, timeout: float = 60) -> None:
    wait_for("no device taints", lambda: not taints(driver), timeout)


def recover_all(driver: Driver) -> None:
    """Every simulated GPU repaired (each GPU's UUID from the published devices)."""
    uuids = {
        d["attributes"].get("parentUUID", d["attributes"].get("uuid", {})).get("string")
        for d in driver.devices().values()
    }
    for uuid in sorted(u for u in uuids if u):
        inject(driver, {"gpu": uuid, "event": "recovered"})


def resource_health(kube: Kube, pod: str, namespace: str) -> list[dict[str, Any]]:
    """The device health the kubelet shows for the pod's containers
    (``status.containerStatuses[].allocatedResourcesStatus[].resources[]``)."""
    status = kube.get("v1", "Pod", pod, namespace).get("status", {})
    return [
        resource
        for container in status.get("containerStatuses") or []
        for allocated in container.get("allocatedResourcesStatus") or []
        for resource in allocated.get("resources") or []
    ]


def wait_resource_health(
    kube: Kube, pod: str, namespace: str, health: str, message_part: str = "", timeout: float = 90
) -> dict[str, Any]:
    """Wait until the pod's status shows a device of `health` whose message holds
    `message_part`; that entry."""
    found: dict[str, Any] = {}

    def shown() -> bool:
        for resource in resource_health(kube, pod, namespace):
            if resource.get("health") == health and message_part in (resource.get("message") or ""):
                found.update(resource)
                return True
        return False

    wait_for(f"pod {namespace}/{pod} to show a {health} device ({message_part!r})", shown, timeout)
    return found


def kill_a_shares_daemon(
    driver: Driver, kube: Kube, share: m.Obj, namespace: str, device: str
) -> str:
    """Create the share claim `share` and a pod on it (both named as the claim), delete the pod
    of its MPS daemon (the node's only one) and wait until `device` is tainted
    ``mps-daemon=not-running:NoSchedule`` and the pod's status shows the device unhealthy;
    the claim's UID."""
    name = share["metadata"]["name"]
    kube.create(share)
    kube.create(m.gpu_pod(name, namespace, claim=name, command=m.SHOW_MPS))
    wait_running(kube, name, namespace)
    uid = claim_uid(kube, name, namespace)
    (daemon_pod,) = driver.mps_daemon_pods()

    kube.delete("v1", "Pod", daemon_pod, MPS_DAEMON_NAMESPACE)  # the daemon dies
    wait_tainted(driver, {device}, MPS_DAEMON_KEY, timeout=90)
    (taint,) = taints(driver)[device]
    assert (taint["value"], taint["effect"]) == ("not-running", "NoSchedule")
    wait_resource_health(kube, name, namespace, "Unhealthy", "MPS daemon not running")
    return uid
