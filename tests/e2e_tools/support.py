"""Helpers for the test-bed tool tests: device nodes, the library's environment, the probe
subprocess, the host's view of the driver for nvidia-ctk (`host_view`), and go-nvml's mock data
read from its source."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import nvmlmock

REPO = Path(__file__).resolve().parents[2]
LIBRARY_DIR = "usr/lib/x86_64-linux-gnu"


def gpu_nodes(dev_root: Path, minors: range | list[int]) -> None:
    """``dev/nvidia<minor>`` as plain files: the library only checks that they exist."""
    (dev_root / "dev").mkdir(parents=True, exist_ok=True)
    for minor in minors:
        (dev_root / "dev" / f"nvidia{minor}").touch()


def cap_nodes(dev_root: Path, minors: list[int]) -> None:
    caps = dev_root / "dev" / "nvidia-caps"
    caps.mkdir(parents=True, exist_ok=True)
    for minor in minors:
        (caps / f"nvidia-cap{minor}").touch()


def all_cap_minors(gpu_minor: int) -> list[int]:
    """Every GPU-instance and compute-instance capability minor of one GPU."""
    return [
        nvmlmock.mig_cap_minor(gpu_minor, gi, ci)
        for gi in range(nvmlmock.MIG_CAPS_GPU_INSTANCES)
        for ci in (None, *range(nvmlmock.MIG_CAPS_COMPUTE_INSTANCES))
    ]


def library_env(**settings: Any) -> dict[str, str]:
    """This process's environment without any GPU_DRA_NVML_MOCK_* setting, plus `settings`
    (`nvmlmock.environment` keywords) and ``trace=True`` for GPU_DRA_NVML_MOCK_TRACE."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_DRA_NVML_MOCK_")}
    if settings.pop("trace", False):
        env[nvmlmock.ENV_TRACE] = "1"
    return env | nvmlmock.environment(**settings)


_HOST_VIEW = (
    "mount -t tmpfs tmpfs /proc/driver && mkdir /proc/driver/nvidia-caps && "
    'cp "$1" /proc/driver/nvidia-caps/mig-minors && '
    '{ [ -z "$2" ] || mount --bind "$2" /sys/bus/pci/devices; } && shift 2 && exec "$@"'
)


def host_view(
    command: list[str], *, mig_minors: Path, pci_devices: Path | None = None
) -> list[str]:
    """`command` run in a private mount namespace where the host's driver facts are the test's:
    `mig_minors` as /proc/driver/nvidia-caps/mig-minors (nvidia-ctk reads MIG capability minors
    from the host, not from the driver root) and, if given, `pci_devices` over
    /sys/bus/pci/devices (where nvidia-ctk and gpu-dra find a GPU's DRM nodes). Needs root."""
    script = ("sh", "-c", _HOST_VIEW, "sh", str(mig_minors), str(pci_devices or ""))
    return ["unshare", "--mount", "--propagation", "private", *script, *command]


@dataclass(frozen=True)
class Probe:
    """A finished `tests.e2e_tools.nvml_probe` run."""

    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        assert self.returncode == 0, self.stderr
        return json.loads(self.stdout.splitlines()[-1])


def probe(root: Path, *args: str, env: dict[str, str]) -> Probe:
    """Runs gpu-dra's NVML code on the library of `root` in a fresh process."""
    return run_module("tests.e2e_tools.nvml_probe", root, *args, env=env)


def plugin_probe(root: Path, *args: str, env: dict[str, str]) -> Probe:
    """Runs the kubelet plugin's real-mode code on the library of `root` in a fresh process
    (`tests.e2e_tools.plugin_probe`)."""
    return run_module("tests.e2e_tools.plugin_probe", root, *args, env=env)


def run_module(module: str, root: Path, *args: str, env: dict[str, str]) -> Probe:
    done = subprocess.run(
        [sys.executable, "-m", module, str(root), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return Probe(done.returncode, done.stdout, done.stderr)


@dataclass(frozen=True)
class MockServer:
    """What go-nvml's source says a mock server is (read from the module cache)."""

    gpu_count: int
    name: str
    memory_mib: int
    pci_device_id: int
    cuda_compute_capability: tuple[int, int]
    driver_version: str
    cuda_driver_version: int


def mock_server(go_nvml: Path, machine: str) -> MockServer:
    mock = go_nvml / "pkg" / "nvml" / "mock"
    server = (mock / machine / f"{machine}.go").read_text()
    count, config = _one(r"gpus\.Multiple\((\d+), gpus\.(\w+)\)", server)
    configs = "\n".join(path.read_text() for path in sorted((mock / "gpus").glob("*.go")))
    block = _one(rf"\b{config}\s*=\s*Config\{{(.*?)\n\t\}}", configs, flags=re.DOTALL)[0]
    return MockServer(
        gpu_count=int(count),
        name=_one(r'Name:\s*"([^"]+)"', block)[0],
        memory_mib=int(_one(r"MemoryMB:\s*(\d+)", block)[0]),
        pci_device_id=int(_one(r"PciDeviceId:\s*(0x[0-9A-Fa-f]+)", block)[0], 16),
        cuda_compute_capability=(
            int(_one(r"CudaMajor:\s*(\d+)", block)[0]),
            int(_one(r"CudaMinor:\s*(\d+)", block)[0]),
        ),
        driver_version=_one(r'WithDriverVersion\("([^"]+)"\)', server)[0],
        cuda_driver_version=int(_one(r"WithCUDADriverVersion\((\d+)\)", server)[0]),
    )


def _one(pattern: str, text: str, flags: int = 0) -> tuple[str, ...]:
    found = re.findall(pattern, text, flags)
    assert len(found) == 1, f"{pattern!r}: {len(found)} matches in go-nvml's source"
    match = found[0]
    return match if isinstance(match, tuple) else (match,)
