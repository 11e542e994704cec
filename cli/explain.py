"""`gpu-dra explain <namespace>/<claim>`: why a ResourceClaim is (not) allocatable.

`explain` (pure, over raw ``resource.k8s.io/v1`` objects) runs each request's devices through a
funnel of the scheduler's checks (selectors, taints, in use, capacity, shared counters), counting
per pool what passes each step, and lists the attribute values the constraints can use. The
verdict is a bound: no backtracking search is made across requests. The command reads the
cluster (`cluster`). See docs/cel.md, "gpu-dra explain and gpu-dra inventory".

A claim that is not allocated because its pod or Job waits for Kueue to admit it (docs/kueue.md)
gets Kueue's verdict first (`with_queue`: the LocalQueue, ClusterQueue and Kueue's message, from
`gpu_dra.cli.queueing`); ``NAMESPACE/job/NAME`` explains a Job: its Kueue state and each claim
its pods would use (a claim made from a ResourceClaimTemplate is explained from the template).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Final

from gpu_dra.cli.cluster import (
    add_cluster_arguments,
    api_client,
    cluster_errors,
    read_claim,
    read_claim_template,
    read_job,
    read_jobs,
    read_kueue,
    read_objects,
    read_pod,
    read_pod_events,
    read_pods,
    read_quotas,
)
from gpu_dra.cli.command import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Streams,
    Subcommand,
    write_blocks,
    write_data,
)
from gpu_dra.cli.queueing import QueueWait, claim_wait, job_wait
from gpu_dra.cli.quota_use import (
    QuotaLine,
    pod_extended_resources,
    pod_refusals,
    quota_lines,
)
from gpu_dra.driver.cel import (
    CelCompileError,
    CelRuntimeError,
    CelValueError,
    DeviceTable,
    Selector,
    compile_selector,
    select,
)
from gpu_dra.driver.cel.device import split_qualified_name
from gpu_dra.driver.cluster.availability import (
    capacity_fits,
    counter_use,
    counters_shortage,
    quantity_value,
)
from gpu_dra.driver.cluster.state import (
    ALL_NODES,
    ClusterState,
    Obj,
    PoolDevice,
    build_cluster_state,
    claim_key,
    compile_class,
    selector_expressions,
)
from gpu_dra.driver.cluster.tier_quota import SHARE_MEMORY
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.kube import errors

_SHOWN_HOLDERS: Final = 5
_SHOWN_EXPRESSION: Final = 70
_VERDICT_EXPRESSION: Final = 160


@dataclass
class Step:
    """One funnel step: how many devices came in, passed, were rejected, or raised errors."""

    name: str
    """``class gpu.nvidia.com selector #0``, ``request selector #1``, ``not allocated``, ..."""
    detail: str = ""
    """The CEL expression, or what the step checks."""
    entered: int = 0
    passed: int = 0
    rejected: int = 0
    errors: int = 0
    error_example: str = ""
    passing_by_pool: dict[str, int] = field(default_factory=dict)
    holders: list[str] = field(default_factory=list)
    """For ``not allocated``: the claims holding the rejected devices."""
    taints: list[str] = field(default_factory=list)
    """For ``not tainted``: the untolerated taints (``key=value:Effect``) of rejected devices."""
    defaults: list[str] = field(default_factory=list)
    """For ``capacity``: what a capacity the request does not name consumes on shared devices
    (its request policy's default), e.g. ``names no compute: gets 25 of 100 (1/4 ...)``."""

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.name,
            "defaults": list(self.defaults),
            "detail": self.detail,
            "in": self.entered,
            "pass": self.passed,
            "rejected": self.rejected,
            "errors": self.errors,
            "errorExample": self.error_example,
            "passingByPool": dict(self.passing_by_pool),
            "holders": list(self.holders),
            "taints": list(self.taints),
        }


