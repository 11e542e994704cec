"""The driver's devices per node with their state and holders, and what each DeviceClass matches
and how much of it is free: the `Inventory` that `gpu-dra inventory` prints and the controller
exports as gauges (pure, no I/O).
See docs/cel.md, "gpu-dra explain and gpu-dra inventory".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Final

from gpu_dra.driver.cluster.availability import (
    ALLOCATABLE_STATES,
    DEVICE_STATES,
    Availability,
    CapacityLeft,
    availabilities,
)
from gpu_dra.driver.cluster.state import (
    CompiledClass,
    Obj,
    Pool,
    PoolDevice,
    build_cluster_state,
    compile_class,
    select_all,
)
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME

CLASS_STATES: Final = ("total", "free", "blocked")
"""The device counts of a `ClassRow` (`Inventory.class_counts`)."""


@dataclass(frozen=True)
class DeviceRow:
    node: str
    pool: str
    device: str
    type: str
    product: str
    state: str
    """One of `DEVICE_STATES` (`device_availability`)."""
    holders: tuple[str, ...]
    """``ns/name`` of each claim holding it (request in parentheses)."""
    reason: str = ""
    """Why a ``blocked`` device cannot be allocated (``counters of <set> used by <claims>``)."""
    capacity: Mapping[str, CapacityLeft] = field(default_factory=dict)
    """Multi-allocatable devices: each consumable capacity's value and what is left of it."""


@dataclass(frozen=True)
class ClassRow:
    name: str
    total: int
    free: int
    """Matched devices the scheduler can allocate now (`ALLOCATABLE_STATES`)."""
    errors: int
    error: str = ""
    """A compile error, or one example runtime error (device: message)."""
    blocked: int = 0
    """Matched devices not held but out of shared counters."""
    capacity: Mapping[str, CapacityLeft] = field(default_factory=dict)
    """Capacity name -> sum over the matched multi-allocatable devices of its value and of
    what is left of it (the class's free capacity)."""


@dataclass(frozen=True)
class Inventory:
    driver: str
    pools: tuple[Pool, ...]
    devices: tuple[DeviceRow, ...]
    classes: tuple[ClassRow, ...]
    unknown_allocations: tuple[str, ...]

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Per node: device counts, by state (``free`` counts devices held only with
        adminAccess; ``shared``: multi-allocatable devices with allocations and capacity left;
        ``blocked``: out of shared counters) and by type (``free``: allocatable now)."""
        summary: dict[str, dict[str, Any]] = {}
        for row in self.devices:
            node = summary.setdefault(
                row.node,
                {"devices": 0, "free": 0, "allocated": 0, "shared": 0, "blocked": 0, "types": {}},
            )
            free = row.state in ALLOCATABLE_STATES
            node["devices"] += 1
            node["free" if row.state == "admin" else row.state] += 1
            types = node["types"].setdefault(row.type, {"devices": 0, "free": 0})
            types["devices"] += 1
            types["free"] += free
        return summary

    def device_counts(self) -> dict[tuple[str, str, str], int]:
        """(node, type, state) -> devices; every state of `DEVICE_STATES` for each node and type
        seen, zeros included."""
        counts: dict[tuple[str, str, str], int] = {}
        for row in self.devices:
            for state in DEVICE_STATES:
                counts.setdefault((row.node, row.type, state), 0)
            counts[(row.node, row.type, row.state)] += 1
        return counts

    def class_counts(self) -> dict[tuple[str, str], int]:
        """(class, state of `CLASS_STATES`) -> devices."""
        counts: dict[tuple[str, str], int] = {}
        for row in self.classes:
            counts[(row.name, "total")] = row.total
            counts[(row.name, "free")] = row.free
            counts[(row.name, "blocked")] = row.blocked
        return counts

    def to_json(self) -> dict[str, Any]:
        return {
            "driver": self.driver,
            "pools": [pool.to_json() for pool in self.pools],
            "nodes": self.nodes(),
            "devices": [
                {
                    "node": row.node,
                    "pool": row.pool,
                    "device": row.device,
                    "type": row.type,
                    "product": row.product,
                    "state": row.state,
                    "reason": row.reason,
                    "holders": list(row.holders),
                    "capacity": {k: v.to_json() for k, v in row.capacity.items()},
                }
                for row in self.devices
            ],
            "classes": [
                {
                    "name": row.name,
                    "total": row.total,
                    "free": row.free,
                    "blocked": row.blocked,
                    "capacity": {k: v.to_json() for k, v in row.capacity.items()},
                    "errors": row.errors,
                    "error": row.error,
                }
                for row in self.classes
            ],
            "unknownAllocations": list(self.unknown_allocations),
        }


def inventory(
    slices: Sequence[Obj],
    classes: Sequence[Obj],
    claims: Sequence[Obj],
    *,
    driver: str = DEFAULT_DRIVER_NAME,
) -> Inventory:
    """Devices of `driver` per node with their state and holders; every class's total, free
    and blocked devices and free capacity (over the devices of all drivers, as the scheduler
    sees them)."""
    state = build_cluster_state(slices, claims)
    available = availabilities(state)
    rows = [
        DeviceRow(
            node=device.node,
            pool=device.pool,
            device=device.name,
            type=device.type,
            product=device.product,
            state=available[device.key].state,
            holders=tuple(f"{h.claim} ({h.request})" for h in device.holders),
            reason=available[device.key].reason,
            capacity=available[device.key].capacity,
        )
        for device in state.devices
        if device.driver == driver
    ]
    rows.sort(key=lambda row: (row.node, row.pool, row.device))
    class_rows = [
        _class_row(compile_class(c), state.devices, available)
        for c in sorted(classes, key=lambda c: str((c.get("metadata") or {}).get("name", "")))
    ]
    return Inventory(
        driver=driver,
        pools=tuple(pool for pool in state.pools if pool.driver == driver),
        devices=tuple(rows),
        classes=tuple(class_rows),
        unknown_allocations=tuple(
            f"{label} held by {holder.claim}" for holder, label in state.unknown_allocations
        ),
    )


def _class_row(
    compiled: CompiledClass,
    devices: Sequence[PoolDevice],
    available: Mapping[tuple[str, str, str], Availability],
) -> ClassRow:
    if compiled.error:
        return ClassRow(compiled.name, 0, 0, 0, compiled.error)
    matched, failures = select_all(compiled.selectors, devices)
    errors = len(failures)
    example = f"{devices[failures[0][0]].label}: {failures[0][1]}" if failures else ""
    states = [available[devices[i].key].state for i in matched]
    capacity: dict[str, CapacityLeft] = {}
    for i in matched:
        for name, left in available[devices[i].key].capacity.items():
            before = capacity.get(name, CapacityLeft(Fraction(0), Fraction(0)))
            capacity[name] = CapacityLeft(
                before.value + left.value, before.remaining + max(left.remaining, Fraction(0))
            )
    return ClassRow(
        compiled.name,
        total=len(matched),
        free=sum(s in ALLOCATABLE_STATES for s in states),
        errors=errors,
        error=example,
        blocked=states.count("blocked"),
        capacity=capacity,
    )
