"""The NVML mock library (e2e/toolchain/nvml-mock) under gpu-dra's own NVML code.

Every library load happens in a subprocess (tests.e2e_tools.nvml_probe): pynvml keeps one
loaded library per process. GPUs are checked against go-nvml's mock data as its source says,
MIG against NVML's return codes (shared/reference/gpu-hardware.md section 3.4).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e2e import nvmlmock
from e2e.cluster.paths import ClusterPaths
from tests.e2e_tools.support import (
    REPO,
    all_cap_minors,
    cap_nodes,
    gpu_nodes,
    library_env,
    mock_server,
    probe,
)

MIB = 1024 * 1024
H100_1G = "0"  # the dgxh100 mock's GPU-instance profile ID of 1g.10gb (go-nvml uses the index)
H100_2G = "1"


def test_library_soname_is_libnvidia_ml_so_1(nvml_mock_library: Path, tmp_path: Path) -> None:
    """ldconfig names the link after the ELF SONAME, as it does for the real driver's file."""
    shutil.copy(nvml_mock_library, tmp_path / "libnvidia-ml.so.550.54.15")
    subprocess.run(["ldconfig", "-n", str(tmp_path)], check=True)
    link = tmp_path / "libnvidia-ml.so.1"
    assert link.is_symlink()
    assert link.readlink() == Path("libnvidia-ml.so.550.54.15")


def test_every_nvml_function_is_defined(
    nvml_mock_library: Path, cluster_paths: ClusterPaths
) -> None:
    """Every function nvml.h declares resolves, and the library loads with RTLD_NOW (ctypes):
    no client gets an unresolved symbol, whatever it calls."""
    header = nvmlmock.nvml_header(cluster_paths).read_text()
    declared = sorted(set(re.findall(r"nvmlReturn_t\s+DECLDIR\s+(nvml\w+)\s*\(", header)))
    assert len(declared) > 400
    code = (
        "import ctypes, json, sys\n"
        "lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)\n"
        "print(json.dumps([n for n in sys.argv[2:] if not hasattr(lib, n)]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(nvml_mock_library), *declared, "nvmlErrorString"],
        capture_output=True,
        text=True,
        check=True,
        env=library_env(),
    )
    assert json.loads(done.stdout) == []


def test_without_configuration_init_fails_as_without_a_driver(driver_root: Path) -> None:
    gpu_nodes(driver_root, range(8))
    run = probe(driver_root, "discover", env=library_env(dev_root=driver_root))
    assert run.returncode != 0
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in run.stderr
    assert (
        "neither GPU_DRA_NVML_MOCK_MACHINE nor GPU_DRA_NVML_MOCK_STATE is set: "
        "no NVIDIA driver here" in run.stderr
    )


def test_unknown_machine_is_refused_naming_the_known_ones(driver_root: Path) -> None:
    env = library_env(dev_root=driver_root) | {nvmlmock.ENV_MACHINE: "dgx1"}
    run = probe(driver_root, "discover", env=env)
    assert run.returncode != 0
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in run.stderr
    assert 'GPU_DRA_NVML_MOCK_MACHINE="dgx1" is not a mock server' in run.stderr
    assert ", ".join(sorted(nvmlmock.MACHINES)) in run.stderr


