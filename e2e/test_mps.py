"""Per-claim MPS end to end (issue 5, e2e (a)): NVIDIA's gpu-test-mps shape on a simulated
hgx-h100 node. The plugin runs each daemon as a pod (``--mps-daemon-runner=pod``) from a locally
built image of the nvidia-cuda-mps-control TEST DOUBLE (tests/doubles), and uses the double as
its control client, so the daemon is a real process (in the host's PID namespace) with real
directories, settings and control.log, and the pods get the daemon's pipe directory through the
claim's CDI spec."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import manifests as m
from e2e.driver import CDI_ROOT, MPS_DAEMON_NAMESPACE, Driver
from e2e.kube import Kube, wait_for
from e2e.test_whole_gpu import allocated_devices, wait_running
from gpu_dra.kubelet_plugin.mps import claim_daemon_id
from tests.doubles.mps_helpers import kill_processes_under, processes_under
from tests.doubles.nvidia_cuda_mps_control import PID_FILE, SOCKET, STATE_FILE, read_state

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = "hgx-h100"
PIPE = "/tmp/nvidia-mps"
MPS_CONFIG = {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"}
_SECTION = re.compile(r"^--- (\w+)\n(.*?)(?=^--- )", re.M | re.S)


@pytest.fixture(autouse=True)
def no_daemon_left(driver: Driver, kube: Kube) -> Iterator[None]:
    """Every test starts and ends without MPS daemons or daemon pods; what a failed test left is
    removed (and fails the test) so that no double process outlives the run."""
    assert not daemons(driver), "MPS daemons left by an earlier test"
    assert not driver.mps_daemon_pods(), "MPS daemon pods left by an earlier test"
    yield
    left_pods = sorted(driver.mps_daemon_pods())
    for name in left_pods:
        kube.delete("v1", "Pod", name, MPS_DAEMON_NAMESPACE)
    left = kill_processes_under(driver.data_dir / "mps", grace_s=10)
    assert not left, f"MPS daemon processes left behind: {left}"
    assert not left_pods, f"MPS daemon pods left behind: {left_pods}"


def daemons(driver: Driver) -> list[int]:
    """PIDs of the double's processes serving a pipe dir under the plugin's data dir."""
    return processes_under(driver.data_dir / "mps")


def mps_output(kube: Kube, pod: str, namespace: str) -> dict[str, str]:
    """The SHOW_MPS sections the pod's container printed (env, ls, pid); waits for them."""
    sections: dict[str, str] = {}

    def printed() -> bool:
        log = kube.pod_log(pod, namespace)
        sections.update({k: v.strip() for k, v in _SECTION.findall(log)})
        return "--- end" in log

    wait_for(f"MPS lines in {pod}'s log", printed, 30)
    return sections


def checkpoint_entry(driver: Driver, uid: str) -> dict[str, Any]:
    claims = json.loads((driver.state_dir / "gpu-dra-checkpoint.json").read_text())["claims"]
    return dict(claims[uid])


def failed_prepare_message(kube: Kube, namespace: str, pod: str) -> str:
    message = ""

    def failed() -> bool:
        nonlocal message
        for event in kube.events_for(namespace, pod):
            if event["reason"] == "FailedPrepareDynamicResources":
                message = event["message"]
                return True
        return False

    wait_for("a FailedPrepareDynamicResources event", failed, 90)
    return message


