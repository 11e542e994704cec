"""Fixtures shared by the kubelet plugin's prepare tests (builders: tests/kubelet_plugin/nodes)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from tests.doubles.mps_helpers import kill_processes_under, scratch_root
from tests.kubelet_plugin.nodes import hgx_h100_inventory


@pytest.fixture(scope="module")
def inventory() -> NodeInventory:
    """The whole GPUs of the simulated hgx-h100 node."""
    return hgx_h100_inventory()


@pytest.fixture
def mps_root() -> Iterator[Path]:
    """A short scratch data dir for MPS daemons (socket paths stay below 108 bytes); fails the
    test if a daemon or server process is left running there."""
    path = scratch_root()
    yield path
    leftovers = kill_processes_under(path)
    subprocess.run(["rm", "-rf", str(path)], check=False)
    assert not leftovers, f"test left MPS processes running: {leftovers}"


@pytest.fixture(autouse=True)
def _disarmed_crash_points() -> Iterator[None]:
    """No test leaves a fault injection point armed in this process (`crash_points.arm`)."""
    yield
    crash_points.arm(None)