@dataclass
class Alternative:
    """An ``exactly`` request or one ``firstAvailable`` subrequest, and its funnel."""

    name: str
    """``gpu`` or ``gpu/small``."""
    device_class: str
    mode: str
    count: int
    admin_access: bool
    class_selectors: tuple[str, ...]
    request_selectors: tuple[str, ...]
    steps: list[Step] = field(default_factory=list)
    problem: str = ""
    """A reason no device can be considered: unknown class, compile error."""
    candidates: list[PoolDevice] = field(default_factory=list)
    allocated: list[str] = field(default_factory=list)
    """``device -> holder`` for devices matching the selectors that are held by claims."""
    total: int = 0

    @property
    def needed(self) -> int:
        return max(self.count, 1) if self.mode != "All" else 1

    @property
    def satisfied(self) -> bool:
        if self.problem:
            return False
        if self.mode == "All":
            return bool(self.candidates)
        return best_node_count(self.candidates) >= self.count

    def verdict(self) -> str:
        wanted = "all matching devices" if self.mode == "All" else f"{self.count}"
        head = (
            f"request {self.name}: {len(self.candidates)} of {self.total} devices pass"
            f" (needs {wanted})"
        )
        if self.problem:
            return f"request {self.name}: {self.problem}"
        losses = []
        for step in self.steps:
            if step.rejected:
                if step.name == "not allocated":
                    losses.append(
                        f"{step.rejected} allocated to other claims ({_shortlist(step.holders)})"
                    )
                elif step.name == "not tainted":
                    losses.append(f"{step.rejected} excluded by taint ({_shortlist(step.taints)})")
                else:
                    detail = _short(step.detail, _VERDICT_EXPRESSION)
                    what = f"{step.name} ({detail})" if step.detail else step.name
                    losses.append(f"{step.rejected} rejected by {what}")
            if step.errors:
                losses.append(
                    f"{step.errors} CEL runtime errors in {step.name} (e.g. {step.error_example})"
                )
        text = head + (": " + "; ".join(losses) if losses else "")
        if (
            not self.problem
            and self.mode != "All"
            and len(self.candidates) >= self.count > best_node_count(self.candidates)
        ):
            text += f"; no single node has {self.count} of them"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "deviceClassName": self.device_class,
            "allocationMode": self.mode,
            "count": self.count,
            "adminAccess": self.admin_access,
            "classSelectors": list(self.class_selectors),
            "requestSelectors": list(self.request_selectors),
            "problem": self.problem,
            "funnel": [step.to_json() for step in self.steps],
            "candidates": [device.label for device in self.candidates],
            "allocated": list(self.allocated),
            "satisfied": self.satisfied,
            "verdict": self.verdict(),
        }


@dataclass
class RequestReport:
    name: str
    alternatives: list[Alternative]
    first_available: bool

    @property
    def satisfied(self) -> bool:
        return any(alternative.satisfied for alternative in self.alternatives)

    def verdict(self) -> str:
        if not self.first_available:
            return self.alternatives[0].verdict()
        chosen = next((a for a in self.alternatives if a.satisfied), None)
        lines = "; ".join(a.verdict() for a in self.alternatives)
        if chosen is None:
            return f"request {self.name}: no firstAvailable subrequest can be satisfied: {lines}"
        return f"request {self.name}: subrequest {chosen.name} can be satisfied: {lines}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "firstAvailable": self.first_available,
            "satisfied": self.satisfied,
            "verdict": self.verdict(),
            "alternatives": [alternative.to_json() for alternative in self.alternatives],
        }


@dataclass
class ConstraintReport:
    kind: str
    """``matchAttribute`` or ``distinctAttribute``."""
    attribute: str
    requests: list[str]
    values: dict[str, dict[str, int]]
    """Attribute value (as text) -> request name -> candidate devices having that value."""
    missing: dict[str, int]
    """Request name -> candidates that lack the attribute (they cannot be chosen)."""
    satisfiable: bool
    note: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "attribute": self.attribute,
            "requests": list(self.requests),
            "values": {k: dict(v) for k, v in self.values.items()},
            "missingAttribute": dict(self.missing),
            "satisfiable": self.satisfiable,
            "note": self.note,
        }


@dataclass
class Explanation:
    claim: str
    allocated: bool
    allocation: list[dict[str, Any]]
    reserved_for: list[str]
    pools: list[dict[str, Any]]
    requests: list[RequestReport]
    constraints: list[ConstraintReport]
    verdict: str
    queue: QueueWait | None = None
    """The Kueue Workload that holds back the claim's pod or Job (`with_queue`)."""
    queue_error: str = ""
    """Why Kueue's objects could not be read (the rest of the report stands)."""
    quota: list[QuotaLine] = field(default_factory=list)
    """The lines of the namespace's ResourceQuotas that limit the claim's classes."""
    quota_error: str = ""
    """Why the namespace's ResourceQuotas could not be read (the rest of the report stands)."""

    @property
    def satisfied(self) -> bool:
        """Allocated, or allocatable now and not held back by Kueue."""
        if self.allocated:
            return True
        if self.queue is not None and self.queue.waiting:
            return False
        return all(r.satisfied for r in self.requests) and all(
            c.satisfiable for c in self.constraints
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "claim": self.claim,
            "allocated": self.allocated,
            "allocation": list(self.allocation),
            "reservedFor": list(self.reserved_for),
            "verdict": self.verdict,
            "queue": None if self.queue is None else self.queue.to_json(),
            "queueError": self.queue_error,
            "quota": [line.to_json() for line in self.quota],
            "quotaError": self.quota_error,
            "pools": list(self.pools),
            "requests": [request.to_json() for request in self.requests],
            "constraints": [constraint.to_json() for constraint in self.constraints],
        }


# ---- the analysis ------------------------------------------------------------------------------


