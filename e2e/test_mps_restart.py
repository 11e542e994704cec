"""MPS daemons outlive the plugin (issue 5, e2e (d)): per-claim MPS with the daemon run as a pod
(``--mps-daemon-runner=pod``) from the locally built image of the nvidia-cuda-mps-control TEST
DOUBLE. Two pods share an MPS claim; the plugin is killed with SIGKILL while they run: the
daemon pod, its daemon process and the workload pods are undisturbed and the daemon keeps
answering; the restarted plugin adopts the daemon (only queries reach it) and, when the pods
go, tears it down: pod deleted, directories removed, checkpoint entry gone."""

from __future__ import annotations

import sys

import pytest

from e2e import manifests as m
from e2e.driver import MPS_CONTROL_DOUBLE, PLUGIN, Driver
from e2e.kube import Kube
from e2e.mps import MPS_CONFIG, assert_unprepared_without_daemon, daemon_pid, daemons, mps_output
from e2e.workloads import allocated_devices, claim_uid, delete_pods, run_pods_sharing
from gpu_dra.kubelet_plugin.mps import ControlClient, claim_daemon_id

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100"
PODS = ("mps-pod-1", "mps-pod-2")


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
    run_pods_sharing(kube, namespace, "shared-gpu", PODS, command=m.SHOW_MPS)
    uid = claim_uid(kube, "shared-gpu", namespace)
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
    (handle,) = driver.checkpoint_entry(uid)["state"]["mpsDaemons"]
    assert (handle["runner"], handle["runnerRef"]) == ("pod", pod_uid)
    pid = daemon_pid(driver, daemon_id)
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
    delete_pods(kube, namespace, PODS)
    assert_unprepared_without_daemon(driver, uid, daemon_id)
