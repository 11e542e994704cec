"""NVIDIA's ``nvidia-cdi-hook apply-cuda-memory-limits`` (v1.20.1) on the NVML mock's 615 driver.

runc runs a ``createRuntime`` hook with the OCI state on stdin (the container's PID and bundle)
and only the environment the hook's spec names, in the runtime's mount namespace. The tests do
the same by hand: a "container" is a ``sleep`` in a cgroup v2 leaf of its own (cgroup2 mounted at
``/sys/fs/cgroup`` in a private mount namespace: this host mounts cgroup v1 there), its bundle a
``config.json`` carrying the CDI edits gpu-dra writes for a share. The mock (``GPU_DRA_NVML_MOCK_
DRIVER=615``, settings in the configuration file beside the library, as the hook has no others)
records what the hook set per GPU and cgroup. See docs/shares.md, "How it is tested".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from e2e import nvidiactk, nvmlmock
from gpu_dra.kubelet_plugin.memory_limits import MemoryLimitSupport
from tests.e2e_tools.support import LIBRARY_DIR, REPO, gpu_nodes, library_env

MIB = 1024 * 1024
MACHINE = "dgxh100"
H100_MIB = 81920  # the dgxh100 mock's memory


def _cgroup2_mountable() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return "cgroup2" in Path("/proc/filesystems").read_text()


pytestmark = pytest.mark.skipif(
    not _cgroup2_mountable(), reason="needs root, unshare and cgroup2 (kernel)"
)

# Runs in a private mount namespace: cgroup2 at /sys/fs/cgroup, a leaf cgroup holding a sleep
# (the container), then each step (a command; "oci_state": its stdin is the OCI state of the
# container with that bundle; "in_cgroup": started inside the leaf; "{cgroup}" in an argument is
# the leaf's path), then removes the leaf and runs the "after" steps. Prints one JSON document.
_RUNNER = r"""
import json, os, subprocess, sys
spec = json.loads(sys.argv[1])
subprocess.run(["mount", "-t", "cgroup2", "none", "/sys/fs/cgroup"], check=True)
cgroup = "/sys/fs/cgroup/" + spec["cgroup"]
os.mkdir(cgroup)
result = {"cgroup": cgroup}

def join():
    with open(cgroup + "/cgroup.procs", "w") as procs:
        procs.write(str(os.getpid()))

def run(name, step, pid):
    stdin = None
    if step.get("oci_state"):
        state = {"ociVersion": "1.2.0", "id": "ctr", "status": "creating", "pid": pid,
                 "bundle": step["oci_state"]}
        stdin = json.dumps(state)
    command = [arg.replace("{cgroup}", cgroup) for arg in step["command"]]
    start = join if step.get("in_cgroup") else None
    done = subprocess.run(command, input=stdin, env=step["env"], capture_output=True,
                          text=True, timeout=120, preexec_fn=start)
    result[name] = {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}

container = subprocess.Popen(["sleep", "120"], preexec_fn=join)
try:
    for name, step in spec["steps"]:
        run(name, step, container.pid)
finally:
    container.kill()
    container.wait()
    os.rmdir(cgroup)
for name, step in spec.get("after", []):
    run(name, step, 0)
print(json.dumps(result))
"""


Step = tuple[str, dict[str, Any]]


def in_cgroup(steps: list[Step], after: list[Step] | None = None) -> dict[str, Any]:
    """`_RUNNER`'s result for these steps: per step its exit status and output, and the leaf
    cgroup's path (``cgroup``)."""
    name = f"gpu-dra-test-{uuid.uuid4().hex[:8]}"
    spec = {"cgroup": name, "steps": steps, "after": after or []}
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _RUNNER,
         json.dumps(spec)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.fixture
def root(tmp_path: Path, nvml_mock_library: Path) -> Path:
    """A driver root with the library and every GPU's device node, the mock's settings (the 615
    driver, a state file) in the configuration file beside the library."""
    root = tmp_path / "driver-root"
    (root / LIBRARY_DIR).mkdir(parents=True)
    shutil.copy(nvml_mock_library, root / LIBRARY_DIR / nvmlmock.LIBRARY_NAME)
    gpu_nodes(root, range(8))
    nvmlmock.write_config_file(root / LIBRARY_DIR, settings(root, tmp_path))
    return root


def settings(root: Path, tmp_path: Path, *, driver: str | None = "615") -> dict[str, str]:
    return nvmlmock.environment(
        machine=MACHINE, state=tmp_path / "state.json", dev_root=root, driver=driver
    )


