"""MPS daemons as pods: the real `MpsDaemonManager` with `PodRunner` over an in-memory pod API
whose kubelet runs each pod's container (the nvidia-cuda-mps-control test double, ``-f``) as a
real host process. Checks the pod the runner asks for, readiness through the control pipe, stop
(pod deleted and waited for), adoption by a restarted plugin, dead/FAULT detection, leftovers,
and failed starts leaving nothing behind."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_dra.kube import errors
from gpu_dra.kubelet_plugin.mps import (
    DaemonPaths,
    DaemonState,
    MpsDaemonGoneError,
    MpsDaemonManager,
    MpsSettings,
    MpsStartError,
    MpsStopError,
    PlainDirectoryShm,
    PodRunner,
    ProcessRunner,
    claim_daemon_id,
)
from gpu_dra.kubelet_plugin.mps.pod import DAEMON_ID_LABEL, pod_name
from gpu_dra.kubelet_plugin.mps.process import start_time
from gpu_dra.kubelet_plugin.tiers.state import handles_from_state, handles_to_state
from tests.doubles import nvidia_cuda_mps_control as double
from tests.doubles.mps_helpers import (
    DOUBLE_BINARY,
    double_env,
    kill_processes_under,
    processes_under,
    scratch_root,
)
from tests.fakes.pod_api import InMemoryPodApi, container_env

CLAIM = "0f6c2c6e-8a3c-4d0e-9a63-8e2b5e0c1d11"
OTHER_CLAIM = "7a1d2c3b-0000-4e5f-8a9b-0c1d2e3f4a5b"
GPU = "GPU-11111111-2222-3333-4444-555555555555"
MIG = "MIG-99999999-8888-7777-6666-555555555555"
NODE = "gpu-node-1"
NAMESPACE = "gpu-dra"
IMAGE = "registry.example/gpu-dra-mps-double:1"
PRIORITY_CLASS = "system-node-critical"
SETTINGS = MpsSettings(active_thread_percentage=40, pinned_limits={GPU: "4096M"})


@pytest.fixture
def root(mps_root: Path) -> Path:
    """The daemons' scratch data dir (conftest's `mps_root`: fails on leftover processes)."""
    return mps_root


@pytest.fixture
def api() -> Iterator[InMemoryPodApi]:
    fake = InMemoryPodApi(
        {"nvidia-cuda-mps-control": DOUBLE_BINARY},
        extra_env={"PYTHON": sys.executable},
        unpullable=frozenset({"registry.example/missing:1"}),
    )
    yield fake
    fake.close()


def make_manager(
    root: Path, api: InMemoryPodApi, image: str = IMAGE, node: str = NODE
) -> MpsDaemonManager:
    runner = PodRunner(
        api, namespace=NAMESPACE, node_name=node, image=image, priority_class=PRIORITY_CLASS
    )
    return MpsDaemonManager(
        root,
        binary=DOUBLE_BINARY,
        base_env=double_env(),
        runner=runner,
        shm=PlainDirectoryShm(),
        start_timeout_s=15.0,
        remove_timeout_s=15.0,
    )


@pytest.fixture
def manager(root: Path, api: InMemoryPodApi) -> MpsDaemonManager:
    return make_manager(root, api)


def daemon_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "mps").glob("*"))


def pods(api: InMemoryPodApi) -> dict[str, str]:
    """Live pod objects: name -> phase."""
    return {name: pod["status"]["phase"] for (_, name), pod in sorted(api.pods.items())}


def test_the_daemon_pod_is_bound_to_the_node_with_the_mps_contract(
    manager: MpsDaemonManager, api: InMemoryPodApi, root: Path
) -> None:
    daemon_id = claim_daemon_id(CLAIM, [GPU])
    handle = manager.start(daemon_id, [GPU], MpsSettings(multi_user=True))
    try:
        (pod,) = api.created
        spec = pod["spec"]
        (container,) = spec["containers"]
        assert pod["metadata"]["name"] == f"mps-control-daemon-{daemon_id}"
        assert pod["metadata"]["namespace"] == NAMESPACE
        assert pod["metadata"]["labels"] == {
            "app.kubernetes.io/managed-by": "gpu-dra-kubelet-plugin",
            "app.kubernetes.io/component": "mps-control-daemon",
            DAEMON_ID_LABEL: daemon_id,
        }
        assert "ownerReferences" not in pod["metadata"]  # outlives the plugin's pod
        assert spec["nodeName"] == NODE
        assert spec["restartPolicy"] == "Never"
        assert spec["hostPID"] is True
        assert "hostIPC" not in spec
        assert container["image"] == IMAGE
        assert container["command"] == ["nvidia-cuda-mps-control", "-f", "-M"]
        assert container["securityContext"] == {"privileged": True}
        # Evicted last under node pressure: high priority, Burstable (requests, no limits).
        assert spec["priorityClassName"] == PRIORITY_CLASS
        assert set(container["resources"]) == {"requests"}
        assert set(container["resources"]["requests"]) == {"cpu", "memory"}
        env = container_env(pod)
        assert env["CUDA_VISIBLE_DEVICES"] == GPU
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "mps" / daemon_id / "pipe")
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(root / "mps" / daemon_id / "log")
        assert env["PATH"].endswith(":/driver-root/usr/bin")
        assert not {k for k in env if k.startswith(("GPU_DRA_", "PYTHON", "HOME"))}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
        assert volumes[mounts[str(handle.root)]] == str(handle.root)
        assert volumes[mounts["/dev/shm"]] == str(handle.paths.shm)
        assert volumes[mounts["/driver-root"]] == "/"

        # The handle names the pod; the daemon is the container's process, found by PID file.
        assert handle.runner == "pod"
        assert handle.runner_ref == pod["metadata"]["uid"]
        assert api.processes[handle.runner_ref].pid == handle.pid
        assert start_time(handle.pid) == handle.pid_start_time
        assert double.read_state(handle.paths.pipe)["multiUser"] is True
        assert handles_from_state({"mpsDaemons": handles_to_state([handle])}) == [handle]
    finally:
        manager.stop(handle)


def test_start_applies_the_settings_through_the_control_pipe_and_stop_deletes_the_pod(
    manager: MpsDaemonManager, api: InMemoryPodApi, root: Path
) -> None:
    daemon_id = claim_daemon_id(CLAIM, [GPU])
    handle = manager.start(daemon_id, [GPU], SETTINGS)
    state = double.read_state(handle.paths.pipe)
    assert state["defaults"] == {
        "activeThreadPercentage": 40.0,
        "pinnedMemLimits": {GPU: "4096M"},
    }
    assert pods(api) == {pod_name(daemon_id): "Running"}
    assert manager.status(handle).state is DaemonState.READY

    manager.stop(handle)

    assert pods(api) == {}
    assert not handle.root.exists()
    assert processes_under(root) == []
    manager.stop(handle)  # idempotent


def test_a_restarted_plugin_adopts_the_daemon_pod_and_stops_it(
    root: Path, api: InMemoryPodApi
) -> None:
    first = make_manager(root, api)
    handle = first.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    recorded = handles_to_state([handle])
    log_before = (handle.paths.log / "control.log").read_text()
    del first  # the plugin dies; the pod and its daemon stay

    restarted = make_manager(root, api)
    (again,) = handles_from_state({"mpsDaemons": recorded})
    assert restarted.adopt(again) == handle
    assert restarted.status(again).state is DaemonState.READY
    queries = (handle.paths.log / "control.log").read_text()[len(log_before) :]
    assert all("Cmd:get_" in line for line in queries.splitlines()), queries
    assert restarted.leftovers() == [handle.daemon_id]  # recorded, so recovery keeps it

    restarted.stop(again)
    assert pods(api) == {}
    assert not handle.root.exists()


def test_a_dead_daemon_container_is_reported_dead_and_stop_cleans_up(
    manager: MpsDaemonManager, api: InMemoryPodApi
) -> None:
    handle = manager.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    api.kill_container(NAMESPACE, pod_name(handle.daemon_id))

    status = manager.status(handle)
    assert status.state is DaemonState.DEAD
    assert "ended (Failed)" in status.detail
    with pytest.raises(MpsDaemonGoneError, match="ended"):
        manager.adopt(handle)
    manager.stop(handle)
    assert pods(api) == {}
    assert not handle.root.exists()


def test_a_daemon_pod_deleted_behind_the_plugins_back_is_dead(
    manager: MpsDaemonManager, api: InMemoryPodApi
) -> None:
    handle = manager.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    api.remove_object(NAMESPACE, pod_name(handle.daemon_id))

    status = manager.status(handle)
    assert status.state is DaemonState.DEAD
    assert f"daemon pod {NAMESPACE}/{pod_name(handle.daemon_id)} is gone" in status.detail
    manager.stop(handle)
    assert not handle.root.exists()


def test_fault_is_detected_in_a_daemon_pod(manager: MpsDaemonManager, api: InMemoryPodApi) -> None:
    handle = manager.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    try:
        double.inject_fault(handle.paths.pipe)
        status = manager.status(handle)
        assert status.state is DaemonState.FAULT
        assert len(status.faulted_servers) == 1
        double.inject_fault(handle.paths.pipe, on=False)
        assert manager.status(handle).state is DaemonState.READY
    finally:
        manager.stop(handle)


def test_an_unpullable_image_fails_the_start_with_the_reason_and_leaves_nothing(
    root: Path, api: InMemoryPodApi
) -> None:
    manager = make_manager(root, api, image="registry.example/missing:1")
    with pytest.raises(MpsStartError, match="ErrImagePull: failed to pull image"):
        manager.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    assert pods(api) == {}
    assert daemon_dirs(root) == []


def test_an_image_without_the_control_program_fails_the_start(
    root: Path, api: InMemoryPodApi
) -> None:
    api.binaries.clear()
    manager = make_manager(root, api)
    with pytest.raises(MpsStartError, match="executable file not found"):
        manager.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    assert pods(api) == {}
    assert daemon_dirs(root) == []


def test_an_api_error_fails_the_start_cleanly(
    manager: MpsDaemonManager, api: InMemoryPodApi, root: Path
) -> None:
    # the first call is the check for a leftover pod of the same id
    api.fail_next(errors.ApiError("get Pod: 503 Service Unavailable", status=503))
    with pytest.raises(MpsStartError, match="503"):
        manager.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    assert pods(api) == {}
    assert daemon_dirs(root) == []


def test_leftover_daemon_pods_of_this_node_are_listed_and_removed(
    root: Path, api: InMemoryPodApi
) -> None:
    here = make_manager(root, api)
    elsewhere_root = scratch_root()
    elsewhere = make_manager(elsewhere_root, api, node="gpu-node-2")
    mine = here.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    theirs = elsewhere.start(claim_daemon_id(OTHER_CLAIM, [GPU]), [GPU], SETTINGS)
    try:
        # A plugin that died between start and checkpoint: its directory is gone too (say a
        # node clean-up), only the pod is left. It is still found, by label and node.
        subprocess.run(["rm", "-rf", str(mine.root)], check=True)
        assert here.leftovers() == [mine.daemon_id]
        here.remove_leftover(mine.daemon_id)
        assert pod_name(mine.daemon_id) not in pods(api)
        assert here.leftovers() == []
        assert pods(api) == {pod_name(theirs.daemon_id): "Running"}
    finally:
        elsewhere.stop(theirs)
        kill_processes_under(elsewhere_root)
        subprocess.run(["rm", "-rf", str(elsewhere_root)], check=False)


def test_a_stale_handle_names_the_newer_pod_and_never_deletes_it_by_its_old_uid(
    manager: MpsDaemonManager, api: InMemoryPodApi
) -> None:
    daemon_id = claim_daemon_id(CLAIM, [GPU])
    old = manager.start(daemon_id, [GPU], SETTINGS)
    new = manager.start(daemon_id, [GPU], SETTINGS)  # replaces the leftover of the same id
    assert new.runner_ref != old.runner_ref
    assert pods(api) == {pod_name(daemon_id): "Running"}

    # The runner deletes by UID: the old pod's UID never deletes the newer pod.
    manager.runner.remove(daemon_id, old.runner_ref, 5.0)
    assert pods(api) == {pod_name(daemon_id): "Running"}
    # The manager resolves any handle of the id to its current instance (docs/mps.md).
    assert manager.status(old).state is DaemonState.READY
    assert manager.adopt(old) == new
    manager.stop(old)
    assert pods(api) == {}
    assert not new.root.exists()


def test_a_pod_that_does_not_go_fails_stop_and_stop_can_be_retried(
    manager: MpsDaemonManager, api: InMemoryPodApi
) -> None:
    handle = manager.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    api.fail_next(errors.ApiError("get Pod: 500 Internal Server Error", status=500))
    # quit succeeds, the pod lookup fails: the directories and the checkpoint entry stay.
    with pytest.raises(MpsStopError, match="500"):
        manager.stop(handle)
    assert handle.root.exists()
    manager.stop(handle)
    assert pods(api) == {}
    assert not handle.root.exists()


class _PodStaysRunner(PodRunner):
    """A pod runner whose removal of a launched pod (``ref`` given) fails, as on an API outage."""

    def remove(self, daemon_id: str, ref: str | None, timeout_s: float) -> None:
        if ref is not None:
            raise MpsStopError("get Pod: 500 Internal Server Error")
        super().remove(daemon_id, ref, timeout_s)


def test_a_failed_start_whose_pod_does_not_go_still_ends_the_daemon_and_a_retry_cleans_up(
    root: Path,
) -> None:
    # The daemon refuses its settings; removing its pod then fails. Nothing records the start,
    # so the daemon process must not be left running (the fixture fails on leftovers).
    api = InMemoryPodApi(
        {"nvidia-cuda-mps-control": DOUBLE_BINARY},
        extra_env={
            "PYTHON": sys.executable,
            "GPU_DRA_MPS_DOUBLE_FAIL_COMMAND": "set_default_active_thread_percentage",
        },
    )
    try:
        manager = MpsDaemonManager(
            root,
            binary=DOUBLE_BINARY,
            base_env=double_env(),
            runner=_PodStaysRunner(api, namespace=NAMESPACE, node_name=NODE, image=IMAGE),
            shm=PlainDirectoryShm(),
            start_timeout_s=15.0,
            remove_timeout_s=15.0,
        )
        daemon_id = claim_daemon_id(CLAIM, [GPU])
        with pytest.raises(MpsStartError, match="set_default_active_thread_percentage failed"):
            manager.start(daemon_id, [GPU], SETTINGS)
        assert processes_under(root) == []
        assert daemon_dirs(root) == [daemon_id]  # kept for the retry

        manager.remove_leftover(daemon_id)
        assert pods(api) == {}
        assert daemon_dirs(root) == []
    finally:
        api.close()


def test_mig_devices_get_their_own_daemon_pod_keyed_by_the_mig_uuid(
    manager: MpsDaemonManager, api: InMemoryPodApi
) -> None:
    handle = manager.start(
        claim_daemon_id(CLAIM, [MIG]), [MIG], MpsSettings(pinned_limits={MIG: "2048M"})
    )
    try:
        assert container_env(api.created[0])["CUDA_VISIBLE_DEVICES"] == MIG
        assert double.read_state(handle.paths.pipe)["defaults"] == {
            "activeThreadPercentage": 100.0,
            "pinnedMemLimits": {MIG: "2048M"},
        }
    finally:
        manager.stop(handle)


def test_after_a_switch_to_host_processes_the_daemon_pods_are_still_adopted_and_stopped(
    root: Path, api: InMemoryPodApi
) -> None:
    handle = make_manager(root, api).start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    # The plugin restarts with --mps-daemon-runner=process: pods only for what exists.
    switched = MpsDaemonManager(
        root,
        binary=DOUBLE_BINARY,
        base_env=double_env(),
        shm=PlainDirectoryShm(),
        other_runners=[PodRunner(api, namespace=NAMESPACE, node_name=NODE, image="")],
    )

    assert switched.adopt(handle) == handle
    assert switched.status(handle).state is DaemonState.READY
    new = switched.start(claim_daemon_id(OTHER_CLAIM, [GPU]), [GPU], SETTINGS)
    assert new.runner == "process"
    assert len(api.created) == 1  # no new pod

    switched.stop(handle)
    switched.stop(new)
    assert pods(api) == {}
    assert daemon_dirs(root) == []


def test_after_a_switch_to_pods_host_process_daemons_are_still_stopped(
    root: Path, api: InMemoryPodApi
) -> None:
    process_manager = MpsDaemonManager(
        root, binary=DOUBLE_BINARY, base_env=double_env(), shm=PlainDirectoryShm()
    )
    handle = process_manager.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    switched = MpsDaemonManager(
        root,
        binary=DOUBLE_BINARY,
        base_env=double_env(),
        runner=PodRunner(api, namespace=NAMESPACE, node_name=NODE, image=IMAGE),
        shm=PlainDirectoryShm(),
        other_runners=[ProcessRunner()],
    )

    assert switched.status(handle).state is DaemonState.READY
    switched.stop(handle)
    assert processes_under(root) == []
    assert daemon_dirs(root) == []


def test_a_pod_runner_without_an_image_starts_nothing(root: Path, api: InMemoryPodApi) -> None:
    manager = make_manager(root, api, image="")
    with pytest.raises(MpsStartError, match="no image for MPS daemon pods"):
        manager.start(claim_daemon_id(CLAIM, [GPU]), [GPU], SETTINGS)
    assert pods(api) == {}
    assert daemon_dirs(root) == []


def test_an_empty_priority_class_leaves_the_daemon_pod_without_one(
    root: Path, api: InMemoryPodApi
) -> None:
    runner = PodRunner(api, namespace=NAMESPACE, node_name=NODE, image=IMAGE, priority_class="")
    paths = DaemonPaths.of(root, claim_daemon_id(CLAIM, [GPU]))

    manifest = runner.manifest(["nvidia-cuda-mps-control", "-d"], {}, paths)

    assert "priorityClassName" not in manifest["spec"]


def test_the_daemon_pod_pulls_with_the_given_secrets_and_none_by_default(
    root: Path, api: InMemoryPodApi
) -> None:
    paths = DaemonPaths.of(root, claim_daemon_id(CLAIM, [GPU]))
    with_secrets = PodRunner(
        api, namespace=NAMESPACE, node_name=NODE, image=IMAGE, image_pull_secrets=["a", "b"]
    )
    plain = PodRunner(api, namespace=NAMESPACE, node_name=NODE, image=IMAGE)

    manifest = with_secrets.manifest(["nvidia-cuda-mps-control", "-d"], {}, paths)

    assert manifest["spec"]["imagePullSecrets"] == [{"name": "a"}, {"name": "b"}]
    assert "imagePullSecrets" not in plain.manifest(["x", "-d"], {}, paths)["spec"]
