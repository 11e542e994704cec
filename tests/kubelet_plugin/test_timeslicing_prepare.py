"""Time-slicing in the whole-GPU preparer, NVIDIA-compatible (``nvidia-compat.md`` §8): the
recorded fake `TimeSlicer` (its JSON record shows what ``nvidia-smi`` would have been told), the
real checkpoint and CDI store, GPUs of the simulated hgx-h100 node; MPS conflicts run the real
daemon manager with the ``nvidia-cuda-mps-control`` test double.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Any

import pytest

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice
from gpu_dra.kubelet_plugin.tiers.state import TIME_SLICE_STATE_KEY, time_slices_from_state
from gpu_dra.kubelet_plugin.time_slicer import RecordedTimeSlicer, TimeSlicingError
from tests.fakes.claim_reader import allocation_result, gpu_config, opaque_config, resource_claim
from tests.kubelet_plugin.nodes import (
    NODE,
    UID_A,
    UID_B,
    UID_C,
    MpsNode,
    failed,
    ok,
)

INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


class FlakySlicer(RecordedTimeSlicer):
    """The fake, whose commands fail (retryably) for the GPUs in ``failing``."""

    def __init__(self, path: Path, failing: set[str]) -> None:
        super().__init__(path)
        self.failing = failing

    def set_interval(self, uuid: str, interval: int) -> None:
        if uuid in self.failing:
            raise TimeSlicingError(
                f"nvidia-smi ... exited with 4: Insufficient Permissions ({uuid})"
            )
        super().set_interval(uuid, interval)

    def reset(self, uuid: str) -> None:
        if uuid in self.failing:
            raise TimeSlicingError(
                f"nvidia-smi ... exited with 4: Insufficient Permissions ({uuid})"
            )
        super().reset(uuid)


class TsNode(MpsNode):
    """`MpsNode` whose preparer also has the recorded time slicer."""

    def __init__(self, root: Path, inventory: NodeInventory, mps_root: Path) -> None:
        self.not_supported: set[str] = set()
        self.failing: set[str] = set()
        super().__init__(root, inventory, mps_root)

    @property
    def record_path(self) -> Path:
        return self.data_dir / "time-slicing.json"

    def preparer_options(self) -> dict[str, Any]:
        self.slicer = (
            FlakySlicer(self.record_path, self.failing)
            if self.failing
            else RecordedTimeSlicer(self.record_path, not_supported=self.not_supported)
        )
        return {**super().preparer_options(), "time_slicer": self.slicer}

    def add_sliced(
        self,
        claim_uid: str,
        *devices: str,
        interval: str | None = "Long",
        name: str = "claim-a",
        admin_access: bool | None = None,
        slicing_config: dict[str, Any] | None = None,
    ) -> ClaimRef:
        """A claim for ``devices`` (request ``gpu``) with one TimeSlicing config for all."""
        sharing: dict[str, Any] = {"strategy": "TimeSlicing"}
        if slicing_config is not None:
            sharing["timeSlicingConfig"] = slicing_config
        elif interval is not None:
            sharing["timeSlicingConfig"] = {"interval": interval}
        config = opaque_config(gpu_config(sharing=sharing), requests=["gpu"])
        results = [allocation_result(d, admin_access=admin_access) for d in devices]
        return self.add(resource_claim(claim_uid, name, results=results, claim_configs=[config]))

    def intervals(self) -> dict[str, int]:
        return RecordedTimeSlicer(self.record_path).intervals()

    def calls(self) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = RecordedTimeSlicer(self.record_path).read()["calls"]
        return calls

    def applied(self, claim_uid: str) -> dict[str, int]:
        entry = self.checkpoint.get(claim_uid)
        assert entry is not None
        return time_slices_from_state(entry.state)


@pytest.fixture(scope="module")
def inventory() -> NodeInventory:
    host = SimulatedHost.load("hgx-h100", NODE)
    return NodeInventory.from_discovery(discover_devices(host.nvml, host.pci), simulated=True)


@pytest.fixture
def node(tmp_path: Path, inventory: NodeInventory, mps_root: Path) -> TsNode:
    return TsNode(tmp_path, inventory, mps_root)


def mig_node(tmp_path: Path, mps_root: Path) -> TsNode:
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    devices = discover_devices(host.nvml, host.pci)
    return TsNode(tmp_path, NodeInventory.from_discovery(devices, simulated=True), mps_root)


# ---- prepare -------------------------------------------------------------------------------


def test_a_claim_whose_tiers_change_the_node_keeps_a_claim_directory(node: TsNode) -> None:
    # For plugins of the previous version: they would prepare it again without one.
    sliced = node.add_sliced(UID_A, "gpu-0")
    whole = node.add_gpus(UID_B, "claim-b", "gpu-1")

    node.prepare(sliced, whole)

    assert node.claim_dirs() == [UID_A]
    assert list((node.claims_dir / UID_A).iterdir()) == []
    assert stat.S_IMODE((node.claims_dir / UID_A).stat().st_mode) == 0o755
    node.unprepare(sliced)
    node.assert_nothing_left(UID_A)


def test_the_interval_is_applied_to_every_full_gpu_of_the_group(node: TsNode) -> None:
    claim = node.add_sliced(UID_A, "gpu-0", "gpu-1", interval="Long")
    u0, u1 = node.uuid_of("gpu-0"), node.uuid_of("gpu-1")

    devices = ok(node.prepare(claim)[UID_A])

    assert [d.device_name for d in devices] == ["gpu-0", "gpu-1"]
    assert node.intervals() == {u0: 3, u1: 3}
    assert sorted(node.calls(), key=lambda c: c["uuid"]) == sorted(
        [
            {"call": "set_interval", "uuid": u0, "interval": 3},
            {"call": "set_interval", "uuid": u1, "interval": 3},
        ],
        key=lambda c: c["uuid"],
    )
    assert node.applied(UID_A) == {u0: 3, u1: 3}
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_COMPLETED
    assert node.cdi.writes == [UID_A]


@pytest.mark.parametrize(("interval", "value"), INTERVALS.items())
def test_each_interval_maps_to_its_nvidia_smi_value(
    node: TsNode, interval: str, value: int
) -> None:
    claim = node.add_sliced(UID_A, "gpu-2", interval=interval)

    ok(node.prepare(claim)[UID_A])

    assert node.calls() == [
        {"call": "set_interval", "uuid": node.uuid_of("gpu-2"), "interval": value}
    ]


@pytest.mark.parametrize("slicing_config", [None, {}])
def test_an_omitted_interval_is_default(
    node: TsNode, slicing_config: dict[str, Any] | None
) -> None:
    claim = node.add_sliced(UID_A, "gpu-2", interval=None, slicing_config=slicing_config)

    ok(node.prepare(claim)[UID_A])

    assert node.intervals() == {node.uuid_of("gpu-2"): 0}
    assert node.applied(UID_A) == {node.uuid_of("gpu-2"): 0}


def test_only_the_time_slicing_group_is_touched(node: TsNode) -> None:
    sliced = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Medium"}}
    configs = [
        opaque_config(gpu_config(sharing=sliced), requests=["ts"]),
        opaque_config(gpu_config(), requests=["plain"]),
    ]
    results = [
        allocation_result("gpu-3", request="ts"),
        allocation_result("gpu-4", request="plain"),
    ]
    claim = node.add(resource_claim(UID_A, results=results, claim_configs=configs))

    ok(node.prepare(claim)[UID_A])

    assert node.intervals() == {node.uuid_of("gpu-3"): 2}


def test_claims_without_time_slicing_run_nothing(node: TsNode) -> None:
    claim = node.add_gpus(UID_A, "claim-a", "gpu-0")

    ok(node.prepare(claim)[UID_A])
    node.unprepare(claim)

    assert node.calls() == []
    assert not node.record_path.exists()


def test_a_prepared_claim_is_not_applied_again(node: TsNode) -> None:
    claim = node.add_sliced(UID_A, "gpu-0", interval="Short")
    ok(node.prepare(claim)[UID_A])

    ok(node.prepare(claim)[UID_A])

    assert len(node.calls()) == 1


# ---- unprepare, rollback, recover ------------------------------------------------------------


def test_unprepare_resets_to_default_once(node: TsNode) -> None:
    claim = node.add_sliced(UID_A, "gpu-0", "gpu-1", interval="Long")
    ok(node.prepare(claim)[UID_A])

    assert node.unprepare(claim) == {UID_A: None}
    assert node.unprepare(claim) == {UID_A: None}  # unknown now: nothing to do

    u0, u1 = node.uuid_of("gpu-0"), node.uuid_of("gpu-1")
    assert node.intervals() == {u0: 0, u1: 0}
    assert [c["call"] for c in node.calls()] == ["set_interval"] * 2 + ["reset"] * 2
    node.assert_nothing_left(UID_A)


def test_a_later_failure_rolls_the_intervals_back(node: TsNode) -> None:
    node.fail_cdi_writes = True
    node.restart()
    claim = node.add_sliced(UID_A, "gpu-0", "gpu-1", interval="Long")

    error = failed(node.prepare(claim)[UID_A])

    assert "No space left on device" in error
    assert "(will retry)" in error
    assert node.intervals() == {node.uuid_of("gpu-0"): 0, node.uuid_of("gpu-1"): 0}
    node.assert_nothing_left(UID_A)


def test_recover_resets_the_intervals_of_an_interrupted_prepare(node: TsNode) -> None:
    claim = node.add_sliced(UID_A, "gpu-0", interval="Medium")
    ok(node.prepare(claim)[UID_A])
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    # The plugin died after applying the interval, before PrepareCompleted.
    node.checkpoint.put(
        CheckpointEntry(claim=entry.claim, phase=ClaimPhase.PREPARE_STARTED, state=entry.state)
    )

    node.restart()
    node.recover()

    assert node.intervals() == {node.uuid_of("gpu-0"): 0}
    assert node.calls()[-1] == {"call": "reset", "uuid": node.uuid_of("gpu-0")}
    node.assert_nothing_left(UID_A)


def test_recover_keeps_the_intervals_of_prepared_claims(node: TsNode) -> None:
    claim = node.add_sliced(UID_A, "gpu-0", interval="Medium")
    ok(node.prepare(claim)[UID_A])

    node.restart()
    node.recover()

    assert node.intervals() == {node.uuid_of("gpu-0"): 2}
    assert node.applied(UID_A) == {node.uuid_of("gpu-0"): 2}


def test_the_intervals_are_recorded_before_nvidia_smi_runs(node: TsNode) -> None:
    # A setting on the node: the claim's PrepareStarted record, with the devices it prepares
    # (other claims' checks see them held), is on disk before it is changed.
    seen: list[dict[str, int]] = []
    seen_devices: list[tuple[PreparedDevice, ...]] = []
    original = node.slicer.set_interval

    def spying(uuid: str, interval: int) -> None:
        entry = node.checkpoint.get(UID_A)
        assert entry is not None
        assert entry.phase is ClaimPhase.PREPARE_STARTED
        seen.append(dict(entry.state[TIME_SLICE_STATE_KEY]))  # type: ignore[arg-type]
        seen_devices.append(entry.devices)
        original(uuid, interval)

    node.slicer.set_interval = spying  # type: ignore[method-assign]
    claim = node.add_sliced(UID_A, "gpu-0", interval="Short")

    devices = ok(node.prepare(claim)[UID_A])

    assert seen == [{node.uuid_of("gpu-0"): 1}]
    assert seen_devices == [devices]


def test_a_re_prepare_of_an_interrupted_claim_rolls_back_first(node: TsNode) -> None:
    claim = node.add_sliced(UID_A, "gpu-0", interval="Long")
    ok(node.prepare(claim)[UID_A])
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    node.checkpoint.put(
        CheckpointEntry(claim=entry.claim, phase=ClaimPhase.PREPARE_STARTED, state=entry.state)
    )
    node.restart()

    ok(node.prepare(claim)[UID_A])

    assert [c["call"] for c in node.calls()] == ["set_interval", "reset", "set_interval"]
    assert node.intervals() == {node.uuid_of("gpu-0"): 3}


# ---- Not Supported, failures ----------------------------------------------------------------


def test_not_supported_fails_the_claim_clearly_and_leaks_nothing(node: TsNode) -> None:
    u0, u1 = node.uuid_of("gpu-0"), node.uuid_of("gpu-1")
    node.not_supported.add(u1)
    node.restart()
    claim = node.add_sliced(UID_A, "gpu-0", "gpu-1", interval="Long")

    error = failed(node.prepare(claim)[UID_A])

    assert error.startswith(f"claim default/claim-a ({UID_A}): spec.devices.config[0]: ")
    assert (
        f"GPU {u1} (NVIDIA H100 80GB HBM3) does not support time-slice intervals; "
        "remove timeSlicingConfig or use Default" in error
    )
    assert "(will retry)" not in error
    assert node.intervals() == {u0: 0}  # gpu-0 was set, then reset
    node.assert_nothing_left(UID_A)
    assert node.cdi.writes == []
    other = node.add_gpus(UID_B, "claim-b", "gpu-0", "gpu-1")
    ok(node.prepare(other)[UID_B])


def test_default_on_a_gpu_without_time_slice_support_needs_no_change(
    node: TsNode, caplog: pytest.LogCaptureFixture
) -> None:
    u0 = node.uuid_of("gpu-0")
    node.not_supported.add(u0)
    node.restart()
    claim = node.add_sliced(UID_A, "gpu-0", interval="Default")

    with caplog.at_level(logging.WARNING):
        ok(node.prepare(claim)[UID_A])

    assert "does not support time-slice intervals" in caplog.text
    entry = node.checkpoint.get(UID_A)
    assert entry is not None
    assert TIME_SLICE_STATE_KEY not in entry.state
    assert node.unprepare(claim) == {UID_A: None}
    assert [c["call"] for c in node.calls()] == ["set_interval"]  # no reset of nothing


def test_a_failing_nvidia_smi_is_retried_and_leaks_nothing(node: TsNode) -> None:
    node.failing.add(node.uuid_of("gpu-1"))
    node.restart()
    claim = node.add_sliced(UID_A, "gpu-0", "gpu-1", interval="Short")

    error = failed(node.prepare(claim)[UID_A])

    # gpu-1 failed to set, and its reset fails too: the entry stays for the next try.
    assert "Insufficient Permissions" in error
    assert "(will retry)" in error
    assert node.intervals() == {node.uuid_of("gpu-0"): 0}
    node.failing.clear()
    node.restart()
    node.recover()
    node.assert_nothing_left(UID_A)


# ---- MIG -------------------------------------------------------------------------------------


def test_time_slicing_on_mig_devices_is_a_logged_no_op(
    tmp_path: Path,
    mps_root: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = mig_node(tmp_path, mps_root)
    mig = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "MigDeviceConfig",
        "sharing": {"strategy": "TimeSlicing"},
    }
    sliced = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}
    configs = [
        opaque_config(mig, requests=["mig"]),
        opaque_config(gpu_config(sharing=sliced), requests=["gpu"]),
    ]
    results = [
        allocation_result("gpu-0-mig-1g10gb-19-0", request="mig"),
        allocation_result("gpu-7", request="gpu"),
    ]
    claim = node.add(resource_claim(UID_A, results=results, claim_configs=configs))

    with caplog.at_level(logging.INFO):
        ok(node.prepare(claim)[UID_A])

    assert "time-slicing on MIG device gpu-0-mig-1g10gb-19-0 accepted as a no-op" in caplog.text
    assert node.intervals() == {node.uuid_of("gpu-7"): 1}  # the full GPU only
    node.unprepare(claim)
    assert node.intervals() == {node.uuid_of("gpu-7"): 0}


# ---- conflicts -------------------------------------------------------------------------------


def test_a_gpu_time_sliced_by_another_claim_with_another_interval_is_refused(
    node: TsNode,
) -> None:
    first = node.add_sliced(UID_A, "gpu-0", interval="Long")
    ok(node.prepare(first)[UID_A])
    admin = node.add_sliced(UID_B, "gpu-0", interval="Short", name="claim-b", admin_access=True)

    error = failed(node.prepare(admin)[UID_B])

    assert f"is already time-sliced with interval Long by claim default/claim-a ({UID_A})" in error
    assert "this claim asks for Short" in error
    node.assert_nothing_left(UID_B)
    assert node.intervals() == {node.uuid_of("gpu-0"): 3}


def test_the_same_interval_is_shared_and_reset_by_the_last_claim(node: TsNode) -> None:
    u0 = node.uuid_of("gpu-0")
    first = node.add_sliced(UID_A, "gpu-0", interval="Long")
    ok(node.prepare(first)[UID_A])
    admin = node.add_sliced(UID_B, "gpu-0", interval="Long", name="claim-b", admin_access=True)
    ok(node.prepare(admin)[UID_B])

    node.unprepare(first)
    assert node.intervals() == {u0: 3}  # claim-b still has it
    node.unprepare(admin)
    assert node.intervals() == {u0: 0}


def test_mps_and_time_slicing_on_one_gpu_of_one_claim_are_refused(node: TsNode) -> None:
    sliced = {"strategy": "TimeSlicing"}
    configs = [
        opaque_config(gpu_config(sharing=sliced), requests=["a"]),
        opaque_config(gpu_config(sharing={"strategy": "MPS"}), requests=["b"]),
    ]
    results = [allocation_result("gpu-0", request="a"), allocation_result("gpu-0", request="b")]
    claim = node.add(resource_claim(UID_A, results=results, claim_configs=configs))

    error = failed(node.prepare(claim)[UID_A])

    assert "MPS and TimeSlicing cannot both be active on one GPU" in error
    node.assert_nothing_left(UID_A)
    assert node.calls() == []
    assert node.running() == []


def test_time_slicing_a_gpu_served_by_another_claims_mps_daemon_is_refused(
    node: TsNode,
) -> None:
    mps = node.add_mps(UID_A, "gpu-0")
    ok(node.prepare(mps)[UID_A])
    admin = node.add_sliced(UID_B, "gpu-0", name="claim-b", admin_access=True)

    error = failed(node.prepare(admin)[UID_B])

    assert f"runs an MPS daemon of claim default/claim-a ({UID_A})" in error
    assert "MPS and TimeSlicing cannot both be active on one GPU" in error
    node.assert_nothing_left(UID_B)
    assert node.calls() == []
    node.unprepare(mps)
    assert node.running() == []


def test_mps_on_a_gpu_time_sliced_by_another_claim_is_refused(node: TsNode) -> None:
    admin = node.add_sliced(UID_A, "gpu-0", interval="Long", admin_access=True)
    ok(node.prepare(admin)[UID_A])
    mps = node.add_mps(UID_C, "gpu-0", name="claim-c")

    error = failed(node.prepare(mps)[UID_C])

    assert f"is time-sliced by claim default/claim-a ({UID_A})" in error
    assert "MPS and TimeSlicing cannot both be active on one GPU" in error
    node.assert_nothing_left(UID_C)
    assert node.running() == []
    assert node.daemon_dirs() == []


def test_a_gpu_in_two_groups_with_two_intervals_is_refused(node: TsNode) -> None:
    configs = [
        opaque_config(
            gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": i}}),
            requests=[r],
        )
        for r, i in (("a", "Short"), ("b", "Long"))
    ]
    results = [allocation_result("gpu-0", request="a"), allocation_result("gpu-0", request="b")]
    claim = node.add(resource_claim(UID_A, results=results, claim_configs=configs))

    error = failed(node.prepare(claim)[UID_A])

    assert "one GPU has one interval" in error
    node.assert_nothing_left(UID_A)
    assert node.calls() == []
