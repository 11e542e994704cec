"""The pynvml backend: driver-root library lookup, and (on a lent GPU machine) real discovery."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pynvml
import pytest

from gpu_dra.driver.discovery import discover_gpus
from gpu_dra.driver.nvml.real import (
    NVML_LIBRARY_NAME,
    RealNvml,
    find_nvml_library,
    load_nvml_library,
)
from gpu_dra.driver.nvml.sysfs import SysfsPciTopology


def _library(root: Path, directory: str, name: str = NVML_LIBRARY_NAME) -> Path:
    path = root / directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF")
    return path


@pytest.mark.parametrize(
    "directory", ["usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "usr/lib/aarch64-linux-gnu"]
)
def test_library_is_found_in_the_common_lib_dirs_of_the_driver_root(tmp_path, directory):
    assert find_nvml_library(tmp_path) is None
    path = _library(tmp_path, directory)
    assert find_nvml_library(tmp_path) == path


def test_lib64_is_preferred_over_lib(tmp_path):
    _library(tmp_path, "usr/lib")
    preferred = _library(tmp_path, "usr/lib64")
    assert find_nvml_library(tmp_path) == preferred


def test_versioned_library_behind_a_relative_symlink_is_found(tmp_path):
    target = _library(tmp_path, "usr/lib/x86_64-linux-gnu", "libnvidia-ml.so.580.95.05")
    (target.parent / NVML_LIBRARY_NAME).symlink_to(target.name)
    assert find_nvml_library(tmp_path) == target


def test_absolute_symlink_is_resolved_inside_the_driver_root(tmp_path):
    target = _library(tmp_path, "usr/lib64", "libnvidia-ml.so.580.95.05")
    link = tmp_path / "usr/lib/x86_64-linux-gnu" / NVML_LIBRARY_NAME
    link.parent.mkdir(parents=True)
    link.symlink_to("/usr/lib64/libnvidia-ml.so.580.95.05")
    # /usr/lib64 outside the root may or may not exist; the root's copy must win.
    assert find_nvml_library(tmp_path) == target


def test_dangling_symlink_and_symlink_loops_are_not_found(tmp_path):
    directory = tmp_path / "usr/lib64"
    directory.mkdir(parents=True)
    (directory / NVML_LIBRARY_NAME).symlink_to("libnvidia-ml.so.missing")
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / NVML_LIBRARY_NAME).symlink_to(NVML_LIBRARY_NAME)
    assert find_nvml_library(tmp_path) is None


@pytest.mark.skipif(pynvml.nvmlLib is not None, reason="libnvidia-ml already loaded in-process")
def test_missing_library_under_a_driver_root_raises_library_not_found_naming_it(tmp_path):
    with pytest.raises(pynvml.NVMLError_LibraryNotFound) as raised:
        load_nvml_library(tmp_path / "driver-root")
    assert pynvml.nvmlLib is None
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert str(tmp_path / "driver-root") in notes
    assert NVML_LIBRARY_NAME in notes


def _has_gpu() -> bool:
    return find_nvml_library(Path("/")) is not None and os.path.exists("/dev/nvidiactl")


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU and libnvidia-ml")
def test_real_gpus_are_discovered_with_nvml_formats():
    gpus = discover_gpus(RealNvml(Path("/")), SysfsPciTopology())
    assert gpus
    for gpu in gpus:
        assert re.match(r"^GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$", gpu.uuid)
        assert re.match(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$", gpu.pci_bus_id)
        assert re.match(r"^\d+\.\d+(\.\d+)?$", gpu.driver_version)
        assert gpu.cuda_driver_version >= 11000
        assert gpu.memory_bytes is None or gpu.memory_bytes % (1024 * 1024) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU and libnvidia-ml")
def test_real_gpus_take_xid_registrations_and_a_quiet_wait_times_out():
    nvml = RealNvml(Path("/"))
    nvml.init()
    try:
        event_set = nvml.event_set_create()
        try:
            handle = nvml.device_get_handle_by_index(0)
            supported = nvml.device_get_supported_event_types(handle)
            assert supported & pynvml.nvmlEventTypeXidCriticalError
            nvml.device_register_events(
                handle, supported & pynvml.nvmlEventTypeXidCriticalError, event_set
            )
            with pytest.raises(pynvml.NVMLError_Timeout):
                nvml.event_set_wait(event_set, 100)
        finally:
            nvml.event_set_free(event_set)
    finally:
        nvml.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU and libnvidia-ml")
def test_real_gpus_answer_the_utilization_calls_the_sampler_makes():
    nvml = RealNvml(Path("/"))
    nvml.init()
    try:
        handle = nvml.device_get_handle_by_index(0)
        if nvml.device_get_mig_mode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                nvml.device_get_utilization_rates(handle)
        else:
            rates = nvml.device_get_utilization_rates(handle)
            assert 0 <= rates.gpu <= 100
            assert 0 <= rates.memory <= 100
        memory = nvml.device_get_memory_info(handle)
        assert 0 <= memory.used <= memory.total
        for process in nvml.device_get_compute_running_processes(handle):
            assert process.pid > 0
        # No sample newer than now: NVML's NotFound reads as no samples.
        future_us = (time.time_ns() // 1000) + 10**9
        assert nvml.device_get_process_utilization(handle, future_us) == []
    finally:
        nvml.shutdown()


@pytest.mark.parametrize(
    ("code", "empty"),
    [
        (pynvml.NVML_ERROR_NOT_FOUND, True),  # no sample newer than the timestamp
        (pynvml.NVML_SUCCESS, True),  # pynvml's error for a size query that found no process
        (pynvml.NVML_ERROR_NOT_SUPPORTED, False),
        (pynvml.NVML_ERROR_GPU_IS_LOST, False),
    ],
)
def test_process_utilization_reads_no_samples_as_empty_and_raises_the_rest(
    monkeypatch: pytest.MonkeyPatch, code: int, empty: bool
) -> None:
    def fails(handle: object, timestamp: int) -> None:
        raise pynvml.NVMLError(code)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetProcessUtilization", fails)
    if empty:
        assert RealNvml().device_get_process_utilization(object(), 0) == []
    else:
        with pytest.raises(pynvml.NVMLError) as raised:
            RealNvml().device_get_process_utilization(object(), 0)
        assert raised.value.value == code


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU and libnvidia-ml")
def test_real_gpus_say_whether_they_offer_gpm_as_their_architecture_implies():
    """The idle rule reads a MIG device's SM activity through GPM (Hopper and newer); the query
    must answer (True/False), never raise, whatever the GPU (docs/metrics.md#idle-claims)."""
    nvml = RealNvml(Path("/"))
    nvml.init()
    try:
        handle = nvml.device_get_handle_by_index(0)
        hopper_or_newer = nvml.device_get_architecture(handle) >= pynvml.NVML_DEVICE_ARCH_HOPPER
        assert nvml.gpm_query_device_support(handle) is hopper_or_newer
    finally:
        nvml.shutdown()
