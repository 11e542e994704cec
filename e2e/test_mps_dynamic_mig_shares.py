"""MPS shares of a dynamic MIG partition end to end (issue 16, item 5): two claims from two
namespaces each hold an amount of ONE 7g.80gb partition of gpu-0; the first share's prepare
makes the MIG device, the second joins it and its one MPS daemon (keyed by the new MIG UUID),
and the scheduler keeps an overlapping 1g.10gb placement on that GPU unschedulable while the
shares hold it (the partition pays its counters once). After the last share the MIG device is
destroyed and the 1g claim is scheduled onto the freed slices.

The simulated ``hgx-h100`` node with ``--dynamic-mig --mps-shares-on-dynamic-mig=7g.80gb`` (a
7g partition has one placement per GPU, so both shares land on the same partition); class
``mps.mig.nvidia.com``. The daemon is the nvidia-cuda-mps-control TEST DOUBLE run as a pod from
the local image."""

from __future__ import annotations

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.mig import mig_instances, mig_request
from e2e.mps import PIPE, daemon_pid, daemons, mps_output
from e2e.workloads import allocated_devices, delete_pods, share_claim_uid, wait_event, wait_running
from gpu_dra.kubelet_plugin.mps import shared_daemon_id
from tests.doubles.nvidia_cuda_mps_control import read_state

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.usefixtures("no_mps_daemon_left", "no_mig_left"),
]

SIMULATED_PROFILE = "hgx-h100"
DYNAMIC_MIG = True
PLUGIN_ARGS = ("--mps-shares-on-dynamic-mig=7g.80gb",)
MIG_MPS_CLASS = "mps.mig.nvidia.com"
PARTITION = "gpu-0-mig-7g80gb-0-0"
NOT_OFFERED = "gpu-0-mig-1g10gb-19-0"


def made_mig_uuids(driver: Driver) -> list[str]:
    """UUIDs of the MIG devices the simulated GPUs hold now."""
    return sorted(
        ci["uuid"]
        for instances in mig_instances(driver).values()
        for gi in instances
        for ci in gi["computeInstances"]
    )


def test_two_shares_of_a_partition_share_the_mig_device_it_made_and_block_overlaps(
    driver: Driver, kube: Kube, namespace: str, other_namespace: str
) -> None:
    devices = driver.devices()
    published = devices[PARTITION]
    memory = published["capacity"]["memory"]["value"]
    assert published["allowMultipleAllocations"] is True
    assert memory == "81152Mi"  # the profile's, as the MIG device made from it reports
    assert published["capacity"]["compute"]["value"] == "100"
    assert published["consumesCounters"][0]["counterSet"] == "gpu-0-counter-set"
    assert "allowMultipleAllocations" not in devices[NOT_OFFERED]  # 1g.10gb: not offered
    gpu0 = devices["gpu-0"]["attributes"]["uuid"]["string"]
    on_partition = [  # gpu-0's one 7g.80gb placement
        "device.attributes['gpu.nvidia.com'].profile == '7g.80gb'",
        f"device.attributes['gpu.nvidia.com'].parentUUID == '{gpu0}'",
    ]
    shares = {  # pod / claim name: (namespace, memory, MiB, compute)
        "part-a": (namespace, "8Gi", 8192, 25),
        "part-b": (other_namespace, "16Gi", 16384, 50),
    }
    for name, (ns, amount, _, compute) in shares.items():
        claim = m.share_claim(
            name, ns, amount, compute, device_class=MIG_MPS_CLASS, selectors=on_partition
        )
        kube.create(claim)
        kube.create(m.gpu_pod(name, ns, claim=name, command=m.SHOW_MPS))
    for name, (ns, *_) in shares.items():
        wait_running(kube, name, ns)

    # One MIG device made, by the first share; both claims hold it.
    [mig_uuid] = made_mig_uuids(driver)
    uids = {}
    for name, (ns, amount, _, compute) in shares.items():
        uids[name] = share_claim_uid(kube, name, ns, PARTITION, amount, compute)
        state = driver.checkpoint_entry(uids[name])["state"]
        [intent] = state["dynamicMig"]
        assert intent["uuid"] == mig_uuid
        assert intent["shared"] is True
        assert state["mpsShares"][PARTITION]["uuid"] == mig_uuid
        assert state["mpsShares"][PARTITION]["memoryEnforcement"] == "mps-client"

    # One daemon for the MIG device, named after the UUID it was made with.
    daemon_id = shared_daemon_id(mig_uuid)
    assert [p.name for p in driver.mps_dir.iterdir()] == [daemon_id]
    pid = daemon_pid(driver, daemon_id)
    assert daemons(driver) == [pid]
    daemon_state = read_state(driver.mps_dir / daemon_id / "pipe")
    assert daemon_state["visibleDevices"] == [mig_uuid]
    assert daemon_state["defaults"] == {
        "activeThreadPercentage": 100.0,
        "pinnedMemLimits": {mig_uuid: "81152M"},
    }
    for name, (ns, _, mib, compute) in shares.items():
        seen = mps_output(kube, name, ns)
        assert seen["env"].splitlines() == [
            f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}",
            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={mig_uuid}={mib}M",
            f"CUDA_MPS_PIPE_DIRECTORY={PIPE}",
        ], (name, seen)
        assert seen["pid"] == str(pid), (name, seen)
    assert driver.metric("gpu_dra_mps_daemon_claims", daemon=daemon_id) == 2

    # The scheduler charged the partition's counters once: an overlapping 1g.10gb placement
    # on gpu-0 (any of them: the 7g spans every memory slice) is unschedulable.
    on_gpu0 = f"device.attributes['gpu.nvidia.com'].parentUUID == '{gpu0}'"
    overlap = m.claim_spec([mig_request("mig", "1g.10gb", on_gpu0)])
    kube.create(m.claim("overlap", namespace, overlap))
    kube.create(m.gpu_pod("overlap", namespace, claim="overlap"))
    wait_event(kube, namespace, "overlap", "FailedScheduling", 90)
    assert made_mig_uuids(driver) == [mig_uuid]

    # The device and its daemon stay while a share is prepared, and go with the last one.
    delete_pods(kube, namespace, ["part-a"])
    driver.wait_unprepared(uids["part-a"])
    assert made_mig_uuids(driver) == [mig_uuid]
    assert daemons(driver) == [pid]
    delete_pods(kube, other_namespace, ["part-b"])
    driver.wait_unprepared(uids["part-b"])
    wait_for("the daemon to stop", lambda: not daemons(driver), 30)

    # The freed slices take the 1g claim: a new MIG device, not the shares' one.
    wait_running(kube, "overlap", namespace, timeout=120)
    [slice_device] = allocated_devices(kube, "overlap", namespace)
    assert slice_device.startswith("gpu-0-mig-1g10gb-")
    assert len(made_mig_uuids(driver)) == 1
    assert made_mig_uuids(driver) != [mig_uuid]
    delete_pods(kube, namespace, ["overlap"])
    wait_for("every claim to be unprepared", lambda: not driver.checkpoint_claims(), 60)
