"""A real-mode node for the e2e tests: gpu-dra's kubelet plugin without ``--simulate``, on a fake
driver root (`e2e.driverroot`) whose ``libnvidia-ml.so.1`` is the NVML mock library built from
NVIDIA's go-nvml mock servers (`e2e.nvmlmock`), with NVIDIA's ``nvidia-cdi-hook``
(`e2e.nvidiactk`) running the CDI specs' hooks.

The mock keeps its GPUs' state (MIG mode, GPU and compute instances) in a file shared by every
process using the library, as the kernel driver is shared on a real node: the plugin changes it,
and workloads' ``nvidia-smi`` read it. Workload pods therefore mount the state's directory
(`workload_volume`) and name the file (`workload_env`): the stand-in for the kernel driver that
containers on a real node reach through their device nodes. Nothing else reaches them but what
the CDI spec gives. See docs/e2e-cluster.md, "Real-mode node".
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from e2e import manifests as m
from e2e import nvidiactk, nvmlmock
from e2e.cluster.paths import ClusterPaths
from e2e.driverroot import DriverRoot, build_driver_root, remove_driver_root
from e2e.kube import Kube, wait_for

BIN = Path(sys.executable).parent
STATE_MOUNT: Final = "/run/gpu-dra-nvml-mock"
"""Where workload pods mount the mock's state directory."""
STATE_FILE: Final = "state.json"
# What a CUDA container's start-up needs, between markers: nvidia-smi -L (and its exit status),
# the loader's cache entries of the driver's libraries, the NVIDIA device nodes; then it waits.
SHOW_DRIVER: Final = (
    "trap 'exit 0' TERM; echo '--- smi'; nvidia-smi -L; echo \"smi-exit=$?\"; "
    "echo '--- ldcache'; ldconfig -p | grep -E 'libcuda|libnvidia-ml|libnvidia-ptxjit'; "
    "echo '--- dev'; ls /dev | grep nvidia; echo '--- end'; sleep 3600 & wait"
)

