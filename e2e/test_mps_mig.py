"""MPS on a MIG slice made at prepare (issue 5, e2e (c)): a simulated hgx-h100 node with
``--dynamic-mig``. A claim for one 1g.10gb partition with ``MigDeviceConfig`` ``sharing: MPS`` is
shared by two pods: the plugin makes the MIG device, then starts its MPS daemon - a pod running
the nvidia-cuda-mps-control TEST DOUBLE - keyed by the UUID the new MIG device got; both
containers see that UUID and connect to that daemon. Unpreparing stops the daemon before the
MIG device is destroyed; nothing is left."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import manifests as m
from e2e.cluster import Cluster
from e2e.driver import MPS_DAEMON_NAMESPACE, Driver
from e2e.kube import Kube, wait_for
from e2e.test_mig_dynamic import mig_instances, mig_modes, mig_request
from e2e.test_mps import PIPE, daemons, mps_output
from e2e.test_whole_gpu import allocated_devices, wait_running
from gpu_dra.kubelet_plugin.mig import SIMULATED_STATE_FILE
from gpu_dra.kubelet_plugin.mps import claim_daemon_id
from tests.doubles.mps_helpers import kill_processes_under
from tests.doubles.nvidia_cuda_mps_control import PID_FILE, read_state

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = "hgx-h100"
PODS = ("mig-mps-1", "mig-mps-2")
# SHOW_MPS plus the MIG device UUID the container got from its CDI device.
SHOW_MPS_AND_UUID = m.SHOW_MPS.replace(
    "echo '--- end';",
    "echo '--- uuid'; env | grep '^GPU_DRA_.*MIG.*_UUID=' | sort; echo '--- end';",
)


@pytest.fixture(scope="module")
def driver(cluster: Cluster, kube: Kube) -> Iterator[Driver]:
    """The plugin with dynamic MIG; the simulated GPUs start without MIG and must end so."""
    running = Driver(cluster, kube, SIMULATED_PROFILE, dynamic_mig=True)
    (running.state_dir / SIMULATED_STATE_FILE).unlink(missing_ok=True)
    running.install()
    running.start_plugin()
    yield running
    running.stop_plugin()
    (running.state_dir / SIMULATED_STATE_FILE).unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def nothing_left(driver: Driver, kube: Kube) -> Iterator[None]:
    assert not daemons(driver), "MPS daemons left by an earlier test"
    assert not driver.mps_daemon_pods(), "MPS daemon pods left by an earlier test"
    assert mig_instances(driver) == {}, "MIG instances left by an earlier test"
    yield
    left_pods = sorted(driver.mps_daemon_pods())
    for name in left_pods:
        kube.delete("v1", "Pod", name, MPS_DAEMON_NAMESPACE)
    left = kill_processes_under(driver.data_dir / "mps", grace_s=10)
    wait_for("every claim to be unprepared", lambda: not driver.checkpoint_claims(), 120)
    assert not left, f"MPS daemon processes left behind: {left}"
    assert not left_pods, f"MPS daemon pods left behind: {left_pods}"
    assert mig_instances(driver) == {}, "MIG instances left behind"
    assert all(mode == [0, 0] for mode in mig_modes(driver).values()), mig_modes(driver)


def test_mps_on_a_mig_slice_made_at_prepare_is_keyed_by_its_new_uuid(
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
    config = m.gpu_config(mig_mps, requests=["mig"])
    kube.create(
        m.claim("mig-mps", namespace, m.claim_spec([mig_request("mig", "1g.10gb")], [config]))
    )
    for name in PODS:
        kube.create(m.gpu_pod(name, namespace, claim="mig-mps", command=SHOW_MPS_AND_UUID))
    for name in PODS:
        wait_running(kube, name, namespace, timeout=120)

    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "mig-mps", namespace)["metadata"]["uid"]
    (device,) = allocated_devices(kube, "mig-mps", namespace)
    published = driver.devices()[device]["attributes"]
    assert "uuid" not in published  # a partition: its MIG device did not exist before prepare
    parent = published["parentUUID"]["string"]

    # The MIG device was made, and the checkpoint records the UUID it got ...
    (held,) = mig_instances(driver)[parent]
    (ci,) = held["computeInstances"]
    mig_uuid = ci["uuid"]
    claims = json.loads((driver.state_dir / "gpu-dra-checkpoint.json").read_text())["claims"]
    entry = claims[uid]
    assert [i["uuid"] for i in entry["state"]["dynamicMig"]] == [mig_uuid]
    # ... which keys the claim's one daemon: a pod, CUDA_VISIBLE_DEVICES and the pinned limit.
    daemon_id = claim_daemon_id(uid, [mig_uuid])
    (handle,) = entry["state"]["mpsDaemons"]
    assert (handle["daemonId"], handle["devices"]) == (daemon_id, [mig_uuid])
    (daemon_pod,) = driver.mps_daemon_pods().values()
    assert daemon_pod["metadata"]["name"] == f"mps-control-daemon-{daemon_id}"
    assert handle["runnerRef"] == daemon_pod["metadata"]["uid"]
    root = driver.mps_dir / daemon_id
    pid = int((root / "pipe" / PID_FILE).read_text())
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

    for name in PODS:
        kube.delete("v1", "Pod", name, namespace)
    for name in PODS:
        kube.wait_gone("v1", "Pod", name, namespace)
    wait_for("the claim to be unprepared", lambda: uid not in driver.checkpoint_claims(), 60)
    assert driver.mps_daemon_pods() == {}
    assert daemons(driver) == []
    assert not root.exists()
    assert mig_instances(driver) == {}
    assert uid not in driver.cdi_spec_claims()