def explain(
    claim: Obj, classes: Sequence[Obj], slices: Sequence[Obj], claims: Sequence[Obj]
) -> Explanation:
    """Explain `claim` against the cluster given by `classes`, `slices` and all `claims`."""
    key = claim_key(claim)
    state = build_cluster_state(slices, claims)
    by_name = {str((c.get("metadata") or {}).get("name", "")): c for c in classes}
    devices_spec = (claim.get("spec") or {}).get("devices") or {}
    requests = [
        _request(request, by_name, state, key) for request in devices_spec.get("requests") or []
    ]
    constraints = [
        _constraint(constraint, requests) for constraint in devices_spec.get("constraints") or []
    ]
    status = claim.get("status") or {}
    allocation = status.get("allocation")
    results = [
        {
            "request": str(r.get("request", "")),
            "device": f"{r.get('driver', '')}/{r.get('pool', '')}/{r.get('device', '')}",
            **({"adminAccess": True} if r.get("adminAccess") else {}),
            **({"shareID": str(r["shareID"])} if r.get("shareID") else {}),
        }
        for r in ((allocation or {}).get("devices") or {}).get("results") or []
    ]
    reserved = [
        f"{r.get('resource', '')}/{r.get('name', '')}" for r in status.get("reservedFor") or []
    ]
    verdict = _verdict(key, allocation is not None, results, reserved, requests, constraints)
    return Explanation(
        claim=key,
        allocated=allocation is not None,
        allocation=results,
        reserved_for=reserved,
        pools=[pool.to_json() for pool in state.pools],
        requests=requests,
        constraints=constraints,
        verdict=verdict,
    )


def with_queue(explanation: Explanation, wait: QueueWait | None) -> Explanation:
    """`explanation` of a claim that is not allocated with the Kueue Workload `wait` that holds
    back its user in front of the verdict (unchanged when nothing waits)."""
    if explanation.allocated or wait is None or not wait.waiting:
        return explanation
    explanation.queue = wait
    devices = explanation.verdict.removeprefix(f"claim {explanation.claim} ")
    explanation.verdict = f"{wait.verdict(f'claim {explanation.claim}')} (devices: {devices})"
    return explanation


def _verdict(  # noqa: PLR0917 - private, called once
    key: str,
    allocated: bool,
    results: Sequence[Mapping[str, Any]],
    reserved: Sequence[str],
    requests: Sequence[RequestReport],
    constraints: Sequence[ConstraintReport],
) -> str:
    if allocated:
        devices = ", ".join(f"{r['request']} -> {r['device']}" for r in results) or "no devices"
        users = f"; reserved for {', '.join(reserved)}" if reserved else "; not reserved by a pod"
        return f"claim {key} is allocated: {devices}{users}"
    failing = [request.verdict() for request in requests if not request.satisfied]
    failing += [f"{c.kind} {c.attribute}: {c.note}" for c in constraints if not c.satisfiable]
    if failing:
        return f"claim {key} cannot be allocated now: " + " | ".join(failing)
    return (
        f"claim {key} is not allocated, but each request has enough devices: it is allocated "
        "when a pod using it is scheduled (no backtracking search was made across requests)"
    )


def _request(
    request: Obj, classes: Mapping[str, Obj], state: ClusterState, claim: str
) -> RequestReport:
    name = str(request.get("name", ""))
    if isinstance(request.get("firstAvailable"), list):
        alternatives = [
            _alternative(f"{name}/{sub.get('name', '')}", sub, classes, state, claim)
            for sub in request["firstAvailable"]
        ]
        return RequestReport(name, alternatives, True)
    exactly = request.get("exactly") or {}
    return RequestReport(name, [_alternative(name, exactly, classes, state, claim)], False)


