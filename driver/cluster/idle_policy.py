"""The idle policy's rules (pure, no I/O): which namespaces opted in and how, when a pod counts
as idle, and what the controller does about it next.

A namespace opts in with the label ``gpu.nvidia.com/idle-reclaim`` (``enabled`` or ``dry-run``)
and sets its window and grace with the annotations ``gpu.nvidia.com/idle-window`` and
``gpu.nvidia.com/idle-grace``. A claim is idle since the newest ``data.idleSince`` of its
``gpu.nvidia.com`` devices when every device allocated to it by the driver has a
``status.devices`` entry whose ``Active`` condition is False and whose ``data.sampledAt`` is at
most the policy's ``max_sample_age_s`` old; a device without one (not sampled, status off) makes
the claim not idle, and an entry whose sample is older or not named makes it **stale**: neither
idle nor busy, and the controller leaves its pods alone. A pod is idle when every such claim it
holds is idle, since the newest of their times. The pod's condition ``gpu.nvidia.com/GpuIdle``
carries the policy's state (warned at, blocked, would evict), so a new leader picks it up. See
docs/idle-reclaim.md.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME

Obj = Mapping[str, Any]

LABEL: Final = "gpu.nvidia.com/idle-reclaim"
WINDOW_ANNOTATION: Final = "gpu.nvidia.com/idle-window"
GRACE_ANNOTATION: Final = "gpu.nvidia.com/idle-grace"
CONDITION_TYPE: Final = "gpu.nvidia.com/GpuIdle"
DEFAULT_WINDOW_S: Final = 2 * 3600.0
DEFAULT_GRACE_S: Final = 30 * 60.0
DEFAULT_MAX_SAMPLE_AGE_S: Final = 3 * (30 + 10 + 2.0)
"""Three times the longest a live plugin's report waits, at its defaults: a write at most every
``--claim-status-min-interval`` (30 s) of a sample every ``--utilization-interval`` (10 s), seen
by a writer pass every 2 s."""


class Mode(enum.StrEnum):
    ENABLED = "enabled"
    DRY_RUN = "dry-run"


class Reason(enum.StrEnum):
    """Reasons of the pod condition ``gpu.nvidia.com/GpuIdle``."""

    IDLE = "Idle"
    """True: warned; evicted after the grace period unless used."""
    EVICTION_BLOCKED = "EvictionBlocked"
    """True: the grace period is over; a PodDisruptionBudget refused the eviction (retried)."""
    IDLE_DRY_RUN = "IdleDryRun"
    """True: warned in a dry-run namespace; nothing will be evicted."""
    WOULD_EVICT = "WouldEvict"
    """True: dry-run, the grace period is over; the pod would have been evicted."""
    WOULD_BE_BLOCKED = "WouldBeBlocked"
    """True: dry-run, the grace period is over; a PodDisruptionBudget would refuse it."""
    ACTIVE = "Active"
    """False: the GPU was used again (or the pod no longer counts as idle)."""


_REASONS_OF: Final = {
    Mode.ENABLED: frozenset({Reason.IDLE, Reason.EVICTION_BLOCKED}),
    Mode.DRY_RUN: frozenset({Reason.IDLE_DRY_RUN, Reason.WOULD_EVICT, Reason.WOULD_BE_BLOCKED}),
}


class PolicyError(ValueError):
    """A namespace's label or annotation the policy cannot use; the message says which and how
    to fix it."""


_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(d|h|m|s)")
_UNIT_S: Final = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds from ``90s``, ``30m``, ``2h``, ``1d``, ``1h30m``; more than 0. ValueError else."""
    value = text.strip()
    parts = _DURATION_PART.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(f"{text!r} is not a duration such as 90s, 30m, 2h, 1d or 1h30m")
    seconds = sum(float(number) * _UNIT_S[unit] for number, unit in parts)
    if seconds <= 0:
        raise ValueError(f"{text!r} is not more than 0")
    return seconds


def duration_text(seconds: float) -> str:
    """``1d2h``, ``2h``, ``1h30m``, ``45m``, ``20s``."""
    whole = round(seconds)
    out = ""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, whole = divmod(whole, size)
        if count:
            out += f"{count}{unit}"
    return out or "0s"