@pytest.mark.parametrize("machine", nvmlmock.MACHINES)
def test_discovery_reports_the_mock_servers_gpus(
    machine: str, driver_root: Path, go_nvml: Path
) -> None:
    expected = mock_server(go_nvml, machine)
    gpu_nodes(driver_root, range(expected.gpu_count))
    found = probe(
        driver_root, "discover", env=library_env(machine=machine, dev_root=driver_root)
    ).json()
    assert found["problems"] == []
    gpus = found["gpus"]
    assert [g["index"] for g in gpus] == list(range(expected.gpu_count))
    assert [g["minor"] for g in gpus] == list(range(expected.gpu_count))
    assert [g["uuid"] for g in gpus] == [
        nvmlmock.gpu_uuid(machine, i) for i in range(expected.gpu_count)
    ]
    assert [g["pci_bus_id"] for g in gpus] == [f"0000:{i:02x}:00.0" for i in range(len(gpus))]
    for gpu in gpus:
        assert gpu["name"] == expected.name
        assert gpu["memory_bytes"] == expected.memory_mib * MIB
        assert gpu["pci_device_id"] == expected.pci_device_id
        assert tuple(gpu["cuda_compute_capability"]) == expected.cuda_compute_capability
        assert gpu["driver_version"] == expected.driver_version
        assert gpu["cuda_driver_version"] == expected.cuda_driver_version
        assert gpu["mig_capable"] is True
        assert gpu["mig_enabled"] is False
    assert found["mig_devices"] == []
    assert found["profiles"], "every mock GPU offers MIG profiles"


def test_only_gpus_with_a_device_node_are_visible(driver_root: Path) -> None:
    gpu_nodes(driver_root, [2, 5])
    env = library_env(machine="dgxh100", dev_root=driver_root)
    gpus = probe(driver_root, "discover", env=env).json()["gpus"]
    assert [(g["index"], g["minor"], g["uuid"]) for g in gpus] == [
        (0, 2, nvmlmock.gpu_uuid("dgxh100", 2)),
        (1, 5, nvmlmock.gpu_uuid("dgxh100", 5)),
    ]


def test_no_device_node_no_gpu(driver_root: Path) -> None:
    """Like a container without /dev/nvidia*: NVML initialises and counts 0 GPUs."""
    env = library_env(machine="dgxa100", dev_root=driver_root)
    assert probe(driver_root, "smi-list", env=env).json() == ["driver 550.54.15"]


def test_mig_lifecycle_through_real_nvml(driver_root: Path, tmp_path: Path) -> None:
    gpu_nodes(driver_root, range(8))
    cap_nodes(driver_root, all_cap_minors(0))
    env = library_env(machine="dgxh100", state=tmp_path / "state.json", dev_root=driver_root)

    created = probe(driver_root, "create", "0", H100_1G, "3", env=env).json()
    assert created["name"] == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    assert created["uuid"].startswith("MIG-")
    assert created["is_mig"] is True

    found = probe(driver_root, "discover", env=env).json()
    assert found["problems"] == []
    assert found["gpus"][0]["mig_enabled"] is True
    assert found["mig_devices"] == [
        {
            "parent": nvmlmock.gpu_uuid("dgxh100", 0),
            "uuid": created["uuid"],
            "profile": "1g.10gb",
            "gi_profile_id": int(H100_1G),
            "placement": [3, 1],
            "gi_id": created["gi_id"],
            "ci_id": created["ci_id"],
            "memory_bytes": 10240 * MIB,
            "multiprocessors": 16,
        }
    ]

    probe(driver_root, "destroy", "0", str(created["gi_id"]), str(created["ci_id"]), env=env)
    found = probe(driver_root, "discover", env=env).json()
    assert found["mig_devices"] == []
    assert found["gpus"][0]["mig_enabled"] is True


