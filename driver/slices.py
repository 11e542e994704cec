"""The desired ResourceSlices of one pool: device order, paging, and the 1.35+ split layout (pure).

`build_pool` cuts a node's devices and the counter sets they consume into slices (at most 128
devices, 64 with taints or consumesCounters; `SliceLayout.SPLIT`: counter sets in slices of their
own, at most 8 each; `COMBINED` (1.34): each counter set in one slice with its devices). An empty
pool is one slice without devices. The output depends only on the input; the publisher
(`gpu_dra.kubelet_plugin.slices.publisher`) stamps the generation and writes the slices.
Rules: `shared/reference/resource-api.md` §5-6; see docs/architecture.md#slice-publishing.
Device taints (health, `gpu_dra.driver.health`) are given by device name and rendered into
copies of the devices (`with_taints`); they only change the paging limit.
"""

from __future__ import annotations

import collections
import copy
import enum
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpu_dra.driver.resourceapi import (
    CounterSet,
    Device,
    DeviceTaint,
    ResourcePool,
    ResourceSliceSpec,
)

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS = 64
MAX_COUNTER_SETS_PER_SLICE = 8
# Kubernetes 1.34 (combined layout): per slice, counters summed over its counter sets, and
# device-counter entries (counters consumed, summed over its devices).
MAX_COUNTERS_PER_COMBINED_SLICE = 32
MAX_CONSUMED_COUNTERS_PER_COMBINED_SLICE = 1024

# Placeholder until the publisher stamps the pool generation it writes.
UNSTAMPED_GENERATION = 0


class DeviceOrder(enum.Enum):
    """How `build_pool` orders devices before paging them into slices."""

    GIVEN = "given"
    """Keep the caller's order (e.g. sorted by PCI bus id, then MIG placement)."""

    BY_NAME = "by-name"
    """Sort by device name."""


class SliceLayout(enum.Enum):
    """Where shared counters go (resource-api.md §5.2); the apiserver accepts only one."""

    SPLIT = "split"
    """Kubernetes 1.35+: counter sets in slices of their own, devices in other slices."""

    COMBINED = "combined"
    """Kubernetes 1.34: each counter set in one slice with the devices that consume it."""


def layout_for_kubernetes(major: str, minor: str) -> SliceLayout:
    """The layout the apiserver of version `major`.`minor` (``/version`` fields) accepts.

    Vendor builds decorate the minor (``35+``); only its leading digits count. Versions before
    1.35 get `SliceLayout.COMBINED`, later ones `SliceLayout.SPLIT`.
    """
    digits = "".join(itertools.takewhile(str.isdigit, minor.strip()))
    if not major.strip().isdigit() or not digits:
        raise ValueError(
            f"cannot read a Kubernetes version from major {major!r}, minor {minor!r}; "
            "set the slice layout explicitly"
        )
    return SliceLayout.COMBINED if (int(major), int(digits)) < (1, 35) else SliceLayout.SPLIT


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
    layout: SliceLayout = SliceLayout.SPLIT,
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
) -> DesiredPool:
    """Cut one node-local pool into slices (see the module docstring for the rules); the
    devices named in `taints` get those taints (`with_taints`)."""
    if taints:
        devices = with_taints(devices, taints, pool)
    ordered = _ordered_devices(devices, order)
    sets = sorted(counter_sets, key=lambda counter_set: counter_set["name"])
    _check_unique("device", [device["name"] for device in ordered], pool)
    _check_unique("counter set", [counter_set["name"] for counter_set in sets], pool)
    if layout is SliceLayout.COMBINED:
        return _combined_pool(driver, pool, node_name, ordered, sets)

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


