"""The composition root's driver userspace: the version from NVML, common edits only in real
mode, a wrong driver root logged at start rather than fatal."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pynvml
import pytest

from gpu_dra.driver.nvml.interface import nvml_error
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.nvidia_driver_root import DriverUserspaceError
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup.userspace import common_edits, driver_root, nvml_driver_version
from tests.kubelet_plugin.fake_driver_root import VERSION, build_driver_root


class NoDriver:
    """An NVML library whose init fails as on a node without a loaded driver."""

    def init_with_flags(self, flags: int) -> None:
        raise nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


class Versioned:
    """Just enough NVML for `nvml_driver_version`, counting init and shutdown."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.inits = self.shutdowns = 0

    def init_with_flags(self, flags: int) -> None:
        self.inits += 1

    def system_get_driver_version(self) -> str:
        return self.version

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_the_driver_version_comes_from_nvml_between_init_and_shutdown() -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    host.nvml.init()
    expected = host.nvml.system_get_driver_version()
    host.nvml.shutdown()
    counted = Versioned(VERSION)

    assert nvml_driver_version(host.nvml) == expected
    assert nvml_driver_version(counted) == VERSION
    assert (counted.inits, counted.shutdowns) == (1, 1)


def test_an_nvml_error_is_reported_with_its_return_code() -> None:
    with pytest.raises(DriverUserspaceError, match="NVML_ERROR_DRIVER_NOT_LOADED"):
        nvml_driver_version(NoDriver())


def test_simulated_nodes_have_no_common_edits() -> None:
    settings = KubeletPluginSettings.parse(["--node-name=n", "--simulate=hgx-h100"], {})

    assert asyncio.run(common_edits(settings, NoDriver())) is None


def test_real_nodes_find_the_userspace_at_start_under_both_roots(tmp_path: Path) -> None:
    fake = build_driver_root(tmp_path)
    settings = KubeletPluginSettings.parse(
        ["--node-name=n", f"--driver-root={fake.root}", "--nvidia-driver-root=/run/nvidia/driver"],
        {},
    )

    common = asyncio.run(common_edits(settings, Versioned(VERSION)))

    assert common is not None
    assert common.userspace is not None
    assert (driver_root(settings).path, str(driver_root(settings).host_path)) == (
        fake.root,
        "/run/nvidia/driver",
    )
    assert common.userspace.libraries[0].host_path.startswith("/run/nvidia/driver/usr/lib/")


def test_a_wrong_driver_root_is_logged_at_start_and_fails_prepares_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = KubeletPluginSettings.parse(["--node-name=n", f"--driver-root={tmp_path}"], {})

    with caplog.at_level(logging.ERROR):
        common = asyncio.run(common_edits(settings, Versioned(VERSION)))

    assert common is not None
    assert "driver userspace not found, GPU claims will fail until it is" in caplog.text
    assert f"no library of NVIDIA driver {VERSION}" in caplog.text
    with pytest.raises(DriverUserspaceError):
        common.current()
