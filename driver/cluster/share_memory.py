"""Share-memory quota (pure): how much share memory a claim asks for, a namespace's limit, and
the ledger of admitted claims that makes the count race-safe. See docs/shares.md#share-memory-quota.

A namespace's GPU quota is its ResourceQuota labelled ``gpu.nvidia.com/tier-quota: "true"``; the
key ``gpu.nvidia.com/share-memory`` of its ``spec.hard`` limits the memory all of the namespace's
share claims ask for together (Kubernetes' quota controller counts no such resource and leaves
it alone). A share claim's memory is the sum over its requests of share classes (`share_classes`:
classes whose selectors require ``device.allowMultipleAllocations``) of ``count`` times the
request's ``capacity.requests.memory``, or, for a request that names none, the largest default
share (`unnamed_share_memory`: the ``requestPolicy.default`` of ``memory``) any share device of the
driver publishes; of a ``firstAvailable`` list, the largest subrequest. `admit` decides with the
ledger (admitted claims by UID) and the namespace's claims, and gives the ledger to write back.
An entry is confirmed once its claim was seen stored (`confirmed`); a confirmed entry whose claim
is gone is pruned at once (the claim was deleted), an unconfirmed one after `LEDGER_GRACE_S`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

from gpu_dra.driver.attributes import binary_si_quantity
from gpu_dra.driver.cluster.tier_quota import SHARE_MEMORY
from gpu_dra.driver.config.quantity import QuantityError, parse_quantity
from gpu_dra.driver.jsonbounds import describe
from gpu_dra.driver.shares import MEMORY, MIB

LEDGER_GRACE_S: Final = 120.0
"""How long an unconfirmed ledger entry (its claim never seen stored) of a claim that does not
exist is kept: the claim may still be on its way to storage (admission answers first; other
webhooks may take up to 30 s). Later it was never created (another admission step refused it),
or it was deleted before anyone saw it."""

_SHARE_CONJUNCT: Final = re.compile(r"(^|&&)\s*device\.allowMultipleAllocations\s*(?=&&|$)")


class ShareQuotaError(ValueError):
    """The share memory cannot be counted (a malformed quota, ledger or request); the message
    says what and where, and is the admission refusal's cause."""


class UnsizedShareError(ShareQuotaError):
    """A share request names no memory and no share device's default size is known."""


def is_share_class(device_class: Mapping[str, Any]) -> bool:
    """Whether a DeviceClass selects only shares: one of its CEL selectors requires
    ``device.allowMultipleAllocations`` (a top-level ``&&`` term), as the catalog's
    ``mps.gpu.nvidia.com``, ``mps.mig.nvidia.com`` and ``capped.gpu.nvidia.com`` do."""
    spec = device_class.get("spec")
    selectors = spec.get("selectors") if isinstance(spec, Mapping) else None
    if not isinstance(selectors, list):
        return False
    for selector in selectors:
        cel = selector.get("cel") if isinstance(selector, Mapping) else None
        expression = cel.get("expression") if isinstance(cel, Mapping) else None
        if isinstance(expression, str) and _SHARE_CONJUNCT.search(" ".join(expression.split())):
            return True
    return False


