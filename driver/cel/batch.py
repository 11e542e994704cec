"""One selector over many published devices, with the result of each device the same as
converting it (`to_cel_device`) and calling `Selector.matches`.

`select` groups the *plain* devices of a `DeviceTable` by the published values of the parts of
``device`` the selector reads (`source.device_footprint`), and converts and evaluates one
representative per group: a 1000-node inventory has a few dozen distinct combinations among
hundreds of thousands of devices. Any other device, and every device when the footprint cannot be
told, is converted and evaluated on its own. Runtime errors are per device, as the scheduler
sees them. See docs/cel.md#api (`select`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpu_dra.driver.cel.device import DraDevice, parsed_quantity, parsed_semver, to_cel_device
from gpu_dra.driver.cel.errors import CelRuntimeError
from gpu_dra.driver.cel.selector import Selector
from gpu_dra.driver.cel.source import DevicePath
from gpu_dra.driver.cel.values import CelValueError
from gpu_dra.driver.resourceapi import Device

# A published device and the driver that publishes it (the slice's ``spec.driver``).
PublishedDevice = tuple[str, Device]
# Reads one footprint path of a plain device: a hashable stand-in for the converted value there
# (equal stand-ins, equal values), or `_UNKEYED` when the published entries do not tell it.
_Reader = Callable[[str, Mapping[str, Any]], Hashable]

_ABSENT: Final = ("absent",)
_UNKEYED: Final = object()
_EMPTY: Final[Mapping[str, Any]] = {}
_ATTRIBUTE_TYPES: Final = {"bool": bool, "int": int, "string": str, "version": str}


@dataclass(frozen=True)
class Selection:
    """`matched`: indexes of the matching devices, ascending; `errors`: (index, message) of the
    devices whose conversion or evaluation failed, ascending; `evaluations`: how many times CEL
    ran."""

    matched: list[int]
    errors: list[tuple[int, str]]
    evaluations: int


class DeviceTable:
    """Published devices to select from. Holds the device dicts as given (no copy of their
    values), one byte per device telling whether it is plain (computed on first use) and the
    converted form of the group representatives evaluated so far; so the dicts must not change
    while the table is in use (build a new table for new slices)."""

    def __init__(self, devices: Iterable[PublishedDevice]) -> None:
        self.devices: Sequence[PublishedDevice] = tuple(devices)
        self._plain: bytearray | None = None
        self._converted: dict[int, DraDevice] = {}

    def __len__(self) -> int:
        return len(self.devices)

    def plain(self) -> bytearray:
        """1 for each device that can be grouped (see the module docstring), else 0."""
        if self._plain is None:
            good_versions: set[str] = set()
            good_quantities: set[str] = set()
            self._plain = bytearray(
                _is_plain(device, good_versions, good_quantities) for _, device in self.devices
            )
        return self._plain

    def converted(self, index: int) -> DraDevice:
        """`to_cel_device` of a plain device, kept (representatives are few)."""
        found = self._converted.get(index)
        if found is None:
            driver, device = self.devices[index]
            found = self._converted[index] = to_cel_device(driver, device)
        return found


def select(selector: Selector, table: DeviceTable) -> Selection:
    """`selector` over every device of `table`; each device's outcome is that of
    ``selector.matches(to_cel_device(driver, device))``, a `CelRuntimeError` from either being
    an error of that device."""
    footprint = selector.footprint
    devices = table.devices
    if footprint is None:
        return _evaluate(selector, table, {}, list(range(len(devices))))
    readers = [_reader(path) for path in sorted(footprint)]
    plain = table.plain()
    groups: dict[tuple[Hashable, ...], list[int]] = {}
    alone: list[int] = []
    for index, (driver, device) in enumerate(devices):
        if not plain[index]:
            alone.append(index)
            continue
        key = tuple([read(driver, device) for read in readers])
        if _UNKEYED in key:
            alone.append(index)
            continue
        members = groups.get(key)
        if members is None:
            groups[key] = [index]
        else:
            members.append(index)
    return _evaluate(selector, table, groups, alone)


def _evaluate(
    selector: Selector,
    table: DeviceTable,
    groups: dict[tuple[Hashable, ...], list[int]],
    alone: list[int],
) -> Selection:
    matched: list[int] = []
    errors: list[tuple[int, str]] = []
    for members in groups.values():
        try:
            if selector.matches(table.converted(members[0])):
                matched.extend(members)
        except CelRuntimeError as error:
            errors.extend((index, str(error)) for index in members)
    for index in alone:
        driver, device = table.devices[index]
        try:  # converted and dropped: nothing is kept per device
            if selector.matches(to_cel_device(driver, device)):
                matched.append(index)
        except CelRuntimeError as error:
            errors.append((index, str(error)))
    matched.sort()
    errors.sort()
    return Selection(matched, errors, len(groups) + len(alone))


def _is_plain(device: Any, good_versions: set[str], good_quantities: set[str]) -> bool:
    if type(device) is not dict or type(device.get("name")) is not str:
        return False
    attributes = device.get("attributes", _EMPTY)
    capacity = device.get("capacity", _EMPTY)
    if type(attributes) is not dict or type(capacity) is not dict:
        return False
    for attribute in attributes.values():
        if type(attribute) is not dict or len(attribute) != 1:
            return False
        ((kind, value),) = attribute.items()
        if type(value) is not _ATTRIBUTE_TYPES.get(kind):
            return False
        if kind == "version" and isinstance(value, str) and value not in good_versions:
            if not _parses(parsed_semver, value):
                return False
            good_versions.add(value)
    for entry in capacity.values():
        text = entry.get("value") if type(entry) is dict else None
        if type(text) is not str:
            return False
        if text not in good_quantities:
            if not _parses(parsed_quantity, text):
                return False
            good_quantities.add(text)
    return True


def _parses(parse: Callable[[str], object], text: str) -> bool:
    try:
        parse(text)
    except CelValueError:
        return False
    return True


def _reader(path: DevicePath) -> _Reader:
    """How to read `path` from a plain published device (`to_cel_device`'s mapping: a bare name
    is in the driver's domain, ``domain/id`` in ``domain``)."""
    if path == ("driver",):
        return lambda driver, device: driver
    if path == ("allowMultipleAllocations",):
        return lambda driver, device: bool(device.get("allowMultipleAllocations", False))
    field, domain, *entry = path
    if entry and "/" in domain:
        return lambda driver, device: _ABSENT  # no published name has such a domain
    if entry:
        identifier = entry[0]
        qualified = f"{domain}/{identifier}"
        # A bare name is an identifier without "/".
        bare = identifier if "/" not in identifier else None

        def read_entry(driver: str, device: Mapping[str, Any]) -> Hashable:
            values = device.get(field, _EMPTY)
            found = values.get(qualified)
            if domain == driver and bare is not None and bare in values:
                if found is not None:
                    return _UNKEYED  # published twice; conversion keeps the later one
                found = values[bare]
            return _ABSENT if found is None else _entry_key(field, found)

        return read_entry

    def read_domain(driver: str, device: Mapping[str, Any]) -> Hashable:
        values: dict[str, Hashable] = {}  # later names win, as in to_cel_device
        for key, value in device.get(field, _EMPTY).items():
            domain_of, slash, identifier = key.partition("/")
            if (domain_of if slash else driver) == domain:
                values[identifier if slash else key] = _entry_key(field, value)
        return frozenset(values.items())

    return read_domain


def _entry_key(field: str, entry: Mapping[str, Any]) -> Hashable:
    """``{"string": "mig"}`` -> ("string", "mig"), a capacity's ``{"value": "80Gi"}`` -> "80Gi".
    In a plain device an attribute has one kind of the exact JSON type and every text parses,
    so equal keys convert to equal values."""
    if field == "capacity":
        text: str = entry["value"]
        return text
    ((kind, value),) = entry.items()
    return (kind, value)