def _alternative(
    name: str, spec: Obj, classes: Mapping[str, Obj], state: ClusterState, claim: str
) -> Alternative:
    class_name = str(spec.get("deviceClassName", ""))
    mode = str(spec.get("allocationMode") or "ExactCount")
    alternative = Alternative(
        name=name,
        device_class=class_name,
        mode=mode,
        count=int(spec.get("count") or 1) if mode != "All" else 0,
        admin_access=bool(spec.get("adminAccess", False)),
        class_selectors=(),
        request_selectors=selector_expressions(spec.get("selectors")),
        total=len(state.devices),
    )
    device_class = classes.get(class_name)
    if device_class is None:
        alternative.problem = f"DeviceClass {class_name} does not exist"
        return alternative
    compiled = compile_class(device_class)
    alternative.class_selectors = compiled.expressions
    if compiled.error:
        alternative.problem = f"class {class_name}: {compiled.error}"
        return alternative
    request_selectors: list[Selector] = []
    for number, expression in enumerate(alternative.request_selectors):
        try:
            request_selectors.append(compile_selector(expression))
        except CelCompileError as error:
            alternative.problem = f"request selector #{number} does not compile: {error.first_line}"
            return alternative
    devices = state.devices
    for number, selector in enumerate(compiled.selectors):
        devices = _selector_step(
            alternative, f"class {class_name} selector #{number}", selector, devices
        )
    for number, selector in enumerate(request_selectors):
        devices = _selector_step(alternative, f"request selector #{number}", selector, devices)
    tolerations = [t for t in spec.get("tolerations") or [] if isinstance(t, Mapping)]
    if any(untolerated_taints(d.raw, ()) for d in devices):
        devices = _taint_step(alternative, tolerations, devices)
    alternative.allocated = [
        f"{device.label} -> "
        + ", ".join(sorted({h.claim if h.claim != claim else "this claim" for h in busy}))
        for device in devices
        if (busy := device.busy_holders())
    ]
    devices = _filter_step(
        alternative,
        "not allocated",
        "adminAccess: allocated devices allowed" if alternative.admin_access else "",
        devices,
        lambda d: alternative.admin_access or d.multi_allocatable or not d.busy_holders(claim),
        holders=lambda d: [h.claim for h in d.busy_holders(claim)],
    )
    capacity = {
        str(k): str(v) for k, v in ((spec.get("capacity") or {}).get("requests") or {}).items()
    }
    if capacity or any(d.multi_allocatable for d in devices):
        detail = ", ".join(f"{k}={v}" for k, v in sorted(capacity.items()))
        defaults = unnamed_capacity_defaults(capacity, devices)
        devices = _filter_step(
            alternative,
            "capacity",
            detail,
            devices,
            lambda d: capacity_fits(d, capacity, claim) is None,
        )
        alternative.steps[-1].defaults = defaults
    if any(d.raw.get("consumesCounters") for d in devices):
        pools = {pool.key: pool for pool in state.pools}
        use = counter_use(state.devices, claim)
        devices = _filter_step(
            alternative,
            "counters",
            "shared counters of the pool",
            devices,
            lambda d: (
                counters_shortage(
                    d, pools[f"{d.driver}/{d.pool}"].counter_sets, use.get((d.driver, d.pool))
                )
                is None
            ),
        )
    alternative.candidates = devices
    return alternative


def _selector_step(
    alternative: Alternative, name: str, selector: Selector, devices: list[PoolDevice]
) -> list[PoolDevice]:
    step = Step(name, selector.expression, entered=len(devices))
    # One conversion and CEL evaluation per group of devices that agree on what the selector
    # reads; a device that does not convert is an error of that device.
    table = DeviceTable((d.driver, d.raw) for d in devices)  # type: ignore[misc]
    selection = select(selector, table)
    if selection.errors:
        index, message = selection.errors[0]
        step.errors = len(selection.errors)
        step.error_example = f"{devices[index].label}: {message}"
    passing = [devices[index] for index in selection.matched]
    step.rejected = len(devices) - len(selection.matched) - len(selection.errors)
    _finish(step, passing)
    alternative.steps.append(step)
    return passing


# Taint effects that keep the allocator away (resource-api.md §5.3); ``None`` is informational.
_SCHEDULING_EFFECTS: Final = frozenset({"NoSchedule", "NoExecute"})


def untolerated_taints(device: Obj, tolerations: Sequence[Mapping[str, Any]]) -> list[str]:
    """The device's ``NoSchedule`` / ``NoExecute`` taints that no toleration tolerates, as
    ``key=value:Effect`` (``key:Effect`` without a value). A toleration tolerates a taint when
    its effect is empty or the same, its key is the taint's (or empty with ``Exists``), and
    with ``Equal`` (the default operator) its value is the taint's."""
    found = []
    for taint in device.get("taints") or []:
        effect = str(taint.get("effect", ""))
        if effect not in _SCHEDULING_EFFECTS:
            continue
        if any(_tolerates(toleration, taint) for toleration in tolerations):
            continue
        value = str(taint.get("value") or "")
        found.append(f"{taint.get('key', '')}{'=' + value if value else ''}:{effect}")
    return found


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return not key or key == taint.get("key")
    return key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")


def _taint_step(
    alternative: Alternative, tolerations: Sequence[Mapping[str, Any]], devices: list[PoolDevice]
) -> list[PoolDevice]:
    detail = ", ".join(_toleration_text(t) for t in tolerations)
    step = Step("not tainted", f"tolerations: {detail}" if detail else "no tolerations")
    step.entered = len(devices)
    passing: list[PoolDevice] = []
    for device in devices:
        taints = untolerated_taints(device.raw, tolerations)
        if not taints:
            passing.append(device)
            continue
        step.rejected += 1
        step.taints.extend(t for t in taints if t not in step.taints)
    _finish(step, passing)
    alternative.steps.append(step)
    return passing


def _toleration_text(toleration: Mapping[str, Any]) -> str:
    operator = toleration.get("operator") or "Equal"
    key = toleration.get("key") or "*"
    text = f"{key} Exists" if operator == "Exists" else f"{key}={toleration.get('value') or ''}"
    return f"{text}:{toleration['effect']}" if toleration.get("effect") else text