def test_mig_refusals_carry_nvml_return_codes(driver_root: Path) -> None:
    gpu_nodes(driver_root, range(8))
    cap_nodes(driver_root, all_cap_minors(0))
    env = library_env(machine="dgxh100", dev_root=driver_root)
    assert probe(driver_root, "errors", env=env).json() == {
        "create with MIG off": "NVML_ERROR_NOT_SUPPORTED",
        "remaining capacity with MIG off": "NVML_ERROR_NOT_SUPPORTED",
        "GPU instance by id with MIG off": "NVML_ERROR_NOT_SUPPORTED",
        "unknown profile id": "NVML_ERROR_INVALID_ARGUMENT",
        "placement not offered": "NVML_ERROR_INVALID_ARGUMENT",
        "overlapping placement": "NVML_ERROR_INSUFFICIENT_RESOURCES",
        "GPU instance by unknown id": "NVML_ERROR_NOT_FOUND",
        "second full compute instance": "NVML_ERROR_INSUFFICIENT_RESOURCES",
        "destroy GPU instance with a compute instance": "NVML_ERROR_IN_USE",
        "MIG off with GPU instances": "NVML_ERROR_IN_USE",
        "compute instance by unknown id": "NVML_ERROR_NOT_FOUND",
        "minor number of a MIG device": "NVML_ERROR_NOT_SUPPORTED",
        "MIG device by index past the maximum": "NVML_ERROR_INVALID_ARGUMENT",
        "NUMA node": "NVML_ERROR_NOT_SUPPORTED",
        "addressing mode": "NVML_ERROR_NOT_SUPPORTED",
        "stale handle": "NVML_ERROR_INVALID_ARGUMENT",
        "destroyed GPU instance": "NVML_ERROR_INVALID_ARGUMENT",
        "MIG off without GPU instances": "NVML_SUCCESS",
    }


def test_state_is_shared_across_processes(driver_root: Path, tmp_path: Path) -> None:
    """A process in an NVML session sees the instances another process creates after it
    started (the state file is re-read when it changes), and later processes too."""
    gpu_nodes(driver_root, range(8))
    cap_nodes(driver_root, all_cap_minors(1))
    state = tmp_path / "state.json"
    env = library_env(machine="dgxh100", state=state, dev_root=driver_root)
    command = [sys.executable, "-m", "tests.e2e_tools.nvml_probe", str(driver_root)]
    waiting = subprocess.Popen(
        [*command, "mig-devices", "1", "--wait"],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert waiting.stdout is not None
        assert waiting.stdout.readline() == "ready\n"
        created = probe(driver_root, "create", "1", H100_2G, "4", env=env).json()
        listed, errors = waiting.communicate("go\n", timeout=60)
    finally:
        waiting.kill()
    assert waiting.returncode == 0, errors
    devices = json.loads(listed.splitlines()[-1])
    assert devices[0] == {
        "index": 0,
        "uuid": created["uuid"],
        "name": "NVIDIA H100 80GB HBM3 MIG 2g.20gb",
        "gi_id": created["gi_id"],
        "ci_id": created["ci_id"],
        "parent": nvmlmock.gpu_uuid("dgxh100", 1),
        "memory_bytes": 20480 * MIB,
    }
    assert {d.get("error") for d in devices[1:]} == {"NVML_ERROR_NOT_FOUND"}

    saved = json.loads(state.read_text())
    assert saved["machine"] == "dgxh100"
    assert [g["uuid"] for g in saved["gpus"]] == [nvmlmock.gpu_uuid("dgxh100", i) for i in range(8)]
    assert saved["gpus"][1]["migMode"] == 1
    assert saved["gpus"][1]["gpuInstances"] == [
        {
            "id": created["gi_id"],
            "profileId": int(H100_2G),
            "start": 4,
            "size": 2,
            "computeInstances": [{"id": created["ci_id"], "profileId": 1, "uuid": created["uuid"]}],
        }
    ]

    # The machine comes from the state file when the variable is left out.
    later = library_env(state=state, dev_root=driver_root)
    assert probe(driver_root, "smi-list", env=later).json()[2:4] == [
        f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {nvmlmock.gpu_uuid('dgxh100', 1)})",
        f"  MIG 2g.20gb Device 0: (UUID: {created['uuid']})",
    ]
    probe(driver_root, "destroy", "1", str(created["gi_id"]), str(created["ci_id"]), env=later)
    assert {d.get("error") for d in probe(driver_root, "mig-devices", "1", env=later).json()} == {
        "NVML_ERROR_NOT_FOUND"
    }


