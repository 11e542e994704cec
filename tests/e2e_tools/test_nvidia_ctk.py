"""NVIDIA's nvidia-ctk and nvidia-cdi-hook (e2e/nvidiactk.py) against the NVML mock library.

``nvidia-ctk cdi generate`` runs on a minimal fake driver root (the library under the real
driver's file names, an ``ldconfig -r`` cache, device nodes made with mknod) and must list the
mock's GPUs and a MIG device created through the library; a hook it generates must run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import nvidiactk, nvmlmock
from tests.e2e_tools.support import (
    LIBRARY_DIR,
    REPO,
    host_view,
    library_env,
    mock_server,
    probe,
)

NVIDIA_MAJOR = 195
CAPS_MAJOR = 240  # nvidia-caps gets a dynamic major; any free one will do here
HOOK_PATH = "/usr/bin/nvidia-cdi-hook"

NVIDIA_CTK_NVML_CALLS = frozenset(
    {
        "nvmlInit_v2",
        "nvmlShutdown",
        "nvmlSystemGetDriverVersion",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceIsMigDeviceHandle",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        "nvmlDeviceGetAttributes_v2",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceGetGpuInstanceById",
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "nvmlGpuInstanceGetInfo",
        "nvmlGpuInstanceGetComputeInstanceById",
        "nvmlGpuInstanceGetComputeInstanceProfileInfo",
        "nvmlComputeInstanceGetInfo_v2",
    }
)
"""What ``nvidia-ctk cdi generate`` v1.20.1 calls for whole GPUs and one MIG device (traced);
docs/real-nodes.md lists the same."""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and mount need root")


def char_device(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


def fake_driver_root(root: Path, library: Path, version: str, gpus: int) -> None:
    """The library as ``libnvidia-ml.so.<version>`` with its ``.so.1`` link, found through the
    root's ld cache, the control and GPU device nodes, and ``proc/devices`` naming the
    ``nvidia-caps`` major (with which the library makes the MIG capability nodes)."""
    libraries = root / LIBRARY_DIR
    libraries.mkdir(parents=True)
    shutil.copy(library, libraries / f"libnvidia-ml.so.{version}")
    (libraries / nvmlmock.LIBRARY_NAME).symlink_to(f"libnvidia-ml.so.{version}")
    (root / "etc").mkdir()
    (root / "etc" / "ld.so.conf").write_text(f"/{LIBRARY_DIR}\n")
    subprocess.run(["ldconfig", "-r", str(root)], check=True)
    char_device(root / "dev" / "nvidiactl", NVIDIA_MAJOR, 255)
    (root / "proc").mkdir()
    (root / "proc" / "devices").write_text(
        f"Character devices:\n{NVIDIA_MAJOR} nvidia-frontend\n{CAPS_MAJOR} nvidia-caps\n"
    )
    for minor in range(gpus):
        char_device(root / "dev" / f"nvidia{minor}", NVIDIA_MAJOR, minor)


def cdi_generate(
    ctk: Path,
    root: Path,
    env: dict[str, str],
    minors: Path,
    pci_devices: Path | None = None,
) -> tuple[Any, str]:
    """``nvidia-ctk cdi generate`` on `root`, with `minors` as the host's
    /proc/driver/nvidia-caps/mig-minors (which it reads from the host, not the driver root)
    and `pci_devices` as /sys/bus/pci/devices, in a private mount namespace (`host_view`)."""
    command = [
        *(str(ctk / nvidiactk.NVIDIA_CTK), "cdi", "generate"),
        *("--driver-root", str(root), "--dev-root", str(root)),
        *("--nvidia-cdi-hook-path", HOOK_PATH, "--format", "yaml"),
    ]
    done = subprocess.run(
        host_view(command, mig_minors=minors, pci_devices=pci_devices),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout), done.stderr


def nodes(device: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    return [
        (n["path"], n["hostPath"], n["major"], n.get("minor", 0))
        for n in device["containerEdits"]["deviceNodes"]
    ]


def test_tools_report_the_pinned_release(nvidia_ctk_dir: Path) -> None:
    for tool in (nvidiactk.NVIDIA_CTK, nvidiactk.NVIDIA_CDI_HOOK):
        done = subprocess.run(
            [str(nvidia_ctk_dir / tool), "--version"], capture_output=True, text=True, check=True
        )
        assert f"version {nvidiactk.VERSION.removeprefix('v')}" in done.stdout


def test_the_pin_is_the_go_mod_pin() -> None:
    go_mod = (REPO / "e2e" / "toolchain" / "nvidia-container-toolkit" / "go.mod").read_text()
    assert f"{nvidiactk.MODULE} {nvidiactk.VERSION}" in go_mod
    for _, package in nvidiactk.TOOL.outputs:
        assert re.search(rf"^\s*(tool\s+)?{re.escape(package)}$", go_mod, re.MULTILINE), package


@needs_root
def test_cdi_generate_lists_the_mock_gpus_and_mig_devices(
    nvidia_ctk_dir: Path, nvml_mock_library: Path, go_nvml: Path, tmp_path: Path
) -> None:
    version = mock_server(go_nvml, "dgxh100").driver_version
    root = tmp_path / "driver-root"
    fake_driver_root(root, nvml_mock_library, version, gpus=4)
    state = tmp_path / "state.json"
    env = library_env(machine="dgxh100", state=state, dev_root=root)
    mig = probe(root, "create", "1", "1", "4", env=env).json()  # a 2g.20gb on GPU 1
    gi_cap = nvmlmock.mig_cap_minor(1, mig["gi_id"])
    ci_cap = nvmlmock.mig_cap_minor(1, mig["gi_id"], mig["ci_id"])
    # The library made their capability nodes, as nvidia-modprobe does on a host.
    for minor in (gi_cap, ci_cap):
        made = (root / "dev" / "nvidia-caps" / f"nvidia-cap{minor}").lstat()
        assert stat.S_ISCHR(made.st_mode)
        assert (os.major(made.st_rdev), os.minor(made.st_rdev)) == (CAPS_MAJOR, minor)
    minors = tmp_path / "mig-minors"
    minors.write_text(nvmlmock.mig_minors_file_text())

    spec, stderr = cdi_generate(
        nvidia_ctk_dir, root, library_env(state=state, dev_root=root, trace=True), minors
    )

    assert spec["kind"] == "nvidia.com/gpu"
    devices = {d["name"]: d for d in spec["devices"]}
    uuids = {i: nvmlmock.gpu_uuid("dgxh100", i) for i in range(4)}
    # GPU 1 is in MIG mode: NVIDIA publishes its MIG device, not the GPU.
    assert set(devices) == {"0", "2", "3", uuids[0], uuids[2], uuids[3], "1:0", mig["uuid"], "all"}
    for index in (0, 2, 3):
        expected = [(f"/dev/nvidia{index}", str(root / f"dev/nvidia{index}"), NVIDIA_MAJOR, index)]
        assert nodes(devices[str(index)]) == expected
        assert nodes(devices[uuids[index]]) == expected
    expected_mig = [
        ("/dev/nvidia1", str(root / "dev/nvidia1"), NVIDIA_MAJOR, 1),
        (
            f"/dev/nvidia-caps/nvidia-cap{gi_cap}",
            str(root / f"dev/nvidia-caps/nvidia-cap{gi_cap}"),
            CAPS_MAJOR,
            gi_cap,
        ),
        (
            f"/dev/nvidia-caps/nvidia-cap{ci_cap}",
            str(root / f"dev/nvidia-caps/nvidia-cap{ci_cap}"),
            CAPS_MAJOR,
            ci_cap,
        ),
    ]
    assert nodes(devices["1:0"]) == expected_mig
    assert nodes(devices[mig["uuid"]]) == expected_mig

    common = spec["containerEdits"]
    assert ("/dev/nvidiactl", str(root / "dev/nvidiactl"), NVIDIA_MAJOR, 255) in nodes(
        {"containerEdits": common}
    )
    hooks = [h["args"] for h in common["hooks"]]
    assert all(h["path"] == HOOK_PATH for h in common["hooks"])
    assert [
        "nvidia-cdi-hook",
        "create-symlinks",
        "--link",
        f"libnvidia-ml.so.{version}::/{LIBRARY_DIR}/libnvidia-ml.so.1",
    ] in hooks
    assert ["nvidia-cdi-hook", "enable-cuda-compat", f"--host-driver-version={version}"] in hooks

    assert "not implemented" not in stderr
    called = set(re.findall(r"\): (nvml\w+) -> NVML_SUCCESS", stderr))
    assert called == NVIDIA_CTK_NVML_CALLS
    # The only errors: the six empty MIG device indexes of GPU 1, which go-nvlib skips.
    errors = re.findall(r"\): (nvml\w+) -> (NVML_ERROR_\w+)", stderr)
    assert errors == [("nvmlDeviceGetMigDeviceHandleByIndex", "NVML_ERROR_NOT_FOUND")] * 6


@needs_root
def test_a_generated_hook_runs(
    nvidia_ctk_dir: Path, nvml_mock_library: Path, go_nvml: Path, tmp_path: Path
) -> None:
    """nvidia-cdi-hook runs the create-symlinks hook nvidia-ctk wrote, in a container bundle."""
    version = mock_server(go_nvml, "dgxa100").driver_version
    root = tmp_path / "driver-root"
    fake_driver_root(root, nvml_mock_library, version, gpus=1)
    minors = tmp_path / "mig-minors"
    minors.write_text(nvmlmock.mig_minors_file_text())
    spec, _ = cdi_generate(
        nvidia_ctk_dir, root, library_env(machine="dgxa100", dev_root=root), minors
    )
    hook = next(
        h["args"] for h in spec["containerEdits"]["hooks"] if h["args"][1] == "create-symlinks"
    )

    bundle = tmp_path / "bundle"
    (bundle / "rootfs" / LIBRARY_DIR).mkdir(parents=True)
    (bundle / "config.json").write_text(
        json.dumps({"ociVersion": "1.2.0", "root": {"path": "rootfs"}})
    )
    state = {"ociVersion": "1.2.0", "id": "c", "status": "creating", "pid": os.getpid()}
    subprocess.run(
        [str(nvidia_ctk_dir / nvidiactk.NVIDIA_CDI_HOOK), *hook[1:]],
        input=json.dumps(state | {"bundle": str(bundle)}),
        text=True,
        check=True,
        timeout=60,
    )
    link = bundle / "rootfs" / LIBRARY_DIR / "libnvidia-ml.so.1"
    assert link.is_symlink()
    assert link.readlink() == Path(f"libnvidia-ml.so.{version}")


def test_docs_list_the_nvml_calls_of_nvidia_ctk() -> None:
    doc = (REPO / "docs" / "real-nodes.md").read_text()
    section = doc.split("### NVML functions nvidia-ctk calls\n\n", 1)[1]
    listing = section.split("\n\n", 1)[0]  # its first paragraph
    assert set(re.findall(r"`(nvml\w+)`", listing)) == NVIDIA_CTK_NVML_CALLS
