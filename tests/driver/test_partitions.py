"""Dynamic MIG publication: counter sets, partition devices, names, and that the counters let
the scheduler allocate exactly the placements the hardware can hold at once.

Each model is a one-GPU simulated node (gpu-hardware.json geometry). Conflicts are checked with
the scheduler's rule (resource-api.md §5.2): a set of devices fits while, for every counter, the
sum of what they consume stays within the counter set. The simulated NVML is the referee for what
the hardware accepts.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_dra.driver import attributes
from gpu_dra.driver.cel import Selector, compile_selector, to_cel_device
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.mig_policy import DEFAULT, EVERYTHING, MigPolicy, parse_policy
from gpu_dra.driver.model import MigCapableGpu, MigPartition, NodeDevices
from gpu_dra.driver.nvml.interface import NVMLError, NvmlLibrary
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.simulated_profiles import parse_profile
from gpu_dra.driver.partitions import (
    counter_set,
    gpu_partition_devices,
    is_partitionable,
    offered_partitions,
    offers_whole,
    partitioned_node,
)
from gpu_dra.driver.resourceapi import CounterSet, Device

# Per model: MIG mode that makes it partitionable, then the partition names (slug-id-start).
MODELS = {
    "A100-SXM4-40GB": (
        [1, 1],
        ["1g5gb-19"] * 7 + ["1g5gb-me-20"] * 7 + ["1g10gb-15"] * 4 + ["2g10gb-14"] * 3,
        ["3g20gb-9"] * 2 + ["4g20gb-5", "7g40gb-0"],
    ),
    "A100-SXM4-80GB": (
        [1, 1],
        ["1g10gb-19"] * 7 + ["1g10gb-me-20"] * 7 + ["1g20gb-15"] * 4 + ["2g20gb-14"] * 3,
        ["3g40gb-9"] * 2 + ["4g40gb-5", "7g80gb-0"],
    ),
    "A30": (
        [1, 1],
        ["1g6gb-14"] * 4 + ["1g6gb-me-21"] * 4 + ["2g12gb-5"] * 2,
        ["2g12gb-me-6"] * 2 + ["4g24gb-0"],
    ),
    "H100-SXM5-80GB": (
        [0, 0],
        ["1g10gb-19"] * 7 + ["1g10gb-me-20"] * 7 + ["1g20gb-15"] * 4 + ["2g20gb-14"] * 3,
        ["3g40gb-9"] * 2 + ["4g40gb-5", "7g80gb-0"],
    ),
    "H200-141GB": (
        [0, 0],
        ["1g18gb-19"] * 7 + ["1g18gb-me-20"] * 7 + ["1g35gb-15"] * 4 + ["2g35gb-14"] * 3,
        ["3g71gb-9"] * 2 + ["4g71gb-5", "7g141gb-0"],
    ),
}
HOPPER = {"H100-SXM5-80GB", "H200-141GB"}


def host_of(gpus: list[dict[str, object]]) -> SimulatedHost:
    doc = {"driverVersion": "580.65.06", "cudaDriverVersion": 13000, "gpus": gpus}
    return SimulatedHost.from_profile(parse_profile(doc, name="test", node_name="node-a"))


@cache
def one_gpu(model: str) -> tuple[NodeDevices, SimulatedHost]:
    mode = MODELS[model][0]
    host = host_of([{"model": model, "busId": "0000:1b:00.0", "migMode": mode}])
    return discover_devices(host.nvml, host.pci, mig_profiles=True), host


def mig_gpu(model: str) -> MigCapableGpu:
    (found,) = one_gpu(model)[0].mig_profiles
    return found


def devices_by_name(model: str, policy: MigPolicy = EVERYTHING) -> dict[str, Device]:
    return {device["name"]: device for device in gpu_partition_devices(mig_gpu(model), policy)}


def fits(devices: list[Device], shared: CounterSet) -> bool:
    """The scheduler's counter check: the devices' summed consumption stays within the set."""
    available = {name: quantity(c["value"]) for name, c in shared["counters"].items()}
    used: dict[str, int] = {}
    for device in devices:
        for entry in device.get("consumesCounters", []):
            assert entry["counterSet"] == shared["name"]
            for name, counter in entry["counters"].items():
                used[name] = used.get(name, 0) + quantity(counter["value"])
    return all(amount <= available[name] for name, amount in used.items())


def quantity(text: str) -> int:
    for power, suffix in enumerate(("Ki", "Mi", "Gi", "Ti"), start=1):
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * 1024**power
    return int(text)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_placement_of_every_profile_is_a_device(model: str) -> None:
    _, small, large = MODELS[model]
    names = set(devices_by_name(model))
    mig_names = {name for name in names if "-mig-" in name}

    assert len(mig_names) == len(small) + len(large)
    assert {name.rsplit("-", 1)[0].removeprefix("gpu-0-mig-") for name in mig_names} == set(
        small + large
    )
    assert ("gpu-0" in names) is (model in HOPPER)  # an Ampere in MIG mode is not offered whole


def test_names_spell_profile_id_and_placement_start() -> None:
    names = set(devices_by_name("H100-SXM5-80GB"))
    expected = (
        {f"gpu-0-mig-1g10gb-19-{s}" for s in range(7)}
        | {f"gpu-0-mig-1g10gb-me-20-{s}" for s in range(7)}
        | {f"gpu-0-mig-1g20gb-15-{s}" for s in (0, 2, 4, 6)}
        | {f"gpu-0-mig-2g20gb-14-{s}" for s in (0, 2, 4)}
        | {"gpu-0-mig-3g40gb-9-0", "gpu-0-mig-3g40gb-9-4", "gpu-0-mig-4g40gb-5-0"}
        | {"gpu-0-mig-7g80gb-0-0", "gpu-0"}
    )
    assert names == expected
    a30 = set(devices_by_name("A30"))
    assert {"gpu-0-mig-1g6gb-14-3", "gpu-0-mig-2g12gb-me-6-2", "gpu-0-mig-4g24gb-0-0"} <= a30


@pytest.mark.parametrize("model", sorted(MODELS))
def test_counter_set_holds_the_gpus_amounts_of_the_counters_that_can_run_out(model: str) -> None:
    gpu = mig_gpu(model)
    shared = counter_set(gpu, EVERYTHING)
    slices = 4 if model == "A30" else 8
    full = max(gpu.profiles, key=lambda profile: profile.placement_size)

    assert shared["name"] == "gpu-0-counter-set"
    counters = {name: quantity(c["value"]) for name, c in shared["counters"].items()}
    assert [counters.pop(f"memory-slice-{i}") for i in range(slices)] == [1] * slices
    # with every profile, only media engines that the +me slices take can run out before the
    # memory slices do (the single OFA engine everywhere); SMs, copy engines, memory never can
    assert "ofa-engines" in counters
    assert set(counters) <= {"ofa-engines", "decoders", "jpeg-engines", "encoders"}
    maxima = {
        "ofa-engines": full.ofa_engines,
        "decoders": full.decoders,
        "jpeg-engines": full.jpeg_engines,
        "encoders": full.encoders,
    }
    assert counters == {name: maxima[name] for name in counters}
    # without the +me profiles no engine counter is left: memory slices say everything
    plain = counter_set(gpu, parse_policy("1g,2g,3g,4g,7g"))
    assert sorted(plain["counters"]) == [f"memory-slice-{i}" for i in range(slices)]


def test_a_counter_stays_when_the_offered_partitions_can_exceed_it() -> None:
    """A GPU whose 1g slices have more SMs than the GPU has, once packed: the SM counter binds."""
    gpu = mig_gpu("H100-SXM5-80GB")
    small = next(p for p in gpu.profiles if p.name == "1g.10gb")
    greedy = replace(gpu, profiles=(replace(small, multiprocessors=20), *gpu.profiles[1:]))
    shared = counter_set(greedy, parse_policy("1g.10gb"))

    assert quantity(shared["counters"]["multiprocessors"]["value"]) == 132  # 7 x 20 > 132
    assert set(shared["counters"]) == {"multiprocessors"} | {
        f"memory-slice-{i}" for i in range(7)
    }  # a 1g never sits on slice 7: no counter for it


def test_the_go_nvml_mock_h100_numbers_make_decoders_and_memory_binding() -> None:
    """go-nvml's dgxh100 mock: 7g 5 decoders (1 per 1g), 3g spanning 3 of 7 memory slices, round
    GiB. Seven 1g.10gb need 7 decoders; 3g, 1g, 3g fit the slices and need 90 of 80 GiB. So real
    mode on the mock keeps both counters that an H100's own numbers let us leave out."""
    gpu = mig_gpu("H100-SXM5-80GB")
    gib = 1 << 30
    mock = {
        "1g.10gb": {"decoders": 1, "memory_bytes": 10 * gib},
        "2g.20gb": {"decoders": 1, "memory_bytes": 20 * gib},
        "3g.40gb": {"decoders": 2, "memory_bytes": 40 * gib, "placement_size": 3},
        "7g.80gb": {"decoders": 5, "memory_bytes": 80 * gib, "placement_size": 7},
    }
    mock_like = replace(
        gpu, profiles=tuple(replace(p, **mock.get(p.name, {})) for p in gpu.profiles)
    )
    kept = set(counter_set(mock_like, DEFAULT)["counters"])
    assert {"decoders", "memory"} <= kept
    assert not {"decoders", "memory"} & set(counter_set(gpu, DEFAULT)["counters"])
    only_1g = parse_policy("1g.10gb")
    assert "decoders" in counter_set(mock_like, only_1g)["counters"]  # 7 x 1 > 5
    assert "memory" not in counter_set(mock_like, only_1g)["counters"]  # 7 x 10 <= 80 GiB


