"""Read a ResourceClaim's allocation: its results, configs and the claim itself.

Each function either returns well-formed data or raises `PrepareError` naming the malformed
field (or the deleted claim), so that prepare reports it on the claim. See
docs/architecture.md, "Prepare and unprepare".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_dra.driver.jsonbounds import describe
from gpu_dra.kubelet_plugin.kubeapi import ClaimNotFoundError, ClaimReader, ResourceClaim
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.tiers.protocol import AllocatedResult, PrepareError


def _object(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise PrepareError(f"the claim's {where} is not an object: {describe(value)}")
    return value


def claim_uid(resource_claim: ResourceClaim) -> object:
    """``metadata.uid`` (None when absent); `PrepareError` when metadata is not an object."""
    return _object(resource_claim.get("metadata", {}), "metadata").get("uid")


def allocation_of(resource_claim: ResourceClaim) -> Mapping[str, Any] | None:
    """``status.allocation``; None when the claim is not allocated (no status, no or an empty
    allocation), `PrepareError` naming the field that is not an object. A malformation stays
    with the claim: retrying does not help, so the message says what is wrong, not "retry"."""
    status = resource_claim.get("status")
    if status is None:
        return None
    allocation = _object(status, "status").get("allocation")
    if allocation is None:
        return None
    return _object(allocation, "status.allocation") or None


def allocated_devices(resource_claim: ResourceClaim) -> dict[str, list[Mapping[str, Any]]]:
    """``status.allocation.devices``: its ``results`` and ``config`` (lists of objects, empty
    when absent); `PrepareError` naming what is malformed."""
    allocation = allocation_of(resource_claim)
    devices = allocation.get("devices") if allocation is not None else None
    where = "status.allocation.devices"
    if not isinstance(devices, Mapping):
        raise PrepareError(f"the claim's {where} is not an object: {describe(devices)}")
    found: dict[str, list[Mapping[str, Any]]] = {}
    for key in ("results", "config"):
        items = devices.get(key)
        items = [] if items is None else items
        if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
            raise PrepareError(f"the claim's {where}.{key} is not a list of objects")
        found[key] = items
    return found


def spec_configs(resource_claim: ResourceClaim) -> list[Mapping[str, Any]] | None:
    """``spec.devices.config`` (used only to name claim configs in messages), if well-formed."""
    spec = resource_claim.get("spec")
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    configs = devices.get("config") if isinstance(devices, Mapping) else None
    if isinstance(configs, list) and all(isinstance(c, Mapping) for c in configs):
        return configs
    return None


def allocated_result(index: int, item: Mapping[str, Any]) -> AllocatedResult:
    """One of this driver's allocation results; `PrepareError` naming a malformed field."""

    def field(key: str, kind: type | tuple[type, ...], *, required: bool = False) -> Any:
        value = item.get(key)
        if (value is None and required) or (value is not None and not isinstance(value, kind)):
            raise PrepareError(
                f"allocation result {index} of the claim is malformed: {key} is {describe(value)}"
            )
        return value

    consumed = field("consumedCapacity", Mapping)
    bad = [value for value in (consumed or {}).values() if not isinstance(value, str)]
    if bad:
        raise PrepareError(
            f"allocation result {index} of the claim is malformed: consumedCapacity is not a "
            f"map of quantity strings (it holds {describe(bad[0])})"
        )
    return AllocatedResult(
        request=field("request", str, required=True),
        device=field("device", str, required=True),
        admin_access=bool(field("adminAccess", bool)),
        share_id=field("shareID", str),
        consumed=consumed,
    )


def get_claim(reader: ClaimReader, claim: ClaimRef) -> ResourceClaim:
    """The claim as ``reader`` has it; `PrepareError` when it was deleted."""
    try:
        return reader.get_claim(claim.namespace, claim.name)
    except ClaimNotFoundError as error:
        raise PrepareError(f"{error}; it was deleted before the pod started") from error
