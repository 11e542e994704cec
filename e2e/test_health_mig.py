"""Device health of MIG devices and MPS shares end to end (issue 12): a GPU's taint reaches every
static MIG device of it, an XID of one MIG device taints only that device, the MPS share device
of a GPU takes its GPU's taint, and a share daemon that dies marks the share device (pod status
included) until no claim needs it any more.

A simulated hgx-h100-mig node (GPUs 0-6 with static MIG devices, GPU 7 whole and offered as MPS
shares) with ``--health-monitor=true``; MPS daemons run as pods of the TEST DOUBLE."""

from __future__ import annotations

import pytest

from e2e import manifests as m
from e2e.cluster import versions
from e2e.driver import Driver
from e2e.health import (
    HEALTH_ARGS,
    XID_KEY,
    inject,
    kill_a_shares_daemon,
    taints,
    wait_tainted,
    wait_untainted,
)
from e2e.kube import Kube, wait_for
from e2e.workloads import allocated_devices, claim_uid, delete_pods, wait_event, wait_running
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.model import MigDevice
from gpu_dra.driver.nvml.simulated import SimulatedHost

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("healthy_node", "no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100-mig"
SHARED = "gpu-7"
# Supervision off: the daemons are only watched (as by an instance that does not publish), so a
# dead share daemon stays dead and tainted until no claim needs it. The repairing instance's
# taint while it restarts a daemon: e2e/test_mps_containment.py.
# Warm daemons off: the share daemon goes with its last share (checked below).
PLUGIN_ARGS = (
    *HEALTH_ARGS,
    "--mps-shares=7",
    "--mps-daemon-check-interval=0",
    "--mps-share-daemon-warm=off",
)


def mig_devices_of(driver: Driver, parent_uuid: str) -> set[str]:
    return {
        name
        for name, d in driver.devices().items()
        if d["attributes"].get("parentUUID", {}).get("string") == parent_uuid
    }


def local_mig_device(uuid: str) -> MigDevice:
    """The static MIG device of `uuid` as this profile's simulator makes it (GI and CI ids)."""
    host = SimulatedHost.load(SIMULATED_PROFILE, versions.NODE_NAME)
    found = discover_devices(host.nvml, host.pci)
    matches = [d for d in found.mig_devices if d.uuid == uuid]
    assert matches, f"no MIG device {uuid} on a fresh {SIMULATED_PROFILE} simulator"
    return matches[0]


def test_a_gpu_taint_reaches_every_mig_device_of_it_and_no_other(driver: Driver) -> None:
    gpu0 = next(
        d["attributes"]["parentUUID"]["string"]
        for name, d in driver.devices().items()
        if name.startswith("gpu-0-mig-")
    )
    of_gpu0 = mig_devices_of(driver, gpu0)
    assert len(of_gpu0) == 7
    inject(driver, {"gpu": gpu0, "event": "xid", "xid": 79})
    wait_tainted(driver, of_gpu0, XID_KEY)
    assert set(taints(driver)) == of_gpu0
    assert {t["effect"] for name in of_gpu0 for t in taints(driver)[name]} == {"NoExecute"}
    inject(driver, {"gpu": gpu0, "event": "recovered"})
    wait_untainted(driver)


def test_an_xid_of_one_mig_device_taints_that_device_only(driver: Driver) -> None:
    name, published = next(
        (name, d) for name, d in sorted(driver.devices().items()) if name.startswith("gpu-1-mig-")
    )
    mig = local_mig_device(published["attributes"]["uuid"]["string"])
    inject(
        driver,
        {
            "gpu": mig.parent.uuid,
            "event": "xid",
            "xid": 94,
            "gpuInstanceId": mig.gi_id,
            "computeInstanceId": mig.ci_id,
        },
    )
    wait_tainted(driver, {name}, XID_KEY)
    assert sorted(taints(driver)) == [name]
    (taint,) = taints(driver)[name]
    assert (taint["value"], taint["effect"]) == ("94", "NoSchedule")


def test_the_share_device_takes_its_gpus_taint_and_new_shares_wait(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    assert driver.devices()[SHARED]["allowMultipleAllocations"] is True
    inject(driver, {"gpu": driver.uuid_of(SHARED), "event": "xid", "xid": 48})
    wait_tainted(driver, {SHARED}, XID_KEY)
    assert sorted(taints(driver)) == [SHARED]
    assert driver.devices()[SHARED]["allowMultipleAllocations"] is True  # still a share device

    kube.create(m.share_claim("share", namespace, "10Gi", 10))
    kube.create(m.gpu_pod("share", namespace, claim="share", command=m.SHOW_MPS))
    wait_event(kube, namespace, "share", "FailedScheduling", 60)
    inject(driver, {"gpu": driver.uuid_of(SHARED), "event": "recovered"})
    wait_untainted(driver)
    wait_running(kube, "share", namespace, timeout=120)
    assert allocated_devices(kube, "share", namespace) == [SHARED]
    uid = claim_uid(kube, "share", namespace)
    delete_pods(kube, namespace, ["share"])
    driver.wait_unprepared(uid)


def test_a_dead_share_daemon_marks_the_share_device_until_no_claim_needs_it(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    uid = kill_a_shares_daemon(
        driver, kube, m.share_claim("share", namespace, "10Gi", 10), namespace, SHARED
    )

    delete_pods(kube, namespace, ["share"])  # the last share goes: no daemon is needed
    driver.wait_unprepared(uid)
    wait_untainted(driver, timeout=60)
    wait_for("the daemon pod to be gone", lambda: not driver.mps_daemon_pods(), 60)
