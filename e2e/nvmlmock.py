"""The NVML mock library: a ``libnvidia-ml.so.1`` whose GPUs are go-nvml's mock servers.

`build` builds it from ``e2e/toolchain/nvml-mock`` (cached like every test-bed tool) and returns
the library; the ``ENV_*`` variables configure it (`environment` sets them). `mig_cap_minor` and
`mig_minors_file_text` give the real driver's numbering of the MIG capability device nodes
(``/dev/nvidia-caps/nvidia-cap<N>``, ``/proc/driver/nvidia-caps/mig-minors``) that the library
checks for and a fake driver root must provide. `gpu_uuid` is the UUID the library gives a GPU.
`write_config_file` puts the settings beside the library for processes started without them
(OCI hooks); `memory_limits` reads the per-cgroup GPU memory limits a 615 driver
(``ENV_DRIVER``) recorded. See docs/real-nodes.md, "The NVML mock library".
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Final

from e2e.cluster.paths import ClusterPaths
from e2e.cluster.toolchain import (
    TOOLCHAIN,
    ToolBuild,
    build_tool,
    go_env,
    run_go,
    tool_built,
    tool_dir,
)

LIBRARY_NAME: Final = "libnvidia-ml.so.1"

MACHINES: Final = ("dgxa100", "dgxh100", "dgxh200", "dgxb200")
"""go-nvml's mock servers (``pkg/nvml/mock/<machine>``), eight GPUs each."""

ENV_MACHINE: Final = "GPU_DRA_NVML_MOCK_MACHINE"
"""Which mock server (`MACHINES`); may be left out when `ENV_STATE` names an existing file."""
ENV_STATE: Final = "GPU_DRA_NVML_MOCK_STATE"
"""JSON file with the machine, MIG mode, compute mode and MIG instances, shared by every
process using the library; without it the state lives in the process only."""
ENV_DEV_ROOT: Final = "GPU_DRA_NVML_MOCK_DEV_ROOT"
"""Directory holding ``dev/nvidia<minor>`` and ``dev/nvidia-caps/`` (default ``/``)."""
ENV_TRACE: Final = "GPU_DRA_NVML_MOCK_TRACE"
"""When set (any value), every NVML call and its return code is logged to stderr."""
ENV_DRIVER: Final = "GPU_DRA_NVML_MOCK_DRIVER"
"""A driver branch (`DRIVERS`) reported instead of the mock server's, with what it has; unset:
the mock server's driver (550.54.15 or 560.28.03)."""
DRIVERS: Final = {"615": ("615.71.09", 13040)}
"""`ENV_DRIVER` values: (driver version, CUDA driver version). 615 has the per-cgroup GPU memory
limits (``nvmlDeviceSet/GetMemoryLimits_v1``)."""
CONFIG_FILE_NAME: Final = "gpu-dra-nvml-mock.env"
"""The file beside the loaded library holding ``NAME=value`` settings for what the environment
leaves unset (an OCI hook runs with only the variables its spec names)."""

GO_NVML: Final = "github.com/NVIDIA/go-nvml"

TOOL: Final = ToolBuild(
    name="nvml-mock",
    outputs=((LIBRARY_NAME, "."),),
    cgo=True,
    buildmode="c-shared",
    ldflags=f"-s -w -extldflags=-Wl,-soname,{LIBRARY_NAME}",
)

MIG_CAPS_GPUS: Final = 32
"""GPUs in the driver's capability table (gpu0..gpu31), whatever the node has."""
MIG_CAPS_GPU_INSTANCES: Final = 15
"""GPU-instance ids 0..14 per GPU."""
MIG_CAPS_COMPUTE_INSTANCES: Final = 8
"""Compute-instance ids 0..7 per GPU instance."""
_FIRST_MIG_MINOR: Final = 3  # 0: nvlink fabric-mgmt, 1: mig config, 2: mig monitor
_MINORS_PER_GI: Final = 1 + MIG_CAPS_COMPUTE_INSTANCES
_MINORS_PER_GPU: Final = MIG_CAPS_GPU_INSTANCES * _MINORS_PER_GI

_UUID_NAMESPACE: Final = uuid.UUID("6a1e3f0c-2b7d-5c41-9e8a-4d0f5b6c7a21")
"""The library's (e2e/toolchain/nvml-mock/library.go, uuidNamespace)."""


def build(paths: ClusterPaths) -> Path:
    """The built ``libnvidia-ml.so.1`` (built now unless cached).

    The build generates two headers into a scratch include directory: one including go-nvml's
    own ``gen/nvml/nvml.h`` from the module cache (the struct layouts), and weak
    NOT_SUPPORTED definitions of every function it declares (``internal/stubgen``).
    """
    if not tool_built(paths, TOOL):
        module = TOOLCHAIN / TOOL.name
        env = go_env(paths, cgo=True)
        header = nvml_header(paths)
        with tempfile.TemporaryDirectory(prefix="nvml-mock-include-") as include:
            run_go(
                ["go", "run", "./internal/stubgen", "-header", str(header), "-out", include],
                cwd=module,
                env=env,
                what="nvml-mock-stubgen",
                logs=paths.cache / "logs",
            )
            build_tool(
                paths,
                TOOL,
                # go-nvml calls functions nvml.h marks deprecated: one warning each.
                env={"CGO_CFLAGS": f"-O2 -g -Wno-deprecated-declarations -I{include}"},
            )
    return tool_dir(paths, TOOL) / LIBRARY_NAME