_VERSION_PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
assert lib.nvmlInit_v2() == 0, "nvmlInit_v2 failed"
buf = ctypes.create_string_buffer(96)
assert lib.nvmlSystemGetDriverVersion(buf, 96) == 0
print(buf.value.decode())
lib.nvmlShutdown()
"""


def mock_driver_version(library: Path, machine: str, driver: str | None = None) -> str:
    """What the NVML mock reports as the driver version for `machine` and `driver`
    (``GPU_DRA_NVML_MOCK_DRIVER``; None: the mock server's), which the fake root's library files
    carry in their names, as a real install does."""
    done = subprocess.run(
        [sys.executable, "-c", _VERSION_PROBE, str(library)],
        env={**nvmlmock.environment(machine=machine, driver=driver), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return done.stdout.strip()


@dataclass(frozen=True)
class RealNode:
    """A fake driver root of `machine` with all its GPUs' device nodes, and the mock's state."""

    root: DriverRoot
    state_dir: Path
    hook: Path
    """Host path of NVIDIA's ``nvidia-cdi-hook`` (built from its Go module)."""
    driver: str | None = None
    """``GPU_DRA_NVML_MOCK_DRIVER`` (``615``: per-cgroup GPU memory limits); None: the mock
    server's driver."""

    @classmethod
    def create(
        cls, paths: ClusterPaths, machine: str = "dgxh100", gpus: int = 8, driver: str | None = None
    ) -> RealNode:
        """The node; with `driver`, the mock's settings are also written beside the root's
        library (`nvmlmock.write_config_file`), for the OCI hooks runc starts without them."""
        library = nvmlmock.build(paths)
        hook = nvidiactk.build(paths) / nvidiactk.NVIDIA_CDI_HOOK
        base = paths.state / "real-node"
        state_dir = base / "nvml-mock"
        if state_dir.exists():
            shutil.rmtree(state_dir)
        state_dir.mkdir(parents=True)
        root = build_driver_root(
            base / "driver-root",
            nvml_library=library,
            machine=machine,
            gpu_minors=range(gpus),
            driver_version=mock_driver_version(library, machine, driver),
            paths=paths,
        )
        node = cls(root, state_dir, hook, driver)
        if driver is not None:
            nvmlmock.write_config_file(root.lib_dir, node.plugin_env())
        return node

    def __str__(self) -> str:
        return f"the real-mode {self.root.machine} node on {self.root.root}"

    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE

    def plugin_args(self) -> list[str]:
        """The plugin's flags in real mode: the driver root (host path = plugin's view here,
        the plugin runs on the host) and the hook."""
        return [f"--driver-root={self.root.root}", f"--nvidia-cdi-hook-path={self.hook}"]

    def plugin_env(self) -> dict[str, str]:
        """The mock's variables for host processes: its machine, state and device-node root
        (the fake root's ``dev``, which holds every GPU's node as a host's ``/dev`` does)."""
        return nvmlmock.environment(
            machine=self.root.machine,
            state=self.state_file,
            dev_root=self.root.root,
            driver=self.driver,
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``gpu-dra <args> --driver-root <root>`` with the mock's variables."""
        return subprocess.run(
            [str(BIN / "gpu-dra"), *args, f"--driver-root={self.root.root}"],
            env={"PATH": "/usr/bin:/bin", **self.plugin_env()},
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip

    def device_names(self, *, dynamic_mig: bool = False) -> set[str]:
        """What the plugin must publish: ``gpu-dra devices -o json`` on the same root."""
        done = self.cli("devices", "-o", "json", *(["--dynamic-mig"] if dynamic_mig else []))
        if done.returncode != 0:
            raise RuntimeError(f"gpu-dra devices failed ({done.returncode}): {done.stderr}")
        devices: list[dict[str, Any]] = json.loads(done.stdout)
        return {device["name"] for device in devices}

    def mig_instances(self) -> list[dict[str, Any]]:
        """The GPU instances the mock holds now, each with its GPU's UUID (``gpuUUID``)."""
        if not self.state_file.exists():
            return []
        state = json.loads(self.state_file.read_text())
        return [
            {**instance, "gpuUUID": gpu["uuid"]}
            for gpu in state.get("gpus", [])
            for instance in gpu.get("gpuInstances", [])
        ]

    def mig_modes(self) -> dict[str, int]:
        """MIG mode (0 off, 1 on) of every GPU the mock has touched, by UUID."""
        if not self.state_file.exists():
            return {}
        state = json.loads(self.state_file.read_text())
        return {gpu["uuid"]: int(gpu.get("migMode", 0)) for gpu in state.get("gpus", [])}

    def memory_limits(self) -> dict[str, dict[str, tuple[int, int]]]:
        """The GPU memory limits the mock's driver holds now (cgroups that exist), by GPU UUID
        and cgroup path: ``(soft, hard)`` bytes (`nvmlmock.memory_limits`)."""
        if not self.state_file.exists():
            return {}
        return nvmlmock.memory_limits(self.state_file)

    def workload_env(self) -> list[dict[str, str]]:
        """Container ``env`` that points the mock at the shared state (and nothing else)."""
        return [{"name": nvmlmock.ENV_STATE, "value": f"{STATE_MOUNT}/{STATE_FILE}"}]

    def workload_volume(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(volume, volumeMount) of the mock's state directory for a workload pod."""
        volume = {"name": "nvml-mock", "hostPath": {"path": str(self.state_dir)}}
        return volume, {"name": "nvml-mock", "mountPath": STATE_MOUNT}

    def pod(
        self, name: str, namespace: str, claim: str, image: str, command: str = SHOW_DRIVER
    ) -> m.Obj:
        """A pod of `image` (the glibc test image) using `claim`, pointed at the mock's state."""
        volume, mount = self.workload_volume()
        ctr = m.container(command=command, claims=[{"name": "gpu"}])
        ctr.update(image=image, env=self.workload_env(), volumeMounts=[mount])
        pod = m.pod(name, namespace, [ctr], [{"name": "gpu", "resourceClaimName": claim}])
        pod["spec"]["volumes"] = [volume]
        return pod

    def remove(self) -> None:
        remove_driver_root(self.root.root)
        shutil.rmtree(self.state_dir, ignore_errors=True)


def section(log: str, name: str) -> str:
    """What a container printed between ``--- <name>`` and the next marker."""
    return log.split(f"--- {name}\n", 1)[1].split("\n--- ", 1)[0]


def finished_log(kube: Kube, pod: str, namespace: str, timeout: float = 60) -> str:
    """The log of a running pod once it printed ``--- end``."""
    text = ""

    def printed() -> bool:
        nonlocal text
        text = kube.pod_log(pod, namespace)
        return "--- end" in text

    wait_for(f"{namespace}/{pod} to print what it got", printed, timeout)
    return text


def gpu_lines(nvidia_smi_l: str) -> list[str]:
    """The ``GPU <i>: <name> (UUID: GPU-...)`` lines of ``nvidia-smi -L``."""
    return [line for line in nvidia_smi_l.splitlines() if line.startswith("GPU ")]


def uuids(nvidia_smi_l: str, prefix: str = "GPU-") -> list[str]:
    """The UUIDs ``nvidia-smi -L`` lists that start with `prefix` (``GPU-`` or ``MIG-``)."""
    found = []
    for line in nvidia_smi_l.splitlines():
        marker = "(UUID: "
        if marker in line:
            uuid = line.split(marker, 1)[1].rstrip(")").strip()
            if uuid.startswith(prefix):
                found.append(uuid)
    return found
