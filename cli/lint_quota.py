"""`gpu-dra lint` on ResourceQuotas: the holes a tier quota leaves (docs/quotas.md).

Kubernetes counts devices per DeviceClass (``<class>.deviceclass.resource.k8s.io/devices``); a
class the quota does not name is unlimited, and two named classes that select the same devices
let claims of one take the other's hardware without counting against its limit. `quota_findings`
(pure) checks one quota against the linted classes' selections on the simulated devices:

- not labelled ``gpu.nvidia.com/tier-quota: "true"`` (so the chart's tier-quota policy leaves
  the namespace's other classes unlimited): WARNING naming the classes that reach its devices;
- two named classes selecting common devices (one limit bypasses the other): WARNING;
- a named class with an ``extendedResourceName`` but no ``requests.<name>`` limit: INFO (such
  pods are admitted over quota and wait Pending instead of being refused at creation);
- a named class the lint run does not know: WARNING (lint the catalog with the quota).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from gpu_dra.driver.cluster.tier_quota import (
    CLASS_SUFFIX,
    REQUESTS_PREFIX,
    TIER_QUOTA_LABEL,
    is_tier_quota,
)

QUOTAS_DOC: Final = "docs/quotas.md"

Level = Literal["ERROR", "WARNING", "INFO"]
DeviceKey = tuple[str, str]


@dataclass(frozen=True)
class Quota:
    """A ResourceQuota as the lint reads it."""

    name: str
    namespace: str | None
    labelled: bool
    hard: Mapping[str, str]

    @property
    def label(self) -> str:
        return f"ResourceQuota/{self.name}"

    @property
    def classes(self) -> dict[str, str]:
        """The DeviceClasses it limits: name -> limit."""
        return {
            key.removesuffix(CLASS_SUFFIX): limit
            for key, limit in self.hard.items()
            if key.endswith(CLASS_SUFFIX)
        }


@dataclass(frozen=True)
class LintedClass:
    """What the lint run knows of a DeviceClass."""

    name: str
    devices: frozenset[DeviceKey] | None
    """The simulated devices it selects; None where its selectors could not be evaluated."""
    extended_resource: str | None = None


def read_quota(manifest: Mapping[str, Any]) -> Quota | None:
    """The quota of a ``v1`` ResourceQuota manifest; None for any other object."""
    if manifest.get("kind") != "ResourceQuota" or manifest.get("apiVersion") != "v1":
        return None
    metadata = _mapping(manifest.get("metadata"))
    hard = _mapping(_mapping(manifest.get("spec")).get("hard"))
    namespace = metadata.get("namespace")
    return Quota(
        name=str(metadata.get("name") or "<unnamed>"),
        namespace=namespace if isinstance(namespace, str) else None,
        labelled=is_tier_quota(manifest),
        hard={str(key): str(value) for key, value in hard.items()},
    )


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def quota_findings(
    quota: Quota,
    classes: Mapping[str, LintedClass],
    missing: Callable[[str], str],
) -> list[tuple[Level, str, str]]:
    """(level, message, path) of each hole `quota` leaves over `classes` (the linted catalog);
    `missing(name)` describes a class the catalog lacks (with the closest name)."""
    findings: list[tuple[Level, str, str]] = []
    named = quota.classes
    where = f"namespace {quota.namespace}" if quota.namespace else "its namespace"
    for name in named:
        if name not in classes:
            findings.append(
                (
                    "WARNING",
                    f"{missing(name)}; lint the quota together with the catalog",
                    "spec.hard",
                )
            )
    known = {name: classes[name] for name in named if name in classes}
    if named and not quota.labelled:
        findings.append(("WARNING", _unlabelled(quota, known, classes, where), "metadata.labels"))
    findings.extend(_overlaps(quota, known))
    for name, linted in known.items():
        extended = linted.extended_resource
        if extended is None or f"{REQUESTS_PREFIX}{extended}" in quota.hard:
            continue
        findings.append(
            (
                "INFO",
                f"limits {name} but not {REQUESTS_PREFIX}{extended}: pods asking for "
                f"{extended} are admitted over the limit and wait Pending (the claim the "
                f"scheduler makes for them is refused); add {REQUESTS_PREFIX}{extended}: "
                f'"{named[name]}" to refuse them at creation',
                "spec.hard",
            )
        )
    return findings


def _unlabelled(
    quota: Quota,
    named: Mapping[str, LintedClass],
    classes: Mapping[str, LintedClass],
    where: str,
) -> str:
    limited = frozenset().union(*(c.devices or frozenset() for c in named.values()))
    around = sorted(
        name
        for name, linted in classes.items()
        if name not in quota.classes and linted.devices and linted.devices & limited
    )
    reach = (
        f"; {', '.join(around)} reach the same devices"
        if around
        else "; any class over the same devices gets around it"
    )
    return (
        f"limits {len(quota.classes)} DeviceClasses, but every class it does not name stays "
        f'unlimited in {where}{reach}. Fix: label it {TIER_QUOTA_LABEL}: "true" (the chart\'s '
        f"tier-quota policy then refuses the classes it does not name; {QUOTAS_DOC})"
    )


def _overlaps(quota: Quota, named: Mapping[str, LintedClass]) -> list[tuple[Level, str, str]]:
    findings: list[tuple[Level, str, str]] = []
    limits = quota.classes
    names = sorted(named)
    for index, first in enumerate(names):
        for second in names[index + 1 :]:
            mine, theirs = named[first].devices, named[second].devices
            if not mine or not theirs or not mine & theirs:
                continue
            if _zero(limits[first]) and _zero(limits[second]):
                continue
            both = len(mine & theirs)
            findings.append(
                (
                    "WARNING",
                    f"limits both {first} ({limits[first]}) and {second} ({limits[second]}), "
                    f"which select {both} common devices: claims of one take them without "
                    f"counting against the other's limit. Fix: limit classes that select "
                    f"disjoint devices, e.g. the tier classes gpu.nvidia.com, "
                    f"mig-<N>g.gpu.nvidia.com, mps.gpu.nvidia.com ({QUOTAS_DOC})",
                    "spec.hard",
                )
            )
    return findings


def _zero(limit: str) -> bool:
    return limit.strip() in {"0", "0.0"}


def sources_quotas(documents: Sequence[Mapping[str, Any]]) -> list[Quota]:
    """The ResourceQuotas among `documents`."""
    return [quota for document in documents if (quota := read_quota(document)) is not None]