def test_partition_consumes_the_binding_counters_of_its_profile_and_memory_slices() -> None:
    device = devices_by_name("H100-SXM5-80GB")["gpu-0-mig-3g40gb-9-4"]
    (entry,) = device["consumesCounters"]

    assert entry["counterSet"] == "gpu-0-counter-set"
    assert entry["counters"] == {f"memory-slice-{i}": {"value": "1"} for i in (4, 5, 6, 7)}
    media = devices_by_name("H100-SXM5-80GB")["gpu-0-mig-1g10gb-me-20-3"]
    assert media["consumesCounters"][0]["counters"] == {
        "ofa-engines": {"value": "1"},
        "memory-slice-3": {"value": "1"},
    }
    whole = devices_by_name("H100-SXM5-80GB")["gpu-0"]
    assert (
        whole["consumesCounters"][0]["counters"]
        == counter_set(mig_gpu("H100-SXM5-80GB"), EVERYTHING)["counters"]
    )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_two_partitions_fit_exactly_when_the_hardware_holds_both(model: str) -> None:
    """Every pair of placements: counters allow it iff the simulated NVML creates both."""
    gpu = mig_gpu(model)
    devices = devices_by_name(model)
    shared = counter_set(gpu, EVERYTHING)
    partitions = {name: p for name, p in zip_partitions(gpu)}
    _, host = one_gpu(model)
    nvml = host.nvml
    nvml.init()
    handle = nvml.device_get_handle_by_index(0)
    if not gpu.gpu.mig_enabled:
        nvml.device_set_mig_mode(handle, 1)
    try:
        for a, b in itertools.combinations_with_replacement(sorted(partitions), 2):
            pair = [devices[a], devices[b]] if a != b else [devices[a], devices[a]]
            assert fits(pair, shared) == hardware_holds(
                nvml, handle, partitions[a], partitions[b]
            ), (a, b)
    finally:
        if not gpu.gpu.mig_enabled:
            nvml.device_set_mig_mode(handle, 0)
        nvml.shutdown()