def _combined_pool(
    driver: str, pool: str, node_name: str, devices: list[Device], sets: list[CounterSet]
) -> DesiredPool:
    """The 1.34 layout: one slice per counter set with its consumers, other devices paged."""
    by_name = {counter_set["name"]: counter_set for counter_set in sets}
    groups: dict[str | None, list[Device]] = {}
    for device in devices:
        consumed = {entry["counterSet"] for entry in device.get("consumesCounters", [])}
        unknown = sorted(consumed - by_name.keys())
        if unknown:
            raise SliceLayoutError(
                f"pool {pool!r}: device {device['name']} consumes counter set(s) "
                f"{', '.join(unknown)}, which the pool does not publish"
            )
        if len(consumed) > 1:
            raise SliceLayoutError(
                f"pool {pool!r}: device {device['name']} consumes counters of "
                f"{len(consumed)} counter sets; the combined (Kubernetes 1.34) layout puts each "
                "counter set in one slice with its devices, so a device may use only one"
            )
        groups.setdefault(consumed.pop() if consumed else None, []).append(device)
    for set_name in by_name:
        groups.setdefault(set_name, [])

    contents: list[tuple[CounterSet | None, list[Device]]] = []
    for group, members in groups.items():
        if group is None:
            contents.extend((None, page) for page in page_devices(members))
            continue
        _check_combined_limits(pool, by_name[group], members)
        contents.append((by_name[group], members))
    if not contents:
        contents = [(None, [])]

    resource_pool = ResourcePool(
        name=pool, generation=UNSTAMPED_GENERATION, resourceSliceCount=len(contents)
    )
    slices: list[ResourceSliceSpec] = []
    for shared, members in contents:
        spec = ResourceSliceSpec(
            driver=driver, pool=copy.deepcopy(resource_pool), nodeName=node_name
        )
        if shared is not None:
            spec["sharedCounters"] = [copy.deepcopy(shared)]
        spec["devices"] = copy.deepcopy(members)
        slices.append(spec)
    return DesiredPool(driver=driver, name=pool, node_name=node_name, slices=tuple(slices))


def _check_combined_limits(pool: str, counter_set: CounterSet, devices: list[Device]) -> None:
    where = f"pool {pool!r}: counter set {counter_set['name']}"
    if len(devices) > MAX_DEVICES_PER_SLICE:
        raise SliceLayoutError(
            f"{where} has {len(devices)} devices; one slice holds at most "
            f"{MAX_DEVICES_PER_SLICE} in the combined (Kubernetes 1.34) layout"
        )
    if len(counter_set["counters"]) > MAX_COUNTERS_PER_COMBINED_SLICE:
        raise SliceLayoutError(
            f"{where} has {len(counter_set['counters'])} counters; a slice holds at most "
            f"{MAX_COUNTERS_PER_COMBINED_SLICE} in the combined (Kubernetes 1.34) layout"
        )
    consumed = sum(
        len(entry["counters"]) for device in devices for entry in device.get("consumesCounters", [])
    )
    if consumed > MAX_CONSUMED_COUNTERS_PER_COMBINED_SLICE:
        raise SliceLayoutError(
            f"{where}: its devices consume {consumed} counters in all; a slice allows at most "
            f"{MAX_CONSUMED_COUNTERS_PER_COMBINED_SLICE} in the combined (Kubernetes 1.34) layout"
        )


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


def with_taints(
    devices: Iterable[Device], taints: Mapping[str, Sequence[DeviceTaint]], pool: str = ""
) -> list[Device]:
    """Copies of `devices`; each one `taints` names carries exactly those taints (an empty list
    removes any it had). `SliceLayoutError` when `taints` names a device that is not there."""
    result = []
    seen = set()
    for device in devices:
        name = device["name"]
        if name not in taints:
            result.append(device)
            continue
        seen.add(name)
        tainted = copy.deepcopy(device)
        if taints[name]:
            tainted["taints"] = copy.deepcopy(list(taints[name]))
        else:
            tainted.pop("taints", None)
        result.append(tainted)
    unknown = sorted(set(taints) - seen)
    if unknown:
        raise SliceLayoutError(
            f"pool {pool!r}: taints name device(s) {', '.join(unknown)}, which the pool does "
            "not publish"
        )
    return result


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