@dataclass(frozen=True)
class NamespacePolicy:
    namespace: str
    mode: Mode
    window_s: float
    grace_s: float


def namespace_policy(
    namespace: Obj,
    *,
    default_window_s: float = DEFAULT_WINDOW_S,
    default_grace_s: float = DEFAULT_GRACE_S,
) -> NamespacePolicy | None:
    """The policy of a Namespace object; None when it did not opt in (no label). `PolicyError`
    when its label or an annotation is not usable (the namespace is then left alone)."""
    metadata = namespace.get("metadata") or {}
    name = str(metadata.get("name") or "")
    labels = metadata.get("labels") or {}
    if LABEL not in labels:
        return None
    raw = str(labels[LABEL])
    try:
        mode = Mode(raw)
    except ValueError:
        raise PolicyError(
            f"namespace {name}: label {LABEL}={raw!r} is neither 'enabled' nor 'dry-run'; the "
            "idle policy leaves the namespace alone until it is"
        ) from None
    annotations = metadata.get("annotations") or {}
    window = _annotated(name, annotations, WINDOW_ANNOTATION, default_window_s)
    grace = _annotated(name, annotations, GRACE_ANNOTATION, default_grace_s)
    return NamespacePolicy(name, mode, window, grace)


def _annotated(namespace: str, annotations: Obj, key: str, default: float) -> float:
    if key not in annotations:
        return default
    try:
        return parse_duration(str(annotations[key]))
    except ValueError as error:
        raise PolicyError(
            f"namespace {namespace}: annotation {key}: {error}; the idle policy leaves the "
            "namespace alone until it is fixed"
        ) from None


def parse_time(text: object) -> float | None:
    """Seconds since the epoch of an RFC 3339 time; None when it is not one."""
    if not isinstance(text, str):
        return None
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class PodRef:
    name: str
    uid: str


@dataclass(frozen=True)
class ClaimActivity:
    """One claim as the policy reads it."""

    namespace: str
    name: str
    uid: str
    holds_devices: bool
    """Whether the driver allocated it any device (the policy considers no other claim)."""
    idle_since: float | None
    """When its last device went idle; None while any of its devices is not reported idle."""
    pods: tuple[PodRef, ...]
    """The pods it is reserved for (``status.reservedFor``)."""
    pools: tuple[str, ...] = ()
    """The pools of its devices: the nodes whose kubelet plugins report them (a node's pool is
    named after it)."""
    stale: tuple[str, ...] = ()
    """Why its activity report cannot be trusted now, one line per device whose ``Active``
    True or False names no sample (``data.sampledAt``) or one older than the policy's bound;
    such a device is not idle (`idle_since` None) and the claim is not busy either."""

    def idle_for(self, now: float) -> float | None:
        return None if self.idle_since is None else max(now - self.idle_since, 0.0)


def claim_activity(
    claim: Obj,
    driver: str = DEFAULT_DRIVER_NAME,
    *,
    now: float,
    max_sample_age_s: float = DEFAULT_MAX_SAMPLE_AGE_S,
) -> ClaimActivity:
    """What the policy needs of a ResourceClaim at `now` (see the module doc for when it is
    idle and when its report is stale)."""
    metadata = claim.get("metadata") or {}
    status = claim.get("status") or {}
    allocation = status.get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    allocated = {
        _device_key(result) for result in results if isinstance(result, Mapping)
        and result.get("driver") == driver
    }  # fmt: skip
    reported: dict[tuple[str, str, str], float | None] = {}
    stale: list[str] = []
    for entry in status.get("devices") or []:
        if isinstance(entry, Mapping) and entry.get("driver") == driver:
            key = _device_key(entry)
            why = _stale(entry, now, max_sample_age_s)
            if why is not None and key in allocated:
                stale.append(f"{key[0]}/{key[1]}: {why}")
            reported[key] = None if why is not None else _entry_idle_since(entry)
    since = [reported.get(key) for key in allocated]
    idle_since = (
        max(s for s in since if s is not None)
        if allocated and all(s is not None for s in since)
        else None
    )
    return ClaimActivity(
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        uid=str(metadata.get("uid") or ""),
        holds_devices=bool(allocated),
        idle_since=idle_since,
        pods=tuple(_reserved_pods(status)),
        pools=tuple(sorted({pool for pool, _, _ in allocated})),
        stale=tuple(sorted(stale)),
    )


