"""The desired ResourceSlices of one pool: device order, paging, and the 1.35+ split layout.

Pure: values in, values out. Given a node's devices (already rendered as `resourceapi.Device`) and
the counter sets they consume, `build_pool` decides how the pool is cut into slices. The publisher
(`gpu_dra.controller.publisher`) stamps the pool generation and writes the slices.

Rules (`shared/reference/resource-api.md` §5-6):

- at most 128 devices per slice, at most 64 when any device in the slice has taints or
  consumesCounters;
- shared counters never share a slice with devices (1.35+ "split" layout), at most 8 counter sets
  per slice, counter-set names unique in the pool;
- device names unique in the pool;
- a managed pool always has at least one slice, so an empty pool is published as one slice with no
  devices ("empty pool" is not "no pool").

The output depends only on the input: devices keep the order chosen by `DeviceOrder`, counter sets
are sorted by name, counter slices come before device slices.
"""

from __future__ import annotations

import collections
import copy
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpu_dra.driver.resourceapi import CounterSet, Device, ResourcePool, ResourceSliceSpec

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS = 64
MAX_COUNTER_SETS_PER_SLICE = 8

# Placeholder until the publisher stamps the pool generation it writes.
UNSTAMPED_GENERATION = 0


class DeviceOrder(enum.Enum):
    """How `build_pool` orders devices before paging them into slices."""

    GIVEN = "given"
    """Keep the caller's order (e.g. sorted by PCI bus id, then MIG placement)."""

    BY_NAME = "by-name"
    """Sort by device name."""


class SliceLayoutError(ValueError):
    """The pool's devices or counter sets cannot be published as given."""


@dataclass(frozen=True)
class DesiredPool:
    """The slice specs of one pool, in publishing order.

    `pool.generation` in each spec is `UNSTAMPED_GENERATION`; `pool.resourceSliceCount` is already
    `len(slices)`. Treat the specs as read-only: the publisher copies them before stamping.
    """

    driver: str
    name: str
    node_name: str
    slices: tuple[ResourceSliceSpec, ...]

    @property
    def device_count(self) -> int:
        return sum(len(spec.get("devices", [])) for spec in self.slices)


def build_pool(
    driver: str,
    pool: str,
    node_name: str,
    devices: Iterable[Device],
    counter_sets: Iterable[CounterSet] = (),
    *,
    order: DeviceOrder,
) -> DesiredPool:
    """Cut one node-local pool into slices (see the module docstring for the rules)."""
    ordered = _ordered_devices(devices, order)
    sets = sorted(counter_sets, key=lambda counter_set: counter_set["name"])
    _check_unique("device", [device["name"] for device in ordered], pool)
    _check_unique("counter set", [counter_set["name"] for counter_set in sets], pool)

    counter_pages = [
        sets[start : start + MAX_COUNTER_SETS_PER_SLICE]
        for start in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE)
    ]
    device_pages = page_devices(ordered)
    if not counter_pages and not device_pages:
        device_pages = [[]]
    count = len(counter_pages) + len(device_pages)

    def spec() -> ResourceSliceSpec:
        resource_pool = ResourcePool(
            name=pool, generation=UNSTAMPED_GENERATION, resourceSliceCount=count
        )
        return ResourceSliceSpec(driver=driver, pool=resource_pool, nodeName=node_name)

    slices: list[ResourceSliceSpec] = []
    for counter_page in counter_pages:
        counter_slice = spec()
        counter_slice["sharedCounters"] = copy.deepcopy(counter_page)
        slices.append(counter_slice)
    for device_page in device_pages:
        device_slice = spec()
        device_slice["devices"] = copy.deepcopy(device_page)
        slices.append(device_slice)
    return DesiredPool(driver=driver, name=pool, node_name=node_name, slices=tuple(slices))


def page_devices(devices: Sequence[Device]) -> list[list[Device]]:
    """Split devices, in order, into the fewest consecutive pages the per-slice limits allow.

    A page is closed when the next device would exceed 128 devices, or 64 devices once the page
    holds (or the next device is) a device with taints or consumesCounters.
    """
    pages: list[list[Device]] = []
    page: list[Device] = []
    page_is_limited = False
    for device in devices:
        limited = page_is_limited or has_taints_or_counters(device)
        limit = MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS if limited else MAX_DEVICES_PER_SLICE
        if len(page) + 1 > limit:
            pages.append(page)
            page = []
            limited = has_taints_or_counters(device)
        page.append(device)
        page_is_limited = limited
    if page:
        pages.append(page)
    return pages


def has_taints_or_counters(device: Device) -> bool:
    """Whether the device counts against the lower per-slice limit (1.35+)."""
    return bool(device.get("taints")) or bool(device.get("consumesCounters"))


def _ordered_devices(devices: Iterable[Device], order: DeviceOrder) -> list[Device]:
    if order is DeviceOrder.BY_NAME:
        return sorted(devices, key=lambda device: device["name"])
    return list(devices)


def _check_unique(what: str, names: Sequence[str], pool: str) -> None:
    duplicates = sorted(name for name, times in collections.Counter(names).items() if times > 1)
    if duplicates:
        raise SliceLayoutError(
            f"pool {pool!r}: {what} names must be unique within the pool; "
            f"duplicated: {', '.join(duplicates)}"
        )
