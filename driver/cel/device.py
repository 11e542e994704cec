"""The ``device`` variable of a DRA selector, built from a `resourceapi.Device` the way the
scheduler builds it (``k8s.io/dynamic-resource-allocation/cel``; resource-api.md §8.1):

- ``device.driver``: the driver name of the slice;
- ``device.attributes[domain][id]``: attributes grouped by domain; a bare name belongs to the
  driver's domain, ``resource.kubernetes.io/pciBusID`` to ``resource.kubernetes.io`` (split at
  the first ``/``). Values: int, bool, string, or `Semver` for versions;
- ``device.capacity[domain][id]``: `Quantity` values, grouped the same way;
- ``device.allowMultipleAllocations``: the device field, absent counts as false.

Unknown domains read as empty maps; that rule is the engine's job (see `engine_cel_expr_python`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpu_dra.driver.cel.errors import CelRuntimeError
from gpu_dra.driver.cel.values import CelValueError, Quantity, Semver
from gpu_dra.driver.resourceapi import Device, DeviceAttribute

AttributeValue = bool | int | str | Semver


@dataclass(frozen=True)
class DraDevice:
    """What a selector sees as ``device`` (plus `name`, which selectors cannot see)."""

    driver: str
    attributes: Mapping[str, Mapping[str, AttributeValue]]
    capacity: Mapping[str, Mapping[str, Quantity]]
    allow_multiple_allocations: bool = False
    name: str = ""
    # The engine's converted form of this device, built on first use and reused by every
    # selector evaluated against it; not part of the value.
    engine_cache: dict[str, Any] = field(
        default_factory=dict, compare=False, repr=False, hash=False
    )


def to_cel_device(driver: str, device: Device) -> DraDevice:
    """The ``device`` value for `device` published by `driver`.

    Raises `CelRuntimeError` when an attribute or capacity cannot be converted (the scheduler
    fails evaluation the same way): a version that is not semver, a capacity that is not a
    quantity, an attribute with no value.
    """
    name = device["name"]
    attributes: dict[str, dict[str, AttributeValue]] = {}
    for key, attribute in device.get("attributes", {}).items():
        domain, identifier = split_qualified_name(key, driver)
        attributes.setdefault(domain, {})[identifier] = _attribute_value(name, key, attribute)
    capacity: dict[str, dict[str, Quantity]] = {}
    for key, entry in device.get("capacity", {}).items():
        domain, identifier = split_qualified_name(key, driver)
        try:
            capacity.setdefault(domain, {})[identifier] = parsed_quantity(entry["value"])
        except CelValueError as error:
            raise CelRuntimeError(f"device {name}: capacity {key}: {error}") from error
    return DraDevice(
        driver=driver,
        attributes=attributes,
        capacity=capacity,
        allow_multiple_allocations=bool(device.get("allowMultipleAllocations", False)),
        name=name,
    )


def split_qualified_name(key: str, driver: str) -> tuple[str, str]:
    """``productName`` -> (driver, ``productName``); ``a.b/c`` -> (``a.b``, ``c``)."""
    domain, slash, identifier = key.partition("/")
    return (domain, identifier) if slash else (driver, key)


def _attribute_value(device: str, key: str, attribute: DeviceAttribute) -> AttributeValue:
    if "bool" in attribute:
        return bool(attribute["bool"])
    if "int" in attribute:
        return int(attribute["int"])
    if "string" in attribute:
        return str(attribute["string"])
    if "version" in attribute:
        try:
            return parsed_semver(attribute["version"])
        except CelValueError as error:
            raise CelRuntimeError(f"device {device}: attribute {key}: {error}") from error
    raise CelRuntimeError(f"device {device}: attribute {key} has no value")


# Inventories repeat the same few capacity and version texts on every device ("16", "9984Mi",
# "580.95.5"); the values are immutable, so each text is parsed once.
@functools.lru_cache(maxsize=4096)
def parsed_quantity(text: str) -> Quantity:
    return Quantity.parse(text)


@functools.lru_cache(maxsize=4096)
def parsed_semver(text: str) -> Semver:
    return Semver.parse(text)