def share_classes(classes: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """The names of the share classes (`is_share_class`) among `classes`."""
    names: set[str] = set()
    for device_class in classes:
        metadata = device_class.get("metadata")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        if isinstance(name, str) and is_share_class(device_class):
            names.add(name)
    return frozenset(names)


def unnamed_share_memory(slices: Iterable[Mapping[str, Any]], driver: str) -> int | None:
    """The largest memory a share request that names none can get: the largest
    ``capacity.memory.requestPolicy.default`` of the driver's devices that allow multiple
    allocations, rounded up to whole MiB; None when no such device is published. Devices whose
    default cannot be read are skipped (the scheduler could not use them either)."""
    largest: int | None = None
    for resource_slice in slices:
        spec = resource_slice.get("spec")
        if not isinstance(spec, Mapping) or spec.get("driver") != driver:
            continue
        devices = spec.get("devices")
        for device in devices if isinstance(devices, list) else ():
            if (
                not isinstance(device, Mapping)
                or device.get("allowMultipleAllocations") is not True
            ):
                continue
            capacity = device.get("capacity")
            memory = capacity.get(MEMORY) if isinstance(capacity, Mapping) else None
            policy = memory.get("requestPolicy") if isinstance(memory, Mapping) else None
            default = policy.get("default") if isinstance(policy, Mapping) else None
            if not isinstance(default, str):
                continue
            try:
                size = _whole_mib(parse_quantity(default))
            except QuantityError:
                continue
            largest = size if largest is None else max(largest, size)
    return largest


def _whole_mib(value: Fraction) -> int:
    """`value` bytes rounded up to whole MiB (the shares' step), as the scheduler rounds."""
    mib = -(-value // MIB)
    return int(mib) * MIB


def claim_share_memory(
    spec: object, classes: frozenset[str], unnamed: int | None, *, where: str = "spec"
) -> int:
    """The share memory (bytes) a ResourceClaim spec (resource.k8s.io/v1) asks for; 0 without
    share requests. `unnamed` is what a share request naming no memory counts as
    (`unnamed_share_memory`); `UnsizedShareError` when one needs it and it is None.
    `ShareQuotaError` for a share request that cannot be counted (``allocationMode: All``, a
    malformed count or memory), naming it under `where`."""
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    requests = devices.get("requests") if isinstance(devices, Mapping) else None
    if not isinstance(requests, list):
        return 0
    total = 0
    for index, request in enumerate(requests):
        if not isinstance(request, Mapping):
            continue
        at = f"{where}.devices.requests[{index}]"
        exactly = request.get("exactly")
        if isinstance(exactly, Mapping):
            total += _request_memory(exactly, classes, unnamed, f"{at}.exactly")
            continue
        alternatives = request.get("firstAvailable")
        if isinstance(alternatives, list):
            sizes = [
                _request_memory(sub, classes, unnamed, f"{at}.firstAvailable[{i}]")
                for i, sub in enumerate(alternatives)
                if isinstance(sub, Mapping)
            ]
            total += max(sizes, default=0)
    return total


def needs_unnamed(spec: object, classes: frozenset[str]) -> bool:
    """Whether counting `spec` needs the size of a share that names no memory."""
    try:
        claim_share_memory(spec, classes, None)
    except UnsizedShareError:
        return True
    except ShareQuotaError:
        return False
    return False


def _request_memory(
    request: Mapping[str, Any], classes: frozenset[str], unnamed: int | None, where: str
) -> int:
    if request.get("deviceClassName") not in classes:
        return 0
    mode = request.get("allocationMode", "ExactCount")
    if mode != "ExactCount":
        raise ShareQuotaError(
            f"{where}: allocationMode {describe(mode)} of share class "
            f"{request.get('deviceClassName')} cannot be counted against {SHARE_MEMORY}: ask for "
            "a count of shares (allocationMode ExactCount)"
        )
    count = request.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ShareQuotaError(f"{where}.count: expected a whole number of at least 1, got "
                              f"{describe(count)}")  # fmt: skip
    capacity = request.get("capacity")
    requests = capacity.get("requests") if isinstance(capacity, Mapping) else None
    memory = requests.get(MEMORY) if isinstance(requests, Mapping) else None
    if memory is None:
        if unnamed is None:
            raise UnsizedShareError(
                f"{where} names no capacity.requests.memory and no share device is published "
                f"to size it by (its requestPolicy default): name the memory to count it against "
                f"{SHARE_MEMORY}"
            )
        return count * unnamed
    if not isinstance(memory, str):
        raise ShareQuotaError(
            f"{where}.capacity.requests.memory: expected a quantity, got {describe(memory)}"
        )
    try:
        value = parse_quantity(memory)
    except QuantityError as error:
        raise ShareQuotaError(f"{where}.capacity.requests.memory: {error}") from error
    if value <= 0:
        raise ShareQuotaError(f"{where}.capacity.requests.memory: {memory} is not positive")
    return count * _whole_mib(value)


@dataclass(frozen=True)
class Limit:
    """One GPU quota's share-memory limit."""

    quota: str
    memory_bytes: int


def share_memory_limits(quotas: Iterable[Mapping[str, Any]]) -> tuple[Limit, ...]:
    """The limits of the GPU quotas (labelled ResourceQuotas) that set `SHARE_MEMORY`;
    `ShareQuotaError` naming the quota when its value is not a quantity."""
    limits: list[Limit] = []
    for quota in quotas:
        metadata = quota.get("metadata")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        spec = quota.get("spec")
        hard = spec.get("hard") if isinstance(spec, Mapping) else None
        if not isinstance(hard, Mapping) or SHARE_MEMORY not in hard:
            continue
        value = hard[SHARE_MEMORY]
        try:
            if not isinstance(value, str):
                raise QuantityError(f"expected a quantity string, got {describe(value)}")
            limit = parse_quantity(value)
        except QuantityError as error:
            raise ShareQuotaError(
                f"ResourceQuota {name}: spec.hard[{SHARE_MEMORY}]: {error}"
            ) from error
        limits.append(Limit(str(name), max(int(limit), 0)))
    return tuple(limits)


@dataclass(frozen=True)
class LedgerEntry:
    """An admitted share claim: its name, the memory counted, when it was admitted (Unix s),
    whether it was seen stored since."""

    name: str
    memory_bytes: int
    admitted_at: float
    confirmed: bool = False

    def encoded(self) -> str:
        entry = {
            "name": self.name,
            "memoryBytes": self.memory_bytes,
            "admittedAt": self.admitted_at,
        }
        if self.confirmed:
            entry["confirmed"] = True
        return json.dumps(entry, sort_keys=True)


Ledger = Mapping[str, LedgerEntry]
"""Admitted share claims of one namespace by UID."""


def decode_ledger(data: object, where: str) -> dict[str, LedgerEntry]:
    """The ledger in a ConfigMap's ``data`` (UID -> `LedgerEntry.encoded`; None: empty);
    `ShareQuotaError` naming `where` and the entry when it is not one."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ShareQuotaError(f"{where}: data is {describe(data)}, not an object")
    ledger: dict[str, LedgerEntry] = {}
    for uid, text in data.items():
        try:
            entry = json.loads(text) if isinstance(text, str) else None
            if not isinstance(entry, dict):
                raise ValueError(f"expected a JSON object, got {describe(text)}")
            name, memory, at = entry.get("name"), entry.get("memoryBytes"), entry.get("admittedAt")
            if not isinstance(name, str) or not isinstance(memory, int) or memory < 0:
                raise ValueError("expected name and memoryBytes (a whole number)")
            if not isinstance(at, (int, float)) or isinstance(at, bool):
                raise ValueError("expected admittedAt (Unix seconds)")
            confirmed = entry.get("confirmed", False)
            if not isinstance(confirmed, bool):
                raise ValueError("expected confirmed to be true or false")
        except ValueError as error:
            raise ShareQuotaError(f"{where}: entry {describe(uid)}: {error}") from error
        ledger[str(uid)] = LedgerEntry(name, memory, float(at), confirmed)
    return ledger


def encode_ledger(ledger: Ledger) -> dict[str, str]:
    return {uid: entry.encoded() for uid, entry in sorted(ledger.items())}


@dataclass(frozen=True)
class Decision:
    """`admit`'s answer: whether the claim fits, the refusal message, the share memory counted
    for the namespace before it, and the ledger to write back (pruned; with the claim's entry
    when it fits)."""

    allowed: bool
    message: str
    used_bytes: int
    ledger: dict[str, LedgerEntry]


def admit(
    uid: str,
    name: str,
    requested: int,
    *,
    limits: Iterable[Limit],
    ledger: Ledger,
    existing: Mapping[str, tuple[str, int]],
    now: float,
    grace_s: float = LEDGER_GRACE_S,
) -> Decision:
    """Whether claim `uid` (`name`), asking for `requested` bytes of share memory, fits under
    every limit. Used is the ledger's entries (of existing claims, and of missing ones admitted
    less than `grace_s` ago: they may not be stored yet) plus the `existing` claims (UID ->
    name, share memory) the ledger lacks (made before the quota, or while no webhook answered).
    A claim already in the ledger (a repeated review) is allowed again."""
    kept = pruned(ledger, existing, now=now, grace_s=grace_s)
    if uid in kept:
        return Decision(True, "", _used(kept, existing, uid), kept)
    used = _used(kept, existing, uid)
    for limit in limits:
        if used + requested > limit.memory_bytes:
            return Decision(False, exceeded_message(limit, requested, used), used, kept)
    return Decision(True, "", used, {**kept, uid: LedgerEntry(name, requested, now)})


def pruned(
    ledger: Ledger, existing: Mapping[str, object], *, now: float, grace_s: float = LEDGER_GRACE_S
) -> dict[str, LedgerEntry]:
    """The entries of `ledger` still counted, given the namespace's `existing` claims by UID:
    those of existing claims (confirmed now), and unconfirmed ones admitted less than `grace_s`
    ago (their claim may not be stored yet)."""
    kept: dict[str, LedgerEntry] = {}
    for key, entry in ledger.items():
        if key in existing:
            kept[key] = confirmed(entry)
        elif not entry.confirmed and now - entry.admitted_at < grace_s:
            kept[key] = entry
    return kept


def confirmed(entry: LedgerEntry) -> LedgerEntry:
    """`entry`, marked as seen stored."""
    return entry if entry.confirmed else LedgerEntry(entry.name, entry.memory_bytes,
                                                     entry.admitted_at, True)  # fmt: skip


def _used(ledger: Ledger, existing: Mapping[str, tuple[str, int]], uid: str) -> int:
    counted = {key: entry.memory_bytes for key, entry in ledger.items()}
    counted.update({key: size for key, (_, size) in existing.items() if key not in ledger})
    counted.pop(uid, None)
    return sum(counted.values())


def exceeded_message(limit: Limit, requested: int, used: int) -> str:
    """Worded as the quota admission's own refusal."""
    return (
        f"exceeded quota: {limit.quota}, requested: {SHARE_MEMORY}={binary_si_quantity(requested)}"
        f", used: {SHARE_MEMORY}={binary_si_quantity(used)}, limited: {SHARE_MEMORY}="
        f"{binary_si_quantity(limit.memory_bytes)}"
    )
