"""MPS on a static MIG device end to end (issue 5, e2e (c) on existing slices; the dynamic case
is e2e/test_mps_mig.py), on the simulated node profile ``hgx-h100-mig``, whose slices the
profile creates. A claim for one 1g.10gb slice with ``MigDeviceConfig`` ``sharing:
MPS`` is shared by two pods: one daemon pod for that MIG device, ``CUDA_VISIBLE_DEVICES`` and
the pinned limit keyed by its MIG UUID, both pods connected to it; unpreparing removes it all.
The daemon is the nvidia-cuda-mps-control TEST DOUBLE run as a pod from the local image."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.kube import Kube
from e2e.mps import PIPE, assert_unprepared_without_daemon, daemon_pid, daemons, mps_output
from e2e.workloads import allocated_devices, claim_uid, delete_pods, run_pods_sharing
from gpu_dra.kubelet_plugin.mps import claim_daemon_id
from tests.doubles.nvidia_cuda_mps_control import read_state

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100-mig"
PODS = ("mig-mps-1", "mig-mps-2")


def test_mps_on_a_mig_slice_runs_one_daemon_pod_for_that_mig_device(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    mig_mps = m.mps_sharing(
        "MigDeviceConfig", defaultActiveThreadPercentage=40, defaultPinnedDeviceMemoryLimit="4Gi"
    )
    request = m.request(
        "mig",
        device_class="mig.nvidia.com",
        selectors=["device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"],
    )
    config = m.gpu_config(mig_mps, requests=["mig"])
    kube.create(m.claim("mig-mps", namespace, m.claim_spec([request], [config])))
    run_pods_sharing(kube, namespace, "mig-mps", PODS, command=m.SHOW_MPS)

    uid = claim_uid(kube, "mig-mps", namespace)
    (device,) = allocated_devices(kube, "mig-mps", namespace)
    assert "-mig-1g10gb-" in device
    mig_uuid = driver.uuid_of(device)
    assert mig_uuid.startswith("MIG-")
    daemon_id = claim_daemon_id(uid, [mig_uuid])
    root = driver.mps_dir / daemon_id

    # One daemon, as a pod, for the MIG device, with settings keyed by its MIG UUID.
    (daemon_pod,) = driver.mps_daemon_pods().values()
    assert daemon_pod["metadata"]["name"] == f"mps-control-daemon-{daemon_id}"
    pid = daemon_pid(driver, daemon_id)
    assert daemons(driver) == [pid]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={mig_uuid}".encode() in environ
    state = read_state(root / "pipe")
    assert state["visibleDevices"] == [mig_uuid]
    assert state["defaults"] == {
        "activeThreadPercentage": 40.0,
        "pinnedMemLimits": {mig_uuid: "4096M"},
    }
    (handle,) = driver.checkpoint_entry(uid)["state"]["mpsDaemons"]
    assert handle["devices"] == [mig_uuid]
    for name in PODS:
        seen = mps_output(kube, name, namespace)
        assert seen["env"] == f"CUDA_MPS_PIPE_DIRECTORY={PIPE}", (name, seen)
        assert seen["pid"] == str(pid), (name, seen)

    delete_pods(kube, namespace, PODS)
    assert_unprepared_without_daemon(driver, uid, daemon_id)
