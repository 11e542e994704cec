"""Per-container GPU memory caps of MPS shares (issue 16, item 3): `memory_limits.detect` decides
per offered GPU whether the driver can cap a container's cgroup (setting, real node, cgroup v2,
the hook's version, the driver branch, NVML's answer on the simulated NVML), and the share tier
puts NVIDIA_GPU_MEMORY_LIMIT / _REQUEST and the createRuntime hook into the share's CDI device,
records and reports which enforcement each share got."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.driver.nvml.interface import NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_NOT_SUPPORTED
from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.nvml.simulated_profiles import load_profile, parse_profile
from gpu_dra.kubelet_plugin.memory_limits import (
    Enforcement,
    MemoryLimitSupport,
    ShareMemory,
    detect,
    hook_version,
    own_cgroup,
)
from gpu_dra.kubelet_plugin.metrics import MpsCollector
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.tiers.state import MEMORY_ENFORCEMENT_KEY, SHARES_STATE_KEY
from tests.kubelet_plugin.nodes import UID_A, UID_B, SharesNode, device_env, ok

HOOK = "/usr/bin/nvidia-cdi-hook"


def nvml_with_driver(version: str, **faults: str) -> SimulatedNvml:
    """Two simulated H100s on driver ``version``; ``faults`` for the second GPU."""
    gpus: list[dict[str, Any]] = [
        {"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0"},
        {"model": "H100-SXM5-80GB", "busId": "00000000:43:00.0", "faults": faults},
    ]
    profile = parse_profile(
        {"driverVersion": version, "cudaDriverVersion": 13040, "gpus": gpus},
        name="driver-" + version,
        node_name="node-a",
    )
    return SimulatedNvml(profile)


def uuids(nvml: SimulatedNvml) -> list[str]:
    nvml.init()
    try:
        return [
            nvml.device_get_uuid(nvml.device_get_handle_by_index(i))
            for i in range(nvml.device_get_count())
        ]
    finally:
        nvml.shutdown()


@pytest.fixture
def cgroup_v2(tmp_path: Path) -> tuple[Path, Path]:
    """A cgroup v2 root and a /proc/self/cgroup naming a pod container's cgroup."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory dmem\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope\n")
    return root, proc


def run_detect(
    nvml: SimulatedNvml,
    cgroup: tuple[Path, Path],
    *,
    version: tuple[int, int, int] | None = (1, 20, 1),
    **options: Any,
) -> MemoryLimitSupport:
    root, proc = cgroup
    asked: list[str] = []

    def version_of(path: str) -> tuple[int, int, int] | None:
        asked.append(path)
        return version

    support = detect(
        nvml,
        uuids(nvml),
        **{
            "mode": "auto",
            "simulated": False,
            "hook_path": HOOK,
            "driver_root": "/run/nvidia/driver",
            "hook_candidates": [Path(HOOK)],
            "cgroup_root": root,
            "proc_self_cgroup": proc,
            "version_of": version_of,
            **options,
        },
    )
    assert not nvml.initialized
    return support


# ---- detection ---------------------------------------------------------------------------------


def test_a_615_driver_with_cgroup_v2_and_a_new_hook_caps_every_share(
    cgroup_v2: tuple[Path, Path],
) -> None:
    nvml = nvml_with_driver("615.71.09")

    support = run_detect(nvml, cgroup_v2)

    assert support.enforced == frozenset(uuids(nvml))
    assert {support.enforcement(u) for u in uuids(nvml)} == {Enforcement.DRIVER}
    assert support.why(uuids(nvml)[0]) == "driver cgroup limit through nvidia-cdi-hook " + (
        "apply-cuda-memory-limits"
    )


