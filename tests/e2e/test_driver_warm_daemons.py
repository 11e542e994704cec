"""`e2e.driver.Driver.warm_daemon_ids`, which the e2e leak check (`no_mps_daemon_left`) reads:
the daemons the plugin keeps warm follow ``--mps-share-daemon-warm`` and, when a module does
not pass it, the plugin's own default (``always``), for GPUs and static MIG devices offered as
shares alike. No cluster: the published devices are given."""

from __future__ import annotations

from typing import Any, cast

import pytest

from e2e.cluster import Cluster
from e2e.driver import Driver
from e2e.kube import Kube
from gpu_dra.kubelet_plugin.mps import shared_daemon_id

GPU = "GPU-0c1d2e3f-0000-4000-8000-000000000001"
MIG = "MIG-0c1d2e3f-0000-4000-8000-000000000002"


class PublishedDriver(Driver):
    """A `Driver` whose ResourceSlices hold a GPU and a MIG device offered as shares, and a GPU
    that is not."""

    def devices(self) -> dict[str, dict[str, Any]]:
        def device(uuid: str, shared: bool) -> dict[str, Any]:
            published: dict[str, Any] = {"attributes": {"uuid": {"string": uuid}}}
            return {**published, "allowMultipleAllocations": True} if shared else published

        return {
            "gpu-0": device(GPU, True),
            "gpu-1-mig-1g10gb-19-0": device(MIG, True),
            "gpu-2": device("GPU-0c1d2e3f-0000-4000-8000-000000000003", False),
        }


def driver(*args: str) -> Driver:
    return PublishedDriver(cast(Cluster, None), cast(Kube, None), "hgx-h100-mig", plugin_args=args)


@pytest.mark.parametrize(
    "args",
    [
        ("--mps-share-daemon-warm=off",),
        ("--mps-share-daemon-warm=always", "--mps-share-daemon-warm=off"),
    ],
    ids=["off", "last-wins"],
)
def test_no_warm_daemon_when_the_plugin_is_told_off(args: tuple[str, ...]) -> None:
    assert driver("--mps-shares=0", *args).warm_daemon_ids() == set()


@pytest.mark.parametrize(
    "args",
    [(), ("--mps-share-daemon-warm=always",), ("--mps-share-daemon-warm=idle:10m",)],
    ids=["default", "always", "idle"],
)
def test_warm_daemons_of_every_gpu_and_mig_device_offered(args: tuple[str, ...]) -> None:
    warm = driver(*args).warm_daemon_ids()

    assert warm == {shared_daemon_id(GPU), shared_daemon_id(MIG)}