def test_state_file_of_another_machine_is_refused(driver_root: Path, tmp_path: Path) -> None:
    gpu_nodes(driver_root, range(8))
    state = tmp_path / "state.json"
    first = probe(driver_root, "smi-list", env=library_env(machine="dgxa100", state=state))
    assert first.returncode == 0, first.stderr
    run = probe(
        driver_root,
        "discover",
        env=library_env(machine="dgxb200", state=state, dev_root=driver_root),
    )
    assert run.returncode != 0
    assert f"GPU_DRA_NVML_MOCK_MACHINE=dgxb200 but the state file {state} is of dgxa100" in (
        run.stderr
    )


def test_mig_device_needs_both_capability_nodes(driver_root: Path, tmp_path: Path) -> None:
    """As in a container given one MIG device: the GI and CI access nodes decide."""
    gpu_nodes(driver_root, range(8))
    cap_nodes(driver_root, all_cap_minors(0))
    state = tmp_path / "state.json"
    created = probe(
        driver_root,
        "create",
        "0",
        H100_1G,
        "0",
        env=library_env(machine="dgxh100", state=state, dev_root=driver_root),
    ).json()

    container = tmp_path / "container"
    gpu_nodes(container, [0])
    cap_nodes(container, [nvmlmock.mig_cap_minor(0, created["gi_id"])])
    env = library_env(state=state, dev_root=container)
    assert probe(driver_root, "mig-devices", "0", env=env).json()[0] == {
        "index": 0,
        "error": "NVML_ERROR_NOT_FOUND",
    }
    cap_nodes(container, [nvmlmock.mig_cap_minor(0, created["gi_id"], created["ci_id"])])
    assert probe(driver_root, "mig-devices", "0", env=env).json()[0]["uuid"] == created["uuid"]


def test_instances_make_their_capability_nodes_in_the_dev_root(
    driver_root: Path, tmp_path: Path
) -> None:
    """As nvidia-modprobe on a host: creating a GPU and compute instance makes their nodes in the
    dev root (character devices with the root's nvidia-caps major), so host-side walks list the
    MIG device; destroying removes them. A container's dev root gets none."""
    gpu_nodes(driver_root, range(8))
    (driver_root / "proc").mkdir()
    (driver_root / "proc" / "devices").write_text("Character devices:\n237 nvidia-caps\n")
    state = tmp_path / "state.json"
    env = library_env(machine="dgxh100", state=state, dev_root=driver_root)
    created = probe(driver_root, "create", "2", H100_2G, "4", env=env).json()

    caps = driver_root / "dev" / "nvidia-caps"
    minors = [
        nvmlmock.mig_cap_minor(2, created["gi_id"]),
        nvmlmock.mig_cap_minor(2, created["gi_id"], created["ci_id"]),
    ]
    assert sorted(p.name for p in caps.iterdir()) == sorted(f"nvidia-cap{m}" for m in minors)
    for minor in minors:
        node = (caps / f"nvidia-cap{minor}").lstat()
        assert node.st_mode & 0o777 == 0o444
        if os.geteuid() == 0:  # mknod needs CAP_MKNOD; else an empty file stands in
            assert stat.S_ISCHR(node.st_mode)
            assert (os.major(node.st_rdev), os.minor(node.st_rdev)) == (237, minor)
    assert probe(driver_root, "mig-devices", "2", env=env).json()[0]["uuid"] == created["uuid"]

    container = tmp_path / "container"
    gpu_nodes(container, [2])
    reader = library_env(state=state, dev_root=container)
    assert {d.get("error") for d in probe(driver_root, "mig-devices", "0", env=reader).json()} == {
        "NVML_ERROR_NOT_FOUND"
    }
    assert not (container / "dev" / "nvidia-caps").exists()

    probe(driver_root, "destroy", "2", str(created["gi_id"]), str(created["ci_id"]), env=env)
    assert list(caps.iterdir()) == []


def test_compute_mode_is_kept_in_the_state(driver_root: Path, tmp_path: Path) -> None:
    gpu_nodes(driver_root, range(8))
    env = library_env(machine="dgxh200", state=tmp_path / "state.json", dev_root=driver_root)
    assert probe(driver_root, "compute-mode", "3", env=env).json() == 0
    assert probe(driver_root, "set-compute-mode", "3", "3", env=env).json() == 3
    assert probe(driver_root, "compute-mode", "3", env=env).json() == 3
    assert probe(driver_root, "compute-mode", "2", env=env).json() == 0


