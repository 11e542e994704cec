"""NVIDIA's device plugin (``k8s-device-plugin``), built from its pinned Go module and run on the
e2e node as a host process against the NVML mock library.

`build` builds ``nvidia-device-plugin`` from ``e2e/toolchain/nvidia-device-plugin`` (Go module
``github.com/NVIDIA/k8s-device-plugin`` at `VERSION`, cached like every test-bed tool; about
2 minutes cold on 2 cores). `DevicePlugin` runs it with ``libnvidia-ml.so.1`` from
`e2e.nvmlmock` (one of go-nvml's mock machines) and a device root holding the mock GPUs'
``dev/nvidia<minor>`` files, registered with the node's kubelet on its device-plugin socket
(``/var/lib/kubelet/device-plugins/kubelet.sock``: the kubelet's path whatever its ``--root-dir``),
so that the node serves ``nvidia.com/gpu`` as a GPU Operator node would. See docs/migration.md,
"What the test bed shows".
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Final, TextIO

from e2e import nvmlmock
from e2e.cluster.paths import ClusterPaths
from e2e.cluster.toolchain import ToolBuild, build_tool

VERSION: Final = "v0.19.0"
"""The release pinned in ``e2e/toolchain/nvidia-device-plugin/go.mod`` (v0.19.1's go.sum names a
container-toolkit pseudo-version the checksum database does not know)."""

MODULE: Final = "github.com/NVIDIA/k8s-device-plugin"
BINARY: Final = "nvidia-device-plugin"
KUBELET_SOCKET: Final = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
"""Where the kubelet's device manager listens (fixed in the kubelet, not under --root-dir)."""
GPU_COUNT: Final = 8
"""GPUs of each of go-nvml's mock machines."""

TOOL: Final = ToolBuild(
    name="nvidia-device-plugin",
    outputs=((BINARY, f"{MODULE}/cmd/{BINARY}"),),
    # go-nvml (NVML through dlopen) has no build without cgo.
    cgo=True,
    # What NVIDIA's Makefile sets, so that the start-up log names the release.
    ldflags=f"-s -w -X {MODULE}/internal/info.version={VERSION}",
)


def build(paths: ClusterPaths) -> Path:
    """The directory holding ``nvidia-device-plugin`` (built now unless cached)."""
    # go-nvml's cgo wrappers call functions nvml.h marks deprecated: one warning each.
    return build_tool(paths, TOOL, env={"CGO_CFLAGS": "-O2 -g -Wno-deprecated-declarations"})


class DevicePlugin:
    """NVIDIA's device plugin as a host process serving the mock `machine`'s GPUs to the kubelet
    as ``nvidia.com/gpu``; `start`, then `stop` (SIGTERM: it removes its socket, the kubelet
    marks the GPUs unhealthy and the Node's allocatable drops to 0)."""

    def __init__(self, paths: ClusterPaths, log_path: Path, machine: str = "dgxh100") -> None:
        self._paths = paths
        self._log_path = log_path
        self._machine = machine
        self._process: subprocess.Popen[bytes] | None = None
        self._log: TextIO | None = None
        self._dev_root: Path | None = None

    def start(self) -> None:
        binary = build(self._paths) / BINARY
        library = nvmlmock.build(self._paths)
        self._dev_root = Path(tempfile.mkdtemp(prefix="gpu-dra-device-plugin-"))
        (self._dev_root / "dev").mkdir()
        for minor in range(GPU_COUNT):
            (self._dev_root / "dev" / f"nvidia{minor}").touch()
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": str(library.parent),
            **nvmlmock.environment(machine=self._machine, dev_root=self._dev_root),
        }
        self._log = self._log_path.open("w")
        self._process = subprocess.Popen(
            [
                str(binary),
                "--device-discovery-strategy=nvml",
                f"--dev-root={self._dev_root}",
                f"--kubelet-socket={KUBELET_SOCKET}",
                "--fail-on-init-error=true",
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self._dev_root,
        )

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log(self) -> str:
        return self._log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=30)
        self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._dev_root is not None:
            shutil.rmtree(self._dev_root, ignore_errors=True)
            self._dev_root = None
