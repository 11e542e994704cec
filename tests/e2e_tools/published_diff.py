"""Field-by-field differences between two publications of the same hardware.

A publication is what the kubelet plugin publishes for a node (``devices``, ``counterSets``)
plus its GPUs in NVML index order (``gpus``: ``uuid``, ``pciBusId``) and its static MIG devices
(``migDevices``: ``uuid``, ``parent``, ``placement``). Before comparing, only what differs per
machine by nature is normalised: a GPU's UUID and PCI bus id become ``<GPU i>`` (its NVML
index), a MIG device's UUID ``<MIG of GPU i at slice s>``, wherever they appear. Devices are
aligned by name; a MIG device or partition by parent, profile and placement start, its
GPU-instance profile ID (part of the name) being compared as the field ``name.giProfileId``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_dra.driver.naming import MigDeviceName, parse_device_name

DEVICE = "(device)"
"""The field of a `Difference` saying a device is published on one side only."""
ORDER = "(order)"
"""The device of a `Difference` saying the devices both sides publish come in another order."""


@dataclass(frozen=True, order=True)
class Difference:
    """One field that differs; None: the side does not have it."""

    device: str
    field: str
    real: str | None
    simulated: str | None

    def __str__(self) -> str:
        return f"{self.device} {self.field}: real {self.real!r}, simulated {self.simulated!r}"


def differences(real: dict[str, Any], simulated: dict[str, Any]) -> list[Difference]:
    """Every difference between the `real` and `simulated` publications, sorted."""
    left, right = normalise(real), normalise(simulated)
    found = []
    for key in sorted(left.keys() | right.keys()):
        a, b = left.get(key), right.get(key)
        if a is None or b is None:
            found.append(Difference(key, DEVICE, _present(a), _present(b)))
            continue
        for field in sorted(a.keys() | b.keys()):
            if a.get(field) != b.get(field):
                found.append(Difference(key, field, a.get(field), b.get(field)))
    common = [key for key in left if key in right]
    other = [key for key in right if key in left]
    if common != other:
        found.append(Difference(ORDER, "devices", " ".join(common), " ".join(other)))
    return sorted(found)


def _present(fields: dict[str, str] | None) -> str | None:
    return None if fields is None else "published"


def normalise(publication: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Aligned key -> field -> value, in publication order (devices, then counter sets)."""
    identities = {}
    for index, gpu in enumerate(publication["gpus"]):
        identities[gpu["uuid"]] = f"<GPU {index}>"
        identities[gpu["pciBusId"]] = f"<GPU {index}>"
    for mig in publication.get("migDevices", ()):
        parent = identities[mig["parent"]].strip("<>")
        identities[mig["uuid"]] = f"<MIG of {parent} at slice {mig['placement'][0]}>"
    aligned: dict[str, dict[str, str]] = {}
    for device in publication["devices"]:
        key, fields = _device_fields(device, identities)
        if key in aligned:
            raise AssertionError(f"two devices align as {key}")
        aligned[key] = fields
    for counter_set in publication["counterSets"]:
        aligned[f"counterSet/{counter_set['name']}"] = {
            f"counters.{name}": counter["value"]
            for name, counter in counter_set["counters"].items()
        }
    return aligned


def _device_fields(
    device: dict[str, Any], identities: dict[str, str]
) -> tuple[str, dict[str, str]]:
    name = device["name"]
    parsed = parse_device_name(name)
    fields = {}
    key = name
    if isinstance(parsed, MigDeviceName):
        slug = name.split("-mig-", 1)[1].rsplit("-", 2)[0]
        key = f"gpu-{parsed.parent_minor}-mig-{slug}-*-{parsed.placement_start}"
        fields["name.giProfileId"] = str(parsed.gi_profile_id)
    for attribute, typed in device.get("attributes", {}).items():
        ((kind, value),) = typed.items()
        text = str(value).lower() if kind == "bool" else str(value)
        fields[f"attributes.{attribute}"] = identities.get(text, text)
    for capacity, quantity in device.get("capacity", {}).items():
        fields[f"capacity.{capacity}"] = str(quantity["value"])
    for consumed in device.get("consumesCounters", []):
        for counter, quantity in consumed["counters"].items():
            fields[f"consumesCounters.{consumed['counterSet']}.{counter}"] = str(quantity["value"])
    extra = set(device) - {"name", "attributes", "capacity", "consumesCounters"}
    for other in sorted(extra):
        fields[other] = repr(device[other])
    return key, fields