def unnamed_capacity_defaults(
    requests: Mapping[str, str], devices: Sequence[PoolDevice]
) -> list[str]:
    """For each capacity of the shared (multi-allocatable) `devices` that `requests` does not
    name and whose request policy has a default: what the request gets instead, e.g. ``names
    no compute: gets 25 of 100 (1/4 of the device; gpu-dra: the node's --mps-share-replicas)``
    (resource-api.md §5.1: an unnamed amount consumes the policy's default)."""
    named = {split_qualified_name(key, "")[1] for key in requests}
    seen: dict[str, list[str]] = {}
    for device in devices:
        if not device.multi_allocatable:
            continue
        for key, entry in sorted((device.raw.get("capacity") or {}).items()):
            name = split_qualified_name(str(key), device.driver)[1]
            policy = entry.get("requestPolicy") if isinstance(entry, Mapping) else None
            default = policy.get("default") if isinstance(policy, Mapping) else None
            if name in named or default is None:
                continue
            text = f"{default} of {entry.get('value')}"
            try:
                total = quantity_value(str(entry.get("value")))
                part = quantity_value(str(default))
            except CelValueError:
                part = total = Fraction(0)
            if part > 0 and total > part:
                text += f" (1/{round(total / part)} of the device)"
            elif part > 0 and total == part:
                text += " (all of the device)"
            if text not in seen.setdefault(name, []):
                seen[name].append(text)
    notes = []
    for name, texts in seen.items():
        shown = ", ".join(texts[:3]) + (", ..." if len(texts) > 3 else "")
        notes.append(f"names no {name}: gets {shown}")
    if notes and any(device.driver == DEFAULT_DRIVER_NAME for device in devices):
        notes.append(
            f"the parts of {DEFAULT_DRIVER_NAME} devices are set by the node's "
            "--mps-share-replicas (docs/mps.md, 'Offering GPUs as shares')"
        )
    return notes


def _filter_step(
    alternative: Alternative,
    name: str,
    detail: str,
    devices: list[PoolDevice],
    keep: Callable[[PoolDevice], bool],
    *,
    holders: Callable[[PoolDevice], list[str]] | None = None,
) -> list[PoolDevice]:
    step = Step(name, detail, entered=len(devices))
    passing: list[PoolDevice] = []
    for device in devices:
        if keep(device):
            passing.append(device)
            continue
        step.rejected += 1
        for holder in holders(device) if holders else []:
            if holder not in step.holders:
                step.holders.append(holder)
    _finish(step, passing)
    alternative.steps.append(step)
    return passing


def _finish(step: Step, passing: Sequence[PoolDevice]) -> None:
    step.passed = len(passing)
    by_pool: dict[str, int] = defaultdict(int)
    for device in passing:
        by_pool[f"{device.driver}/{device.pool}"] += 1
    step.passing_by_pool = dict(by_pool)


def best_node_count(devices: Sequence[PoolDevice]) -> int:
    """The most candidates one node can use: its node-local devices plus the cluster-wide ones."""
    shared = sum(1 for d in devices if d.node == ALL_NODES)
    per_node: dict[str, int] = defaultdict(int)
    for device in devices:
        if device.node != ALL_NODES:
            per_node[device.node] += 1
    return shared + max(per_node.values(), default=0)


# ---- constraints -------------------------------------------------------------------------------


def _constraint(constraint: Obj, requests: Sequence[RequestReport]) -> ConstraintReport:
    kind = "matchAttribute" if constraint.get("matchAttribute") else "distinctAttribute"
    attribute = str(constraint.get(kind) or "")
    named = [str(r) for r in constraint.get("requests") or []]
    domain, identifier = split_qualified_name(attribute, "")
    # Which alternatives the constraint covers: "req" (all its subrequests) or "req/sub".
    groups: list[tuple[str, list[Alternative]]] = []
    for request in requests:
        if not named or request.name in named:
            groups.append((request.name, list(request.alternatives)))
            continue
        chosen = [a for a in request.alternatives if a.name in named]
        if chosen:
            groups.append((request.name, chosen))
    values: dict[str, dict[str, int]] = defaultdict(dict)
    missing: dict[str, int] = {}
    best: dict[str, dict[str, int]] = defaultdict(dict)  # value -> request -> max over alternatives
    needed: dict[str, int] = {}
    for request_name, alternatives in groups:
        needed[request_name] = min((a.needed for a in alternatives), default=1)
        lacking = 0
        for alternative in alternatives:
            counts: dict[str, int] = defaultdict(int)
            for device in alternative.candidates:
                value = _attribute(device, domain, identifier)
                if value is None:
                    lacking += 1
                else:
                    counts[value] += 1
            for value, count in counts.items():
                values[value][alternative.name] = count
                best[value][request_name] = max(best[value].get(request_name, 0), count)
        missing[request_name] = lacking
    if kind == "matchAttribute":
        feasible = [
            value
            for value, per_request in best.items()
            if all(per_request.get(r, 0) >= n for r, n in needed.items())
        ]
        satisfiable = bool(feasible) or not groups
        shown = ", ".join(f"{v!s}" for v in sorted(feasible))
        note = (
            f"values every request can meet: {shown}"
            if feasible
            else "no single value of the attribute has enough candidate devices for every request"
        )
    else:
        distinct = len(best)
        total_needed = sum(needed.values())
        satisfiable = distinct >= total_needed or not groups
        note = f"{distinct} distinct values available for {total_needed} devices"
    return ConstraintReport(
        kind=kind,
        attribute=attribute,
        requests=named or [r.name for r in requests],
        values=dict(values),
        missing=missing,
        satisfiable=satisfiable,
        note=note,
    )