def test_two_gpus_meet_across_the_system_as_nvidias_device_plugin_asks(
    driver_root: Path,
) -> None:
    gpu_nodes(driver_root, range(8))
    env = library_env(machine="dgxh100", dev_root=driver_root)

    assert probe(driver_root, "common-ancestor", "0", "5", env=env).json() == 50  # SYSTEM
    assert probe(driver_root, "common-ancestor", "3", "3", env=env).json() == 0  # INTERNAL


def test_c_level_return_codes(driver_root: Path) -> None:
    gpu_nodes(driver_root, range(8))
    env = library_env(machine="dgxb200", dev_root=driver_root, trace=True)
    run = probe(driver_root, "raw", env=env)
    assert run.json() == {
        "count before init": 1,  # NVML_ERROR_UNINITIALIZED
        "shutdown before init": 1,
        "error strings": {
            "0": "Success",
            "2": "Invalid Argument",
            "3": "Not Supported",
            "6": "Not Found",
            "9": "Driver Not Loaded",
            "19": "In use by another client",
            "23": "Insufficient Resources",
            "999": "Unknown Error",
        },
        "init": 0,
        "second init": 0,
        "function the mock lacks": 3,  # NVML_ERROR_NOT_SUPPORTED
        "name into a short buffer": 7,  # NVML_ERROR_INSUFFICIENT_SIZE
        "shutdowns": [0, 0, 1],  # two inits, two shutdowns, then UNINITIALIZED
    }
    assert "nvmlDeviceGetTemperature -> NVML_ERROR_NOT_SUPPORTED (not implemented)" in run.stderr


def test_gpu_dra_calls_only_implemented_functions(driver_root: Path, tmp_path: Path) -> None:
    """With every call traced: discovery, the MIG lifecycle and the refusals above reach the
    mock, not the NOT_SUPPORTED stubs, except the two facts x86 GPUs do not have."""
    gpu_nodes(driver_root, range(8))
    cap_nodes(driver_root, all_cap_minors(0))
    stateful = library_env(
        machine="dgxh100", state=tmp_path / "state.json", dev_root=driver_root, trace=True
    )
    fresh = library_env(machine="dgxh100", dev_root=driver_root, trace=True)
    traces = ""
    for args, env in (
        (("create", "0", H100_2G, "0"), stateful),
        (("discover",), stateful),
        (("mig-devices", "0"), stateful),
        (("set-compute-mode", "0", "3"), stateful),
        (("errors",), fresh),
    ):
        run = probe(driver_root, *args, env=env)
        assert run.returncode == 0, run.stderr
        traces += run.stderr
    stubs = set(re.findall(r"(nvml\w+) -> NVML_ERROR_NOT_SUPPORTED \(not implemented\)", traces))
    assert stubs == {"nvmlDeviceGetAddressingMode", "nvmlDeviceGetNumaNodeId"}
    assert "nvmlGpuInstanceCreateComputeInstance -> NVML_SUCCESS" in traces


def test_nvidia_smi_list_through_the_c_abi(driver_root: Path, tmp_path: Path) -> None:
    """The calls the test bed's nvidia-smi -L makes, on a GPU in MIG mode and one without."""
    gpu_nodes(driver_root, range(2))
    cap_nodes(driver_root, all_cap_minors(1))
    env = library_env(machine="dgxa100", state=tmp_path / "state.json", dev_root=driver_root)
    first = probe(driver_root, "create", "1", "0", "6", env=env).json()
    second = probe(driver_root, "create", "1", "1", "0", env=env).json()
    assert probe(driver_root, "smi-list", env=env).json() == [
        "driver 550.54.15",
        f"GPU 0: Mock NVIDIA A100-SXM4-40GB (UUID: {nvmlmock.gpu_uuid('dgxa100', 0)})",
        f"GPU 1: Mock NVIDIA A100-SXM4-40GB (UUID: {nvmlmock.gpu_uuid('dgxa100', 1)})",
        # By GPU-instance id: the 1g (created first) has the lower one.
        f"  MIG 1g.5gb Device 0: (UUID: {first['uuid']})",
        f"  MIG 2g.10gb Device 1: (UUID: {second['uuid']})",
    ]


