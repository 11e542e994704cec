"""Per-claim MPS end to end (issue 5, e2e (a)): NVIDIA's gpu-test-mps shape on a simulated
hgx-h100 node. The plugin runs each daemon as a pod (``--mps-daemon-runner=pod``) from a locally
built image of the nvidia-cuda-mps-control TEST DOUBLE (tests/doubles), and uses the double as
its control client, so the daemon is a real process (in the host's PID namespace) with real
directories, settings and control.log, and the pods get the daemon's pipe directory through the
claim's CDI spec."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from e2e import manifests as m
from e2e.driver import CDI_ROOT, Driver
from e2e.kube import Kube
from e2e.mps import (
    MPS_CONFIG,
    PIPE,
    assert_unprepared_without_daemon,
    daemon_pid,
    daemons,
    mps_output,
)
from e2e.workloads import allocated_devices, claim_uid, delete_pods, run_pods_sharing, wait_event
from gpu_dra.kubelet_plugin.mps import claim_daemon_id
from tests.doubles.nvidia_cuda_mps_control import PID_FILE, SOCKET, STATE_FILE, read_state

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100"


def test_one_mps_claim_shared_by_two_pods_runs_one_daemon_with_its_settings(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    config = m.gpu_config(m.mps_sharing(**MPS_CONFIG), requests=["mps-gpu"])
    spec = m.claim_spec([m.request("mps-gpu")], config=[config])
    kube.create(m.claim("shared-gpu", namespace, spec))
    run_pods_sharing(kube, namespace, "shared-gpu", ("mps-pod-1", "mps-pod-2"), command=m.SHOW_MPS)

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
    # daemon.json: who the daemon is (pod UID, PID and start time), docs/mps.md.
    assert sorted(p.name for p in root.iterdir()) == ["daemon.json", "log", "pipe", "shm"]
    pid = daemon_pid(driver, daemon_id)
    assert daemons(driver) == [pid]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={uuid}".encode() in environ
    (handle,) = driver.checkpoint_entry(uid)["state"]["mpsDaemons"]
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
    delete_pods(kube, namespace, ["mps-pod-1"])
    assert daemons(driver) == [pid]
    assert uid in driver.checkpoint_claims()
    # ... the second one unprepares the claim: daemon, its directories, CDI spec, checkpoint.
    delete_pods(kube, namespace, ["mps-pod-2"])
    assert_unprepared_without_daemon(driver, uid, daemon_id)
    assert list(driver.mps_dir.iterdir()) == []
    assert not (driver.state_dir / "claims" / uid).exists()


def test_an_invalid_mps_config_becomes_a_pod_event_and_starts_no_daemon(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    bad = m.gpu_config(m.mps_sharing(defaultActiveThreadPercentage=150))
    kube.create(m.claim("bad-mps", namespace, m.claim_spec([m.request()], config=[bad])))
    kube.create(m.gpu_pod("pod", namespace, claim="bad-mps", command=m.SHOW_MPS))

    message = wait_event(kube, namespace, "pod", "FailedPrepareDynamicResources", 90)
    assert f"{namespace}/bad-mps" in message
    assert "defaultActiveThreadPercentage" in message
    assert "150" in message
    uid = claim_uid(kube, "bad-mps", namespace)
    assert daemons(driver) == []
    assert driver.mps_daemon_pods() == {}
    assert not driver.mps_dir.exists() or list(driver.mps_dir.iterdir()) == []
    assert uid not in driver.checkpoint_claims()
    assert uid not in driver.cdi_spec_claims()
    assert kube.get("v1", "Pod", "pod", namespace)["status"]["phase"] == "Pending"
