"""MPS on a static MIG device end to end (issue 5, e2e (c) on existing slices; the dynamic case
is e2e/test_mps_mig.py), on the simulated node profile ``hgx-h100-mig``, whose slices the
profile creates. A claim for one 1g.10gb slice with ``MigDeviceConfig`` ``sharing:
MPS`` is shared by two pods: one daemon pod for that MIG device, ``CUDA_VISIBLE_DEVICES`` and
the pinned limit keyed by its MIG UUID, both pods connected to it; unpreparing removes it all.
The daemon is the nvidia-cuda-mps-control TEST DOUBLE run as a pod from the local image."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import manifests as m
from e2e.driver import MPS_DAEMON_NAMESPACE, Driver
from e2e.kube import Kube, wait_for
from e2e.test_mps import PIPE, checkpoint_entry, daemons, mps_output
from e2e.test_whole_gpu import allocated_devices, wait_running
from gpu_dra.kubelet_plugin.mps import claim_daemon_id
from tests.doubles.mps_helpers import kill_processes_under
from tests.doubles.nvidia_cuda_mps_control import PID_FILE, read_state

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = "hgx-h100-mig"
PODS = ("mig-mps-1", "mig-mps-2")


@pytest.fixture(autouse=True)
def no_daemon_left(driver: Driver, kube: Kube) -> Iterator[None]:
    assert not daemons(driver), "MPS daemons left by an earlier test"
    assert not driver.mps_daemon_pods(), "MPS daemon pods left by an earlier test"
    yield
    left_pods = sorted(driver.mps_daemon_pods())
    for name in left_pods:
        kube.delete("v1", "Pod", name, MPS_DAEMON_NAMESPACE)
    left = kill_processes_under(driver.data_dir / "mps", grace_s=10)
    assert not left, f"MPS daemon processes left behind: {left}"
    assert not left_pods, f"MPS daemon pods left behind: {left_pods}"


def test_mps_on_a_mig_slice_runs_one_daemon_pod_for_that_mig_device(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    mig_mps = {
        "kind": "MigDeviceConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 40,
                "defaultPinnedDeviceMemoryLimit": "4Gi",
            },
        },
    }
    request = m.request(
        "mig",
        device_class="mig.nvidia.com",
        selectors=["device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"],
    )
    config = m.gpu_config(mig_mps, requests=["mig"])
    kube.create(m.claim("mig-mps", namespace, m.claim_spec([request], [config])))
    for name in PODS:
        kube.create(m.gpu_pod(name, namespace, claim="mig-mps", command=m.SHOW_MPS))
    for name in PODS:
        wait_running(kube, name, namespace)

    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "mig-mps", namespace)["metadata"]["uid"]
    (device,) = allocated_devices(kube, "mig-mps", namespace)
    assert "-mig-1g10gb-" in device
    mig_uuid = driver.uuid_of(device)
    assert mig_uuid.startswith("MIG-")
    daemon_id = claim_daemon_id(uid, [mig_uuid])
    root = driver.mps_dir / daemon_id

    # One daemon, as a pod, for the MIG device, with settings keyed by its MIG UUID.
    (daemon_pod,) = driver.mps_daemon_pods().values()
    assert daemon_pod["metadata"]["name"] == f"mps-control-daemon-{daemon_id}"
    pid = int((root / "pipe" / PID_FILE).read_text())
    assert daemons(driver) == [pid]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={mig_uuid}".encode() in environ
    state = read_state(root / "pipe")
    assert state["visibleDevices"] == [mig_uuid]
    assert state["defaults"] == {
        "activeThreadPercentage": 40.0,
        "pinnedMemLimits": {mig_uuid: "4096M"},
    }
    (handle,) = checkpoint_entry(driver, uid)["state"]["mpsDaemons"]
    assert handle["devices"] == [mig_uuid]
    for name in PODS:
        seen = mps_output(kube, name, namespace)
        assert seen["env"] == f"CUDA_MPS_PIPE_DIRECTORY={PIPE}", (name, seen)
        assert seen["pid"] == str(pid), (name, seen)

    for name in PODS:
        kube.delete("v1", "Pod", name, namespace)
    for name in PODS:
        kube.wait_gone("v1", "Pod", name, namespace)
    wait_for("the claim to be unprepared", lambda: uid not in driver.checkpoint_claims(), 60)
    assert driver.mps_daemon_pods() == {}
    assert daemons(driver) == []
    assert not root.exists()
    assert uid not in driver.cdi_spec_claims()