def zip_partitions(gpu: MigCapableGpu) -> list[tuple[str, MigPartition]]:
    by_name = {d["name"] for d in gpu_partition_devices(gpu, EVERYTHING)}
    pairs = [
        (f"gpu-0-mig-{slug(p)}-{p.gi_profile_id}-{p.placement_start}", p) for p in gpu.partitions()
    ]
    assert {name for name, _ in pairs} <= by_name
    return pairs


def slug(partition: MigPartition) -> str:
    return partition.profile_name.replace(".", "").replace("+", "-")


def hardware_holds(nvml: NvmlLibrary, handle: object, a: MigPartition, b: MigPartition) -> bool:
    made = []
    try:
        for partition in (a, b):
            placement = _Placement(partition.placement_start, partition.placement_size)
            made.append(
                nvml.device_create_gpu_instance_with_placement(
                    handle, partition.gi_profile_id, placement
                )
            )
        return True
    except NVMLError:
        return False
    finally:
        for gi in made:
            nvml.gpu_instance_destroy(gi)


@st.composite
def policies_and_picks(draw: st.DrawFn) -> tuple[str, str, list[int]]:
    """A model, a policy of a non-empty subset of its profile names, and a pick order."""
    model = draw(st.sampled_from(sorted(MODELS)))
    names = [profile.name for profile in mig_gpu(model).profiles]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    picks = draw(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=12))
    return model, ",".join(chosen), picks