def test_a_gpu_that_answers_not_supported_is_left_to_mps_alone(
    cgroup_v2: tuple[Path, Path],
) -> None:
    nvml = nvml_with_driver("615.71.09", device_get_memory_limits="NOT_SUPPORTED")
    first, second = uuids(nvml)

    support = run_detect(nvml, cgroup_v2)

    assert support.enforced == {first}
    assert support.enforcement(second) is Enforcement.MPS_CLIENT
    cgroup = "/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope"
    assert support.why(second) == (
        f"NVML answers NVML_ERROR_NOT_SUPPORTED for memory limits of {second} "
        f"({cgroup_v2[0]}{cgroup})"
    )


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        pytest.param(
            {"mode": "off"}, "turned off (--mps-share-memory-limits=off)", id="turned-off"
        ),
        pytest.param(
            {"disabled_hooks": frozenset({"all"})},
            "nvidia-cdi-hook hooks are turned off (--disable-cdi-hooks)",
            id="hooks-off",
        ),
        pytest.param(
            {"simulated": True}, "simulated GPUs: no driver to apply a cgroup limit", id="sim"
        ),
        pytest.param(
            {"version": None},
            f"{HOOK} cannot be run from the plugin to check it has apply-cuda-memory-limits "
            f"(seen at: {HOOK})",
            id="hook-not-runnable",
        ),
        pytest.param(
            {"version": (1, 20, 0)},
            f"{HOOK} is version 1.20.0; apply-cuda-memory-limits needs NVIDIA container "
            "toolkit 1.20.1 or newer",
            id="hook-too-old",
        ),
    ],
)
def test_no_share_is_capped_by_the_driver_when(
    cgroup_v2: tuple[Path, Path], setup: dict[str, Any], reason: str
) -> None:
    nvml = nvml_with_driver("615.71.09")

    support = run_detect(nvml, cgroup_v2, **setup)

    assert support.enforced == frozenset()
    assert [support.why(u) for u in uuids(nvml)] == [reason, reason]


def test_an_older_driver_caps_nothing(cgroup_v2: tuple[Path, Path]) -> None:
    nvml = SimulatedNvml(load_profile("hgx-h100", "node-a"))  # driver 580.95.05

    support = run_detect(nvml, cgroup_v2)

    assert support.enforced == frozenset()
    assert support.why(uuids(nvml)[0]) == (
        "driver 580.95.05 has no per-cgroup GPU memory limits (branch 615 or newer)"
    )


def test_a_library_without_the_function_caps_nothing(cgroup_v2: tuple[Path, Path]) -> None:
    nvml = nvml_with_driver("615.71.09")
    nvml.set_fault("device_get_memory_limits", NVML_ERROR_FUNCTION_NOT_FOUND, gpu=0)

    support = run_detect(nvml, cgroup_v2)

    assert support.enforced == frozenset()
    assert support.why(uuids(nvml)[1]) == (
        "driver 615.71.09's NVML has no nvmlDeviceGetMemoryLimits_v1"
    )


def test_cgroup_v1_caps_nothing(cgroup_v2: tuple[Path, Path]) -> None:
    root, _ = cgroup_v2
    (root / "cgroup.controllers").unlink()
    nvml = nvml_with_driver("615.71.09")

    support = run_detect(nvml, cgroup_v2)

    assert support.why(uuids(nvml)[0]) == (
        f"{root} is not cgroup v2 (the driver limits cgroup v2 only)"
    )


def test_no_gpu_offered_asks_nothing(cgroup_v2: tuple[Path, Path]) -> None:
    nvml = nvml_with_driver("615.71.09")
    nvml.set_fault("init", NVML_ERROR_NOT_SUPPORTED)

    support = detect(
        nvml, [], mode="auto", simulated=False, hook_path=HOOK, driver_root="/",
        hook_candidates=[],
    )  # fmt: skip

    assert support.enforced == frozenset()


