"""The cluster as the scheduler sees it, from raw ``resource.k8s.io/v1`` objects (pure, no I/O).

`build_cluster_state`: per (driver, pool) only the slices of the highest generation count (fewer
than ``resourceSliceCount``: *incomplete*), each device with the claims holding it
(``status.allocation``). `compile_class` and `select_all` evaluate DeviceClass selectors as the
scheduler does. Shared by `gpu-dra explain` / ``inventory`` and the controller's inventory gauges.
See docs/cel.md, "gpu-dra explain and gpu-dra inventory".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

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

Obj = Mapping[str, Any]

ALL_NODES: Final = "<all nodes>"
"""The node column of devices in pools that are not node-local (allNodes, nodeSelector)."""


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
