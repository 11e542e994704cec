"""One selector over many devices, with the result of each device the same as `Selector.matches`.

A selector reads only some parts of ``device`` (`source.device_footprint`: the driver, some
attribute or capacity entries, whole domain maps). Devices that agree on those parts get the same
result, so a `DeviceTable` groups its devices by their values there and `select` evaluates each
group once. A 1000-node inventory has a few hundred distinct (type, product, profile, memory...)
combinations among hundreds of thousands of devices. Selectors whose footprint cannot be told
from the text (``device.attributes.exists(...)``, ``device`` rebound) are evaluated device by
device. Runtime errors are per device, as the scheduler sees them.

Columns (one per path: every device's value there) are built on first use and kept, so several
selectors over the same table (a class's selectors, ``gpu-dra inventory``'s classes) share them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from gpu_dra.driver.cel.device import DraDevice
from gpu_dra.driver.cel.errors import CelRuntimeError
from gpu_dra.driver.cel.selector import Selector
from gpu_dra.driver.cel.source import DevicePath

_ABSENT: Final = ("absent",)


@dataclass(frozen=True)
class Selection:
    """`matched`: indexes of the matching devices, ascending; `errors`: (index, message) of the
    devices whose evaluation failed, ascending; `evaluations`: how many times CEL ran."""

    matched: list[int]
    errors: list[tuple[int, str]]
    evaluations: int


class DeviceTable:
    """Devices to select from, with the per-path columns `select` builds on demand."""

    def __init__(self, devices: Iterable[DraDevice]) -> None:
        self.devices: Sequence[DraDevice] = tuple(devices)
        self._columns: dict[DevicePath, list[Hashable]] = {}

    def __len__(self) -> int:
        return len(self.devices)

    def column(self, path: DevicePath) -> list[Hashable]:
        """Every device's value at `path`, comparable by CEL identity (the type is part of it:
        ``True`` and ``1`` differ)."""
        found = self._columns.get(path)
        if found is None:
            found = [_value_at(device, path) for device in self.devices]
            self._columns[path] = found
        return found


def select(selector: Selector, table: DeviceTable) -> Selection:
    """`selector` over every device of `table`; each device's outcome is that of
    ``selector.matches(device)``."""
    footprint = selector.footprint
    devices = table.devices
    if footprint is None:
        return _evaluate(selector, devices, [[i] for i in range(len(devices))])
    columns = [table.column(path) for path in sorted(footprint)]
    groups: dict[tuple[Hashable, ...], list[int]] = {}
    for index, key in enumerate(zip(*columns, strict=True) if columns else [()] * len(devices)):
        members = groups.get(key)
        if members is None:
            groups[key] = [index]
        else:
            members.append(index)
    return _evaluate(selector, devices, list(groups.values()))


def _evaluate(
    selector: Selector, devices: Sequence[DraDevice], groups: list[list[int]]
) -> Selection:
    matched: list[int] = []
    errors: list[tuple[int, str]] = []
    for members in groups:
        try:
            if selector.matches(devices[members[0]]):
                matched.extend(members)
        except CelRuntimeError as error:
            errors.extend((index, str(error)) for index in members)
    matched.sort()
    errors.sort()
    return Selection(matched, errors, len(groups))


def _value_at(device: DraDevice, path: DevicePath) -> Hashable:
    if path == ("driver",):
        return device.driver
    if path == ("allowMultipleAllocations",):
        return device.allow_multiple_allocations
    field, domain, *entry = path
    values = (device.attributes if field == "attributes" else device.capacity).get(domain, {})
    if entry:
        return _typed(values[entry[0]]) if entry[0] in values else _ABSENT
    return frozenset((key, _typed(value)) for key, value in values.items())


def _typed(value: object) -> Hashable:
    return (type(value).__name__, value)