def test_one_mps_claim_shared_by_two_pods_runs_one_daemon_with_its_settings(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    config = m.gpu_config(m.mps_sharing(**MPS_CONFIG), requests=["mps-gpu"])
    spec = m.claim_spec([m.request("mps-gpu")], config=[config])
    kube.create(m.claim("shared-gpu", namespace, spec))
    for name in ("mps-pod-1", "mps-pod-2"):
        kube.create(m.gpu_pod(name, namespace, claim="shared-gpu", command=m.SHOW_MPS))
    for name in ("mps-pod-1", "mps-pod-2"):
        wait_running(kube, name, namespace)

    claim = kube.get("resource.k8s.io/v1", "ResourceClaim", "shared-gpu", namespace)
    uid = claim["metadata"]["uid"]
    assert sorted(r["name"] for r in claim["status"]["reservedFor"]) == ["mps-pod-1", "mps-pod-2"]
    (device,) = allocated_devices(kube, "shared-gpu", namespace)
    uuid = driver.uuid_of(device)

    # Exactly one daemon, for this claim, named as NVIDIA's driver names it.
    daemon_id = claim_daemon_id(uid, [uuid])
    assert re.fullmatch(rf"{uid}-[0-9a-f]{{5}}", daemon_id)
    assert [p.name for p in driver.mps_dir.iterdir()] == [daemon_id]
    root = driver.mps_dir / daemon_id
    assert sorted(p.name for p in root.iterdir()) == ["log", "pipe", "shm"]
    pid = int((root / "pipe" / PID_FILE).read_text())
    assert daemons(driver) == [pid]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={uuid}".encode() in environ
    (handle,) = checkpoint_entry(driver, uid)["state"]["mpsDaemons"]
    assert handle["daemonId"] == daemon_id
    assert handle["pid"] == pid
    # ... run as a pod bound to the node: its container is that process.
    (daemon_pod,) = driver.mps_daemon_pods().values()
    assert daemon_pod["metadata"]["name"] == f"mps-control-daemon-{daemon_id}"
    assert daemon_pod["status"]["phase"] == "Running"
    assert (handle["runner"], handle["runnerRef"]) == ("pod", daemon_pod["metadata"]["uid"])

    # Its settings: 50 % of the threads, 10Gi = 10240M pinned memory on the claim's GPU.
    state = read_state(root / "pipe")
    assert state["pid"] == pid
    assert state["visibleDevices"] == [uuid]
    assert state["defaults"] == {
        "activeThreadPercentage": 50.0,
        "pinnedMemLimits": {uuid: "10240M"},
    }
    assert state["servers"] == []
    control_log = (root / "log" / "control.log").read_text()
    assert "Cmd:set_default_active_thread_percentage 50\n" in control_log
    assert f"Cmd:set_default_device_pinned_mem_limit {uuid} 10240M\n" in control_log

    # Both containers are MPS clients of that daemon: the env and its pipe dir mounted.
    for name in ("mps-pod-1", "mps-pod-2"):
        seen = mps_output(kube, name, namespace)
        assert seen["env"] == f"CUDA_MPS_PIPE_DIRECTORY={PIPE}", (name, seen)
        assert {SOCKET, PID_FILE, STATE_FILE} <= set(seen["ls"].split()), (name, seen)
        assert seen["pid"] == str(pid), (name, seen)
    cdi_spec = (CDI_ROOT / f"k8s.gpu.nvidia.com-claim_{uid}.yaml").read_text()
    assert f"{driver.data_dir}/mps/{daemon_id}/pipe" in cdi_spec

    # The first pod going keeps the daemon (the claim is still in use) ...
    kube.delete("v1", "Pod", "mps-pod-1", namespace)
    kube.wait_gone("v1", "Pod", "mps-pod-1", namespace)
    assert daemons(driver) == [pid]
    assert uid in driver.checkpoint_claims()
    # ... the second one unprepares the claim: daemon, its directories, CDI spec, checkpoint.
    kube.delete("v1", "Pod", "mps-pod-2", namespace)
    kube.wait_gone("v1", "Pod", "mps-pod-2", namespace)
    wait_for("the claim to be unprepared", lambda: uid not in driver.checkpoint_claims(), 60)
    assert daemons(driver) == []
    assert driver.mps_daemon_pods() == {}
    assert not root.exists()
    assert list(driver.mps_dir.iterdir()) == []
    assert uid not in driver.cdi_spec_claims()
    assert not (driver.state_dir / "claims" / uid).exists()


def test_an_invalid_mps_config_becomes_a_pod_event_and_starts_no_daemon(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    bad = m.gpu_config(m.mps_sharing(defaultActiveThreadPercentage=150))
    kube.create(m.claim("bad-mps", namespace, m.claim_spec([m.request()], config=[bad])))
    kube.create(m.gpu_pod("pod", namespace, claim="bad-mps", command=m.SHOW_MPS))

    message = failed_prepare_message(kube, namespace, "pod")
    assert f"{namespace}/bad-mps" in message
    assert "defaultActiveThreadPercentage" in message
    assert "150" in message
    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "bad-mps", namespace)["metadata"]["uid"]
    assert daemons(driver) == []
    assert driver.mps_daemon_pods() == {}
    assert not driver.mps_dir.exists() or list(driver.mps_dir.iterdir()) == []
    assert uid not in driver.checkpoint_claims()
    assert uid not in driver.cdi_spec_claims()
    assert kube.get("v1", "Pod", "pod", namespace)["status"]["phase"] == "Pending"
