"""Device health: what NVML events and MPS daemon checks mean for the published devices.

Pure: values in, values out. `classify_event` reads one NVML event (`HealthPolicy` says which
XIDs are application errors and ignored); `HealthState` records the problems of GPUs and MIG
devices (a later event never weakens a problem; a recovery clears a GPU's NVML problems); and
`device_health` maps them onto the published devices: a GPU's problems go to every device of it
(the whole GPU, its static MIG devices, its dynamic-MIG partitions, its MPS share device), a MIG
device's only to that device. Each problem becomes one ResourceSlice device taint
``<driver>/<key>`` (`HealthPolicy.effect`: degraded -> NoSchedule, lost -> NoExecute by
default) and the device's health in the kubelet's DRA health stream. See
docs/architecture.md, "Health monitor".
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Final

from gpu_dra.driver.nvml.interface import (
    EVENT_TYPE_SIMULATED_RECOVERY,
    NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
)
from gpu_dra.driver.resourceapi import DeviceTaint

DEFAULT_IGNORED_XIDS: Final = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs NVIDIA's DRA driver treats as application errors, not device faults (13 graphics engine
exception, 31 GPU memory page fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video
processor exception, 109 context switch timeout)."""

LOST_XIDS: Final = frozenset({79})
"""XIDs that mean the GPU is gone: 79, the GPU has fallen off the bus."""

XID_NAMES: Final = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapping recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
"""Names of well-known XIDs, for messages (NVIDIA's XID catalogue)."""

KEY_XID: Final = "xid"
KEY_ECC: Final = "ecc"
KEY_GPU_LOST: Final = "gpu-lost"
KEY_MPS_DAEMON: Final = "mps-daemon"
KEY_UNMONITORED: Final = "unmonitored"
NVML_KEYS: Final = frozenset({KEY_XID, KEY_ECC, KEY_GPU_LOST})
"""Problems NVML reports; a recovery of the GPU clears them."""

MAX_MESSAGE: Final = 1024
"""The kubelet keeps at most this many characters of a device's health message."""


class Severity(enum.IntEnum):
    """How bad a problem is; a device is as bad as its worst problem."""

    UNMONITORED = 1
    """Health unknown (NVML cannot watch the GPU): no taint, reported as Unknown."""
    DEGRADED = 2
    """The GPU reported a fault (a critical XID, a double-bit ECC error, a dead MPS daemon)."""
    LOST = 3
    """The GPU is gone (fallen off the bus, NVML answers GPU_IS_LOST)."""


class TaintEffect(enum.StrEnum):
    """``resource.k8s.io/v1`` DeviceTaint effects."""

    NONE = "None"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


class HealthStatus(enum.StrEnum):
    """The kubelet's DRA health states."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"
    UNKNOWN = "Unknown"


def parse_taint_effect(text: str, what: str) -> TaintEffect:
    """``None``, ``NoSchedule`` or ``NoExecute`` (any case); ValueError naming `what`."""
    for effect in TaintEffect:
        if text.strip().lower() == effect.value.lower():
            return effect
    choices = ", ".join(effect.value for effect in TaintEffect)
    raise ValueError(f"{what} must be one of {choices}, got {text!r}")


def parse_xids(text: str, what: str) -> frozenset[int]:
    """A comma-separated list of XIDs (``13,31``; empty: none); ValueError naming `what`."""
    xids = set()
    for item in text.split(","):
        if not item.strip():
            continue
        if not item.strip().isdigit():
            raise ValueError(f"{what}: {item.strip()!r} is not an XID (a whole number)")
        xids.add(int(item))
    return frozenset(xids)


@dataclass(frozen=True)
class HealthPolicy:
    """Which XIDs are ignored and which taint effect each severity gets."""

    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    degraded_effect: TaintEffect = TaintEffect.NO_SCHEDULE
    lost_effect: TaintEffect = TaintEffect.NO_EXECUTE
    unmonitored_effect: TaintEffect | None = None
    """A GPU NVML cannot watch (health Unknown): no taint by default, as NVIDIA's driver; a
    platform that would rather not schedule onto unwatched GPUs sets an effect."""

    def effect(self, severity: Severity) -> TaintEffect | None:
        """The taint effect of a problem of `severity`; None: no taint."""
        if severity is Severity.LOST:
            return self.lost_effect
        if severity is Severity.DEGRADED:
            return self.degraded_effect
        return self.unmonitored_effect


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a GPU or MIG device: one taint ``<driver>/<key>=<value>``."""

    key: str
    value: str
    severity: Severity
    message: str
    since: datetime
    """When the problem (at this severity) began: the taint's ``timeAdded``."""