def _attribute(device: PoolDevice, domain: str, identifier: str) -> str | None:
    try:
        value = device.cel().attributes.get(domain, {}).get(identifier)
    except CelRuntimeError:
        return None
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    return f"semver('{value}')"


# ---- table output ------------------------------------------------------------------------------


Block = tuple[list[str], list[list[str]]] | str


def render_explanation(explanation: Explanation) -> list[Block]:
    """The table output: lines (str) and tables (headers, rows), in order; verdict first."""
    out: list[Block] = [f"verdict: {explanation.verdict}"]
    if explanation.queue_error:
        out.append(f"kueue: {explanation.queue_error}")
    out.extend(render_quota(explanation.quota, explanation.quota_error))
    if explanation.allocated:
        out.append("allocation:")
        out.append(
            (
                ["REQUEST", "DEVICE"],
                [[r["request"], r["device"]] for r in explanation.allocation],
            )
        )
    for pool in explanation.pools:
        flag = "  INCOMPLETE" if pool["incomplete"] else ""
        out.append(
            f"pool {pool['driver']}/{pool['pool']}: generation {pool['generation']}, "
            f"{pool['devices']} devices, {pool['slices']}/{pool['resourceSliceCount']} slices, "
            f"nodes {', '.join(pool['nodes'])}{flag}"
        )
    for request in explanation.requests:
        for alternative in request.alternatives:
            mode = (
                "all devices"
                if alternative.mode == "All"
                else f"{alternative.count} device{'s' * (alternative.count != 1)}"
            )
            admin = ", adminAccess" if alternative.admin_access else ""
            out.append(
                f"request {alternative.name}: {mode} of class {alternative.device_class}{admin}"
            )
            if alternative.steps:
                out.append(
                    (
                        [
                            "STEP",
                            "SELECTOR / DETAIL",
                            "IN",
                            "PASS",
                            "OUT",
                            "ERRORS",
                            "PASS BY POOL",
                        ],
                        [
                            [
                                step.name,
                                _short(step.detail) or "-",
                                str(step.entered),
                                str(step.passed),
                                str(step.rejected),
                                str(step.errors),
                                ", ".join(f"{p}: {n}" for p, n in step.passing_by_pool.items())
                                or "-",
                            ]
                            for step in alternative.steps
                        ],
                    )
                )
            for step in alternative.steps:
                if step.errors:
                    out.append(
                        f"  {step.errors} CEL runtime errors in {step.name}, e.g. "
                        f"{step.error_example}"
                    )
            for step in alternative.steps:
                out.extend(f"  {note}" for note in step.defaults)
            for line in alternative.allocated:
                out.append(f"  allocated: {line}")
            out.append(f"  {alternative.verdict()}")
        if request.first_available:
            out.append(f"  {request.verdict()}")
    for constraint in explanation.constraints:
        values = "; ".join(
            f"{value} ({', '.join(f'{r}: {n}' for r, n in per.items())})"
            for value, per in sorted(constraint.values.items())
        )
        out.append(
            f"constraint {constraint.kind} {constraint.attribute} "
            f"(requests {', '.join(constraint.requests)}): {constraint.note}"
            f"; available values: {values or 'none'}"
        )
    return out


def render_quota(lines: Sequence[QuotaLine], error: str = "") -> list[Block]:
    """The quota table (docs/quotas.md): each limit of the namespace's ResourceQuotas on the
    classes asked for, ``full`` where one more is refused."""
    out: list[Block] = []
    if error:
        out.append(f"quota: {error}")
    if lines:
        out.append("quota:")
        rows = [
            [
                f"{line.quota}{' (tier quota)' if line.tier else ''}",
                line.resource,
                line.used or ("counted by gpu-dra" if line.resource == SHARE_MEMORY else "-"),
                line.hard,
                "full" if line.full else "",
            ]
            for line in lines
        ]
        out.append((["RESOURCEQUOTA", "RESOURCE", "USED", "HARD", ""], rows))
    return out


def claim_classes(claim: Obj) -> list[str]:
    """The DeviceClasses a claim's requests (and firstAvailable alternatives) name."""
    found: list[str] = []
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    for request in requests:
        exactly = request.get("exactly") or {}
        alternatives = [exactly] if exactly else list(request.get("firstAvailable") or [])
        if not alternatives and request.get("deviceClassName"):
            alternatives = [request]
        for alternative in alternatives:
            name = alternative.get("deviceClassName")
            if isinstance(name, str) and name not in found:
                found.append(name)
    return found


def _short(text: str, limit: int = _SHOWN_EXPRESSION) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shortlist(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_SHOWN_HOLDERS])
    return shown + (", ..." if len(items) > _SHOWN_HOLDERS else "")


