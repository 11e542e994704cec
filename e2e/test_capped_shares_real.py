"""Capped shares (issue 16, item 4) in real mode: the start-up checks run against a driver.

The kubelet plugin without ``--simulate`` on the fake DGX H100 driver root (`e2e.realnode`: the
NVML mock library, NVIDIA's ``nvidia-cdi-hook`` v1.20.1) with ``--capped-shares=0``. The mock
reports a driver older than the 615 branch (no per-cgroup GPU memory limits), so the plugin runs
every check up to the driver's (cgroup v2, its own cgroup, the hook's version) and then must not
offer gpu-0: it stays a plain whole GPU and the start-up log names the driver version as why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.driver import PLUGIN, Driver
from gpu_dra.driver.shares import CAPPED
from gpu_dra.kubelet_plugin.memory_limits import MIN_DRIVER_BRANCH

pytestmark = pytest.mark.e2e

REAL_MACHINE = "dgxh100"
PLUGIN_ARGS = ("--capped-shares=0",)
NOT_OFFERED = "is not offered as capped shares (--capped-shares), only whole"


def test_a_driver_before_615_gets_no_capped_shares_and_the_log_names_it(driver: Driver) -> None:
    assert driver.real is not None
    version = driver.real.root.driver_version
    assert int(version.split(".")[0]) < MIN_DRIVER_BRANCH, f"the mock now reports {version}"
    devices = driver.devices()
    assert "allowMultipleAllocations" not in devices["gpu-0"]
    assert CAPPED not in devices["gpu-0"]["attributes"]

    log = (driver.cluster.paths.logs / f"{PLUGIN}.log").read_text(errors="replace")
    uuid = driver.uuid_of("gpu-0")
    lines = [line for line in log.splitlines() if f"GPU 0 ({uuid}) {NOT_OFFERED}" in line]
    assert lines, "no start-up warning for gpu-0"
    if Path("/sys/fs/cgroup/cgroup.controllers").is_file():  # the plugin runs on this host
        assert f"driver {version} has no per-cgroup GPU memory limits" in lines[-1], lines[-1]
    else:
        assert "is not cgroup v2" in lines[-1], lines[-1]
