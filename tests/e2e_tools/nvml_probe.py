"""Runs gpu-dra's own NVML code against the NVML mock library, in a process of its own.

pynvml keeps one loaded library per process, so each test runs this as a subprocess:
``python -m tests.e2e_tools.nvml_probe <driver root> <command> [args]``, with the library's
``GPU_DRA_NVML_MOCK_*`` variables in the environment. It prints one JSON document.

Commands:

- ``discover``: `discover_devices` (dynamic MIG) through `RealNvml`: GPUs, MIG devices, the
  profiles of the first MIG-capable GPU, problems.
- ``create <gpu index> <GI profile id> <placement start>``: MIG mode on, a GPU instance there
  and its full compute instance, as the kubelet plugin's lifecycle does.
- ``destroy <gpu index> <GI id> <CI id>``: destroys that compute instance and GPU instance.
- ``mig-devices <gpu index> [--wait]``: the GPU's MIG devices by index (with ``--wait``: after
  printing ``ready`` on a line of its own, waits for a line on stdin, in one NVML session).
- ``errors``: the return code names of calls the mock refuses, on GPU 0.
- ``set-compute-mode <gpu index> <mode>`` / ``compute-mode <gpu index>``.
- ``common-ancestor <gpu index> <gpu index>``: ``nvmlDeviceGetTopologyCommonAncestor`` (what
  NVIDIA's device plugin asks of every GPU pair), the level or the return code name.
- ``smi-list``: ``nvidia-smi -L`` through ctypes, calling only the functions the test bed's
  ``nvidia-smi`` calls.
- ``memory-limits <gpu index or UUID> <cgroup> [<soft> <hard>]``: the driver and CUDA versions,
  then (with limits, in bytes) ``nvmlDeviceSetMemoryLimits_v1`` through pynvml, and the
  cgroup's limits through `RealNvml.device_get_memory_limits` (or the return code name of each).
- ``raw``: C-level answers pynvml hides (calls before init, nvmlErrorString, a function the
  mock lacks).
"""

from __future__ import annotations

import ctypes
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.interface import (
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    DeviceHandle,
    GpuInstanceHandle,
    NVMLError,
    return_code,
    return_code_name,
)
from gpu_dra.driver.nvml.real import NVML_LIBRARY_NAME, RealNvml, find_nvml_library
from gpu_dra.driver.nvml.sysfs import SysfsPciTopology


def main(argv: list[str]) -> int:
    root, command, *args = argv
    nvml = RealNvml(Path(root))
    result: Any
    if command == "discover":
        result = discover(nvml)
    elif command in RAW_COMMANDS:
        library = find_nvml_library(Path(root))
        if library is None:
            raise SystemExit(f"no {NVML_LIBRARY_NAME} under {root}")
        result = RAW_COMMANDS[command](ctypes.CDLL(str(library)))
    else:
        nvml.init()
        try:
            result = COMMANDS[command](nvml, *args)
        finally:
            nvml.shutdown()
    print(json.dumps(result), flush=True)
    return 0


def discover(nvml: RealNvml) -> dict[str, Any]:
    found = discover_devices(nvml, SysfsPciTopology(Path("/nonexistent")), mig_profiles=True)
    return {
        "gpus": [
            {
                "index": g.index,
                "minor": g.minor,
                "uuid": g.uuid,
                "name": g.product_name,
                "memory_bytes": g.memory_bytes,
                "pci_bus_id": g.pci_bus_id,
                "pci_device_id": g.pci_device_id,
                "architecture": g.architecture,
                "cuda_compute_capability": list(g.cuda_compute_capability),
                "driver_version": g.driver_version,
                "cuda_driver_version": g.cuda_driver_version,
                "mig_capable": g.mig_capable,
                "mig_enabled": g.mig_enabled,
            }
            for g in found.gpus
        ],
        "mig_devices": [
            {
                "parent": m.parent.uuid,
                "uuid": m.uuid,
                "profile": m.profile,
                "gi_profile_id": m.gi_profile_id,
                "placement": [m.placement_start, m.placement_size],
                "gi_id": m.gi_id,
                "ci_id": m.ci_id,
                "memory_bytes": m.memory_bytes,
                "multiprocessors": m.multiprocessors,
            }
            for m in found.mig_devices
        ],
        "profiles": [
            {
                "name": p.name,
                "id": p.gi_profile_id,
                "index": p.gi_profile_index,
                "starts": list(p.placement_starts),
                "size": p.placement_size,
                "memory_bytes": p.memory_bytes,
                "multiprocessors": p.multiprocessors,
            }
            for p in (found.mig_profiles[0].profiles if found.mig_profiles else ())
        ],
        "problems": [f"{p.call}: {p.reason}" for p in found.problems],
    }


