"""MPS shares of a static MIG device end to end (issue 16, item 5): two claims from two
namespaces, each a scheduler-accounted amount of ONE 1g.10gb slice (9984Mi, percent of its SMs),
run on the one MPS daemon of that MIG device, keyed by its MIG UUID, each with its own caps.

The simulated ``hgx-h100-mig`` node, whose static 1g.10gb slices are offered as shares
(``--mps-shares-on-mig=1g.10gb``); class ``mps.mig.nvidia.com``. The daemon is the
nvidia-cuda-mps-control TEST DOUBLE run as a pod from the local image; each pod prints the
CUDA_MPS_* environment its CDI spec gave it and the daemon it reaches through the pipe."""

from __future__ import annotations

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.mps import PIPE, daemon_pid, daemons, mps_output
from e2e.workloads import (
    allocated_devices,
    claim_uid,
    delete_pods,
    share_claim_uid,
    wait_event,
    wait_running,
)
from gpu_dra.kubelet_plugin.mps import shared_daemon_id
from tests.doubles.nvidia_cuda_mps_control import read_state

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100-mig"
# Warm daemons off (named: the default is always): the first share starts
# the slice's daemon and the last one stops it.
PLUGIN_ARGS = ("--mps-shares-on-mig=1g.10gb", "--mps-share-daemon-warm=off")
MIG_MPS_CLASS = "mps.mig.nvidia.com"
MIG_CLASS = "mig.nvidia.com"
MIG_1G_CLASS = "mig-1g.gpu.nvidia.com"
SLICE = "gpu-0-mig-1g10gb-19-0"
NOT_OFFERED = "gpu-1-mig-2g20gb-14-0"


def test_two_shares_of_one_mig_device_run_on_its_daemon_with_their_own_caps(
    driver: Driver, kube: Kube, namespace: str, other_namespace: str
) -> None:
    devices = driver.devices()
    published = devices[SLICE]
    assert published["allowMultipleAllocations"] is True
    assert published["capacity"]["memory"]["value"] == "9984Mi"
    assert published["capacity"]["compute"]["value"] == "100"
    assert "allowMultipleAllocations" not in devices[NOT_OFFERED]  # 2g.20gb: not offered
    mig_uuid = driver.uuid_of(SLICE)
    assert mig_uuid.startswith("MIG-")
    shares = {  # pod / claim name: (namespace, memory, MiB, compute)
        "mig-a": (namespace, "4Gi", 4096, 25),
        "mig-b": (other_namespace, "2Gi", 2048, 50),
    }
    for name, (ns, memory, _, compute) in shares.items():
        kube.create(
            m.share_claim(
                name,
                ns,
                memory,
                compute,
                device_class=MIG_MPS_CLASS,
                selectors=[f"device.attributes['gpu.nvidia.com'].uuid == '{mig_uuid}'"],
            )
        )
        kube.create(m.gpu_pod(name, ns, claim=name, command=m.SHOW_MPS))
    for name, (ns, *_) in shares.items():
        wait_running(kube, name, ns)

    uids = {
        name: share_claim_uid(kube, name, ns, SLICE, memory, compute)
        for name, (ns, memory, _, compute) in shares.items()
    }

    # One daemon for the MIG device, named after its MIG UUID, serving both claims.
    daemon_id = shared_daemon_id(mig_uuid)
    assert [p.name for p in driver.mps_dir.iterdir()] == [daemon_id]
    pid = daemon_pid(driver, daemon_id)
    assert daemons(driver) == [pid]
    assert list(driver.mps_daemon_pods()) == [f"mps-control-daemon-{daemon_id}"]
    state = read_state(driver.mps_dir / daemon_id / "pipe")
    assert state["visibleDevices"] == [mig_uuid]
    # Defaults: the largest share allowed, of the slice (not of the GPU).
    assert state["defaults"] == {
        "activeThreadPercentage": 100.0,
        "pinnedMemLimits": {mig_uuid: "9984M"},
    }
    for name, (ns, _, mib, compute) in shares.items():
        entry = driver.checkpoint_entry(uids[name])["state"]
        assert [h["daemonId"] for h in entry["mpsDaemons"]] == [daemon_id]
        assert entry["mpsShares"][SLICE]["uuid"] == mig_uuid
        # The driver's cgroup cap does not take MIG handles: MPS's pinned limit only.
        assert entry["mpsShares"][SLICE]["memoryEnforcement"] == "mps-client"
        seen = mps_output(kube, name, ns)
        assert seen["env"].splitlines() == [
            f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}",
            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={mig_uuid}={mib}M",
            f"CUDA_MPS_PIPE_DIRECTORY={PIPE}",
        ], (name, seen)
        assert seen["pid"] == str(pid), (name, seen)
        labels = {"claim": f"{ns}/{name}", "gpu": mig_uuid}
        assert driver.metric("gpu_dra_mps_claim_pinned_memory_limit_bytes", **labels) == (
            mib * 2**20
        )
        assert (
            driver.metric(
                "gpu_dra_mps_share_memory_enforcement", enforcement="mps-client", **labels
            )
            == 1
        )
    assert driver.metric("gpu_dra_mps_daemon_claims", daemon=daemon_id) == 2

    # The daemon stays while a share is prepared, and goes with the last one.
    delete_pods(kube, namespace, ["mig-a"])
    driver.wait_unprepared(uids["mig-a"])
    assert daemons(driver) == [pid]
    delete_pods(kube, other_namespace, ["mig-b"])
    wait_for("the last share to be unprepared", lambda: not driver.checkpoint_claims(), 60)
    wait_for("the daemon to stop", lambda: not daemons(driver), 30)
    assert driver.mps_daemon_pods() == {}


def test_mig_classes_never_select_a_mig_device_offered_as_shares(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    # Share-only (docs/mps.md, "MPS shares on MIG devices"): mig.nvidia.com and the mig-1g
    # family skip the offered 1g.10gb slices, even free, and take a 1g slice not offered
    # (1g.10gb+me, 1g.20gb).
    mig_uuid = driver.uuid_of(SLICE)
    on_slice = f"device.attributes['gpu.nvidia.com'].uuid == '{mig_uuid}'"
    ten = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"
    requests = {
        "on-slice": m.request("mig", MIG_CLASS, [on_slice]),
        "any-1g10gb": m.request("mig", MIG_1G_CLASS, [ten]),
        "any-1g": m.request("mig", MIG_1G_CLASS),
    }
    for name, request in requests.items():
        kube.create(m.claim(name, namespace, m.claim_spec([request])))
        kube.create(m.gpu_pod(name, namespace, claim=name))

    wait_running(kube, "any-1g", namespace)
    (device,) = allocated_devices(kube, "any-1g", namespace)
    assert "allowMultipleAllocations" not in driver.devices()[device], device
    assert "-mig-1g" in device, device
    assert "-mig-1g10gb-19-" not in device, device
    for name in ("on-slice", "any-1g10gb"):  # every 1g.10gb slice is offered as shares
        wait_event(kube, namespace, name, "FailedScheduling", 60)
        claim = kube.get("resource.k8s.io/v1", "ResourceClaim", name, namespace)
        assert not claim.get("status", {}).get("allocation"), name
    assert daemons(driver) == []

    uid = claim_uid(kube, "any-1g", namespace)
    delete_pods(kube, namespace, list(requests))
    driver.wait_unprepared(uid)