def _device_key(item: Obj) -> tuple[str, str, str]:
    return (str(item.get("pool") or ""), str(item.get("device") or ""),
            str(item.get("shareID") or ""))  # fmt: skip


def _stale(entry: Obj, now: float, max_age_s: float) -> str | None:
    """Why an entry's ``Active`` True or False may no longer hold (None: it is fresh, or it
    has no such condition): no ``data.sampledAt``, or one more than `max_age_s` before `now`.
    A sample time ahead of `now` (clocks apart) counts as fresh."""
    active = _active_status(entry)
    if active not in ("True", "False"):
        return None
    text = (entry.get("data") or {}).get("sampledAt")
    sampled = parse_time(text)
    if sampled is None:
        return (
            f"Active={active} names no sample (data.sampledAt {text!r}; a kubelet plugin "
            "older than the idle policy's freshness check?)"
        )
    if now - sampled > max_age_s:
        age = duration_text(now - sampled)
        return (
            f"Active={active} is from a sample of {rfc3339(sampled)}, {age} ago, older than the "
            f"policy's bound {duration_text(max_age_s)} (is the node's kubelet plugin running "
            "and sampling?)"
        )
    return None


def _active_status(entry: Obj) -> str | None:
    for condition in entry.get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Active":
            return str(condition.get("status") or "")
    return None


def _entry_idle_since(entry: Obj) -> float | None:
    for condition in entry.get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Active":
            if condition.get("status") != "False":
                return None
            return parse_time((entry.get("data") or {}).get("idleSince"))
    return None


def reserved_pods(claim: Obj) -> tuple[PodRef, ...]:
    """The pods a ResourceClaim is reserved for (``status.reservedFor``)."""
    return tuple(_reserved_pods(claim.get("status") or {}))


def _reserved_pods(status: Obj) -> Iterable[PodRef]:
    for consumer in status.get("reservedFor") or []:
        if (
            isinstance(consumer, Mapping)
            and consumer.get("resource") == "pods"
            and not consumer.get("apiGroup")
        ):
            yield PodRef(str(consumer.get("name") or ""), str(consumer.get("uid") or ""))


@dataclass(frozen=True)
class IdleCondition:
    """A pod's condition ``gpu.nvidia.com/GpuIdle``."""

    status: str
    reason: str
    since: float | None
    """lastTransitionTime: when the pod was warned (status True)."""
    message: str

    @property
    def warned(self) -> bool:
        return self.status == "True"


def pod_warning(pod: Obj) -> IdleCondition | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == CONDITION_TYPE:
            return IdleCondition(
                status=str(condition.get("status") or ""),
                reason=str(condition.get("reason") or ""),
                since=parse_time(condition.get("lastTransitionTime")),
                message=str(condition.get("message") or ""),
            )
    return None


def pod_idle_since(claims: Sequence[ClaimActivity]) -> float | None:
    """When a pod holding `claims` (those with the driver's devices) became idle: the newest of
    their times when every one is idle; None otherwise (or when it holds none)."""
    held = [claim for claim in claims if claim.holds_devices]
    if not held or any(claim.idle_since is None for claim in held):
        return None
    return max(claim.idle_since for claim in held if claim.idle_since is not None)


class Action(enum.StrEnum):
    NONE = "none"
    WARN = "warn"
    """Set the condition True (Idle / IdleDryRun), Event GpuClaimIdle."""
    CLEAR = "clear"
    """Set the condition False (Active): the GPU was used again."""
    EVICT = "evict"
    """Grace over, enabled: re-check the claims, then evict through the Eviction API."""
    WOULD_EVICT = "would-evict"
    """Grace over, dry-run: ask the Eviction API in dry-run mode and report; evict nothing."""


def decide(
    policy: NamespacePolicy, warning: IdleCondition | None, idle_since: float | None, now: float
) -> Action:
    """What to do next about one pod of an opted-in namespace."""
    warned = warning is not None and warning.warned
    idle = idle_since is not None and now - idle_since >= policy.window_s
    if not idle:
        return Action.CLEAR if warned else Action.NONE
    if not warned or warning is None or warning.reason not in _REASONS_OF[policy.mode]:
        return Action.WARN  # first time, or the namespace's mode changed since the warning
    if warning.since is None or now < warning.since + policy.grace_s:
        return Action.WARN if warning.since is None else Action.NONE
    if policy.mode is Mode.ENABLED:
        return Action.EVICT
    return Action.NONE if warning.reason == Reason.WOULD_EVICT else Action.WOULD_EVICT