def test_the_own_cgroup_is_the_v2_line_under_the_cgroup_root(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/legacy\n0::/system.slice/kubelet.service\n")
    assert own_cgroup(proc, Path("/sys/fs/cgroup")) == "/sys/fs/cgroup/system.slice/kubelet.service"
    proc.write_text("0::/\n")
    assert own_cgroup(proc, Path("/sys/fs/cgroup")) == "/sys/fs/cgroup"
    proc.write_text("12:memory:/legacy\n")
    assert own_cgroup(proc, Path("/sys/fs/cgroup")) is None


def executable(path: Path, script: str) -> str:
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_the_hook_version_is_read_from_its_version_flag(tmp_path: Path) -> None:
    new = executable(tmp_path / "new", 'echo "NVIDIA CDI Hook version 1.20.1"; echo "commit: 0"')
    failing = executable(tmp_path / "failing", 'echo "version 1.20.1"; exit 3')
    silent = executable(tmp_path / "silent", "true")

    assert hook_version(new) == (1, 20, 1)
    assert hook_version(failing) is None
    assert hook_version(silent) is None
    assert hook_version(str(tmp_path / "missing")) is None


# ---- CDI edits ---------------------------------------------------------------------------------


def test_an_enforced_share_gets_both_variables_and_the_create_runtime_hook() -> None:
    gpu = "GPU-11111111-2222-3333-4444-555555555555"
    support = MemoryLimitSupport(
        hook_path=HOOK, driver_root="/run/nvidia/driver", enforced=frozenset({gpu})
    )

    edits = support.edits(gpu, 10240)

    assert dict(edits.env) == {
        "NVIDIA_GPU_MEMORY_LIMIT": "10240",
        "NVIDIA_GPU_MEMORY_REQUEST": "10240",
    }
    [hook] = edits.hooks
    assert (hook.hook_name, hook.path) == ("createRuntime", HOOK)
    assert hook.args == (
        "nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root", "/run/nvidia/driver",
        "--gpu-id", gpu,
    )  # fmt: skip
    assert support.edits("GPU-99999999-2222-3333-4444-555555555555", 10240).is_empty()
    ctk = MemoryLimitSupport(hook_path="/usr/bin/nvidia-ctk", enforced=frozenset({gpu}))
    assert ctk.edits(gpu, 1).hooks[0].args[:3] == ("nvidia-ctk", "hook", "apply-cuda-memory-limits")
    with pytest.raises(ValueError, match="positive"):
        support.edits(gpu, 0)


# ---- the share tier ----------------------------------------------------------------------------


class CappedNode(SharesNode):
    """`SharesNode` whose gpu-0 the driver caps (gpu-1 not), reporting to ``reports``."""

    def __init__(self, root: Path, mps_root: Path) -> None:
        self.reports: list[tuple[ClaimRef, str]] = []
        super().__init__(root, mps_root)

    def preparer_options(self) -> dict[str, Any]:
        gpu0 = self.inventory.by_name("gpu-0")
        assert gpu0 is not None
        support = MemoryLimitSupport(
            hook_path=HOOK,
            driver_root="/",
            enforced=frozenset({gpu0.uuid}),
            default_reason="NVML answers NVML_ERROR_NOT_SUPPORTED",
        )

        def report(claim: ClaimRef, text: str) -> None:
            self.reports.append((claim, text))

        return {**super().preparer_options(), "mps_share_memory": ShareMemory(support, report)}


def test_each_share_gets_the_enforcement_its_gpu_has_recorded_and_reported(
    tmp_path: Path, mps_root: Path
) -> None:
    node = CappedNode(tmp_path, mps_root)
    capped = node.add_share(UID_A, "10Gi", "10", device="gpu-0", name="capped")
    mps_only = node.add_share(UID_B, "20Gi", "20", device="gpu-1", name="mps-only")
    ok(node.prepare(capped)[UID_A])
    ok(node.prepare(mps_only)[UID_B])
    gpu0, gpu1 = node.uuid_of("gpu-0"), node.uuid_of("gpu-1")

    [device] = node.spec(UID_A)["devices"]
    env = device_env(device)
    assert (env["NVIDIA_GPU_MEMORY_LIMIT"], env["NVIDIA_GPU_MEMORY_REQUEST"]) == ("10240", "10240")
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{gpu0}=10240M"  # the second layer
    assert device["containerEdits"]["hooks"] == [
        {
            "hookName": "createRuntime",
            "path": HOOK,
            "args": ["nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root", "/",
                     "--gpu-id", gpu0],
            "env": ["NVIDIA_CTK_DEBUG=false"],
        }
    ]  # fmt: skip
    [other] = node.spec(UID_B)["devices"]
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in device_env(other)
    assert "hooks" not in other["containerEdits"]

    def recorded(uid: str) -> str:
        entry = node.checkpoint.get(uid)
        assert entry is not None
        shares = entry.state[SHARES_STATE_KEY]
        assert isinstance(shares, dict)
        value = next(iter(shares.values()))
        assert isinstance(value, dict)
        return str(value[MEMORY_ENFORCEMENT_KEY])

    assert (recorded(UID_A), recorded(UID_B)) == ("driver", "mps-client")
    assert [(claim.uid, "per container by the driver" in text) for claim, text in node.reports] == [
        (UID_A, True),
        (UID_B, False),
    ]
    assert "not by the driver: NVML answers NVML_ERROR_NOT_SUPPORTED" in node.reports[1][1]

    registry = CollectorRegistry()
    registry.register(MpsCollector("node-a", node.checkpoint.all))
    samples = {
        (s.labels["claim"], s.labels["gpu"], s.labels["enforcement"]): s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == "gpu_dra_mps_share_memory_enforcement"
    }
    assert samples == {
        ("default/capped", gpu0, "driver"): 1.0,
        ("default/mps-only", gpu1, "mps-client"): 1.0,
    }
    node.unprepare(capped, mps_only)
    assert node.running() == []