def bundle(tmp_path: Path, env: dict[str, str]) -> Path:
    """An OCI bundle whose process has `env` (as the runtime wrote the CDI edits into it)."""
    directory = tmp_path / "bundle"
    directory.mkdir(exist_ok=True)
    config = {
        "ociVersion": "1.2.0",
        "process": {
            "args": ["sleep"],
            "env": ["PATH=/usr/bin:/bin", *(f"{k}={v}" for k, v in env.items())],
        },
        "root": {"path": "rootfs"},
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def share_hook(
    hook: Path, root: Path, gpu: str, mib: int
) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """gpu-dra's CDI edits of a share of `mib` MiB on `gpu` (`MemoryLimitSupport.edits`): the
    hook's command line, its environment, and the container's variables."""
    support = MemoryLimitSupport(
        hook_path=str(hook), driver_root=str(root), enforced=frozenset({gpu})
    )
    edits = support.edits(gpu, mib)
    (spec_hook,) = edits.hooks
    assert spec_hook.hook_name == "createRuntime"
    env = dict(item.split("=", 1) for item in spec_hook.env)
    return [spec_hook.path, *spec_hook.args[1:]], env, dict(edits.env)


def probe_step(root: Path, *args: str) -> dict[str, Any]:
    """`tests.e2e_tools.nvml_probe` on the library, configured by the file only."""
    return {
        "command": [sys.executable, "-m", "tests.e2e_tools.nvml_probe", str(root), *args],
        "env": library_env() | {"PYTHONPATH": str(REPO)},
    }


def test_the_hook_caps_the_containers_cgroup_at_the_shares_memory(
    root: Path, tmp_path: Path, nvidia_ctk_dir: Path
) -> None:
    gpu = nvmlmock.gpu_uuid(MACHINE, 1)
    command, hook_env, container_env = share_hook(
        nvidia_ctk_dir / nvidiactk.NVIDIA_CDI_HOOK, root, gpu, 20480
    )
    assert container_env == {
        "NVIDIA_GPU_MEMORY_LIMIT": "20480",
        "NVIDIA_GPU_MEMORY_REQUEST": "20480",
    }
    hook = {"command": command, "env": hook_env, "oci_state": str(bundle(tmp_path, container_env))}
    result = in_cgroup(
        [("hook", hook), ("get", probe_step(root, "memory-limits", gpu, "{cgroup}"))],
        after=[("gone", probe_step(root, "memory-limits", gpu, "{cgroup}"))],
    )
    cgroup = result["cgroup"]
    assert result["hook"]["rc"] == 0, result["hook"]["stderr"]
    recorded = nvmlmock.memory_limits(tmp_path / "state.json", live=False)
    assert recorded == {gpu: {cgroup: (20480 * MIB, 20480 * MIB)}}
    assert json.loads(result["get"]["stdout"]) == {
        "driver": "615.71.09",
        "cuda": 13040,
        "get": {"soft": 20480 * MIB, "hard": 20480 * MIB, "used": 0},
    }
    # The cgroup removed: its limits are gone (NVML cannot open it).
    assert json.loads(result["gone"]["stdout"])["get"] == "NVML_ERROR_OPERATING_SYSTEM"
    assert nvmlmock.memory_limits(tmp_path / "state.json") == {}


def hook_step(hook_dir: Path, root: Path, tmp_path: Path, gpu: str, mib: int) -> dict[str, Any]:
    command, hook_env, container_env = share_hook(
        hook_dir / nvidiactk.NVIDIA_CDI_HOOK, root, gpu, mib
    )
    return {"command": command, "env": hook_env, "oci_state": str(bundle(tmp_path, container_env))}


def test_without_the_configuration_file_the_hook_finds_no_driver(
    root: Path, tmp_path: Path, nvidia_ctk_dir: Path
) -> None:
    """runc gives a hook only its spec's environment: the file beside the library is all the
    mock has there (without it, as on a node without a driver, the container would not start)."""
    (root / LIBRARY_DIR / nvmlmock.CONFIG_FILE_NAME).unlink()
    gpu = nvmlmock.gpu_uuid(MACHINE, 0)
    result = in_cgroup([("hook", hook_step(nvidia_ctk_dir, root, tmp_path, gpu, 1024))])
    assert result["hook"]["rc"] != 0
    assert "failed to initialize nvml: Driver Not Loaded" in result["hook"]["stderr"]


def test_before_615_the_hook_fails_the_container(
    root: Path, tmp_path: Path, nvidia_ctk_dir: Path
) -> None:
    """The mock's own driver (550) answers NOT_SUPPORTED: the hook exits non-zero naming the GPU
    (a createRuntime hook's failure stops the container), so gpu-dra must not emit it there."""
    nvmlmock.write_config_file(root / LIBRARY_DIR, settings(root, tmp_path, driver=None))
    gpu = nvmlmock.gpu_uuid(MACHINE, 0)
    result = in_cgroup([("hook", hook_step(nvidia_ctk_dir, root, tmp_path, gpu, 1024))])
    assert result["hook"]["rc"] != 0
    assert (
        f'failed to set memory limits for gpu \\"{gpu}\\": Not Supported'
        in (result["hook"]["stderr"])
    )


def test_a_mig_device_is_refused_as_by_the_driver(
    root: Path, tmp_path: Path, nvidia_ctk_dir: Path
) -> None:
    env = library_env() | {"PYTHONPATH": str(REPO)}
    made = subprocess.run(
        [sys.executable, "-m", "tests.e2e_tools.nvml_probe", str(root), "create", "2", "0", "0"],
        env=env, capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    mig = json.loads(made.stdout.splitlines()[-1])["uuid"]
    # gpu-dra never gives a MIG device the hook; run NVIDIA's with it by hand.
    hook = nvidia_ctk_dir / nvidiactk.NVIDIA_CDI_HOOK
    support = MemoryLimitSupport(hook_path=str(hook), enforced=frozenset({mig}))
    assert support.edits(mig, 1024).is_empty()
    command = [str(hook), "apply-cuda-memory-limits", "--driver-root", str(root), "--gpu-id", mig]
    limit = {"NVIDIA_GPU_MEMORY_LIMIT": "1024"}
    step = {"command": command, "env": {}, "oci_state": str(bundle(tmp_path, limit))}
    result = in_cgroup([("hook", step)])
    assert result["hook"]["rc"] != 0
    assert (
        f'failed to set memory limits for gpu \\"{mig}\\": Not Supported'
        in (result["hook"]["stderr"])
    )
    assert nvmlmock.memory_limits(tmp_path / "state.json", live=False) == {}


def plugin_step(root: Path, hook: Path, gpus: str, mib: int) -> dict[str, Any]:
    """The plugin's start-up detection (`plugin_probe capped-shares`), in the leaf cgroup."""
    command = [sys.executable, "-m", "tests.e2e_tools.plugin_probe", str(root), "capped-shares"]
    return {
        "command": [*command, str(hook), gpus, str(mib)],
        "env": library_env() | {"PYTHONPATH": str(REPO)},
        "in_cgroup": True,
    }


def test_the_plugin_detects_the_615_driver_and_offers_capped_shares(
    root: Path, tmp_path: Path, nvidia_ctk_dir: Path
) -> None:
    hook = nvidia_ctk_dir / nvidiactk.NVIDIA_CDI_HOOK
    result = in_cgroup([("plugin", plugin_step(root, hook, "0,1", 10240))])
    assert result["plugin"]["rc"] == 0, result["plugin"]["stderr"]
    found = json.loads(result["plugin"]["stdout"].splitlines()[-1])
    gpus = [nvmlmock.gpu_uuid(MACHINE, i) for i in (0, 1)]
    assert found["offered"] == gpus
    for gpu in gpus:
        enforcement, why = found["enforcement"][gpu]
        assert enforcement == "driver", why
        assert why == "driver cgroup limit through nvidia-cdi-hook apply-cuda-memory-limits"
    assert found["edits"] == {
        "env": {"NVIDIA_GPU_MEMORY_LIMIT": "10240", "NVIDIA_GPU_MEMORY_REQUEST": "10240"},
        "hooks": [
            {
                "hookName": "createRuntime",
                "path": str(hook),
                "args": ["nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root",
                         str(root), "--gpu-id", gpus[0]],
                "env": ["NVIDIA_CTK_DEBUG=false"],
            }
        ],
    }  # fmt: skip


def test_the_plugin_offers_no_capped_share_before_615(
    root: Path, tmp_path: Path, nvidia_ctk_dir: Path
) -> None:
    nvmlmock.write_config_file(root / LIBRARY_DIR, settings(root, tmp_path, driver=None))
    hook = nvidia_ctk_dir / nvidiactk.NVIDIA_CDI_HOOK
    result = in_cgroup([("plugin", plugin_step(root, hook, "0", 10240))])
    assert result["plugin"]["rc"] == 0, result["plugin"]["stderr"]
    found = json.loads(result["plugin"]["stdout"].splitlines()[-1])
    gpu = nvmlmock.gpu_uuid(MACHINE, 0)
    assert found["offered"] == []
    assert found["enforcement"][gpu] == [
        "mps-client",
        "driver 550.54.15 has no per-cgroup GPU memory limits (branch 615 or newer)",
    ]