def go_nvml_dir(paths: ClusterPaths) -> Path:
    """go-nvml's source in the module cache, at the version ``nvml-mock/go.mod`` pins
    (downloaded now if missing): the mock servers are ``pkg/nvml/mock``."""
    done = subprocess.run(
        ["go", "mod", "download", "-json", GO_NVML],
        cwd=TOOLCHAIN / TOOL.name,
        env=go_env(paths),
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(json.loads(done.stdout)["Dir"])


def nvml_header(paths: ClusterPaths) -> Path:
    """go-nvml's copy of NVIDIA's ``nvml.h`` (as released; ``pkg/nvml/nvml.h`` is edited for
    cgo), whose struct layouts the library follows."""
    return go_nvml_dir(paths) / "gen" / "nvml" / "nvml.h"


def environment(
    *,
    machine: str | None = None,
    state: Path | None = None,
    dev_root: Path | None = None,
    driver: str | None = None,
) -> dict[str, str]:
    """The library's variables for these settings (those left out are not set)."""
    env = {}
    if driver is not None:
        if driver not in DRIVERS:
            raise ValueError(f"{driver!r} is not a driver of the library ({', '.join(DRIVERS)})")
        env[ENV_DRIVER] = driver
    if machine is not None:
        if machine not in MACHINES:
            raise ValueError(f"{machine!r} is not a mock server ({', '.join(MACHINES)})")
        env[ENV_MACHINE] = machine
    if state is not None:
        env[ENV_STATE] = str(state)
    if dev_root is not None:
        env[ENV_DEV_ROOT] = str(dev_root)
    return env


def gpu_uuid(machine: str, index: int) -> str:
    """The UUID the library gives GPU `index` of `machine` (go-nvml's mock draws random ones)."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{machine}/{index}')}"


def mig_cap_minor(gpu_minor: int, gi_id: int, ci_id: int | None = None) -> int:
    """Minor of ``/dev/nvidia-caps/nvidia-cap<N>`` guarding GPU instance `gi_id` of GPU
    `gpu_minor`, or its compute instance `ci_id`, as the real driver numbers them.

    The nvidia-caps driver (open-gpu-kernel-modules ``kernel-open/nvidia/nv-caps.c``) numbers
    one table from 0: nvlink ``fabric-mgmt``, MIG ``config`` (1), ``monitor`` (2), then for each
    GPU 0..31 and each GPU instance 0..14 the GI ``access`` file followed by those of its
    compute instances 0..7: GI = 3 + 135 gpu + 9 gi, CI = GI + 1 + ci.
    """
    if not 0 <= gpu_minor < MIG_CAPS_GPUS:
        raise ValueError(f"GPU minor {gpu_minor} is outside the driver's table (0..31)")
    if not 0 <= gi_id < MIG_CAPS_GPU_INSTANCES:
        raise ValueError(f"GPU instance id {gi_id} is outside 0..14")
    minor = _FIRST_MIG_MINOR + gpu_minor * _MINORS_PER_GPU + gi_id * _MINORS_PER_GI
    if ci_id is None:
        return minor
    if not 0 <= ci_id < MIG_CAPS_COMPUTE_INSTANCES:
        raise ValueError(f"compute instance id {ci_id} is outside 0..7")
    return minor + 1 + ci_id


def mig_minors_file_text(gpu_count: int = MIG_CAPS_GPUS) -> str:
    """``/proc/driver/nvidia-caps/mig-minors`` as the driver writes it (``<name> <minor>`` lines:
    ``config``, ``monitor``, then every ``gpu<m>/gi<g>/access`` and ``gpu<m>/gi<g>/ci<c>/access``).

    The real file always lists all 32 GPUs of the table; a smaller `gpu_count` keeps the first
    ones (the numbering does not change).
    """
    if not 0 <= gpu_count <= MIG_CAPS_GPUS:
        raise ValueError(f"gpu_count {gpu_count} is outside 0..{MIG_CAPS_GPUS}")
    lines = ["config 1", "monitor 2"]
    for gpu in range(gpu_count):
        for gi in range(MIG_CAPS_GPU_INSTANCES):
            lines.append(f"gpu{gpu}/gi{gi}/access {mig_cap_minor(gpu, gi)}")
            for ci in range(MIG_CAPS_COMPUTE_INSTANCES):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {mig_cap_minor(gpu, gi, ci)}")
    return "\n".join(lines) + "\n"


def write_config_file(library_dir: Path, settings: dict[str, str]) -> Path:
    """Write `settings` (`environment`'s variables) as the configuration file beside the library
    in `library_dir`, read by every process that loads the library from there without them in
    its environment; return its path."""
    lines = []
    for name, value in sorted(settings.items()):
        if not name.startswith("GPU_DRA_NVML_MOCK_") or "\n" in value:
            raise ValueError(f"{name}={value!r} is not a setting of the library")
        lines.append(f"{name}={value}\n")
    path = library_dir / CONFIG_FILE_NAME
    path.write_text("".join(lines))
    return path


def memory_limits(state: Path, *, live: bool = True) -> dict[str, dict[str, tuple[int, int]]]:
    """The GPU memory limits the state file records, ``{GPU UUID: {cgroup: (soft, hard)}}`` in
    bytes (GPUs without any left out). `live`: only cgroups that exist now (the library drops a
    removed cgroup's limits, as the driver does, when it next saves the state)."""
    document = json.loads(state.read_text())
    found: dict[str, dict[str, tuple[int, int]]] = {}
    for gpu in document.get("gpus", []):
        for limit in gpu.get("memoryLimits") or []:
            if live and not Path(limit["cgroup"]).is_dir():
                continue
            entry = found.setdefault(gpu["uuid"], {})
            entry[limit["cgroup"]] = (int(limit["softLimit"]), int(limit["hardLimit"]))
    return found