def test_mig_cap_minors_follow_the_driver() -> None:
    """Minors the driver's /proc/driver/nvidia-caps/mig-minors shows (NVIDIA's DRA driver
    quotes gpu3/gi3/ci3 = 439 and gpu6/gi11/ci7 = 920 from a real node)."""
    assert nvmlmock.mig_cap_minor(0, 0) == 3
    assert nvmlmock.mig_cap_minor(0, 0, 0) == 4
    assert nvmlmock.mig_cap_minor(0, 1) == 12
    assert nvmlmock.mig_cap_minor(3, 3, 3) == 439
    assert nvmlmock.mig_cap_minor(6, 11, 7) == 920
    assert nvmlmock.mig_cap_minor(31, 14, 7) == 4322
    for bad in ((32, 0, None), (0, 15, None), (0, 0, 8), (-1, 0, None)):
        with pytest.raises(ValueError, match="outside"):
            nvmlmock.mig_cap_minor(*bad)


def test_mig_minors_file_lists_every_capability_once() -> None:
    lines = nvmlmock.mig_minors_file_text().splitlines()
    assert lines[:4] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4"]
    assert lines[-1] == "gpu31/gi14/ci7/access 4322"
    assert len(lines) == 2 + 32 * 15 * 9
    minors = [int(line.split(" ")[1]) for line in lines]
    assert minors == list(range(1, 4323))
    for line in lines[2:]:
        name, minor = line.split(" ")
        numbers = [int(n) for n in re.findall(r"\d+", name)]
        assert nvmlmock.mig_cap_minor(*numbers) == int(minor)
    assert nvmlmock.mig_minors_file_text(2).splitlines() == lines[: 2 + 2 * 15 * 9]


def test_the_615_driver_reports_its_versions_and_keeps_memory_limits(
    driver_root: Path, tmp_path: Path
) -> None:
    """Set in one process, read in another that names only the state file; return codes as
    nvml.h documents them; the state file records the driver and the limits."""
    gpu_nodes(driver_root, range(8))
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    state = tmp_path / "state.json"
    env = library_env(machine="dgxh100", state=state, dev_root=driver_root, driver="615")
    reader = library_env(state=state, dev_root=driver_root)
    total = 81920 * MIB

    def limits(env: dict[str, str], *args: str, gpu: str = "1") -> Any:
        return probe(driver_root, "memory-limits", gpu, *args, env=env).json()

    assert limits(env, str(cgroup)) == {
        "driver": "615.71.09",
        "cuda": 13040,
        "get": "NVML_ERROR_NOT_FOUND",
    }
    assert limits(env, str(cgroup), str(MIB), str(2 * MIB))["set"] == "NVML_SUCCESS"
    assert limits(reader, str(cgroup))["get"] == {"soft": MIB, "hard": 2 * MIB, "used": 0}
    assert limits(reader, str(cgroup), gpu="0")["get"] == "NVML_ERROR_NOT_FOUND"
    document = json.loads(state.read_text())
    assert document["driver"] == "615"
    assert document["gpus"][1]["memoryLimits"] == [
        {"cgroup": str(cgroup), "softLimit": MIB, "hardLimit": 2 * MIB}
    ]
    refused = {
        "soft above hard": (str(cgroup), str(2 * MIB), str(MIB)),
        "above the GPU's memory": (str(cgroup), "0", str(total + 1)),
        "no such cgroup": (str(tmp_path / "gone"), "0", str(MIB)),
    }
    assert {k: limits(env, *args)["set"] for k, args in refused.items()} == {
        "soft above hard": "NVML_ERROR_INVALID_ARGUMENT",
        "above the GPU's memory": "NVML_ERROR_INVALID_ARGUMENT",
        "no such cgroup": "NVML_ERROR_OPERATING_SYSTEM",
    }
    # Soft 0 and hard NVML_DEVICE_MEMORY_LIMIT_MAX clear the limits.
    cleared = limits(env, str(cgroup), "0", str(2**64 - 1))
    assert (cleared["set"], cleared["get"]) == ("NVML_SUCCESS", "NVML_ERROR_NOT_FOUND")
    # A removed cgroup's limits go with it.
    assert limits(env, str(cgroup), str(MIB), str(MIB))["set"] == "NVML_SUCCESS"
    cgroup.rmdir()
    assert limits(reader, str(cgroup))["get"] == "NVML_ERROR_OPERATING_SYSTEM"
    assert nvmlmock.memory_limits(state) == {}