@settings(deadline=None)
@given(policies_and_picks())
def test_for_every_profile_subset_the_counters_allow_exactly_what_nvml_makes(
    case: tuple[str, str, list[int]],
) -> None:
    """Issue 15: whatever subset of profiles a policy offers, devices picked one after the other
    fit by counters exactly when the simulated NVML makes their GPU instances next to those
    made before (and the whole GPU only alone); every published device is a partition of the
    policy or the whole GPU, and each partition alone can be made."""
    model, text, picks = case
    policy = parse_policy(text)
    gpu = mig_gpu(model)
    devices = devices_by_name(model, policy)
    shared = counter_set(gpu, policy)
    partitions = {
        name: p for name, p in zip_partitions(gpu) if p.profile_name in set(text.split(","))
    }
    assert set(devices) - {"gpu-0"} == set(partitions)
    assert [p.profile_name for p in offered_partitions(gpu, policy)] == [
        p.profile_name for p in partitions.values()
    ]
    names = sorted(devices)
    _, host = one_gpu(model)
    nvml = host.nvml
    nvml.init()
    handle = nvml.device_get_handle_by_index(0)
    if not gpu.gpu.mig_enabled:
        nvml.device_set_mig_mode(handle, 1)
    made: list[object] = []
    chosen: list[str] = []
    try:
        for pick in picks:
            name = names[pick % len(names)]
            if name in chosen:
                continue  # the scheduler never offers an allocated device again
            fits_now = fits([devices[n] for n in [*chosen, name]], shared)
            if name == "gpu-0":
                assert fits_now == (not chosen), (text, chosen, name)
            else:
                made_now = None if "gpu-0" in chosen else try_create(nvml, handle, partitions[name])
                assert fits_now == (made_now is not None), (text, chosen, name)
                if made_now is not None:
                    made.append(made_now)
            if fits_now:
                chosen.append(name)
    finally:
        for gi in made:
            nvml.gpu_instance_destroy(gi)
        if not gpu.gpu.mig_enabled:
            nvml.device_set_mig_mode(handle, 0)
        nvml.shutdown()


def try_create(nvml: NvmlLibrary, handle: object, partition: MigPartition) -> object | None:
    placement = _Placement(partition.placement_start, partition.placement_size)
    try:
        return nvml.device_create_gpu_instance_with_placement(
            handle, partition.gi_profile_id, placement
        )
    except NVMLError:
        return None


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_placement_of_an_offered_profile_is_needed(model: str) -> None:
    """A profile's placements never overlap one another, so the layout of as many instances of
    it as fit uses every one of them: no published placement can be dropped (docs/mig.md)."""
    for profile in mig_gpu(model).profiles:
        starts = profile.placement_starts
        for a, b in itertools.combinations(starts, 2):
            assert abs(a - b) >= profile.placement_size, (profile.name, starts)


def test_the_default_policy_publishes_one_profile_per_compute_slice_count() -> None:
    offered = {
        model: sorted({p.profile_name for p in offered_partitions(mig_gpu(model), DEFAULT)})
        for model in MODELS
    }
    assert offered == {
        "A100-SXM4-40GB": ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
        "A100-SXM4-80GB": ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        "A30": ["1g.6gb", "2g.12gb", "4g.24gb"],  # its full slice
        "H100-SXM5-80GB": ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
        "H200-141GB": ["1g.18gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
    }


def test_a_gpu_the_policy_offers_nothing_on_stays_a_plain_gpu() -> None:
    host = host_of(
        [
            {"model": "H100-SXM5-80GB", "busId": "0000:1b:00.0"},
            {"model": "A100-SXM4-80GB", "busId": "0000:2b:00.0", "migMode": [1, 1]},
        ]
    )
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    node = partitioned_node(
        found.gpus, found.mig_devices, found.mig_profiles, parse_policy("A100=1g,7g")
    )

    assert [c["name"] for c in node.counter_sets] == ["gpu-1-counter-set"]
    assert "consumesCounters" not in next(d for d in node.devices if d["name"] == "gpu-0")
    assert {p.profile_name for p in node.partitions} == {"1g.10gb", "7g.80gb"}


class _Placement:
    def __init__(self, start: int, size: int) -> None:
        self.start = start
        self.size = size


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("H100-SXM5-80GB", [f"1g10gb-19-{s}" for s in range(7)]),
        ("H100-SXM5-80GB", ["1g20gb-15-0", "1g20gb-15-2", "1g20gb-15-4", "1g20gb-15-6"]),
        ("H100-SXM5-80GB", ["2g20gb-14-0", "2g20gb-14-2", "2g20gb-14-4", "1g10gb-me-20-6"]),
        ("H100-SXM5-80GB", ["4g40gb-5-0", "3g40gb-9-4"]),
        ("H200-141GB", ["3g71gb-9-0", "3g71gb-9-4"]),
        ("A100-SXM4-40GB", ["3g20gb-9-0", "2g10gb-14-4", "1g5gb-19-6"]),
        ("A100-SXM4-80GB", ["1g10gb-me-20-0"] + [f"1g10gb-19-{s}" for s in range(1, 7)]),
        ("A30", ["2g12gb-me-6-0", "1g6gb-14-2", "1g6gb-14-3"]),
    ],
)
def test_full_layouts_fit_and_nothing_more(model: str, layout: list[str]) -> None:
    devices = devices_by_name(model)
    shared = counter_set(mig_gpu(model), EVERYTHING)
    chosen = [devices[f"gpu-0-mig-{name}"] for name in layout]

    assert fits(chosen, shared)
    free_slice = [d for n, d in devices.items() if n not in layout and fits([*chosen, d], shared)]
    assert [d["name"] for d in free_slice] == []


