"""PCIe root and NUMA node read from a sysfs tree."""

from __future__ import annotations

import pytest

from gpu_dra.driver.nvml.sysfs import SysfsPciTopology


@pytest.fixture
def sysfs(tmp_path):
    devices = tmp_path / "devices" / "pci0000:64" / "0000:64:00.0" / "0000:65:00.0"
    devices.mkdir(parents=True)
    (devices / "numa_node").write_text("1\n")
    vm_device = tmp_path / "devices" / "pci0000:00" / "0000:00:1e.0"
    vm_device.mkdir(parents=True)
    (vm_device / "numa_node").write_text("-1\n")
    links = tmp_path / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    (links / "0000:65:00.0").symlink_to("../../../devices/pci0000:64/0000:64:00.0/0000:65:00.0")
    (links / "0000:00:1e.0").symlink_to("../../../devices/pci0000:00/0000:00:1e.0")
    return SysfsPciTopology(tmp_path)


def test_pcie_root_is_the_root_complex_in_the_device_symlink(sysfs):
    assert sysfs.pcie_root("0000:65:00.0") == "pci0000:64"
    assert sysfs.pcie_root("0000:00:1e.0") == "pci0000:00"


def test_numa_node_is_read_and_negative_means_none(sysfs):
    assert sysfs.numa_node("0000:65:00.0") == 1
    assert sysfs.numa_node("0000:00:1e.0") is None


def test_unknown_device_gives_none_instead_of_raising(sysfs):
    assert sysfs.pcie_root("0000:99:00.0") is None
    assert sysfs.numa_node("0000:99:00.0") is None