# ---- the command --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument(
        "claim",
        metavar="NAMESPACE/CLAIM",
        help="the ResourceClaim to explain, e.g. default/gpu; or NAMESPACE/pod/NAME, a pod (a "
        "quota or the tier-quota policy refusing the claim it needs, then each of its claims); "
        "or NAMESPACE/job/NAME, a batch Job (its Kueue state and the claims its pods would use)",
    )
    add_cluster_arguments(parser, environ)


def run(args: argparse.Namespace, streams: Streams) -> int:
    namespace, slash, name = str(args.claim).partition("/")
    kind, job_slash, job_name = name.partition("/")
    if slash and namespace and kind == "job" and job_slash and job_name and "/" not in job_name:
        return _run_job(args, streams, namespace, job_name)
    if slash and namespace and kind == "pod" and job_slash and job_name and "/" not in job_name:
        return run_pod(args, streams, namespace, job_name)
    if not (slash and namespace and name and "/" not in name):
        raise CliError(
            "expected NAMESPACE/CLAIM, NAMESPACE/pod/NAME or NAMESPACE/job/NAME, got "
            f"{args.claim!r}",
            EXIT_USAGE,
        )
    with cluster_errors():
        client = api_client(args.kubeconfig)
        claim = read_claim(client, namespace, name)
        classes, slices, claims = read_objects(client)
    report = explain(claim, classes, slices, claims)
    if not report.allocated:
        try:
            with_queue(report, _claim_queue(client, namespace, claim))
        except errors.ApiError as error:
            report.queue_error = str(error)
    try:
        report.quota = quota_lines(read_quotas(client, namespace), claim_classes(claim))
    except errors.ApiError as error:
        report.quota_error = str(error)
    if args.output != "table":
        write_data(streams, report.to_json(), args.output)
    else:
        write_blocks(streams, render_explanation(report))
    return EXIT_OK if report.satisfied else EXIT_FAILED


def _claim_queue(client: Any, namespace: str, claim: Obj) -> QueueWait | None:
    kueue = read_kueue(client, namespace)
    if kueue is None or not kueue[0]:
        return None
    workloads, local_queues = kueue
    pods, jobs = read_pods(client, namespace), read_jobs(client, namespace)
    return claim_wait(claim, pods, jobs, workloads, local_queues)


def _run_job(args: argparse.Namespace, streams: Streams, namespace: str, name: str) -> int:
    """`gpu-dra explain NAMESPACE/job/NAME`: the Job's Kueue state, then each of its pod
    template's claims (from its ResourceClaimTemplate, or the claim it names)."""
    key = f"{namespace}/{name}"
    with cluster_errors():
        client = api_client(args.kubeconfig)
        job = read_job(client, namespace, name)
        kueue = read_kueue(client, namespace)
        wait = None if kueue is None else job_wait(job, *kueue)
        classes, slices, claims = read_objects(client)
        template = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
        reports = []
        for pod_claim in template.get("resourceClaims") or []:
            if pod_claim.get("resourceClaimTemplateName"):
                source = read_claim_template(
                    client, namespace, str(pod_claim["resourceClaimTemplateName"])
                )
                claim: Obj = {
                    "metadata": {
                        "namespace": namespace,
                        "name": f"{pod_claim['resourceClaimTemplateName']} (template)",
                    },
                    "spec": (source.get("spec") or {}).get("spec") or {},
                }
            elif pod_claim.get("resourceClaimName"):
                claim = read_claim(client, namespace, str(pod_claim["resourceClaimName"]))
            else:
                continue
            reports.append(explain(claim, classes, slices, claims))
    if wait is not None:
        verdict = wait.verdict(f"job {key}")
    else:
        suspended = bool((job.get("spec") or {}).get("suspend"))
        verdict = f"job {key} is not queued by Kueue" + (" and is suspended" if suspended else "")
    waiting = wait is not None and wait.waiting
    if args.output != "table":
        write_data(
            streams,
            {
                "job": key,
                "verdict": verdict,
                "queue": None if wait is None else wait.to_json(),
                "claims": [report.to_json() for report in reports],
            },
            args.output,
        )
    else:
        blocks: list[Block] = [f"verdict: {verdict}"]
        for report in reports:
            blocks.append(f"claim {report.claim}:")
            blocks.extend(render_explanation(report))
        write_blocks(streams, blocks)
    unsatisfied = any(not (r.allocated or r.satisfied) for r in reports)
    return EXIT_FAILED if waiting or unsatisfied else EXIT_OK


