"""What is left of a device for the next allocation: consumable capacity and shared counters.

Pure logic over the cluster model of `state` (devices with the claims holding them), used by
`gpu-dra explain` (its ``capacity`` and ``counters`` steps), `gpu-dra inventory` and the
controller's inventory gauges (device states: `device_availability`). A multi-allocatable device
has its capacity minus its allocations' ``consumedCapacity`` left; a partitionable device can be
allocated only while its pool's shared counters cover it (an allocated device consumes its counters
once; adminAccess consumes nothing). See docs/cel.md, "gpu-dra explain and gpu-dra inventory".
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Final

from gpu_dra.driver.attributes import binary_si_quantity
from gpu_dra.driver.cel import CelValueError, Quantity
from gpu_dra.driver.cel.device import split_qualified_name
from gpu_dra.driver.cluster.state import ClusterState, PoolDevice

CounterKey = tuple[str, str]
"""(counter set name, counter name)."""

ALLOCATABLE_STATES: Final = ("free", "shared", "admin")
"""States of devices the scheduler can allocate now (a class's ``free`` count)."""
DEVICE_STATES: Final = ("free", "allocated", "shared", "blocked", "admin")
"""Every state `device_availability` gives a device (`usage.DeviceRow.state`)."""


@functools.lru_cache(maxsize=4096)
def quantity_value(text: str) -> Fraction:
    """The value of a quantity text; raises `CelValueError` when it is not one. Cached: a pool's
    devices repeat the same few texts (``1``, ``16``, ``9984Mi``) thousands of times."""
    return Quantity.parse(text).value


def quantity_text(value: Fraction) -> str:
    """A quantity as the apiserver prints it: whole non-negative values in BinarySI form
    (``10Gi``, ``81559Mi``, ``30``), others as numbers."""
    if value.denominator == 1 and value >= 0:
        return binary_si_quantity(value.numerator)
    return str(Quantity(value))


# ---- consumable capacity -----------------------------------------------------------------------


def consumed_capacity(device: PoolDevice, exclude: str = "") -> dict[tuple[str, str], Fraction]:
    """(domain, capacity) -> what the allocations of a multi-allocatable `device` consume (those
    of claim `exclude` left out); a consumed amount that is not a quantity is ignored. Empty for
    a device that is not multi-allocatable (it is taken whole)."""
    consumed: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
    if not device.multi_allocatable:
        return consumed
    for holder in device.busy_holders(exclude):
        for key, amount in holder.consumed_capacity.items():
            try:
                value = quantity_value(amount)
            except CelValueError:
                continue
            consumed[split_qualified_name(key, device.driver)] += value
    return consumed


@dataclass(frozen=True)
class CapacityLeft:
    """One consumable capacity of a device: its published value and what is left of it."""

    value: Fraction
    remaining: Fraction

    def to_json(self) -> dict[str, str]:
        return {"value": quantity_text(self.value), "remaining": quantity_text(self.remaining)}


def remaining_capacity(device: PoolDevice) -> dict[str, CapacityLeft]:
    """Capacity name (as published) -> value and what the device's allocations leave of it; a
    value that is not a quantity is left out."""
    consumed = consumed_capacity(device)
    left: dict[str, CapacityLeft] = {}
    for key, entry in (device.raw.get("capacity") or {}).items():
        try:
            value = quantity_value(str((entry or {}).get("value", "0")))
        except CelValueError:
            continue
        left[str(key)] = CapacityLeft(
            value, value - consumed.get(split_qualified_name(str(key), device.driver), Fraction(0))
        )
    return left


def capacity_fits(device: PoolDevice, requests: Mapping[str, str], claim: str = "") -> str | None:
    """None when `device` can serve the capacity `requests`, else why not (resource-api.md §5.1);
    the allocations of `claim` do not count as consuming."""
    capacities: dict[tuple[str, str], Any] = {
        split_qualified_name(str(k), device.driver): v
        for k, v in (device.raw.get("capacity") or {}).items()
    }
    wanted: dict[tuple[str, str], Fraction] = {}
    for key, amount in requests.items():
        qualified = split_qualified_name(key, device.driver)
        if qualified not in capacities:
            return f"no capacity {key}"
        try:
            wanted[qualified] = quantity_value(amount)
        except CelValueError:
            return f"capacity request {key}={amount} is not a quantity"
    consumed = consumed_capacity(device, claim)
    for qualified, entry in capacities.items():
        try:
            total = quantity_value(str(entry.get("value", "0")))
            demand = _rounded(
                wanted.get(qualified), entry.get("requestPolicy"), total, device.multi_allocatable
            )
        except CelValueError:
            return f"capacity {qualified[1]} is not a quantity"
        if demand is None:
            return f"capacity {qualified[1]}: request outside the requestPolicy"
        available = total - consumed.get(qualified, Fraction(0))
        if demand > available:
            return (
                f"capacity {qualified[1]}: needs {quantity_text(demand)}, "
                f"{quantity_text(available)} left"
            )
    return None


def _rounded(
    request: Fraction | None, policy: object, total: Fraction, multi: bool
) -> Fraction | None:
    """What a request consumes after the device's ``requestPolicy``; None when not allowed."""
    if not isinstance(policy, Mapping):
        policy = {}
    if request is None:
        if not multi:
            return Fraction(0)
        default = policy.get("default")
        return quantity_value(str(default)) if default is not None else total
    valid = policy.get("validValues")
    if isinstance(valid, list) and valid:
        options = sorted(quantity_value(str(v)) for v in valid)
        return next((v for v in options if v >= request), None)
    limits = policy.get("validRange")
    if isinstance(limits, Mapping):
        low = quantity_value(str(limits.get("min", "0")))
        value = max(request, low)
        if limits.get("step") is not None:
            step = quantity_value(str(limits["step"]))
            if step > 0:
                steps = -((low - value) // step)  # ceiling
                value = low + steps * step
        if limits.get("max") is not None and value > quantity_value(str(limits["max"])):
            return None
        return value
    return request


# ---- shared counters ---------------------------------------------------------------------------


@dataclass
class CounterUse:
    """What the allocated devices of one pool consume of its shared counters."""

    consumed: dict[CounterKey, Fraction] = field(default_factory=lambda: defaultdict(Fraction))
    holders: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Counter set name -> the claims (``ns/name``) holding devices that consume from it."""


def counter_use(
    devices: Iterable[PoolDevice], exclude: str = ""
) -> dict[tuple[str, str], CounterUse]:
    """(driver, pool) -> the counters its allocated devices consume; devices held only by claim
    `exclude` (or only with adminAccess) consume nothing. An amount that is not a quantity is
    ignored."""
    use: dict[tuple[str, str], CounterUse] = defaultdict(CounterUse)
    for device in devices:
        busy = device.busy_holders(exclude)
        if not busy:
            continue
        pool = use[(device.driver, device.pool)]
        for entry in device.raw.get("consumesCounters") or []:
            counter_set = str(entry.get("counterSet", ""))
            pool.holders[counter_set].update(h.claim for h in busy)
            for counter, amount in (entry.get("counters") or {}).items():
                try:
                    value = quantity_value(str((amount or {}).get("value", "0")))
                except CelValueError:
                    continue
                pool.consumed[(counter_set, str(counter))] += value
    return use


def counters_shortage(
    device: PoolDevice,
    counter_sets: Mapping[str, Mapping[str, str]],
    use: CounterUse | None,
) -> str | None:
    """None when the pool's `counter_sets` (name -> counter -> quantity), minus what `use` says
    the allocated devices consume, still cover every counter `device` consumes; else why not."""
    consumed: Mapping[CounterKey, Fraction] = use.consumed if use is not None else {}
    for entry in device.raw.get("consumesCounters") or []:
        name = str(entry.get("counterSet", ""))
        counter_set = counter_sets.get(name)
        if counter_set is None:
            return f"counter set {name} is not published in the pool"
        for counter, amount in (entry.get("counters") or {}).items():
            if counter not in counter_set:
                return f"counter set {name} has no counter {counter}"
            try:
                total = quantity_value(counter_set[counter])
                need = quantity_value(str((amount or {}).get("value", "0")))
            except CelValueError:
                return f"counter {counter} of {name} is not a quantity"
            if total - consumed.get((name, str(counter)), Fraction(0)) < need:
                holders = sorted(use.holders.get(name, ())) if use is not None else []
                return f"counters of {name} used by {', '.join(holders) or 'nobody'}"
    return None


@dataclass(frozen=True)
class Availability:
    """A device's state (one of `DEVICE_STATES`), why it is blocked, and its capacity left."""

    state: str
    reason: str = ""
    capacity: Mapping[str, CapacityLeft] = field(default_factory=dict)


def device_availability(
    device: PoolDevice, counter_sets: Mapping[str, Mapping[str, str]], use: CounterUse | None
) -> Availability:
    """The state of `device` given its pool's `counter_sets` and what the pool's allocated
    devices consume of them (`availability.counter_use`)."""
    capacity = remaining_capacity(device) if device.multi_allocatable else {}
    if device.busy_holders():
        if not device.multi_allocatable:
            return Availability("allocated")
        used_up = any(left.remaining <= 0 for left in capacity.values())
        return Availability("allocated" if used_up else "shared", capacity=capacity)
    shortage = counters_shortage(device, counter_sets, use)
    if shortage is not None:
        return Availability("blocked", shortage, capacity)
    return Availability("admin" if device.holders else "free", capacity=capacity)


def availabilities(state: ClusterState) -> dict[tuple[str, str, str], Availability]:
    """`device_availability` of every device, by `PoolDevice.key`."""
    use = counter_use(state.devices)
    return {
        device.key: device_availability(
            device, pool.counter_sets, use.get((pool.driver, pool.name))
        )
        for pool in state.pools
        for device in pool.devices
    }