@dataclass(frozen=True)
class Target:
    """What a problem concerns: a GPU, one of its MIG devices (GPU and compute instance), or a
    dynamic MIG partition of it offered as MPS shares (GI profile ID and placement start: the
    daemon of the MIG device made from it)."""

    gpu_uuid: str
    mig: tuple[int, int] | None = None
    placement: tuple[int, int] | None = None


class Recovery:
    """`classify_event`'s answer for "the GPU was repaired"."""

    def __repr__(self) -> str:
        return "Recovery()"


RECOVERY: Final = Recovery()


def classify_event(
    event_type: int, data: int, policy: HealthPolicy, now: datetime
) -> Problem | Recovery | None:
    """What one NVML event means: a problem, a recovery, or nothing (None: an ignored XID, a
    corrected ECC error, an event type the monitor does not act on)."""
    if event_type & EVENT_TYPE_SIMULATED_RECOVERY:
        return RECOVERY
    if event_type & NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
        if data in policy.ignored_xids:
            return None
        name = XID_NAMES.get(data)
        detail = f" ({name})" if name else ""
        severity = Severity.LOST if data in LOST_XIDS else Severity.DEGRADED
        message = f"critical XID {data}{detail} reported by NVML"
        return Problem(KEY_XID, str(data), severity, message, now)
    if event_type & NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR:
        message = "double-bit ECC error reported by NVML"
        return Problem(KEY_ECC, "double-bit", Severity.DEGRADED, message, now)
    return None


def gpu_lost(reason: str, now: datetime) -> Problem:
    """The GPU answers NVML with GPU_IS_LOST (`reason` says where)."""
    return Problem(KEY_GPU_LOST, "", Severity.LOST, f"GPU is lost: {reason}", now)


def mps_daemon_dead(detail: str, now: datetime) -> Problem:
    """The MPS daemon of the GPU's shares is not running (`detail` says why it was judged so)."""
    return Problem(
        KEY_MPS_DAEMON, "not-running", Severity.DEGRADED, f"MPS daemon not running: {detail}", now
    )


def unmonitored(reason: str, now: datetime) -> Problem:
    """NVML cannot watch the GPU (`reason`: the call and its return code)."""
    return Problem(
        KEY_UNMONITORED, "", Severity.UNMONITORED, f"health not monitored: {reason}", now
    )


@dataclass(frozen=True)
class HealthState:
    """The problems of the node's GPUs and MIG devices, by target, then key."""

    problems: Mapping[Target, Mapping[str, Problem]] = field(default_factory=dict)

    def with_problem(self, target: Target, problem: Problem) -> HealthState:
        """`problem` recorded for `target`. One problem per key: a worse one replaces it, a
        milder one is dropped (a later event never weakens a taint), one of the same severity
        updates value and message but keeps the time it began."""
        current = dict(self.problems.get(target, {}))
        old = current.get(problem.key)
        if old is not None:
            if old.severity > problem.severity:
                return self
            if old.severity == problem.severity:
                problem = replace(problem, since=old.since)
        if old == problem:
            return self
        current[problem.key] = problem
        return HealthState({**self.problems, target: current})

    def without(self, gpu_uuid: str, keys: Iterable[str], *, mig: bool = True) -> HealthState:
        """The problems of `keys` removed from the GPU (and, with `mig`, its MIG devices)."""
        drop = frozenset(keys)
        kept: dict[Target, Mapping[str, Problem]] = {}
        for target, problems in self.problems.items():
            left = problems
            own = target.mig is None and target.placement is None
            if target.gpu_uuid == gpu_uuid and (mig or own):
                left = {key: p for key, p in problems.items() if key not in drop}
            if left:
                kept[target] = left
        return self if kept == self.problems else HealthState(kept)

    def recovered(self, gpu_uuid: str) -> HealthState:
        """The GPU was repaired: its NVML problems (and its MIG devices') are gone."""
        return self.without(gpu_uuid, NVML_KEYS)

    def with_mps_daemons(
        self,
        gpus: Iterable[str],
        dead: Mapping[str, str],
        now: datetime,
        migs: Mapping[str, Target] | None = None,
    ) -> HealthState:
        """For each GPU of `gpus` (those offered as MPS shares) and each MIG device of `migs`
        (MIG UUID -> its target; static MIG devices offered as shares, and the MIG devices made
        from partitions offered as shares): a dead-daemon problem when `dead` names it (UUID ->
        why), none otherwise. A partition whose MIG device is no longer in `migs` (its last
        share went) loses its dead-daemon problem."""
        state = self
        for gpu in gpus:
            if gpu in dead:
                state = state.with_problem(Target(gpu), mps_daemon_dead(dead[gpu], now))
            else:
                state = state.without(gpu, {KEY_MPS_DAEMON}, mig=False)
        for uuid, target in (migs or {}).items():
            if uuid in dead:
                state = state.with_problem(target, mps_daemon_dead(dead[uuid], now))
            elif KEY_MPS_DAEMON in state.of(target):
                left = {k: p for k, p in state.of(target).items() if k != KEY_MPS_DAEMON}
                state = state._replaced(target, left)
        current = set((migs or {}).values())
        for target in [t for t in state.problems if t.placement is not None]:
            if target not in current and KEY_MPS_DAEMON in state.of(target):
                left = {k: p for k, p in state.of(target).items() if k != KEY_MPS_DAEMON}
                state = state._replaced(target, left)
        return state

    def _replaced(self, target: Target, problems: Mapping[str, Problem]) -> HealthState:
        """The state with `target`'s problems replaced by `problems` (none: the target goes)."""
        others = {t: p for t, p in self.problems.items() if t != target}
        return HealthState({**others, target: problems} if problems else others)

    def of(self, target: Target) -> Mapping[str, Problem]:
        return self.problems.get(target, {})