def run_pod(args: argparse.Namespace, streams: Streams, namespace: str, name: str) -> int:
    """`gpu-dra explain NAMESPACE/pod/NAME`: whether a quota or the tier-quota policy refused a
    claim the pod needs (its events, docs/quotas.md), the quota limits on its classes, then each
    of its claims (one not made yet from its ResourceClaimTemplate)."""
    key = f"{namespace}/{name}"
    with cluster_errors():
        client = api_client(args.kubeconfig)
        pod = read_pod(client, namespace, name)
        events = read_pod_events(client, namespace, name)
        quotas = read_quotas(client, namespace)
        classes, slices, claims = read_objects(client)
        pod_claims = _pod_claims(client, pod, claims)
    reports = [explain(claim, classes, slices, claims) for claim in pod_claims]
    refusals = pod_refusals(pod, events)
    wanted = [c for claim in pod_claims for c in claim_classes(claim)]
    lines = quota_lines(quotas, wanted, pod_extended_resources(pod))
    phase = str((pod.get("status") or {}).get("phase") or "Pending")
    waiting = [report for report in reports if not report.satisfied]
    if refusals:
        verdict = refusals[0].verdict(f"pod {key}")
    elif phase != "Pending":
        verdict = f"pod {key} is {phase}"
    elif waiting:
        verdict = f"pod {key} waits for devices: {waiting[0].verdict}"
    else:
        verdict = f"pod {key} is Pending; its claims are allocated or allocatable"
    if args.output != "table":
        write_data(streams, {
            "pod": key,
            "phase": phase,
            "verdict": verdict,
            "refusals": [refusal.to_json() for refusal in refusals],
            "quota": [line.to_json() for line in lines],
            "claims": [report.to_json() for report in reports],
        }, args.output)  # fmt: skip
    else:
        blocks: list[Block] = [f"verdict: {verdict}", *render_quota(lines)]
        for report in reports:
            blocks.append(f"claim {report.claim}:")
            blocks.extend(render_explanation(report))
        write_blocks(streams, blocks)
    return EXIT_FAILED if refusals or (phase == "Pending" and waiting) else EXIT_OK


def _pod_claims(client: Any, pod: Obj, claims: Sequence[Obj]) -> list[Obj]:
    """The claims of `pod`: those it names, those made for it (its status), the scheduler's
    claim for its extended resources, and, for a template whose claim is not made yet, the
    template's claim (named ``<template> (template)``)."""
    metadata, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    status = pod.get("status") or {}
    namespace = str(metadata.get("namespace") or "")
    by_name = {
        str((c.get("metadata") or {}).get("name")): c
        for c in claims
        if (c.get("metadata") or {}).get("namespace") == namespace
    }
    made = {
        str(entry.get("name")): str(entry.get("resourceClaimName") or "")
        for entry in status.get("resourceClaimStatuses") or []
    }
    found: list[Obj] = []
    for pod_claim in spec.get("resourceClaims") or []:
        claim_name = pod_claim.get("resourceClaimName") or made.get(str(pod_claim.get("name")))
        if claim_name and claim_name in by_name:
            found.append(by_name[claim_name])
        elif pod_claim.get("resourceClaimTemplateName"):
            template = str(pod_claim["resourceClaimTemplateName"])
            source = read_claim_template(client, namespace, template)
            found.append({
                "metadata": {"namespace": namespace, "name": f"{template} (template)"},
                "spec": (source.get("spec") or {}).get("spec") or {},
            })  # fmt: skip
    extended = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    if extended and extended in by_name:
        found.append(by_name[extended])
    return found


COMMAND: Final = Subcommand(
    name="explain",
    summary="say why a ResourceClaim is or is not allocatable (reads the cluster)",
    description="Read the claim, the DeviceClasses, every ResourceSlice (highest generation per\n"
    "pool; incomplete pools are marked) and every ResourceClaim, and show, for each request\n"
    "(or firstAvailable subrequest), how many devices in which pools pass each step: the\n"
    "class selectors, the request selectors (CEL evaluated as the scheduler does; runtime\n"
    "errors counted with an example), not allocated to another claim, capacity requests,\n"
    "shared counters; which claims hold the matching devices; which attribute values the\n"
    "matchAttribute / distinctAttribute constraints can use. The first line is the verdict.\n"
    "No backtracking search is made across requests: the verdict is a bound.\n"
    "Where Kueue is installed and the claim's pod or Job waits for its Workload to be\n"
    "admitted, the verdict names the LocalQueue, the ClusterQueue and Kueue's message first;\n"
    "NAMESPACE/job/NAME explains a batch Job that way, then each claim of its pod template.\n"
    "The namespace's ResourceQuota limits on the claim's classes are shown (docs/quotas.md);\n"
    "NAMESPACE/pod/NAME explains a pod: a quota or the tier-quota policy that refused the\n"
    "claim it needs (its events), then each of its claims.\n"
    "Exit status: 0 allocated or allocatable, 1 not allocatable now (or waiting in Kueue) or\n"
    "the cluster cannot be read, 2 usage error or unusable kubeconfig.",
    examples=(
        "gpu-dra explain default/my-claim",
        "gpu-dra explain team-a/job/train",
        "gpu-dra explain team-a/pod/notebook",
        "gpu-dra explain team-a/training -o json --kubeconfig ~/.kube/prod",
    ),
    add_arguments=add_arguments,
    run=run,
)
