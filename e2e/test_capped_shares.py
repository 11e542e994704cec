"""Capped shares (issue 16, item 4) end to end: published only where the driver caps memory.

A simulated hgx-h100 node started with ``--capped-shares=0,1 --mps-shares=2``. A simulated
node has no driver to apply a cgroup memory limit, so the plugin must not offer gpu-0 and gpu-1
as capped shares: they stay plain whole GPUs, the plugin logs why at start, and a claim of the
class ``capped.gpu.nvidia.com`` finds no device, while gpu-2 is an MPS-offered GPU that the
MPS class (which excludes capped GPUs) still selects. The path where the driver enforces the
cap needs an NVML with ``nvmlDeviceSetMemoryLimits_v1`` (a 615 driver, or the NVML mock once
it has the function) and is covered by the unit tests (tests/kubelet_plugin/
test_prepare_capped_shares.py); see docs/shares.md, "Capped shares".
"""

from __future__ import annotations

import pytest

from e2e import manifests as m
from e2e.driver import PLUGIN, Driver
from e2e.kube import Kube
from e2e.workloads import allocated_devices, delete_pods, wait_event, wait_running
from gpu_dra.driver.shares import CAPPED

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100"
PLUGIN_ARGS = ("--capped-shares=0,1", "--mps-shares=2")
CAPPED_CLASS = "capped.gpu.nvidia.com"
MPS_CLASS = "mps.gpu.nvidia.com"
NOT_OFFERED = "is not offered as capped shares (--capped-shares), only whole"
SIMULATED_REASON = "simulated GPUs: no driver to apply a cgroup limit"


def test_gpus_the_driver_cannot_cap_stay_whole_and_the_plugin_says_why(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    devices = driver.devices()
    for name in ("gpu-0", "gpu-1"):
        assert "allowMultipleAllocations" not in devices[name], name
        assert CAPPED not in devices[name]["attributes"], name
        assert "capacity" not in devices[name] or "compute" not in devices[name]["capacity"]
    assert devices["gpu-2"]["allowMultipleAllocations"] is True  # the MPS-offered GPU
    assert CAPPED not in devices["gpu-2"]["attributes"]

    log = (driver.cluster.paths.logs / f"{PLUGIN}.log").read_text(errors="replace")
    for index in (0, 1):
        uuid = driver.uuid_of(f"gpu-{index}")
        lines = [line for line in log.splitlines() if f"GPU {index} ({uuid}) {NOT_OFFERED}" in line]
        assert lines, f"no start-up warning for gpu-{index}"
        assert SIMULATED_REASON in lines[-1]

    # No device for the capped class; the MPS class still gets its share of gpu-2.
    kube.create(m.share_claim("capped", namespace, "10Gi", 25, device_class=CAPPED_CLASS))
    kube.create(m.gpu_pod("capped", namespace, claim="capped"))
    kube.create(m.share_claim("mps", namespace, "10Gi", 25, device_class=MPS_CLASS))
    kube.create(m.gpu_pod("mps", namespace, claim="mps", command=m.SHOW_MPS))
    wait_running(kube, "mps", namespace)
    assert allocated_devices(kube, "mps", namespace) == ["gpu-2"]
    message = wait_event(kube, namespace, "capped", "FailedScheduling", timeout=90)
    assert "cannot allocate all claims" in message, message
    pod = kube.get("v1", "Pod", "capped", namespace)
    assert pod["status"]["phase"] == "Pending"
    delete_pods(kube, namespace, ["capped", "mps"])
