"""MPS shares end to end (issue 5, e2e (b)): scheduler-accounted memory/compute shares of one
GPU, from claims in two namespaces, served by ONE MPS control daemon with per-claim caps.

A simulated hgx-h100 node (H100 80GB, 81559Mi) whose gpu-0 is offered as MPS shares
(``--mps-shares=0``). The plugin runs the daemon as a pod from a locally built image of the
nvidia-cuda-mps-control TEST DOUBLE (tests/doubles), so the daemon is a real process with real
directories, settings and control.log; each pod prints the CUDA_MPS_* environment its CDI spec
gave it and the daemon files it sees in the mounted pipe directory. A device-plugin-style pod
asking for ``nvidia.com/gpu.shared`` gets a share through the same class (issue 27)."""

from __future__ import annotations

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.mps import PIPE, daemon_ids, daemon_pid, daemons, mps_output
from e2e.workloads import (
    allocated_devices,
    claim_uid,
    delete_pods,
    extended_resource_claim,
    share_claim_uid,
    wait_event,
    wait_refused_by_quota,
    wait_running,
)
from gpu_dra.kubelet_plugin.mps import shared_daemon_id
from tests.doubles.nvidia_cuda_mps_control import PID_FILE, SOCKET, read_state

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100"
# The lifecycle without warm daemons (the first share starts the daemon, the last stops it);
# warm daemons: e2e/test_mps_warm.py.
PLUGIN_ARGS = ("--mps-shares=0", "--mps-share-daemon-warm=off")