def test_memory_limits_refuse_mig_devices(driver_root: Path, tmp_path: Path) -> None:
    gpu_nodes(driver_root, range(8))
    env = library_env(
        machine="dgxh100", state=tmp_path / "state.json", dev_root=driver_root, driver="615"
    )
    mig = probe(driver_root, "create", "0", H100_1G, "0", env=env).json()["uuid"]
    found = probe(driver_root, "memory-limits", mig, str(tmp_path), "0", str(MIB), env=env).json()
    assert (found["set"], found["get"]) == ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NOT_SUPPORTED")


def test_without_the_driver_setting_memory_limits_are_not_supported(
    driver_root: Path, tmp_path: Path
) -> None:
    gpu_nodes(driver_root, range(8))
    state = tmp_path / "state.json"
    env = library_env(machine="dgxh100", state=state, dev_root=driver_root)
    found = probe(driver_root, "memory-limits", "0", str(tmp_path), "0", str(MIB), env=env).json()
    assert found == {
        "driver": "550.54.15",
        "cuda": 12040,
        "set": "NVML_ERROR_NOT_SUPPORTED",
        "get": "NVML_ERROR_NOT_SUPPORTED",
    }
    assert "driver" not in json.loads(state.read_text())


def test_driver_setting_refusals(driver_root: Path, tmp_path: Path) -> None:
    gpu_nodes(driver_root, range(8))
    unknown = library_env(machine="dgxh100", dev_root=driver_root) | {nvmlmock.ENV_DRIVER: "580"}
    run = probe(driver_root, "discover", env=unknown)
    assert run.returncode != 0
    assert 'GPU_DRA_NVML_MOCK_DRIVER="580" is not a driver the library knows (615)' in run.stderr
    state = tmp_path / "state.json"
    assert probe(driver_root, "discover", env=library_env(
        machine="dgxh100", state=state, dev_root=driver_root)).returncode == 0  # fmt: skip
    other = library_env(state=state, dev_root=driver_root, driver="615")
    run = probe(driver_root, "discover", env=other)
    assert run.returncode != 0
    assert f'GPU_DRA_NVML_MOCK_DRIVER=615 but the state file {state} is of driver ""' in run.stderr


def test_settings_come_from_the_file_beside_the_library_unless_set(
    driver_root: Path, tmp_path: Path
) -> None:
    gpu_nodes(driver_root, range(8))
    library_dir = driver_root / "usr/lib/x86_64-linux-gnu"
    nvmlmock.write_config_file(
        library_dir, nvmlmock.environment(machine="dgxa100", dev_root=driver_root, driver="615")
    )
    from_file = probe(driver_root, "discover", env=library_env()).json()
    assert {g["name"] for g in from_file["gpus"]} == {"Mock NVIDIA A100-SXM4-40GB"}
    assert {g["driver_version"] for g in from_file["gpus"]} == {"615.71.09"}
    overridden = probe(driver_root, "discover", env=library_env(machine="dgxh100")).json()
    assert {g["name"] for g in overridden["gpus"]} == {"NVIDIA H100 80GB HBM3"}
