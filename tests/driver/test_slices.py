"""driver.slices: device order, paging at the per-slice limits, split counter layout."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

from gpu_dra.driver.resourceapi import CounterSet, Device
from gpu_dra.driver.slices import (
    MAX_COUNTER_SETS_PER_SLICE,
    UNSTAMPED_GENERATION,
    DeviceOrder,
    SliceLayout,
    SliceLayoutError,
    build_pool,
    layout_for_kubernetes,
    page_devices,
    with_taints,
)

DRIVER = "gpu.example.com"
NODE = "node-a"


def plain(name: str) -> Device:
    return Device(name=name, attributes={"model": {"string": "H100"}})


def tainted(name: str) -> Device:
    return Device(name=name, taints=[{"key": f"{DRIVER}/unhealthy", "effect": "NoSchedule"}])


def partition(name: str, counter_set: str = "gpu-0") -> Device:
    return Device(
        name=name,
        consumesCounters=[{"counterSet": counter_set, "counters": {"memory": {"value": "10Gi"}}}],
    )


def counter_set(name: str) -> CounterSet:
    return CounterSet(name=name, counters={"memory": {"value": "80Gi"}})


def names(devices: list[Device]) -> list[str]:
    return [device["name"] for device in devices]


def test_given_order_is_kept_for_callers_that_sorted_by_pci_bus_id() -> None:
    by_bus_id = [plain("gpu-b"), plain("gpu-a"), plain("gpu-c")]

    built = build_pool(DRIVER, NODE, NODE, by_bus_id, order=DeviceOrder.GIVEN)

    assert names(built.slices[0]["devices"]) == ["gpu-b", "gpu-a", "gpu-c"]


def test_by_name_order_sorts_devices() -> None:
    built = build_pool(
        DRIVER, NODE, NODE, [plain("gpu-b"), plain("gpu-a")], order=DeviceOrder.BY_NAME
    )

    assert names(built.slices[0]["devices"]) == ["gpu-a", "gpu-b"]


def test_plain_devices_are_paged_at_128() -> None:
    devices = [plain(f"gpu-{index}") for index in range(300)]

    built = build_pool(DRIVER, NODE, NODE, devices, order=DeviceOrder.GIVEN)

    assert [len(spec["devices"]) for spec in built.slices] == [128, 128, 44]
    assert [name for spec in built.slices for name in names(spec["devices"])] == names(devices)


@pytest.mark.parametrize("limited", [tainted, partition])
def test_devices_with_taints_or_counters_are_paged_at_64(limited: Callable[[str], Device]) -> None:
    devices = [limited(f"dev-{index}") for index in range(130)]

    assert [len(page) for page in page_devices(devices)] == [64, 64, 2]


def test_a_limited_device_closes_a_page_of_more_than_64_plain_devices() -> None:
    devices = [plain(f"gpu-{index}") for index in range(100)] + [tainted("gpu-100")]
    devices += [plain(f"gpu-{index}") for index in range(101, 200)]

    pages = page_devices(devices)

    assert [len(page) for page in pages] == [100, 64, 36]
    assert pages[1][0]["name"] == "gpu-100"


def test_plain_devices_share_a_page_with_a_limited_one_up_to_64() -> None:
    devices = [plain(f"gpu-{index}") for index in range(30)] + [tainted("gpu-30")]
    devices += [plain(f"gpu-{index}") for index in range(31, 70)]

    assert [len(page) for page in page_devices(devices)] == [64, 6]


def test_counter_sets_get_their_own_slices_before_the_devices() -> None:
    sets = [counter_set(f"gpu-{index}") for index in reversed(range(10))]
    devices = [partition(f"gpu-0-mig-{index}") for index in range(3)]

    built = build_pool(DRIVER, NODE, NODE, devices, sets, order=DeviceOrder.GIVEN)

    counter_slices, device_slices = built.slices[:2], built.slices[2:]
    assert [len(spec["sharedCounters"]) for spec in counter_slices] == [
        MAX_COUNTER_SETS_PER_SLICE,
        2,
    ]
    assert all("devices" not in spec for spec in counter_slices)
    assert all("sharedCounters" not in spec for spec in device_slices)
    assert [s["name"] for spec in counter_slices for s in spec["sharedCounters"]] == sorted(
        f"gpu-{index}" for index in range(10)
    )
    assert names(device_slices[0]["devices"]) == ["gpu-0-mig-0", "gpu-0-mig-1", "gpu-0-mig-2"]


def test_every_slice_names_the_pool_node_and_slice_count() -> None:
    devices = [plain(f"gpu-{index}") for index in range(129)]

    built = build_pool(DRIVER, "pool-a", NODE, devices, [counter_set("c")], order=DeviceOrder.GIVEN)

    assert len(built.slices) == 3
    for spec in built.slices:
        assert spec["driver"] == DRIVER
        assert spec["nodeName"] == NODE
        assert spec["pool"] == {
            "name": "pool-a",
            "generation": UNSTAMPED_GENERATION,
            "resourceSliceCount": 3,
        }


def test_empty_pool_is_one_slice_without_devices() -> None:
    built = build_pool(DRIVER, NODE, NODE, [], order=DeviceOrder.GIVEN)

    assert len(built.slices) == 1
    assert built.slices[0]["devices"] == []
    assert built.device_count == 0


def test_same_input_gives_the_same_slices() -> None:
    devices = [partition(f"mig-{index}") for index in range(70)]
    sets = [counter_set("gpu-1"), counter_set("gpu-0")]

    first = build_pool(DRIVER, NODE, NODE, devices, sets, order=DeviceOrder.BY_NAME)
    second = build_pool(
        DRIVER, NODE, NODE, list(reversed(devices)), list(reversed(sets)), order=DeviceOrder.BY_NAME
    )

    assert first == second


def test_output_does_not_share_dictionaries_with_the_input() -> None:
    devices = [plain("gpu-0")]
    before = copy.deepcopy(devices)

    built = build_pool(DRIVER, NODE, NODE, devices, order=DeviceOrder.GIVEN)
    built.slices[0]["devices"][0]["name"] = "changed"

    assert devices == before


def test_duplicate_device_names_are_refused() -> None:
    with pytest.raises(SliceLayoutError, match="duplicated: gpu-0"):
        build_pool(DRIVER, NODE, NODE, [plain("gpu-0"), plain("gpu-0")], order=DeviceOrder.GIVEN)


def test_duplicate_counter_set_names_are_refused() -> None:
    with pytest.raises(SliceLayoutError, match="counter set"):
        build_pool(
            DRIVER, NODE, NODE, [], [counter_set("c"), counter_set("c")], order=DeviceOrder.GIVEN
        )


def test_combined_layout_puts_each_counter_set_with_its_consumers() -> None:

    devices = [plain("gpu-0"), partition("a", "gpu-1"), partition("b", "gpu-1"), plain("gpu-2")]
    devices += [partition("c", "gpu-3")]
    pool = build_pool(
        DRIVER,
        NODE,
        NODE,
        devices,
        [counter_set("gpu-3"), counter_set("gpu-1"), counter_set("unused")],
        order=DeviceOrder.GIVEN,
        layout=SliceLayout.COMBINED,
    )

    shapes = [
        (
            [c["name"] for c in spec.get("sharedCounters", [])],
            [d["name"] for d in spec.get("devices", [])],
        )
        for spec in pool.slices
    ]
    assert shapes == [
        ([], ["gpu-0", "gpu-2"]),
        (["gpu-1"], ["a", "b"]),
        (["gpu-3"], ["c"]),
        (["unused"], []),
    ]
    assert {spec["pool"]["resourceSliceCount"] for spec in pool.slices} == {4}


def test_combined_layout_refuses_what_kubernetes_1_34_cannot_hold() -> None:

    two_sets = Device(
        name="x",
        consumesCounters=[
            {"counterSet": "gpu-0", "counters": {"memory": {"value": "1"}}},
            {"counterSet": "gpu-1", "counters": {"memory": {"value": "1"}}},
        ],
    )
    sets = [counter_set("gpu-0"), counter_set("gpu-1")]
    with pytest.raises(SliceLayoutError, match="device x consumes counters of 2 counter sets"):
        build_pool(
            DRIVER,
            NODE,
            NODE,
            [two_sets],
            sets,
            order=DeviceOrder.GIVEN,
            layout=SliceLayout.COMBINED,
        )
    with pytest.raises(SliceLayoutError, match=r"counter set.*gpu-9.*does not publish"):
        build_pool(
            DRIVER,
            NODE,
            NODE,
            [partition("y", "gpu-9")],
            sets,
            order=DeviceOrder.GIVEN,
            layout=SliceLayout.COMBINED,
        )
    many = [partition(f"p{i}") for i in range(129)]
    with pytest.raises(SliceLayoutError, match="129 devices"):
        build_pool(
            DRIVER, NODE, NODE, many, sets, order=DeviceOrder.GIVEN, layout=SliceLayout.COMBINED
        )
    wide = CounterSet(name="gpu-0", counters={f"c{i}": {"value": "1"} for i in range(33)})
    with pytest.raises(SliceLayoutError, match="33 counters"):
        build_pool(
            DRIVER,
            NODE,
            NODE,
            [partition("z")],
            [wide],
            order=DeviceOrder.GIVEN,
            layout=SliceLayout.COMBINED,
        )


@pytest.mark.parametrize(
    ("major", "minor", "layout"),
    [
        ("1", "34", SliceLayout.COMBINED),
        ("1", "34+", SliceLayout.COMBINED),
        ("1", "35", SliceLayout.SPLIT),
        ("1", "37", SliceLayout.SPLIT),
        ("2", "0", SliceLayout.SPLIT),
    ],
)
def test_layout_follows_the_apiserver_version(major: str, minor: str, layout: SliceLayout) -> None:
    assert layout_for_kubernetes(major, minor) is layout


def test_unreadable_version_names_the_way_out() -> None:
    with pytest.raises(ValueError, match="set the slice layout explicitly"):
        layout_for_kubernetes("", "x")


LOST = {
    "key": f"{DRIVER}/xid",
    "value": "79",
    "effect": "NoExecute",
    "timeAdded": "2026-07-22T02:24:46Z",
}


def test_taints_are_rendered_into_copies_of_the_named_devices() -> None:
    devices = [plain("gpu-0"), plain("gpu-1")]
    pool = build_pool(
        DRIVER, NODE, NODE, devices, order=DeviceOrder.GIVEN, taints={"gpu-1": [LOST]}
    )
    (spec,) = pool.slices
    assert spec["devices"][1]["taints"] == [LOST]
    assert "taints" not in spec["devices"][0]
    assert "taints" not in devices[1]  # the input is not changed
    spec["devices"][1]["taints"][0]["value"] = "48"
    assert LOST["value"] == "79"


def test_an_empty_taint_list_removes_taints_a_device_had() -> None:
    (untainted,) = with_taints([tainted("gpu-0")], {"gpu-0": []})
    assert "taints" not in untainted


def test_taints_for_a_device_the_pool_does_not_publish_are_refused() -> None:
    with pytest.raises(SliceLayoutError, match="gpu-9"):
        build_pool(
            DRIVER, NODE, NODE, [plain("gpu-0")], order=DeviceOrder.GIVEN, taints={"gpu-9": [LOST]}
        )


def test_a_taint_lowers_the_page_limit_of_its_slice() -> None:
    devices = [plain(f"gpu-{i:03}") for i in range(100)]
    assert len(build_pool(DRIVER, NODE, NODE, devices, order=DeviceOrder.GIVEN).slices) == 1
    pool = build_pool(
        DRIVER, NODE, NODE, devices, order=DeviceOrder.GIVEN, taints={"gpu-000": [LOST]}
    )
    assert [len(spec["devices"]) for spec in pool.slices] == [64, 36]