def full_ci_profile(nvml: RealNvml, gi: GpuInstanceHandle) -> int:
    """The compute-instance profile spanning the whole GPU instance (what gpu-dra creates)."""
    best = None
    for index in range(NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.gpu_instance_get_compute_instance_profile_info(
                gi, index, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except NVMLError as error:
            if return_code(error) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        if best is None or info.sliceCount > best.sliceCount:
            best = info
    if best is None:
        raise RuntimeError("the GPU instance lists no compute-instance profile")
    return best.id


def create(nvml: RealNvml, gpu: str, profile_id: str, start: str) -> dict[str, Any]:
    handle = nvml.device_get_handle_by_index(int(gpu))
    if nvml.device_get_mig_mode(handle)[0] != NVML_DEVICE_MIG_ENABLE:
        nvml.device_set_mig_mode(handle, NVML_DEVICE_MIG_ENABLE)
    placement = next(
        p
        for p in nvml.device_get_gpu_instance_possible_placements(handle, int(profile_id))
        if p.start == int(start)
    )
    gi = nvml.device_create_gpu_instance_with_placement(handle, int(profile_id), placement)
    ci = nvml.gpu_instance_create_compute_instance(gi, full_ci_profile(nvml, gi))
    mig = nvml.compute_instance_get_info(ci).device
    return {
        "gi_id": nvml.gpu_instance_get_info(gi).id,
        "ci_id": nvml.compute_instance_get_info(ci).id,
        "uuid": nvml.device_get_uuid(mig),
        "name": nvml.device_get_name(mig),
        "is_mig": nvml.device_is_mig_device_handle(mig),
    }


def destroy(nvml: RealNvml, gpu: str, gi_id: str, ci_id: str) -> dict[str, Any]:
    handle = nvml.device_get_handle_by_index(int(gpu))
    gi = nvml.device_get_gpu_instance_by_id(handle, int(gi_id))
    nvml.compute_instance_destroy(nvml.gpu_instance_get_compute_instance_by_id(gi, int(ci_id)))
    nvml.gpu_instance_destroy(gi)
    return {"destroyed": [int(gi_id), int(ci_id)]}


def mig_devices(nvml: RealNvml, gpu: str, wait: str = "") -> list[dict[str, Any]]:
    handle = nvml.device_get_handle_by_index(int(gpu))
    if wait == "--wait":
        print("ready", flush=True)
        sys.stdin.readline()
    return list_mig_devices(nvml, handle)


def list_mig_devices(nvml: RealNvml, handle: DeviceHandle) -> list[dict[str, Any]]:
    devices = []
    for index in range(nvml.device_get_max_mig_device_count(handle)):
        try:
            mig = nvml.device_get_mig_device_handle_by_index(handle, index)
        except NVMLError as error:
            devices.append({"index": index, "error": code_name(error)})
            continue
        parent = nvml.device_get_device_handle_from_mig_device_handle(mig)
        devices.append(
            {
                "index": index,
                "uuid": nvml.device_get_uuid(mig),
                "name": nvml.device_get_name(mig),
                "gi_id": nvml.device_get_gpu_instance_id(mig),
                "ci_id": nvml.device_get_compute_instance_id(mig),
                "parent": nvml.device_get_uuid(parent),
                "memory_bytes": nvml.device_get_memory_info(mig).total,
            }
        )
    return devices


def code_name(error: Exception) -> str:
    code = return_code(error)
    return "?" if code is None else return_code_name(code)


def outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except NVMLError as error:
        return code_name(error)
    return "NVML_SUCCESS"


def errors(nvml: RealNvml) -> dict[str, str]:
    """What the library answers where real NVML refuses (GPU 0, MIG off at the start)."""
    h = nvml.device_get_handle_by_index(0)
    results = {}

    def placement(start: int, size: int) -> Any:
        return pynvml.c_nvmlGpuInstancePlacement_t(start, size)

    results["create with MIG off"] = outcome(
        lambda: nvml.device_create_gpu_instance_with_placement(h, 0, placement(0, 1))
    )
    results["remaining capacity with MIG off"] = outcome(
        lambda: nvml.device_get_gpu_instance_remaining_capacity(h, 0)
    )
    results["GPU instance by id with MIG off"] = outcome(
        lambda: nvml.device_get_gpu_instance_by_id(h, 0)
    )
    nvml.device_set_mig_mode(h, NVML_DEVICE_MIG_ENABLE)
    results["unknown profile id"] = outcome(
        lambda: nvml.device_create_gpu_instance_with_placement(h, 99, placement(0, 1))
    )
    results["placement not offered"] = outcome(
        lambda: nvml.device_create_gpu_instance_with_placement(h, 1, placement(1, 2))
    )
    gi = nvml.device_create_gpu_instance_with_placement(h, 1, placement(2, 2))
    results["overlapping placement"] = outcome(
        lambda: nvml.device_create_gpu_instance_with_placement(h, 0, placement(3, 1))
    )
    results["GPU instance by unknown id"] = outcome(
        lambda: nvml.device_get_gpu_instance_by_id(h, 13)
    )
    ci = nvml.gpu_instance_create_compute_instance(gi, full_ci_profile(nvml, gi))
    results["second full compute instance"] = outcome(
        lambda: nvml.gpu_instance_create_compute_instance(gi, full_ci_profile(nvml, gi))
    )
    results["destroy GPU instance with a compute instance"] = outcome(
        lambda: nvml.gpu_instance_destroy(gi)
    )
    results["MIG off with GPU instances"] = outcome(
        lambda: nvml.device_set_mig_mode(h, NVML_DEVICE_MIG_DISABLE)
    )
    results["compute instance by unknown id"] = outcome(
        lambda: nvml.gpu_instance_get_compute_instance_by_id(gi, 5)
    )
    results["minor number of a MIG device"] = outcome(
        lambda: nvml.device_get_minor_number(nvml.compute_instance_get_info(ci).device)
    )
    results["MIG device by index past the maximum"] = outcome(
        lambda: nvml.device_get_mig_device_handle_by_index(h, 7)
    )
    results["NUMA node"] = outcome(lambda: nvml.device_get_numa_node_id(h))
    results["addressing mode"] = outcome(lambda: nvml.device_get_addressing_mode(h))
    results["stale handle"] = outcome(
        lambda: nvml.device_get_name(ctypes.cast(ctypes.c_void_p(0x1234), type(h)))
    )
    nvml.compute_instance_destroy(ci)
    nvml.gpu_instance_destroy(gi)
    results["destroyed GPU instance"] = outcome(lambda: nvml.gpu_instance_get_info(gi))
    results["MIG off without GPU instances"] = outcome(
        lambda: nvml.device_set_mig_mode(h, NVML_DEVICE_MIG_DISABLE)
    )
    return results


def set_compute_mode(nvml: RealNvml, gpu: str, mode: str) -> int:
    handle = nvml.device_get_handle_by_index(int(gpu))
    nvml.device_set_compute_mode(handle, int(mode))
    return nvml.device_get_compute_mode(handle)


def compute_mode(nvml: RealNvml, gpu: str) -> int:
    return nvml.device_get_compute_mode(nvml.device_get_handle_by_index(int(gpu)))


def common_ancestor(nvml: RealNvml, first: str, second: str) -> int | str:
    one = nvml.device_get_handle_by_index(int(first))
    two = nvml.device_get_handle_by_index(int(second))
    try:
        return int(pynvml.nvmlDeviceGetTopologyCommonAncestor(one, two))
    except pynvml.NVMLError as error:
        return return_code_name(int(error.value))


def memory_limits(nvml: RealNvml, gpu: str, cgroup: str, *limits: str) -> dict[str, Any]:
    if gpu.isdigit():
        handle = nvml.device_get_handle_by_index(int(gpu))
    else:
        handle = nvml.device_get_handle_by_uuid(gpu)
    result: dict[str, Any] = {
        "driver": nvml.system_get_driver_version(),
        "cuda": nvml.system_get_cuda_driver_version(),
    }
    if limits:
        soft, hard = (int(value) for value in limits)

        def set_limits() -> None:
            struct = pynvml.c_nvmlSetMemoryLimits_v1_t()
            struct.nameSpace = cgroup.encode()
            struct.softLimit, struct.hardLimit = soft, hard
            pynvml.nvmlDeviceSetMemoryLimits_v1(handle, struct)

        result["set"] = outcome(set_limits)
    try:
        got = nvml.device_get_memory_limits(handle, cgroup)
    except NVMLError as error:
        result["get"] = code_name(error)
    else:
        result["get"] = {"soft": got.soft, "hard": got.hard, "used": got.used}
    return result


_NOT_FOUND = 6


def smi_list(lib: ctypes.CDLL) -> list[str]:
    """``nvidia-smi -L``: "GPU <i>: <name> (UUID: <uuid>)", then "  MIG <profile> Device <n>:
    (UUID: <uuid>)" for each MIG device of a GPU in MIG mode."""
    lib.nvmlErrorString.restype = ctypes.c_char_p

    def check(ret: int) -> None:
        if ret != 0:
            raise RuntimeError(lib.nvmlErrorString(ret).decode())

    def text(getter: Any, handle: ctypes.c_void_p) -> str:
        buffer = ctypes.create_string_buffer(96)
        check(getter(handle, buffer, ctypes.c_uint(96)))
        return buffer.value.decode()

    check(lib.nvmlInit_v2())
    version = ctypes.create_string_buffer(80)
    check(lib.nvmlSystemGetDriverVersion(version, ctypes.c_uint(80)))
    lines = [f"driver {version.value.decode()}"]
    count = ctypes.c_uint()
    check(lib.nvmlDeviceGetCount_v2(ctypes.byref(count)))
    for index in range(count.value):
        gpu = ctypes.c_void_p()
        check(lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(gpu)))
        name, uuid = text(lib.nvmlDeviceGetName, gpu), text(lib.nvmlDeviceGetUUID, gpu)
        lines.append(f"GPU {index}: {name} (UUID: {uuid})")
        current, pending = ctypes.c_uint(), ctypes.c_uint()
        check(lib.nvmlDeviceGetMigMode(gpu, ctypes.byref(current), ctypes.byref(pending)))
        if current.value != NVML_DEVICE_MIG_ENABLE:
            continue
        most = ctypes.c_uint()
        check(lib.nvmlDeviceGetMaxMigDeviceCount(gpu, ctypes.byref(most)))
        shown = 0
        for mig_index in range(most.value):
            mig = ctypes.c_void_p()
            ret = lib.nvmlDeviceGetMigDeviceHandleByIndex(
                gpu, ctypes.c_uint(mig_index), ctypes.byref(mig)
            )
            if ret == _NOT_FOUND:
                continue
            check(ret)
            profile = text(lib.nvmlDeviceGetName, mig).split(" MIG ", 1)[1]
            uuid = text(lib.nvmlDeviceGetUUID, mig)
            lines.append(f"  MIG {profile} Device {shown}: (UUID: {uuid})")
            shown += 1
    check(lib.nvmlShutdown())
    return lines


def raw(lib: ctypes.CDLL) -> dict[str, Any]:
    lib.nvmlErrorString.restype = ctypes.c_char_p
    count = ctypes.c_uint()
    result: dict[str, Any] = {
        "count before init": lib.nvmlDeviceGetCount_v2(ctypes.byref(count)),
        "shutdown before init": lib.nvmlShutdown(),
        "error strings": {
            code: lib.nvmlErrorString(code).decode() for code in (0, 2, 3, 6, 9, 19, 23, 999)
        },
    }
    result["init"] = lib.nvmlInit_v2()
    result["second init"] = lib.nvmlInitWithFlags(ctypes.c_uint(1))
    gpu = ctypes.c_void_p()
    lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(0), ctypes.byref(gpu))
    temperature = ctypes.c_uint()
    result["function the mock lacks"] = lib.nvmlDeviceGetTemperature(
        gpu, ctypes.c_int(0), ctypes.byref(temperature)
    )
    name = ctypes.create_string_buffer(4)
    result["name into a short buffer"] = lib.nvmlDeviceGetName(gpu, name, ctypes.c_uint(4))
    result["shutdowns"] = [lib.nvmlShutdown(), lib.nvmlShutdown(), lib.nvmlShutdown()]
    return result


RAW_COMMANDS: dict[str, Callable[[ctypes.CDLL], Any]] = {"smi-list": smi_list, "raw": raw}

COMMANDS: dict[str, Callable[..., Any]] = {
    "create": create,
    "destroy": destroy,
    "mig-devices": mig_devices,
    "errors": errors,
    "set-compute-mode": set_compute_mode,
    "compute-mode": compute_mode,
    "common-ancestor": common_ancestor,
    "memory-limits": memory_limits,
}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