@dataclass(frozen=True)
class DeviceScope:
    """A published device and the GPU (and, for a static MIG device, the GPU and compute
    instance ids; for a dynamic MIG partition, its GI profile ID and placement start) whose
    problems it takes."""

    name: str
    gpu_uuid: str
    mig: tuple[int, int] | None = None
    placement: tuple[int, int] | None = None


@dataclass(frozen=True)
class DeviceHealth:
    """One published device's problems (worst per key), sorted by key."""

    problems: tuple[Problem, ...] = ()

    @property
    def status(self) -> HealthStatus:
        worst = max((p.severity for p in self.problems), default=None)
        if worst is None:
            return HealthStatus.HEALTHY
        return HealthStatus.UNKNOWN if worst is Severity.UNMONITORED else HealthStatus.UNHEALTHY

    @property
    def message(self) -> str:
        """The problems' messages, ``; ``-separated, at most `MAX_MESSAGE` characters."""
        text = "; ".join(p.message for p in self.problems)
        return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."

    def taints(self, policy: HealthPolicy, domain: str) -> list[DeviceTaint]:
        """One taint per problem that has an effect: ``<domain>/<key>``, its value, the
        policy's effect, ``timeAdded`` when the problem began."""
        taints: list[DeviceTaint] = []
        for problem in self.problems:
            effect = policy.effect(problem.severity)
            if effect is None:
                continue
            taint: DeviceTaint = {"key": f"{domain}/{problem.key}", "effect": effect.value}
            if problem.value:
                taint["value"] = problem.value
            taint["timeAdded"] = rfc3339(problem.since)
            taints.append(taint)
        return taints


def device_health(state: HealthState, scopes: Sequence[DeviceScope]) -> dict[str, DeviceHealth]:
    """Each published device's health. A device takes its GPU's problems and, if it is a static
    MIG device or a dynamic MIG partition, its own; a MIG problem no published device matches (a
    dynamic-MIG instance) counts for the whole GPU, as its instance is not published by ids, and
    so does a partition's no published partition matches."""
    published_migs = {(s.gpu_uuid, s.mig) for s in scopes if s.mig is not None}
    published_parts = {(s.gpu_uuid, s.placement) for s in scopes if s.placement is not None}
    gpu_wide: dict[str, list[Problem]] = {}
    for target, problems in state.problems.items():
        if target.placement is not None:
            scoped = (target.gpu_uuid, target.placement) in published_parts
        else:
            scoped = target.mig is not None and (target.gpu_uuid, target.mig) in published_migs
        if not scoped:
            gpu_wide.setdefault(target.gpu_uuid, []).extend(problems.values())
    result = {}
    for scope in scopes:
        found = list(gpu_wide.get(scope.gpu_uuid, ()))
        if scope.mig is not None:
            found.extend(state.of(Target(scope.gpu_uuid, scope.mig)).values())
        if scope.placement is not None:
            found.extend(state.of(Target(scope.gpu_uuid, placement=scope.placement)).values())
        result[scope.name] = DeviceHealth(_worst_per_key(found))
    return result


