"""MPS daemons outlive the plugin (issue 5, e2e (d)): per-claim MPS with the daemon run as a pod
(``--mps-daemon-runner=pod``) from the locally built image of the nvidia-cuda-mps-control TEST
DOUBLE. Two pods share an MPS claim; the plugin is killed with SIGKILL while they run: the
daemon pod, its daemon process and the workload pods are undisturbed and the daemon keeps
answering; the restarted plugin adopts the daemon (only queries reach it) and, when the pods
go, tears it down: pod deleted, directories removed, checkpoint entry gone."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from e2e import manifests as m
from e2e.driver import MPS_CONTROL_DOUBLE, MPS_DAEMON_NAMESPACE, PLUGIN, Driver
from e2e.kube import Kube, wait_for
from e2e.test_mps import MPS_CONFIG, checkpoint_entry, daemons, mps_output
from e2e.test_whole_gpu import allocated_devices, wait_running
from gpu_dra.kubelet_plugin.mps import ControlClient, claim_daemon_id
from tests.doubles.mps_helpers import kill_processes_under
from tests.doubles.nvidia_cuda_mps_control import PID_FILE

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = "hgx-h100"
PODS = ("mps-pod-1", "mps-pod-2")


@pytest.fixture(autouse=True)
def no_daemon_left(driver: Driver, kube: Kube) -> Iterator[None]:
    """No daemon process or daemon pod before or after; leftovers are removed and fail."""
    assert not daemons(driver), "MPS daemons left by an earlier test"
    assert not driver.mps_daemon_pods(), "MPS daemon pods left by an earlier test"
    yield
    left_pods = sorted(driver.mps_daemon_pods())
    for name in left_pods:
        kube.delete("v1", "Pod", name, MPS_DAEMON_NAMESPACE)
    left = kill_processes_under(driver.data_dir / "mps", grace_s=10)
    assert not left, f"MPS daemon processes left behind: {left}"
    assert not left_pods, f"MPS daemon pods left behind: {left_pods}"


def queries_only(before: str, after: str) -> list[str]:
    """The control.log lines added since ``before`` that are not ``get_*`` queries."""
    assert after.startswith(before), "control.log was rewritten"
    added = [line.split("] ", 1)[-1] for line in after[len(before) :].splitlines()]
    return [line for line in added if not line.startswith("Cmd:get_")]


def plugin_log(driver: Driver) -> str:
    return (driver.cluster.paths.logs / f"{PLUGIN}.log").read_text(errors="replace")


def test_a_killed_plugin_leaves_the_daemon_pod_running_and_the_restarted_one_tears_it_down(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    config = m.gpu_config(m.mps_sharing(**MPS_CONFIG), requests=["mps-gpu"])
    kube.create(m.claim("shared-gpu", namespace, m.claim_spec([m.request("mps-gpu")], [config])))
    for name in PODS:
        kube.create(m.gpu_pod(name, namespace, claim="shared-gpu", command=m.SHOW_MPS))
    for name in PODS:
        wait_running(kube, name, namespace)
    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "shared-gpu", namespace)["metadata"][
        "uid"
    ]
    (device,) = allocated_devices(kube, "shared-gpu", namespace)
    daemon_id = claim_daemon_id(uid, [driver.uuid_of(device)])
    root = driver.mps_dir / daemon_id
    pipe = driver.data_dir / "mps" / daemon_id / "pipe"

    # The daemon runs as a pod bound to the node, recorded in the checkpoint by its UID.
    pod_name = f"mps-control-daemon-{daemon_id}"
    (daemon_pod,) = driver.mps_daemon_pods().values()
    assert daemon_pod["metadata"]["name"] == pod_name
    assert daemon_pod["status"]["phase"] == "Running"
    assert daemon_pod["spec"]["hostPID"] is True
    pod_uid = daemon_pod["metadata"]["uid"]
    (handle,) = checkpoint_entry(driver, uid)["state"]["mpsDaemons"]
    assert (handle["runner"], handle["runnerRef"]) == ("pod", pod_uid)
    pid = int((root / "pipe" / PID_FILE).read_text())
    assert daemons(driver) == [pid] == [handle["pid"]]
    for name in PODS:
        assert mps_output(kube, name, namespace)["pid"] == str(pid)
    control_log = root / "log" / "control.log"
    log_before = control_log.read_text()
    client = ControlClient(MPS_CONTROL_DOUBLE, base_env={"PYTHON": sys.executable})

    driver.kill_plugin()

    # Nothing of the claim notices: daemon pod, daemon process, workloads, settings.
    (daemon_pod,) = driver.mps_daemon_pods().values()
    assert (daemon_pod["metadata"]["uid"], daemon_pod["status"]["phase"]) == (pod_uid, "Running")
    assert daemons(driver) == [pid]
    for name in PODS:
        assert kube.get("v1", "Pod", name, namespace)["status"]["phase"] == "Running"
    assert client.active_thread_percentage(pipe) == 50.0
    assert queries_only(log_before, control_log.read_text()) == []

    offset = len(plugin_log(driver))
    driver.start_plugin()

    # The restarted plugin adopted the daemon: same pod, same process, only queries sent.
    assert f"mps daemon adopted daemon_id={daemon_id} pid={pid}" in plugin_log(driver)[offset:]
    (daemon_pod,) = driver.mps_daemon_pods().values()
    assert daemon_pod["metadata"]["uid"] == pod_uid
    assert daemons(driver) == [pid]
    assert queries_only(log_before, control_log.read_text()) == []
    assert uid in driver.checkpoint_claims()
    assert uid in driver.cdi_spec_claims()

    # Deleting the pods unprepares the claim: the restarted plugin removes the daemon.
    for name in PODS:
        kube.delete("v1", "Pod", name, namespace)
    for name in PODS:
        kube.wait_gone("v1", "Pod", name, namespace)
    wait_for("the claim to be unprepared", lambda: uid not in driver.checkpoint_claims(), 60)
    assert driver.mps_daemon_pods() == {}
    assert daemons(driver) == []
    assert not root.exists()
    assert uid not in driver.cdi_spec_claims()