def warned_reason(mode: Mode) -> Reason:
    return Reason.IDLE if mode is Mode.ENABLED else Reason.IDLE_DRY_RUN


def evicts_at(policy: NamespacePolicy, warning: IdleCondition) -> float | None:
    """When a warned pod is evicted (would be, dry-run): the warning plus the grace period."""
    return None if warning.since is None else warning.since + policy.grace_s


def condition(reason: Reason, message: str, since: float) -> dict[str, str]:
    """The pod condition ``gpu.nvidia.com/GpuIdle`` as written to ``status.conditions``."""
    return {
        "type": CONDITION_TYPE,
        "status": "False" if reason is Reason.ACTIVE else "True",
        "reason": str(reason),
        "message": message[:1024],
        "lastTransitionTime": rfc3339(since),
    }


_DEADLINE: Final = re.compile(r"evicted at (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")


def warning_message(mode: Mode, idle: str, pod: str, deadline: float) -> str:
    """The warning's message: `idle` says what is idle since when; `deadline` is when `pod` is
    (would be) evicted, written so that `deadline_of` reads it back."""
    if mode is Mode.ENABLED:
        return f"{idle}: pod {pod} is evicted at {rfc3339(deadline)} unless its GPU is used"
    return (
        f"{idle}: pod {pod} would be evicted at {rfc3339(deadline)} (dry-run namespace: nothing "
        "is evicted)"
    )


def deadline_of(warning: IdleCondition) -> float | None:
    """When a warned pod is (would be) evicted, as its warning said."""
    found = _DEADLINE.search(warning.message)
    return parse_time(found.group(1)) if found else None


@dataclass(frozen=True)
class PolicyState:
    """Where a claim stands with the policy, as `gpu-dra inventory --idle` shows it."""

    mode: str
    """``enabled``, ``dry-run``, ``invalid`` or ``""`` (not opted in)."""
    reason: str
    """The reason of its pods' warning (`Reason`), ``""`` when none is warned."""
    warned_at: float | None
    evicts_at: float | None
    message: str
    text: str

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode or None,
            "reason": self.reason or None,
            "warnedAt": None if self.warned_at is None else rfc3339(self.warned_at),
            "evictsAt": None if self.evicts_at is None else rfc3339(self.evicts_at),
            "message": self.message or None,
            "text": self.text,
        }


def policy_state(namespace: Obj | None, pods: Sequence[Obj]) -> PolicyState:
    """The state of a claim of `namespace` (None: not labelled) held by `pods`: the first warned
    pod's condition, else the namespace's mode."""
    if namespace is None:
        return PolicyState("", "", None, None, "", "not opted in")
    try:
        found = namespace_policy(namespace)
    except PolicyError as error:
        return PolicyState("invalid", "", None, None, str(error), "invalid label or annotation")
    if found is None:
        return PolicyState("", "", None, None, "", "not opted in")
    mode = str(found.mode)
    warnings = [w for w in map(pod_warning, pods) if w is not None and w.warned]
    if not warnings:
        return PolicyState(mode, "", None, None, "", f"{mode}: not warned")
    warning = warnings[0]
    at = deadline_of(warning)
    since = "?" if warning.since is None else rfc3339(warning.since)
    until = "?" if at is None else rfc3339(at)
    texts: dict[str, str] = {
        Reason.IDLE: f"warned {since}, evicts at {until}",
        Reason.EVICTION_BLOCKED: f"warned {since}, eviction blocked (PodDisruptionBudget)",
        Reason.IDLE_DRY_RUN: f"dry-run: warned {since}, would evict at {until}",
        Reason.WOULD_EVICT: f"dry-run: warned {since}, would have been evicted",
        Reason.WOULD_BE_BLOCKED: f"dry-run: warned {since}, eviction would be blocked",
    }
    text = texts.get(warning.reason, f"{mode}: warned {since} ({warning.reason})")
    return PolicyState(mode, warning.reason, warning.since, at, warning.message, text)
