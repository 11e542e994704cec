"""Capped time-sliced shares (issue 16, item 4): the MPS share model on GPUs without MPS.

Publishing only where the driver caps memory per container (`offer_capped`), and the preparer
on the simulated hgx-h100 node with gpu-0 and gpu-1 offered as capped shares, the driver
capping gpu-0 only (a `MemoryLimitSupport` as `memory_limits.detect` returns it), time slices
recorded by `RecordedTimeSlicer`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from gpu_dra.driver import shares
from gpu_dra.driver.discovery import discover_devices, discover_gpus
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.shares import CAPPED, ShareSelection, ShareSelectionError
from gpu_dra.kubelet_plugin.memory_limits import MemoryLimitSupport, ShareMemory
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup import discovery, memory_caps
from gpu_dra.kubelet_plugin.tiers.capped_shares import offer_capped
from gpu_dra.kubelet_plugin.tiers.state import CAPPED_SHARES_STATE_KEY, TIME_SLICE_STATE_KEY
from gpu_dra.kubelet_plugin.time_slicer import RecordedTimeSlicer
from tests.fakes.claim_reader import allocation_result, gpu_config, resource_claim
from tests.kubelet_plugin.nodes import (
    MPS_CLASS_CONFIG,
    NODE,
    UID_A,
    UID_B,
    Node,
    device_env,
    failed,
    mounts,
    ok,
)
from tests.kubelet_plugin.test_prepare_shares import UID_C
from tests.kubelet_plugin.test_prepare_shares import WHOLE_MEMORY as WHOLE

HOOK = "/usr/bin/nvidia-cdi-hook"
CAPPED_CLASS_CONFIG: dict[str, Any] = {
    "source": "FromClass",
    "opaque": {
        "driver": "gpu.nvidia.com",
        "parameters": gpu_config(sharing={"strategy": "TimeSlicing"}),
    },
}


def capped_inventory(selection: str = "0,1") -> NodeInventory:
    host = SimulatedHost.load("hgx-h100", NODE)
    gpus = tuple(discover_gpus(host.nvml, host.pci))
    chosen = ShareSelection.parse(selection, "--capped-shares").select(gpus)
    return NodeInventory(gpus, simulated=True, capped_shares=chosen)


def uuid(inventory: NodeInventory, name: str) -> str:
    gpu = inventory.by_name(name)
    assert gpu is not None
    return gpu.uuid


# ---- publishing ---------------------------------------------------------------------------------


def test_only_gpus_the_driver_caps_are_published_as_capped_shares(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inventory = capped_inventory()
    gpu0, gpu1 = uuid(inventory, "gpu-0"), uuid(inventory, "gpu-1")
    support = MemoryLimitSupport(
        hook_path=HOOK,
        enforced=frozenset({gpu0}),
        reasons={gpu1: "NVML answers NVML_ERROR_NOT_SUPPORTED for memory limits"},
    )
    with caplog.at_level(logging.INFO):
        offered = offer_capped(inventory, support)

    assert [g.uuid for g in offered.capped_shares] == [gpu0]
    devices = {d["name"]: d for d in offered.published_devices()}
    assert devices["gpu-0"]["allowMultipleAllocations"] is True
    assert devices["gpu-0"]["attributes"][CAPPED] == {"bool": True}
    assert devices["gpu-0"]["capacity"]["memory"]["value"] == WHOLE
    assert devices["gpu-0"]["capacity"]["compute"]["value"] == "100"
    for plain in ("gpu-1", "gpu-2"):
        assert "allowMultipleAllocations" not in devices[plain]
        assert CAPPED not in devices[plain]["attributes"]
    assert offered.capped_gpu("gpu-0") is not None
    assert offered.capped_gpu("gpu-1") is None
    assert offered.shared_gpu("gpu-0") is None  # not an MPS share
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"GPU 1 ({gpu1}) is not offered as capped shares" in warning
    assert "NVML_ERROR_NOT_SUPPORTED" in warning


def test_on_a_simulated_node_nothing_is_offered_and_the_reason_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reason = "simulated GPUs: no driver to apply a cgroup limit"
    support = MemoryLimitSupport(default_reason=reason)
    with caplog.at_level(logging.WARNING):
        offered = offer_capped(capped_inventory("0"), support)
    assert offered.capped_shares == ()
    assert all("allowMultipleAllocations" not in d for d in offered.published_devices())
    assert reason in caplog.text


def test_a_gpu_cannot_be_offered_both_as_mps_and_as_capped_shares() -> None:
    inventory = capped_inventory("1")
    with pytest.raises(ShareSelectionError, match="both --mps-shares and --capped-shares"):
        NodeInventory(
            inventory.gpus,
            simulated=True,
            mps_shares=ShareSelection.parse("1").select(inventory.gpus),
            capped_shares=inventory.capped_shares,
        )


def test_the_capped_selection_names_its_flag_in_errors() -> None:
    with pytest.raises(ShareSelectionError, match=r"^--capped-shares: 'x'"):
        ShareSelection.parse("x", "--capped-shares")
    with pytest.raises(ShareSelectionError, match="--capped-shares names GPU 9"):
        capped_inventory("9")


def test_published_capped_device_keeps_the_share_capacities_of_an_mps_one() -> None:
    inventory = capped_inventory("0")
    [gpu] = inventory.capped_shares
    base = {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}
    capped = shares.offered_device(base, gpu, capped=True)
    mps = shares.offered_device(base, gpu)
    assert capped["capacity"] == mps["capacity"]
    assert capped["attributes"] == {**mps["attributes"], CAPPED: {"bool": True}}


# ---- prepare and unprepare ---------------------------------------------------------------------


class CappedNode(Node):
    """gpu-0 and gpu-1 offered as capped shares; the driver caps gpu-0 only."""

    def __init__(self, root: Path) -> None:
        self.reports: list[tuple[ClaimRef, str]] = []
        self.slicer = RecordedTimeSlicer(root / "time-slicing.json")
        super().__init__(root, capped_inventory())

    def preparer_options(self) -> dict[str, Any]:
        support = MemoryLimitSupport(
            hook_path=HOOK,
            driver_root="/run/nvidia/driver",
            enforced=frozenset({self.uuid_of("gpu-0")}),
            default_reason="NVML answers NVML_ERROR_NOT_SUPPORTED",
        )

        def report(claim: ClaimRef, text: str) -> None:
            self.reports.append((claim, text))

        return {
            **super().preparer_options(),
            "time_slicer": self.slicer,
            "capped_share_memory": ShareMemory(support, report),
        }

    def add_share(
        self,
        uid: str,
        memory: str,
        compute: str,
        *,
        device: str = "gpu-0",
        name: str = "share",
        namespace: str = "default",
        configs: tuple[dict[str, Any], ...] = (CAPPED_CLASS_CONFIG,),
    ) -> ClaimRef:
        result = allocation_result(
            device,
            request="share",
            share_id=f"{uid[:8]}-0000-4000-8000-000000000000",
            consumed_capacity={"memory": memory, "compute": compute},
        )
        claim = resource_claim(uid, name, namespace, results=[result], class_configs=list(configs))
        return self.add(claim)

    def calls(self) -> list[dict[str, Any]]:
        return list(self.slicer.read()["calls"])


@pytest.fixture
def node(tmp_path: Path) -> CappedNode:
    return CappedNode(tmp_path)


def test_two_capped_shares_of_one_gpu_get_their_own_driver_cap_and_no_mps(
    node: CappedNode,
) -> None:
    gpu0 = node.uuid_of("gpu-0")
    a = node.add_share(UID_A, "10Gi", "25", name="a", namespace="team-a")
    b = node.add_share(UID_B, "30Gi", "50", name="b", namespace="team-b")
    results = node.prepare(a, b)
    for claim in (a, b):
        [device] = ok(results[claim.uid])
        assert device.device_name == "gpu-0"
        assert device.share_id is not None

    for uid, mib in ((UID_A, "10240"), (UID_B, "30720")):
        [device] = node.spec(uid)["devices"]
        env = device_env(device)
        assert (env["NVIDIA_GPU_MEMORY_LIMIT"], env["NVIDIA_GPU_MEMORY_REQUEST"]) == (mib, mib)
        assert not [key for key in env if key.startswith("CUDA_MPS_")]
        assert not [path for path in mounts(device) if path in ("/tmp/nvidia-mps", "/dev/shm")]
        assert device["containerEdits"]["hooks"] == [
            {
                "hookName": "createRuntime",
                "path": HOOK,
                "args": ["nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root",
                         "/run/nvidia/driver", "--gpu-id", gpu0],
                "env": ["NVIDIA_CTK_DEBUG=false"],
            }
        ]  # fmt: skip
        entry = node.checkpoint.get(uid)
        assert entry is not None
        share = entry.state[CAPPED_SHARES_STATE_KEY]["gpu-0"]  # type: ignore[index]
        assert share["uuid"] == gpu0  # type: ignore[index]
        assert entry.state[TIME_SLICE_STATE_KEY] == {gpu0: 0}
    # The GPU is time-sliced (interval Default: the class asks for none), once per claim.
    assert node.slicer.intervals() == {gpu0: 0}
    assert [c["call"] for c in node.calls()] == ["set_interval", "set_interval"]
    assert sorted(claim.uid for claim, _ in node.reports) == sorted([UID_A, UID_B])
    assert all("per container by the driver" in text for _, text in node.reports)
    assert all("no MPS daemon" in text for _, text in node.reports)

    # The interval stays while a share is prepared; the last one resets it.
    assert node.unprepare(a) == {UID_A: None}
    assert [c["call"] for c in node.calls()] == ["set_interval", "set_interval"]
    assert node.unprepare(b) == {UID_B: None}
    assert node.calls()[-1] == {"call": "reset", "uuid": gpu0}
    for uid in (UID_A, UID_B):
        node.assert_nothing_left(uid)


def test_a_time_slice_interval_from_the_claim_config_applies_to_the_gpu(node: CappedNode) -> None:
    gpu0 = node.uuid_of("gpu-0")
    long_slices: dict[str, Any] = {
        "source": "FromClaim",
        "opaque": {
            "driver": "gpu.nvidia.com",
            "parameters": gpu_config(
                sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
            ),
        },
    }
    a = node.add_share(UID_A, "10Gi", "25", configs=(long_slices,))
    ok(node.prepare(a)[UID_A])
    assert node.slicer.intervals() == {gpu0: 3}
    # Another share asking a different interval of the same GPU is refused: one GPU, one slice.
    b = node.add_share(UID_B, "10Gi", "25", name="b")
    error = failed(node.prepare(b)[UID_B])
    assert "already time-sliced with interval Long" in error


def test_whole_gpu_and_shares_exclude_each_other_but_shares_do_not(node: CappedNode) -> None:
    a = node.add_share(UID_A, "10Gi", "25")
    ok(node.prepare(a)[UID_A])
    # All of the GPU without a capped share's config: allocated through a whole-GPU class
    # before those stopped selecting offered GPUs.
    whole = node.add_share(UID_B, WHOLE, "100", name="whole", configs=())
    assert "already prepared for claim default/share" in failed(node.prepare(whole)[UID_B])
    c = node.add_share(UID_C, "20Gi", "25", name="c")
    ok(node.prepare(c)[UID_C])


def test_a_capped_share_without_time_slicing_or_without_the_cap_is_refused(
    node: CappedNode,
) -> None:
    mps = node.add_share(UID_A, "10Gi", "25", configs=(MPS_CLASS_CONFIG,))
    error = failed(node.prepare(mps)[UID_A])
    assert "capped share of the GPU" in error
    assert "sharing.strategy MPS" in error
    assert "capped.gpu.nvidia.com" in error
    node.assert_nothing_left(UID_A)
    # gpu-1 is in the inventory (a test that skipped `offer_capped`), but not capped.
    uncapped = node.add_share(UID_B, "10Gi", "25", device="gpu-1", name="uncapped")
    error = failed(node.prepare(uncapped)[UID_B])
    assert "the driver does not cap its memory" in error
    assert "NVML_ERROR_NOT_SUPPORTED" in error
    assert node.calls() == []  # refused before anything was set
    node.assert_nothing_left(UID_B)


def test_after_a_restart_the_shares_stay_shares_and_the_last_one_resets(
    node: CappedNode,
) -> None:
    gpu0 = node.uuid_of("gpu-0")
    a = node.add_share(UID_A, "10Gi", "25")
    b = node.add_share(UID_B, "10Gi", "25", name="b")
    ok(node.prepare(a)[UID_A])
    ok(node.prepare(b)[UID_B])
    node.restart()
    node.recover()
    # Still two shares, not two whole-GPU holds: a third share joins, a whole hold does not.
    c = node.add_share(UID_C, "10Gi", "25", name="c")
    ok(node.prepare(c)[UID_C])
    assert node.unprepare(a, b) == {UID_A: None, UID_B: None}
    assert node.slicer.intervals() == {gpu0: 0}
    assert all(call["call"] == "set_interval" for call in node.calls())
    assert node.unprepare(c) == {UID_C: None}
    assert node.calls()[-1] == {"call": "reset", "uuid": gpu0}


def test_a_claim_allocated_whole_before_share_only_is_prepared_as_a_whole_gpu(
    node: CappedNode,
) -> None:
    whole = node.add_share(UID_A, WHOLE, "100", name="whole", configs=())
    [device] = ok(node.prepare(whole)[UID_A])
    assert device.device_name == "gpu-0"
    [spec_device] = node.spec(UID_A)["devices"]
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in device_env(spec_device)
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert CAPPED_SHARES_STATE_KEY not in entry.state


def test_all_of_a_capped_gpu_through_the_class_is_a_capped_share(node: CappedNode) -> None:
    # Offered GPUs are share-only: all of it through capped.gpu.nvidia.com is a share too.
    whole = node.add_share(UID_A, WHOLE, "100", name="whole")
    ok(node.prepare(whole)[UID_A])
    [spec_device] = node.spec(UID_A)["devices"]
    assert device_env(spec_device)["NVIDIA_GPU_MEMORY_LIMIT"] == WHOLE.removesuffix("Mi")
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.state[CAPPED_SHARES_STATE_KEY]["gpu-0"]["computePercent"] == 100  # type: ignore[index]


def test_the_plugins_start_up_offers_nothing_on_a_simulated_node(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = KubeletPluginSettings.parse(
        ["--node-name=node-a", "--simulate=hgx-h100", "--capped-shares=0"], {}
    )
    host = SimulatedHost.load("hgx-h100", NODE)
    devices = discover_devices(host.nvml, host.pci)
    inventory = discovery.node_inventory(settings, devices)
    assert [gpu.index for gpu in inventory.capped_shares] == [0]  # selected, not yet checked
    with caplog.at_level(logging.WARNING):
        offered, memory = memory_caps.capped_shares(settings, host.nvml, inventory, None)
    assert offered.capped_shares == ()
    assert memory.support.enforced == frozenset()
    assert "simulated GPUs: no driver to apply a cgroup limit" in caplog.text
    assert "GPU 0 (" in caplog.text
