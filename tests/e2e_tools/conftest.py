"""Fixtures for the test-bed tools: the NVML mock library and NVIDIA's nvidia-ctk, built once
per session through the project's toolchain (cached; CI's e2e/setup-host has built them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from e2e import nvidiactk, nvmlmock
from e2e.cluster.paths import ClusterPaths
from tests.e2e_tools.support import LIBRARY_DIR


@pytest.fixture(scope="session")
def cluster_paths() -> ClusterPaths:
    return ClusterPaths.from_env()


@pytest.fixture(scope="session")
def nvml_mock_library(cluster_paths: ClusterPaths) -> Path:
    return nvmlmock.build(cluster_paths)


@pytest.fixture(scope="session")
def nvidia_ctk_dir(cluster_paths: ClusterPaths) -> Path:
    return nvidiactk.build(cluster_paths)


@pytest.fixture(scope="session")
def go_nvml(cluster_paths: ClusterPaths) -> Path:
    return nvmlmock.go_nvml_dir(cluster_paths)


@pytest.fixture
def driver_root(tmp_path: Path, nvml_mock_library: Path) -> Path:
    """A driver root holding the library where `RealNvml` looks for it."""
    root = tmp_path / "driver-root"
    (root / LIBRARY_DIR).mkdir(parents=True)
    shutil.copy(nvml_mock_library, root / LIBRARY_DIR / nvmlmock.LIBRARY_NAME)
    return root
