"""`gpu-dra inventory`: what the cluster's ResourceSlices offer and who holds it. Pure logic.

Input: the raw ``resource.k8s.io/v1`` dictionaries the apiserver returns (ResourceSlices,
DeviceClasses, ResourceClaims of all namespaces); no I/O. The cluster model built here
(`ClusterState`: pools at their highest generation, devices, allocations) is shared with
`gpu_dra.controller.explain`.

- Pools: per (driver, pool name) only the slices of the highest ``generation`` count; a pool whose
  kept slices are fewer than ``resourceSliceCount`` is *incomplete* (resource-api.md §9.3 step 1).
- Allocations: every ``status.allocation.devices.results[]`` of every claim, with the claim
  holding it; ``adminAccess`` results do not make a device busy.
- Device states (`DEVICE_STATES`): ``free`` (allocatable now), ``allocated`` (held by claims; a
  multi-allocatable device with a consumable capacity used up), ``shared`` (a multi-allocatable
  device with allocations and capacity left: its remaining capacity is reported), ``blocked``
  (not held, but the pool's shared counters its ``consumesCounters`` need are used up by
  allocated devices: a whole GPU or a MIG placement overlapping allocated slices) and ``admin``
  (held only with adminAccess). Capacity and counters: `gpu_dra.controller.availability`, the
  same code `gpu-dra explain` runs.
- Per DeviceClass: the devices its selectors (compiled with `gpu_dra.driver.cel`) match, how
  many of them can be allocated now (free, shared, admin) or are blocked, and the free
  consumable capacity of its multi-allocatable devices; a selector that does not compile or
  fails at run time is counted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Final

from gpu_dra.controller.availability import (
    CapacityLeft,
    CounterUse,
    counter_use,
    counters_shortage,
    quantity_text,
    remaining_capacity,
)
from gpu_dra.driver.cel import (
    CelCompileError,
    CelRuntimeError,
    DeviceTable,
    DraDevice,
    Selector,
    compile_selector,
    select,
    to_cel_device,
)
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME

Obj = Mapping[str, Any]

ALL_NODES: Final = "<all nodes>"
"""The node column of devices in pools that are not node-local (allNodes, nodeSelector)."""
ALLOCATABLE_STATES: Final = ("free", "shared", "admin")
"""States of devices the scheduler can allocate now (a class's ``free`` count)."""
DEVICE_STATES: Final = ("free", "allocated", "shared", "blocked", "admin")
"""Every value of `DeviceRow.state`."""
CLASS_STATES: Final = ("total", "free", "blocked")
"""The device counts of a `ClassRow` (`Inventory.class_counts`)."""


@dataclass(frozen=True)
class Holder:
    """One allocation result naming a device: the claim and its request."""

    claim: str
    """``<namespace>/<name>``."""
    request: str
    admin_access: bool = False
    share_id: str = ""
    consumed_capacity: Mapping[str, str] = field(default_factory=dict)


@dataclass
class PoolDevice:
    """A device of a pool at the pool's current generation."""

    driver: str
    pool: str
    node: str
    """``spec.nodeName`` of its slice, or `ALL_NODES`."""
    raw: Obj
    holders: list[Holder] = field(default_factory=list)
    _cel: DraDevice | CelRuntimeError | None = None

    @property
    def name(self) -> str:
        return str(self.raw.get("name", ""))

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    @property
    def label(self) -> str:
        """``<driver>/<pool>/<device>``, as the scheduler names devices."""
        return f"{self.driver}/{self.pool}/{self.name}"

    @property
    def multi_allocatable(self) -> bool:
        return bool(self.raw.get("allowMultipleAllocations", False))

    @property
    def type(self) -> str:
        """The ``type`` attribute (gpu, mig, ...), or ``-``."""
        return self._attribute_text("type")

    @property
    def product(self) -> str:
        """The ``productName`` attribute, or ``-``."""
        return self._attribute_text("productName")

    def _attribute_text(self, name: str) -> str:
        """The value of attribute `name` of the driver's domain (published bare or qualified),
        or ``-``."""
        attributes = self.raw.get("attributes") or {}
        value = attributes.get(name) or attributes.get(f"{self.driver}/{name}") or {}
        return str(next(iter(value.values()), "-")) if isinstance(value, Mapping) else "-"

    def busy_holders(self, exclude: str = "") -> list[Holder]:
        """Allocations that occupy the device (not adminAccess), except those of `exclude`."""
        return [h for h in self.holders if not h.admin_access and h.claim != exclude]

    def cel(self) -> DraDevice:
        """The ``device`` CEL value; raises `CelRuntimeError` when it cannot be built."""
        if self._cel is None:
            try:
                self._cel = to_cel_device(self.driver, self.raw)  # type: ignore[arg-type]
            except CelRuntimeError as error:
                self._cel = error
        if isinstance(self._cel, CelRuntimeError):
            raise self._cel
        return self._cel


@dataclass
class Pool:
    driver: str
    name: str
    generation: int
    slice_count: int
    """``resourceSliceCount`` of the kept slices."""
    slices: int
    """How many slices of this generation exist."""
    nodes: list[str]
    devices: list[PoolDevice]
    counter_sets: dict[str, dict[str, str]]
    """Shared counter set name -> counter name -> quantity."""

    @property
    def key(self) -> str:
        return f"{self.driver}/{self.name}"

    @property
    def incomplete(self) -> bool:
        return self.slices < self.slice_count

    def to_json(self) -> dict[str, Any]:
        return {
            "driver": self.driver,
            "pool": self.name,
            "generation": self.generation,
            "slices": self.slices,
            "resourceSliceCount": self.slice_count,
            "incomplete": self.incomplete,
            "nodes": list(self.nodes),
            "devices": len(self.devices),
        }


@dataclass
class ClusterState:
    """Pools (highest generation), their devices, and every claim's allocated devices."""

    pools: list[Pool]
    allocations: dict[str, list[tuple[str, str, str]]]
    """Claim ``ns/name`` -> (driver, pool, device) of its results."""
    unknown_allocations: list[tuple[Holder, str]]
    """Results naming a device no current slice publishes: (holder, ``driver/pool/device``)."""

    @property
    def devices(self) -> list[PoolDevice]:
        return [device for pool in self.pools for device in pool.devices]


def claim_key(claim: Obj) -> str:
    metadata = claim.get("metadata") or {}
    return f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"


def build_cluster_state(slices: Sequence[Obj], claims: Sequence[Obj]) -> ClusterState:
    """The cluster model from raw ResourceSlices and ResourceClaims."""
    grouped: dict[tuple[str, str], list[Obj]] = defaultdict(list)
    for item in slices:
        spec = item.get("spec") or {}
        pool = spec.get("pool") or {}
        grouped[(str(spec.get("driver", "")), str(pool.get("name", "")))].append(item)
    pools: list[Pool] = []
    index: dict[tuple[str, str, str], PoolDevice] = {}
    for (driver, name), members in sorted(grouped.items()):
        generation = max(int(m["spec"]["pool"].get("generation", 0)) for m in members)
        kept = sorted(
            (m for m in members if int(m["spec"]["pool"].get("generation", 0)) == generation),
            key=lambda m: str((m.get("metadata") or {}).get("name", "")),
        )
        devices: list[PoolDevice] = []
        counters: dict[str, dict[str, str]] = {}
        nodes: list[str] = []
        for member in kept:
            spec = member["spec"]
            node = str(spec.get("nodeName") or ALL_NODES)
            if node not in nodes:
                nodes.append(node)
            for counter_set in spec.get("sharedCounters") or []:
                counters[str(counter_set.get("name", ""))] = {
                    str(k): str((v or {}).get("value", "0"))
                    for k, v in (counter_set.get("counters") or {}).items()
                }
            for raw in spec.get("devices") or []:
                device = PoolDevice(driver, name, node, raw)
                devices.append(device)
                index.setdefault(device.key, device)
        slice_count = max(int(m["spec"]["pool"].get("resourceSliceCount", 1)) for m in kept)
        pools.append(
            Pool(driver, name, generation, slice_count, len(kept), nodes, devices, counters)
        )
    allocations: dict[str, list[tuple[str, str, str]]] = {}
    unknown: list[tuple[Holder, str]] = []
    for claim in sorted(claims, key=claim_key):
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            continue
        key = claim_key(claim)
        allocations[key] = []
        for result in (allocation.get("devices") or {}).get("results") or []:
            device_key = (
                str(result.get("driver", "")),
                str(result.get("pool", "")),
                str(result.get("device", "")),
            )
            allocations[key].append(device_key)
            holder = Holder(
                claim=key,
                request=str(result.get("request", "")),
                admin_access=bool(result.get("adminAccess", False)),
                share_id=str(result.get("shareID") or ""),
                consumed_capacity={
                    str(k): str(v) for k, v in (result.get("consumedCapacity") or {}).items()
                },
            )
            if device_key in index:
                index[device_key].holders.append(holder)
            else:
                unknown.append((holder, "/".join(device_key)))
    return ClusterState(pools, allocations, unknown)


# ---- DeviceClasses ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CompiledClass:
    """A DeviceClass's selectors, compiled; `error` when one does not compile."""

    name: str
    expressions: tuple[str, ...]
    selectors: tuple[Selector, ...]
    error: str = ""


def compile_class(device_class: Obj) -> CompiledClass:
    name = str((device_class.get("metadata") or {}).get("name", ""))
    expressions = selector_expressions((device_class.get("spec") or {}).get("selectors"))
    selectors: list[Selector] = []
    for number, expression in enumerate(expressions):
        try:
            selectors.append(compile_selector(expression))
        except CelCompileError as error:
            return CompiledClass(name, expressions, (), f"selector #{number}: {error.first_line}")
    return CompiledClass(name, expressions, tuple(selectors))


def selector_expressions(selectors: object) -> tuple[str, ...]:
    """The CEL expressions of a ``selectors`` list (entries without ``cel`` are skipped)."""
    if not isinstance(selectors, list):
        return ()
    return tuple(
        str(entry["cel"].get("expression", ""))
        for entry in selectors
        if isinstance(entry, Mapping) and isinstance(entry.get("cel"), Mapping)
    )


def select_all(
    selectors: Sequence[Selector], devices: Sequence[PoolDevice]
) -> tuple[list[int], list[tuple[int, str]]]:
    """Indexes of the `devices` every selector matches, and (index, message) of those where a
    selector fails as the scheduler would fail: the selectors in order, each on the devices the
    ones before matched, the first false or failing one deciding. One CEL evaluation per group of
    devices alike on what a selector reads (`select`)."""
    positions = list(range(len(devices)))
    failures: list[tuple[int, str]] = []
    for selector in selectors:
        table = DeviceTable((devices[p].driver, devices[p].raw) for p in positions)  # type: ignore[misc]
        selection = select(selector, table)
        failures += [(positions[index], message) for index, message in selection.errors]
        positions = [positions[index] for index in selection.matched]
    return positions, sorted(failures)


# ---- the inventory -----------------------------------------------------------------------------


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


def _capacity_text(capacity: Mapping[str, CapacityLeft]) -> str:
    """``memory 50Gi/80Gi, compute 30/100`` (left/value), or ``-``."""
    return (
        ", ".join(
            f"{name} {quantity_text(left.remaining)}/{quantity_text(left.value)}"
            for name, left in sorted(capacity.items())
        )
        or "-"
    )


def render_inventory(report: Inventory) -> list[tuple[list[str], list[list[str]]] | str]:
    """The table output: section titles (str) and tables (headers, rows), in order."""
    out: list[tuple[list[str], list[list[str]]] | str] = []
    for pool in report.pools:
        if pool.incomplete:
            out.append(
                f"warning: pool {pool.key} is incomplete ({pool.slices} of "
                f"{pool.slice_count} slices at generation {pool.generation})"
            )
    nodes = report.nodes()
    node_rows = []
    for node, summary in nodes.items():
        kinds = ", ".join(
            f"{t}: {c['free']}/{c['devices']} free" for t, c in sorted(summary["types"].items())
        )
        counts = [str(summary[k]) for k in ("devices", "free", "allocated", "shared", "blocked")]
        node_rows.append([node, *counts, kinds])
    out.append(f"nodes ({report.driver}):")
    out.append(
        (["NODE", "DEVICES", "FREE", "ALLOCATED", "SHARED", "BLOCKED", "BY TYPE"], node_rows)
    )
    out.append("devices:")
    out.append(
        (
            ["NODE", "POOL", "DEVICE", "TYPE", "PRODUCT", "STATE", "HELD BY", "CAPACITY LEFT"],
            [
                [
                    r.node,
                    r.pool,
                    r.device,
                    r.type,
                    r.product,
                    f"{r.state} ({r.reason})" if r.reason else r.state,
                    ", ".join(r.holders) or "-",
                    _capacity_text(r.capacity),
                ]
                for r in report.devices
            ],
        )
    )
    out.append("device classes:")
    out.append(
        (
            ["CLASS", "DEVICES", "FREE", "BLOCKED", "FREE CAPACITY", "CEL ERRORS", "NOTE"],
            [
                [
                    c.name,
                    str(c.total),
                    str(c.free),
                    str(c.blocked),
                    _capacity_text(c.capacity),
                    str(c.errors),
                    c.error or "-",
                ]
                for c in report.classes
            ],
        )
    )
    for line in report.unknown_allocations:
        out.append(f"warning: allocated device not in any current slice: {line}")
    return out