@pytest.mark.parametrize("model", sorted(HOPPER))
def test_the_whole_gpu_excludes_every_partition(model: str) -> None:
    devices = devices_by_name(model)
    shared = counter_set(mig_gpu(model), EVERYTHING)
    whole = devices.pop("gpu-0")

    assert fits([whole], shared)
    assert [name for name, device in devices.items() if fits([whole, device], shared)] == []


def test_partition_attributes_are_a_static_mig_devices_without_uuid() -> None:
    """gpu-1 of hgx-h100-mig has a static 3g.40gb at 4; its partition twin publishes the same."""
    host = SimulatedHost.load("hgx-h100-mig", "node-a")
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    (static,) = [
        attributes.mig_device(mig)
        for mig in found.mig_devices
        if attributes.mig_device(mig)["name"] == "gpu-1-mig-3g40gb-9-4"
    ]
    node = partitioned_node(found.gpus, found.mig_devices, found.mig_profiles, EVERYTHING)
    (dynamic,) = [d for d in node.devices if d["name"] == "gpu-1-mig-3g40gb-9-4"]

    static_attributes = dict(static["attributes"])
    assert static_attributes.pop("uuid")["string"].startswith("MIG-")
    assert dynamic["attributes"] == static_attributes
    static_capacity = {k: v for k, v in static["capacity"].items() if "memorySlice" not in k}
    assert dynamic["capacity"] == static_capacity
    # dynamic MIG owns every H100 there: no static device is published next to the partitions
    assert len(node.devices) == 8 * 26
    assert next(p for p in node.partitions if p.parent.minor == 1).parent == found.gpus[1]
    # the default policy (1g, 2g, 3g, 4g, 7g): 7 + 3 + 2 + 1 + 1 partitions and the whole GPU each
    default = partitioned_node(found.gpus, found.mig_devices, found.mig_profiles)
    assert len(default.devices) == 8 * 15
    assert {p.profile_name for p in default.partitions} == {
        "1g.10gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    }


def test_ampere_with_mig_off_stays_a_plain_whole_gpu() -> None:
    host = host_of([{"model": "A100-SXM4-80GB", "busId": "0000:07:00.0", "migMode": [0, 0]}])
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    (gpu,) = found.mig_profiles

    assert not is_partitionable(gpu)
    node = partitioned_node(found.gpus, found.mig_devices, found.mig_profiles)
    assert [d["name"] for d in node.devices] == ["gpu-0"]
    assert "consumesCounters" not in node.devices[0]
    assert node.counter_sets == ()


def test_mixed_node_orders_by_pci_bus_and_keeps_plain_gpus_plain() -> None:
    host = host_of(
        [
            {"model": "L4", "busId": "0000:c1:00.0"},
            {"model": "H100-SXM5-80GB", "busId": "0000:1b:00.0"},
            {"model": "B200", "busId": "0000:0a:00.0"},  # MIG without known profiles
        ]
    )
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    node = partitioned_node(found.gpus, found.mig_devices, found.mig_profiles)
    bus = [d["attributes"][attributes.PCI_BUS_ID]["string"] for d in node.devices]

    assert bus == sorted(bus)
    assert [c["name"] for c in node.counter_sets] == [f"gpu-{found.gpus[1].minor}-counter-set"]
    plain = [d for d in node.devices if "consumesCounters" not in d]
    assert sorted(d["name"] for d in plain) == sorted(
        f"gpu-{g.minor}" for g in found.gpus if g.product_name != found.gpus[1].product_name
    )
    assert offers_whole(found.mig_profiles[0])


ISSUE_10_PROFILE = (
    Path(__file__).resolve().parents[1] / "fakes" / "profiles" / "hgx-h100-mig-unreadable.yaml"
)


def test_mig_on_with_every_profile_query_not_supported_is_a_problem_per_gpu() -> None:
    """Issue 10: the GPUs did not vanish silently; each is a problem naming the return code."""
    host = SimulatedHost.load(str(ISSUE_10_PROFILE), "node-a")
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)

    assert found.gpus == ()
    assert found.mig_profiles == ()
    assert [p.index for p in found.problems] == list(range(8))
    assert {p.call for p in found.problems} == {"nvmlDeviceGetGpuInstanceProfileInfo"}
    assert {p.reason for p in found.problems} == {"NVML_ERROR_NOT_SUPPORTED"}
    assert [p.uuid for p in found.problems] == [gpu.uuid for gpu in host.profile.gpus]


