"""MPS on a MIG slice made at prepare (issue 5, e2e (c)): a simulated hgx-h100 node with
``--dynamic-mig``. A claim for one 1g.10gb partition with ``MigDeviceConfig`` ``sharing: MPS`` is
shared by two pods: the plugin makes the MIG device, then starts its MPS daemon - a pod running
the nvidia-cuda-mps-control TEST DOUBLE - keyed by the UUID the new MIG device got; both
containers see that UUID and connect to that daemon. Unpreparing stops the daemon before the
MIG device is destroyed; nothing is left."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.kube import Kube
from e2e.mig import mig_instances, mig_request
from e2e.mps import PIPE, assert_unprepared_without_daemon, daemon_pid, daemons, mps_output
from e2e.workloads import allocated_devices, claim_uid, delete_pods, run_pods_sharing
from gpu_dra.kubelet_plugin.mps import claim_daemon_id
from tests.doubles.nvidia_cuda_mps_control import read_state

# no_mig_left is set up first, so that it tears down last: after the MPS daemons are gone.
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mig_left", "no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100"
DYNAMIC_MIG = True
PODS = ("mig-mps-1", "mig-mps-2")
# SHOW_MPS plus the MIG device UUID the container got from its CDI device.
SHOW_MPS_AND_UUID = m.SHOW_MPS.replace(
    "echo '--- end';",
    "echo '--- uuid'; env | grep '^GPU_DRA_.*MIG.*_UUID=' | sort; echo '--- end';",
)


def test_mps_on_a_mig_slice_made_at_prepare_is_keyed_by_its_new_uuid(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    mig_mps = m.mps_sharing(
        "MigDeviceConfig", defaultActiveThreadPercentage=40, defaultPinnedDeviceMemoryLimit="4Gi"
    )
    config = m.gpu_config(mig_mps, requests=["mig"])
    kube.create(
        m.claim("mig-mps", namespace, m.claim_spec([mig_request("mig", "1g.10gb")], [config]))
    )
    run_pods_sharing(kube, namespace, "mig-mps", PODS, command=SHOW_MPS_AND_UUID, timeout=120)

    uid = claim_uid(kube, "mig-mps", namespace)
    (device,) = allocated_devices(kube, "mig-mps", namespace)
    published = driver.devices()[device]["attributes"]
    assert "uuid" not in published  # a partition: its MIG device did not exist before prepare
    parent = published["parentUUID"]["string"]

    # The MIG device was made, and the checkpoint records the UUID it got ...
    (held,) = mig_instances(driver)[parent]
    (ci,) = held["computeInstances"]
    mig_uuid = ci["uuid"]
    entry = driver.checkpoint_entry(uid)
    assert [i["uuid"] for i in entry["state"]["dynamicMig"]] == [mig_uuid]
    # ... which keys the claim's one daemon: a pod, CUDA_VISIBLE_DEVICES and the pinned limit.
    daemon_id = claim_daemon_id(uid, [mig_uuid])
    (handle,) = entry["state"]["mpsDaemons"]
    assert (handle["daemonId"], handle["devices"]) == (daemon_id, [mig_uuid])
    (daemon_pod,) = driver.mps_daemon_pods().values()
    assert daemon_pod["metadata"]["name"] == f"mps-control-daemon-{daemon_id}"
    assert handle["runnerRef"] == daemon_pod["metadata"]["uid"]
    root = driver.mps_dir / daemon_id
    pid = daemon_pid(driver, daemon_id)
    assert daemons(driver) == [pid]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={mig_uuid}".encode() in environ
    assert read_state(root / "pipe")["defaults"] == {
        "activeThreadPercentage": 40.0,
        "pinnedMemLimits": {mig_uuid: "4096M"},
    }
    # Both containers got that MIG device and that daemon's pipe directory.
    for name in PODS:
        seen = mps_output(kube, name, namespace)
        assert seen["env"] == f"CUDA_MPS_PIPE_DIRECTORY={PIPE}", (name, seen)
        assert seen["pid"] == str(pid), (name, seen)
        assert seen["uuid"].endswith(f"_UUID={mig_uuid}"), (name, seen)

    delete_pods(kube, namespace, PODS)
    assert_unprepared_without_daemon(driver, uid, daemon_id)
    assert mig_instances(driver) == {}
