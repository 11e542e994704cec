"""The quota part of `gpu-dra explain` (docs/quotas.md): how much of a namespace's GPU quotas its
claims use, and whether a pod waits because a quota or the tier-quota policy refused the claim
it needs (pure, over raw objects).

A claim over a ResourceQuota is refused at creation, so the claims that wait for quota are the
ones Kubernetes makes for a pod: from a ResourceClaimTemplate (kube-controller-manager, event
``FailedResourceClaimCreation``) and for extended resources such as ``nvidia.com/gpu`` (the
scheduler, event ``FailedScheduling``). `pod_refusals` reads those events; `quota_lines` the
quotas' ``status`` for the classes and extended resources a claim or pod uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpu_dra.driver.cluster.tier_quota import (
    CLASS_SUFFIX,
    REQUESTS_PREFIX,
    SHARE_MEMORY,
    is_tier_quota,
)
from gpu_dra.driver.config.quantity import QuantityError, parse_quantity

Obj = Mapping[str, Any]

QUOTA_MARK: Final = "exceeded quota: "
POLICY_MARK: Final = "gpu-dra tier quota: "
REFUSAL_EVENTS: Final = ("FailedResourceClaimCreation", "FailedScheduling")


@dataclass(frozen=True)
class QuotaLine:
    """One limited resource of one ResourceQuota."""

    quota: str
    tier: bool
    """The quota is labelled ``gpu.nvidia.com/tier-quota: "true"``."""
    resource: str
    used: str
    hard: str

    @property
    def full(self) -> bool:
        """Used up: one more of it is refused."""
        try:
            return parse_quantity(self.used or "0") >= parse_quantity(self.hard)
        except QuantityError:
            return False

    def to_json(self) -> dict[str, Any]:
        return {
            "quota": self.quota,
            "tierQuota": self.tier,
            "resource": self.resource,
            "used": self.used,
            "hard": self.hard,
            "full": self.full,
        }


@dataclass(frozen=True)
class QuotaRefusal:
    """A claim a pod needs that the apiserver refused to make."""

    by: str
    """``quota`` (a ResourceQuota is used up) or ``policy`` (the tier-quota policy)."""
    event: str
    """The event's reason."""
    message: str
    """What the apiserver said (from the event)."""

    def verdict(self, subject: str) -> str:
        what = "a ResourceQuota is used up" if self.by == "quota" else "the tier-quota policy"
        return f"{subject} waits: the claim it needs is refused ({what}): {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"by": self.by, "event": self.event, "message": self.message}


def quota_lines(
    quotas: Iterable[Obj], classes: Iterable[str], extended: Iterable[str] = ()
) -> list[QuotaLine]:
    """The lines of `quotas` that limit `classes` (devices per DeviceClass), the extended
    resources `extended` (``requests.<name>``) or share memory, in the quotas' order."""
    wanted = {f"{name}{CLASS_SUFFIX}" for name in classes}
    wanted |= {f"{REQUESTS_PREFIX}{name}" for name in extended}
    wanted.add(SHARE_MEMORY)
    lines = []
    for quota in quotas:
        metadata = _mapping(quota.get("metadata"))
        status = _mapping(quota.get("status"))
        hard = _mapping(_mapping(quota.get("spec")).get("hard"))
        used = _mapping(status.get("used"))
        for resource in sorted(set(hard) & wanted):
            lines.append(
                QuotaLine(
                    quota=str(metadata.get("name", "")),
                    tier=is_tier_quota(quota),
                    resource=str(resource),
                    used=str(used.get(resource, "")),
                    hard=str(hard[resource]),
                )
            )
    return lines


def pod_refusals(pod: Obj, events: Sequence[Obj]) -> list[QuotaRefusal]:
    """The refusals of the claims a Pending `pod` needs, newest event first per reason; none
    once the pod left Pending."""
    phase = _mapping(pod.get("status")).get("phase", "Pending")
    if phase != "Pending":
        return []
    uid = _mapping(pod.get("metadata")).get("uid")
    newest: dict[str, tuple[str, QuotaRefusal]] = {}
    for event in events:
        involved = _mapping(event.get("involvedObject"))
        if uid and involved.get("uid") not in (None, uid):
            continue
        reason = str(event.get("reason", ""))
        message = str(event.get("message", ""))
        if reason not in REFUSAL_EVENTS:
            continue
        by = "quota" if QUOTA_MARK in message else "policy" if POLICY_MARK in message else ""
        if not by:
            continue
        when = str(event.get("lastTimestamp") or event.get("eventTime") or "")
        if reason not in newest or when >= newest[reason][0]:
            newest[reason] = (when, QuotaRefusal(by, reason, _refusal_text(message)))
    return [refusal for _, refusal in sorted(newest.values(), key=lambda item: item[0],
                                             reverse=True)]  # fmt: skip


def _refusal_text(message: str) -> str:
    """The apiserver's words in an event message (from ``exceeded quota:`` or the policy's
    ``gpu-dra tier quota:`` on)."""
    for mark in (QUOTA_MARK, POLICY_MARK):
        at = message.find(mark)
        if at >= 0:
            return message[at:].strip()
    return message.strip()


def pod_extended_resources(pod: Obj) -> list[str]:
    """The extended resource names a pod's containers ask for (names with a ``/``)."""
    names: set[str] = set()
    spec = _mapping(pod.get("spec"))
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            limits = _mapping(_mapping(_mapping(container).get("resources")).get("limits"))
            names |= {str(name) for name in limits if "/" in str(name)}
    return sorted(names)


def _mapping(value: object) -> Obj:
    return value if isinstance(value, Mapping) else {}