def test_mig_off_with_every_profile_query_not_supported_stays_a_whole_gpu() -> None:
    host = host_of(
        [
            {
                "model": "H100-SXM5-80GB",
                "busId": "0000:1b:00.0",
                "faults": {"device_get_gpu_instance_profile_info": "NOT_SUPPORTED"},
            }
        ]
    )
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    assert found.problems == ()
    assert found.mig_profiles == ()
    node = partitioned_node(found.gpus, found.mig_devices, found.mig_profiles)
    assert [d["name"] for d in node.devices] == ["gpu-0"]


def test_other_profile_query_errors_are_problems_with_mig_on_or_off() -> None:
    host = host_of(
        [
            {
                "model": "H100-SXM5-80GB",
                "busId": f"0000:{0x1B + 0x10 * index:02x}:00.0",
                "migMode": [mode, mode],
                "faults": {call: "UNKNOWN"},
            }
            for index, (mode, call) in enumerate(
                itertools.product(
                    (0, 1),
                    (
                        "device_get_gpu_instance_profile_info",
                        "device_get_gpu_instance_possible_placements",
                    ),
                )
            )
        ]
    )
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    assert found.gpus == ()
    assert [p.call for p in found.problems] == [
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "nvmlDeviceGetGpuInstancePossiblePlacements",
    ] * 2
    assert {p.reason for p in found.problems} == {"NVML_ERROR_UNKNOWN"}


def test_partition_devices_stay_within_the_attribute_limit() -> None:
    for model in MODELS:
        for device in gpu_partition_devices(mig_gpu(model), EVERYTHING):
            attributes.check_limits(device)
            count = len(device.get("attributes", {})) + len(device.get("capacity", {}))
            assert count <= attributes.MAX_ATTRIBUTES_AND_CAPACITIES
            assert len(device.get("consumesCounters", [])) <= 2  # 1.35+ limit
            for entry in device.get("consumesCounters", []):
                assert len(entry["counters"]) <= 32


# ---- the MIG family DeviceClasses on every model's partitions ---------------------------------

DEVICECLASSES = Path(__file__).resolve().parents[2] / "deviceclasses"


def class_selectors(name: str) -> list[Selector]:
    doc = yaml.safe_load((DEVICECLASSES / f"{name}.yaml").read_text())
    return [compile_selector(s["cel"]["expression"]) for s in doc["spec"]["selectors"]]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_family_classes_select_their_compute_slice_count_on_every_model(model: str) -> None:
    devices = gpu_partition_devices(mig_gpu(model), EVERYTHING)
    cel_devices = [(d["name"], to_cel_device("gpu.nvidia.com", d)) for d in devices]
    chosen = {}
    for family in ("1g", "2g", "3g", "4g", "7g"):
        selectors = class_selectors(f"mig-{family}.gpu.nvidia.com")
        chosen[family] = {n for n, d in cel_devices if all(s.matches(d) for s in selectors)}
    expected = {
        family: {
            f"gpu-0-mig-{slug(p)}-{p.gi_profile_id}-{p.placement_start}"
            for p in mig_gpu(model).partitions()
            if p.profile.slice_count == int(family[0])
        }
        for family in chosen
    }

    assert chosen == expected
    assert chosen["1g"]  # every model has small slices
    everything = set().union(*chosen.values())
    mig_class = class_selectors("mig.nvidia.com")
    assert everything == {n for n, d in cel_devices if all(s.matches(d) for s in mig_class)}
