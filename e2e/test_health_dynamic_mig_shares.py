"""Device health of MPS shares of a dynamic MIG partition (issue 16, item 5): when the daemon of
the MIG device made for a partition's shares dies, that partition - not its GPU, not the GPU's
other partitions - is tainted and its pods' status says so, until no claim needs the daemon (the
MIG device goes with the last share).

The simulated ``hgx-h100`` node with ``--dynamic-mig --mps-shares-on-dynamic-mig=7g.80gb
--health-monitor=true``; supervision off (``--mps-daemon-check-interval=0``: the daemons are
only watched, as by an instance that does not publish), so a dead daemon stays dead. MPS daemons
run as pods of the TEST DOUBLE."""

from __future__ import annotations

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.health import (
    HEALTH_ARGS,
    kill_a_shares_daemon,
    taints,
    wait_untainted,
)
from e2e.kube import Kube, wait_for
from e2e.mig import mig_instances
from e2e.workloads import delete_pods

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.usefixtures("healthy_node", "no_mps_daemon_left", "no_mig_left"),
]

SIMULATED_PROFILE = "hgx-h100"
DYNAMIC_MIG = True
PLUGIN_ARGS = (
    *HEALTH_ARGS,
    "--mps-shares-on-dynamic-mig=7g.80gb",
    "--mps-daemon-check-interval=0",
)
PARTITION = "gpu-0-mig-7g80gb-0-0"


def test_a_dead_daemon_of_a_partitions_mig_device_taints_that_partition_only(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    gpu0 = driver.devices()["gpu-0"]["attributes"]["uuid"]["string"]
    on_partition = [
        "device.attributes['gpu.nvidia.com'].profile == '7g.80gb'",
        f"device.attributes['gpu.nvidia.com'].parentUUID == '{gpu0}'",
    ]
    share = m.share_claim(
        "share", namespace, "10Gi", 10, device_class="mps.mig.nvidia.com", selectors=on_partition
    )
    uid = kill_a_shares_daemon(driver, kube, share, namespace, PARTITION)
    assert sorted(taints(driver)) == [PARTITION]  # not gpu-0, not its other partitions

    delete_pods(kube, namespace, ["share"])  # the last share goes: no daemon, no MIG device
    driver.wait_unprepared(uid)
    wait_untainted(driver, timeout=60)
    wait_for("the daemon pod to be gone", lambda: not driver.mps_daemon_pods(), 60)
    assert mig_instances(driver) == {}