def device_taints(
    health: Mapping[str, DeviceHealth], policy: HealthPolicy, domain: str
) -> dict[str, list[DeviceTaint]]:
    """The taints of every device that has some, by device name."""
    taints = {name: h.taints(policy, domain) for name, h in health.items()}
    return {name: found for name, found in taints.items() if found}


def _worst_per_key(problems: Iterable[Problem]) -> tuple[Problem, ...]:
    worst: dict[str, Problem] = {}
    for problem in problems:
        old = worst.get(problem.key)
        if (
            old is None
            or problem.severity > old.severity
            or (problem.severity == old.severity and problem.since < old.since)
        ):
            worst[problem.key] = problem
    return tuple(worst[key] for key in sorted(worst))


def rfc3339(moment: datetime) -> str:
    """``2026-07-22T02:24:46Z``: whole seconds in UTC, as the apiserver writes times."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- the persisted part of the state (the plugin's health record) ------------------------------
HEALTH_RECORD_VERSION: Final = 1
"""Version of `persisted_to_json`'s document; a reader refuses a newer one."""


class HealthRecordError(ValueError):
    """A health record that cannot be read (what is wrong, for the message)."""


def persisted(state: HealthState) -> HealthState:
    """The part of ``state`` that outlives the process: NVML's problems (XIDs, ECC errors, a
    lost GPU), which only evidence clears. Liveness verdicts (a dead MPS daemon, an unwatched
    GPU) are found again by the next process and are left out."""
    kept: dict[Target, Mapping[str, Problem]] = {}
    for target, problems in state.problems.items():
        nvml = {key: p for key, p in problems.items() if key in NVML_KEYS}
        if nvml:
            kept[target] = nvml
    return HealthState(kept)


def persisted_to_json(state: HealthState) -> dict[str, object]:
    """The document of ``persisted(state)``: ``{"version": 1, "problems": [...]}``, one entry
    per target and key, sorted."""
    entries: list[dict[str, object]] = []
    for target, problems in persisted(state).problems.items():
        for problem in problems.values():
            entry: dict[str, object] = {
                "gpuUUID": target.gpu_uuid,
                "key": problem.key,
                "value": problem.value,
                "severity": problem.severity.name.lower(),
                "message": problem.message,
                "since": problem.since.astimezone(UTC).isoformat(),
            }
            if target.mig is not None:
                entry["mig"] = list(target.mig)
            if target.placement is not None:
                entry["placement"] = list(target.placement)
            entries.append(entry)
    entries.sort(key=lambda e: (str(e["gpuUUID"]), str(e.get("mig")), str(e["key"])))
    return {"version": HEALTH_RECORD_VERSION, "problems": entries}


def persisted_from_json(document: object) -> HealthState:
    """The state `persisted_to_json` wrote; `HealthRecordError` naming what is wrong (a newer
    version included: never read as "no problems")."""
    if not isinstance(document, Mapping):
        raise HealthRecordError("not a JSON object")
    version = document.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise HealthRecordError(f"no version number (version: {version!r:.40})")
    if version > HEALTH_RECORD_VERSION:
        raise HealthRecordError(
            f"version {version} is newer than this plugin's {HEALTH_RECORD_VERSION} (a downgrade?)"
        )
    entries = document.get("problems")
    if not isinstance(entries, list):
        raise HealthRecordError("problems is not a list")
    state = HealthState()
    for index, entry in enumerate(entries):
        try:
            target, problem = _persisted_entry(entry)
        except (KeyError, TypeError, ValueError) as error:
            raise HealthRecordError(f"problems[{index}] is unusable: {error}") from error
        state = state.with_problem(target, problem)
    return state


def _persisted_entry(entry: object) -> tuple[Target, Problem]:
    if not isinstance(entry, Mapping):
        raise TypeError("not an object")

    def text(key: str) -> str:
        value = entry[key]
        if not isinstance(value, str):
            raise TypeError(f"{key} is not a string")
        return value

    def pair(key: str) -> tuple[int, int] | None:
        value = entry.get(key)
        if value is None:
            return None
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise TypeError(f"{key} is not two integers")
        return (value[0], value[1])

    key = text("key")
    if key not in NVML_KEYS:
        raise ValueError(f"key {key!r:.40} is not one that is recorded")
    severity = Severity[text("severity").upper()]
    since = datetime.fromisoformat(text("since"))
    if since.tzinfo is None:
        raise ValueError("since has no time zone")
    target = Target(text("gpuUUID"), pair("mig"), pair("placement"))
    return target, Problem(key, text("value"), severity, text("message"), since)
