"""GPUs offered as MPS shares: capacities, request policies, selection, consumed shares."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from gpu_dra.driver.attributes import gpu_device, published_devices
from gpu_dra.driver.config.quantity import parse_quantity
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.model import MigDevice
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.shares import (
    MigShareSelection,
    ShareError,
    ShareSelection,
    ShareSelectionError,
    ShareSize,
    ceiling,
    consumed_share,
    default_share,
    is_partial,
    offered_device,
    share_capacity,
    shareable_memory,
    shared_device_name,
    whole_gpu,
    with_shares,
)
from tests.fakes.gpus import h100

GIB = 2**30
MIB = 2**20

H100 = h100(
    pcie_root=None,
    numa_node=None,
    mig_capable=False,
    memory_bytes=81559 * MIB + 123,  # not a whole MiB
)
SECOND = dataclasses.replace(
    H100,
    index=1,
    minor=5,
    uuid="GPU-b75cda02-62ce-2c30-9150-555ef08935e2",
    pci_bus_id="0000:66:00.0",
)
MIG_MODE = dataclasses.replace(
    H100,
    index=2,
    minor=6,
    uuid="GPU-c75cda02-62ce-2c30-9150-555ef08935e2",
    pci_bus_id="0000:67:00.0",
    mig_enabled=True,
)


def test_offered_gpu_has_memory_rounded_to_mib_and_compute_with_a_quarter_as_defaults():
    assert share_capacity(H100) == {
        "memory": {
            "value": "81559Mi",
            "requestPolicy": {
                "default": "20389Mi",  # 81559Mi / 4, rounded down to whole MiB
                "validRange": {"min": "1Mi", "max": "81559Mi", "step": "1Mi"},
            },
        },
        "compute": {
            "value": "100",
            "requestPolicy": {
                "default": "25",
                "validRange": {"min": "1", "max": "100", "step": "1"},
            },
        },
    }


@pytest.mark.parametrize(
    ("replicas", "memory_mib", "compute"),
    [
        (1, 81559, 100),  # the whole GPU, as before --mps-share-replicas
        (2, 40779, 50),
        (3, 27186, 33),  # rounded down: three of them fit
        (7, 11651, 14),
        (100, 815, 1),
    ],
)
def test_an_unnamed_amount_is_an_equal_part_of_the_device(replicas, memory_mib, compute):
    size = default_share(H100, replicas)
    assert size == ShareSize(memory_mib * MIB, compute)
    assert replicas * size.memory_bytes <= shareable_memory(H100)
    assert replicas * size.compute_percent <= 100
    policies = share_capacity(H100, replicas)
    assert policies["memory"]["requestPolicy"]["default"] == f"{memory_mib}Mi"
    assert policies["compute"]["requestPolicy"]["default"] == str(compute)


@pytest.mark.parametrize("replicas", [0, -1, 101])
def test_replicas_outside_1_to_100_are_refused(replicas):
    with pytest.raises(ValueError, match="--mps-share-replicas must be between 1 and 100"):
        default_share(H100, replicas)


def test_a_tiny_device_still_gets_one_mib_and_one_percent():
    tiny = dataclasses.replace(H100, memory_bytes=3 * MIB)
    assert default_share(tiny, 100) == ShareSize(MIB, 1)


@pytest.mark.parametrize("name", ["memory", "compute"])
def test_request_policies_are_valid_for_the_api(name):
    """resource-api.md §5.1: min <= value, max <= value, default and max multiples of step and
    within the range, min + step <= value."""
    capacity = share_capacity(H100)[name]
    value = parse_quantity(capacity["value"])
    policy = capacity["requestPolicy"]
    limits = policy["validRange"]
    low, high, step = (parse_quantity(limits[k]) for k in ("min", "max", "step"))
    default = parse_quantity(policy["default"])
    assert 0 <= low <= value
    assert high <= value
    assert low + step <= value
    assert default % step == 0
    assert high % step == 0
    assert low <= default <= high
    assert default * 4 <= value  # a request naming no amount consumes a quarter


def test_offered_device_allows_multiple_allocations_and_keeps_attributes():
    published = gpu_device(H100)
    offered = offered_device(published, H100)
    assert offered["allowMultipleAllocations"] is True
    assert offered["attributes"] == published["attributes"]
    assert set(offered["capacity"]) == {"memory", "compute"}
    assert "allowMultipleAllocations" not in published  # the input is not changed


def test_with_shares_changes_only_the_offered_gpus():
    devices = published_devices([H100, SECOND])
    result = with_shares(devices, [SECOND])
    assert result[0] == devices[0]
    assert result[1]["name"] == "gpu-5"
    assert result[1]["allowMultipleAllocations"] is True
    assert with_shares(devices, []) == devices


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("none", ()),
        ("", ()),
        ("all", (H100, SECOND)),  # the MIG-mode GPU is skipped
        ("1", (SECOND,)),
        (f"{SECOND.uuid},0", (H100, SECOND)),
        ("0,0", (H100,)),
    ],
)
def test_selection_picks_gpus_by_index_or_uuid(text, expected):
    assert ShareSelection.parse(text).select([H100, SECOND, MIG_MODE]) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu-0", "neither a GPU index"),
        ("7", "GPU 7, which this node does not have"),
        ("2", "MIG mode"),
        ("GPU-nope", "GPU GPU-nope, which this node does not have"),
    ],
)
def test_selection_errors_say_what_is_wrong(text, message):
    with pytest.raises(ShareSelectionError, match=message):
        ShareSelection.parse(text).select([H100, SECOND, MIG_MODE])


def test_gpus_older_than_volta_are_not_offered():
    pascal = dataclasses.replace(H100, architecture=4, product_name="Tesla P4")
    assert ShareSelection.parse("all").select([pascal, SECOND]) == (SECOND,)
    with pytest.raises(ShareSelectionError, match=r"Tesla P4.*older than Volta"):
        ShareSelection.parse("0").select([pascal])


def test_a_gpu_without_memory_size_cannot_be_offered():
    no_memory = dataclasses.replace(H100, memory_bytes=None)
    assert ShareSelection.parse("all").select([no_memory]) == ()
    with pytest.raises(ShareSelectionError, match="reports no memory size"):
        ShareSelection.parse("0").select([no_memory])


def test_consumed_capacity_is_read_as_a_share():
    size = consumed_share({"memory": "10Gi", "compute": "25"}, H100)
    assert size == ShareSize(10 * GIB, 25)
    assert size.memory_mib == 10240
    assert is_partial(size, H100)
    assert str(size) == "memory 10Gi, compute 25"
    qualified = {"gpu.nvidia.com/memory": "10Gi", "gpu.nvidia.com/compute": "25"}
    assert consumed_share(qualified, H100) == size


def test_whole_gpu_consumption_is_not_a_share():
    assert not is_partial(consumed_share({"memory": "81559Mi", "compute": "100"}, H100), H100)
    assert not is_partial(consumed_share(None, H100), H100)  # capacities not listed: the whole
    assert is_partial(consumed_share({"memory": "81559Mi", "compute": "99"}, H100), H100)


@pytest.mark.parametrize(
    ("consumed", "message"),
    [
        ({"memory": "lots"}, "not a quantity|quantity"),
        ({"memory": "100Gi"}, "between 1Mi and 81559Mi"),
        ({"memory": "1000"}, "whole number of MiB"),
        ({"compute": "0"}, "whole percentage"),
        ({"compute": "2.5"}, "whole percentage"),
    ],
)
def test_unreadable_consumed_capacity_is_an_error(consumed, message):
    with pytest.raises(ShareError, match=message):
        consumed_share(consumed, H100)


def test_ceiling_is_a_percentage_of_memory_and_sms():
    assert ceiling(H100, 100) == ShareSize(81559 * MIB, 100)
    half = ceiling(H100, 50)
    assert half.compute_percent == 50
    assert half.memory_bytes == Fraction(81559 * MIB, 2) // MIB * MIB
    with pytest.raises(ValueError, match=r"1\.\.100"):
        ceiling(H100, 0)


@pytest.mark.parametrize(
    ("consumed", "message"),
    [
        # Each was AttributeError or TypeError before: consumedCapacity is untrusted JSON.
        (["memory"], "consumedCapacity of gpu-4: expected an object of quantities, got an array"),
        ({5: "1Gi"}, "consumedCapacity of gpu-4: capacity names must be strings, got number 5"),
        (
            {"memory": 1073741824},
            "consumedCapacity of gpu-4: memory: expected a quantity string, got number 1073741824",
        ),
        (
            {"compute": None},
            "consumedCapacity of gpu-4: compute: expected a quantity string, got null",
        ),
    ],
)
def test_consumed_capacity_of_another_shape_is_a_share_error(consumed, message):
    with pytest.raises(ShareError) as caught:
        consumed_share(consumed, H100)
    assert str(caught.value) == message


# ---- static MIG devices offered as shares (--mps-shares-on-mig) ------------------------------


def _static_mig() -> tuple[MigDevice, ...]:
    host = SimulatedHost.load("hgx-h100-mig", "node-a")
    return discover_devices(host.nvml, host.pci).mig_devices


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("none", MigShareSelection()),
        ("", MigShareSelection()),
        ("ALL", MigShareSelection(every_device=True)),
        (
            "3g.40gb, 1g.10gb+me,MIG-x,3g.40gb",
            MigShareSelection(profiles=("3g.40gb", "1g.10gb+me"), uuids=("MIG-x",)),
        ),
        ("1c.3g.40gb", MigShareSelection(profiles=("1c.3g.40gb",))),
    ],
)
def test_mig_selection_parses_profiles_and_uuids(text, expected):
    assert MigShareSelection.parse(text) == expected


@pytest.mark.parametrize("text", ["0", "GPU-1", "3g", "big"])
def test_mig_selection_refuses_what_is_neither_profile_nor_mig_uuid(text):
    with pytest.raises(ShareSelectionError, match="neither a MIG profile"):
        MigShareSelection.parse(text)


def test_mig_selection_offers_the_named_profiles_and_uuids_in_publishing_order():
    migs = _static_mig()
    one_me = next(m for m in migs if m.profile == "1g.10gb+me")
    chosen = MigShareSelection.parse(f"3g.40gb,{one_me.uuid}").select(migs)
    assert [m.profile for m in chosen] == ["1g.10gb+me", "3g.40gb", "3g.40gb", "3g.40gb"]
    assert [m.parent.index for m in chosen] == [1, 1, 2, 6]
    assert MigShareSelection(every_device=True).select(migs) == migs
    assert MigShareSelection.parse("2g.35gb").select(migs) == ()  # a fleet profile, not here


def test_mig_selection_skips_partitioned_gpus_and_refuses_naming_their_devices():
    migs = _static_mig()
    parent = migs[0].parent.uuid
    offered = MigShareSelection(every_device=True).select(migs, partitioned={parent})
    assert offered
    assert all(m.parent.uuid != parent for m in offered)
    with pytest.raises(ShareSelectionError, match="--dynamic-mig"):
        MigShareSelection.parse(migs[0].uuid).select(migs, partitioned={parent})
    with pytest.raises(ShareSelectionError, match="does not have"):
        MigShareSelection.parse("MIG-00000000-0000-0000-0000-000000000000").select(migs)


def test_a_mig_share_is_of_the_slice_memory_and_sms():
    mig = next(m for m in _static_mig() if m.profile == "3g.40gb")
    assert shareable_memory(mig) == 40448 * MIB
    assert whole_gpu(mig) == ShareSize(40448 * MIB, 100)
    name = shared_device_name(mig)
    device = with_shares([{"name": name, "capacity": {"memory": {"value": "40448Mi"}}}], [mig])[0]
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"]["memory"]["requestPolicy"]["validRange"]["max"] == "40448Mi"
    size = consumed_share({"memory": "10Gi", "compute": "50"}, mig)
    assert size == ShareSize(10 * 2**30, 50)
    assert is_partial(size, mig)
    assert ceiling(mig, 50) == ShareSize(20224 * MIB, 50)
    with pytest.raises(ShareError, match=f"consumedCapacity of {name}: memory 40449Mi"):
        consumed_share({"memory": "40449Mi", "compute": "50"}, mig)