def test_three_shares_from_two_namespaces_run_on_one_daemon_with_their_own_caps(
    driver: Driver, kube: Kube, namespace: str, other_namespace: str
) -> None:
    published = driver.devices()["gpu-0"]
    assert published["allowMultipleAllocations"] is True
    assert published["capacity"]["compute"]["value"] == "100"
    assert "allowMultipleAllocations" not in driver.devices()["gpu-1"]  # not offered
    uuid = driver.uuid_of("gpu-0")
    shares = {  # pod / claim name: (namespace, memory, MiB, compute)
        "small": (namespace, "10Gi", 10240, 10),
        "medium": (other_namespace, "20Gi", 20480, 20),
        "large": (namespace, "40Gi", 40960, 40),
    }
    for name, (ns, memory, _, compute) in shares.items():
        kube.create(m.share_claim(name, ns, memory, compute))
        kube.create(m.gpu_pod(name, ns, claim=name, command=m.SHOW_MPS))
    for name, (ns, *_) in shares.items():
        wait_running(kube, name, ns)

    # The scheduler accounted each share on gpu-0: its shareID and consumed capacity.
    uids = {
        name: share_claim_uid(kube, name, ns, "gpu-0", memory, compute)
        for name, (ns, memory, _, compute) in shares.items()
    }

    # One daemon for the GPU, named after it, serving all three claims.
    daemon_id = shared_daemon_id(uuid)
    assert [p.name for p in driver.mps_dir.iterdir()] == [daemon_id]
    root = driver.mps_dir / daemon_id
    pid = daemon_pid(driver, daemon_id)
    assert daemons(driver) == [pid]
    assert list(driver.mps_daemon_pods()) == [f"mps-control-daemon-{daemon_id}"]
    for uid in uids.values():
        state = driver.checkpoint_entry(uid)["state"]
        assert [h["daemonId"] for h in state["mpsDaemons"]] == [daemon_id]
        assert state["mpsShares"]["gpu-0"]["uuid"] == uuid
    assert driver.metric("gpu_dra_mps_daemon_claims", daemon=daemon_id) == 3
    assert driver.metric("gpu_dra_mps_daemons", kind="shared") == 1
    # Daemon defaults, set before any server: the largest share allowed (the whole GPU).
    assert read_state(root / "pipe")["defaults"] == {
        "activeThreadPercentage": 100.0,
        "pinnedMemLimits": {uuid: "81559M"},
    }

    # Each container: its own caps, the daemon's pipe directory.
    for name, (ns, _, mib, compute) in shares.items():
        seen = mps_output(kube, name, ns)
        assert seen["env"].splitlines() == [
            f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}",
            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}={mib}M",
            f"CUDA_MPS_PIPE_DIRECTORY={PIPE}",
        ], (name, seen)
        assert {SOCKET, PID_FILE} <= set(seen["ls"].split()), (name, seen)
        assert seen["pid"] == str(pid), (name, seen)
        assert (
            driver.metric(
                "gpu_dra_mps_claim_pinned_memory_limit_bytes", claim=f"{ns}/{name}", gpu=uuid
            )
            == mib * 2**20
        )

    # A fourth share does not fit (70 of 100 compute taken, 40 more asked): not scheduled.
    kube.create(m.share_claim("too-big", other_namespace, "20Gi", 40))
    kube.create(m.gpu_pod("too-big", other_namespace, claim="too-big", command=m.SHOW_MPS))
    wait_event(kube, other_namespace, "too-big", "FailedScheduling", 60)
    # A whole-GPU claim for gpu-0 cannot land on it: gpu.nvidia.com never selects a GPU
    # offered as shares (share-only; test_a_whole_gpu_claim_never_lands_on_an_offered_gpu).
    whole = m.request("gpu", selectors=[f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"])
    kube.create(m.claim("whole", namespace, m.claim_spec([whole])))
    kube.create(m.gpu_pod("whole", namespace, claim="whole"))
    wait_event(kube, namespace, "whole", "FailedScheduling", 60)
    for ns, name in ((other_namespace, "too-big"), (namespace, "whole")):
        assert kube.get("v1", "Pod", name, ns)["status"]["phase"] == "Pending"
        claim = kube.get("resource.k8s.io/v1", "ResourceClaim", name, ns)
        assert not claim.get("status", {}).get("allocation")
        delete_pods(kube, ns, [name])
    assert daemons(driver) == [pid]

    # The daemon stays while any share is prepared, and goes with the last one.
    for name in ("small", "medium"):
        ns = shares[name][0]
        delete_pods(kube, ns, [name])
        driver.wait_unprepared(uids[name])
        assert daemons(driver) == [pid]
    assert driver.metric("gpu_dra_mps_daemon_claims", daemon=daemon_id) == 1
    delete_pods(kube, namespace, ["large"])
    wait_for("the last share to be unprepared", lambda: not driver.checkpoint_claims(), 60)
    wait_for("the daemon to stop", lambda: not daemons(driver), 30)
    assert driver.mps_daemon_pods() == {}
    assert not root.exists()  # pipe, log and shm directories removed
    assert list(driver.mps_dir.iterdir()) == []
    assert not set(uids.values()) & driver.cdi_spec_claims()


def test_a_restarted_plugin_adopts_the_shared_daemon_and_its_reference_count(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    for name, memory, compute in (("first", "10Gi", 10), ("second", "20Gi", 20)):
        kube.create(m.share_claim(name, namespace, memory, compute))
        kube.create(m.gpu_pod(name, namespace, claim=name, command=m.SHOW_MPS))
        wait_running(kube, name, namespace)
    daemon_id = shared_daemon_id(driver.uuid_of("gpu-0"))
    (pid,) = daemons(driver)
    (daemon_pod,) = driver.mps_daemon_pods().values()

    driver.kill_plugin()
    assert daemons(driver) == [pid]  # the daemon does not die with the plugin
    driver.start_plugin()

    # Same daemon pod and process; a third share joins it instead of starting another.
    assert daemons(driver) == [pid]
    assert (
        driver.mps_daemon_pods()[daemon_pod["metadata"]["name"]]["metadata"]["uid"]
        == (daemon_pod["metadata"]["uid"])
    )
    kube.create(m.share_claim("third", namespace, "30Gi", 30))
    kube.create(m.gpu_pod("third", namespace, claim="third", command=m.SHOW_MPS))
    wait_running(kube, "third", namespace)
    assert mps_output(kube, "third", namespace)["pid"] == str(pid)
    assert driver.metric("gpu_dra_mps_daemon_claims", daemon=daemon_id) == 3

    delete_pods(kube, namespace, ("first", "second", "third"))
    wait_for("the shares to be unprepared", lambda: not driver.checkpoint_claims(), 60)
    wait_for("the daemon to stop", lambda: not daemons(driver), 30)
    assert driver.mps_daemon_pods() == {}
    assert not (driver.mps_dir / daemon_id).exists()


# ---- share-only, and an unnamed amount is an equal part (issue 27) ------------------------------
QUARTER_MIB = 81559 // 4  # --mps-share-replicas defaults to 4: 20389Mi of the 81559Mi


def test_two_memory_only_shares_run_side_by_side_on_one_gpu(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    published = driver.devices()["gpu-0"]["capacity"]
    assert published["memory"]["requestPolicy"]["default"] == f"{QUARTER_MIB}Mi"
    assert published["compute"]["requestPolicy"]["default"] == "25"
    uuid = driver.uuid_of("gpu-0")
    for name in ("eight-a", "eight-b"):
        kube.create(m.share_claim(name, namespace, "8Gi", None))
        kube.create(m.gpu_pod(name, namespace, claim=name, command=m.SHOW_MPS))
    for name in ("eight-a", "eight-b"):
        wait_running(kube, name, namespace)

    # Each named 8Gi and no compute: it consumed 8Gi and a quarter of the SMs, so both fit.
    uids = [share_claim_uid(kube, n, namespace, "gpu-0", "8Gi", 25) for n in ("eight-a", "eight-b")]
    daemon_id = shared_daemon_id(uuid)
    pid = daemon_pid(driver, daemon_id)
    for name in ("eight-a", "eight-b"):
        seen = mps_output(kube, name, namespace)
        assert seen["env"].splitlines() == [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}=8192M",
            f"CUDA_MPS_PIPE_DIRECTORY={PIPE}",
        ], (name, seen)
        assert seen["pid"] == str(pid), (name, seen)
    assert driver.metric("gpu_dra_mps_daemon_claims", daemon=daemon_id) == 2

    delete_pods(kube, namespace, ["eight-a", "eight-b"])
    for uid in uids:
        driver.wait_unprepared(uid)
    wait_for("the daemon to stop", lambda: not daemons(driver), 30)


def test_an_amount_less_share_is_a_quarter_of_the_gpu_in_the_shared_daemon(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    uuid = driver.uuid_of("gpu-0")
    kube.create(m.share_claim("quarter", namespace, None, None))
    kube.create(m.gpu_pod("quarter", namespace, claim="quarter", command=m.SHOW_MPS))
    wait_running(kube, "quarter", namespace)

    # No amount named: the request policies' defaults, 1/4 of the GPU, as a share.
    uid = share_claim_uid(kube, "quarter", namespace, "gpu-0", f"{QUARTER_MIB}Mi", 25)
    daemon_id = shared_daemon_id(uuid)  # the GPU's shared daemon, not one of the claim's own
    (handle,) = driver.checkpoint_entry(uid)["state"]["mpsDaemons"]
    assert handle["daemonId"] == daemon_id
    assert driver.checkpoint_entry(uid)["state"]["mpsShares"]["gpu-0"]["computePercent"] == 25
    seen = mps_output(kube, "quarter", namespace)
    assert seen["env"].splitlines() == [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}={QUARTER_MIB}M",
        f"CUDA_MPS_PIPE_DIRECTORY={PIPE}",
    ], seen
    assert seen["pid"] == str(daemon_pid(driver, daemon_id))

    delete_pods(kube, namespace, ["quarter"])
    driver.wait_unprepared(uid)
    wait_for("the daemon to stop", lambda: not daemons(driver), 30)


def test_a_whole_gpu_claim_never_lands_on_an_offered_gpu(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    # gpu-0 is free (no share holds it), yet gpu.nvidia.com does not select it: share-only.
    uuid = driver.uuid_of("gpu-0")
    on_gpu0 = m.request("gpu", selectors=[f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"])
    kube.create(m.claim("on-gpu0", namespace, m.claim_spec([on_gpu0])))
    kube.create(m.gpu_pod("on-gpu0", namespace, claim="on-gpu0"))
    kube.create(m.claim("any-gpu", namespace, m.claim_spec([m.request("gpu")])))
    kube.create(m.gpu_pod("any-gpu", namespace, claim="any-gpu"))

    wait_running(kube, "any-gpu", namespace)
    (device,) = allocated_devices(kube, "any-gpu", namespace)
    assert device != "gpu-0"
    wait_event(kube, namespace, "on-gpu0", "FailedScheduling", 60)
    assert kube.get("v1", "Pod", "on-gpu0", namespace)["status"]["phase"] == "Pending"
    claim = kube.get("resource.k8s.io/v1", "ResourceClaim", "on-gpu0", namespace)
    assert not claim.get("status", {}).get("allocation")
    assert daemons(driver) == []  # nothing was prepared on gpu-0

    any_uid = claim_uid(kube, "any-gpu", namespace)
    delete_pods(kube, namespace, ["on-gpu0", "any-gpu"])
    driver.wait_unprepared(any_uid)


def test_a_device_plugin_style_gpu_shared_pod_gets_an_mps_share(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    """``nvidia.com/gpu.shared: 1`` (the device plugin's renamed shared replicas), no claim: the
    scheduler makes the claim through mps.gpu.nvidia.com (the catalog's extendedResourceName)
    and gets a share of the offered GPU, served by an MPS daemon. A quota on that class counts
    such pods: with none left the pod waits, with one it runs."""
    quota = m.class_quota("mps.gpu.nvidia.com")
    set_quota(kube, namespace, quota, 0)
    legacy = m.device_plugin_pod(
        "legacy-share", namespace, {"nvidia.com/gpu.shared": "1"}, command=m.SHOW_MPS
    )
    kube.create(legacy)
    wait_refused_by_quota(kube, namespace, "legacy-share", quota)
    set_quota(kube, namespace, quota, 1)
    wait_running(kube, "legacy-share", namespace, timeout=120)

    claim = extended_resource_claim(kube, "legacy-share", namespace)
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "mps.gpu.nvidia.com", request
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-0"  # the GPU offered as shares, not a whole gpu-1
    assert result["shareID"], result
    seen = mps_output(kube, "legacy-share", namespace)
    # A client of an MPS daemon of the plugin (its caps follow from the amount the request
    # gets: see docs/deviceclasses.md, mps.gpu.nvidia.com; the request names none).
    assert f"CUDA_MPS_PIPE_DIRECTORY={PIPE}" in seen["env"].splitlines(), seen
    assert int(seen["pid"]) in daemon_ids(driver), seen
    used = kube.get("v1", "ResourceQuota", "shares", namespace)["status"]["used"]
    assert used[quota] == "1", used
    delete_pods(kube, namespace, ["legacy-share"])
    wait_for("the share to be unprepared", lambda: not driver.checkpoint_claims(), 60)


def set_quota(kube: Kube, namespace: str, resource: str, devices: int) -> None:
    """ResourceQuota ``shares`` of `namespace`, limiting `resource` to `devices`, counted."""
    kube.delete("v1", "ResourceQuota", "shares", namespace)
    kube.wait_gone("v1", "ResourceQuota", "shares", namespace)
    kube.create(m.resource_quota("shares", namespace, {resource: str(devices)}))

    def counted() -> bool:
        status = kube.get("v1", "ResourceQuota", "shares", namespace).get("status", {})
        return bool(status.get("hard", {}).get(resource) == str(devices))

    wait_for("the quota to be counted", counted, 30)
