"""The idle policy that acts (leader only): idle GPU pods of opted-in namespaces are warned, then
evicted through the Eviction API.

Every `--idle-reclaim-interval` seconds one pass lists the namespaces labelled
``gpu.nvidia.com/idle-reclaim``, their ResourceClaims and pods, and applies
`gpu_dra.driver.cluster.idle_policy.decide` to each pod holding a claim with the driver's devices:
an idle pod is warned (Warning Event ``GpuClaimIdle`` on the pod and its claims, pod condition
``gpu.nvidia.com/GpuIdle`` True); after the grace period its claims are read again and, still
idle, it is evicted (policy/v1 Eviction with the pod's UID as precondition: PodDisruptionBudgets
decide; a refusal is the Event ``GpuIdleEvictionBlocked`` and the condition's reason, retried
every pass). Activity again clears the condition. A pod one of whose claims has a stale activity
report (``data.sampledAt`` older than ``max_sample_age_s``, or none) is left alone: not warned,
cleared or evicted; counted (action ``stale``) and logged. A dry-run namespace gets the same
reports and asks the Eviction API in dry-run mode, so nothing is evicted. Nothing outside opted-in
namespaces is read or written. See docs/idle-reclaim.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from kubernetes import client as k8s

from gpu_dra.controller.metrics import IdleReclaimMetrics
from gpu_dra.driver.cluster import idle_policy as policy
from gpu_dra.driver.cluster.idle_policy import (
    Action,
    ClaimActivity,
    IdleCondition,
    NamespacePolicy,
    PodRef,
    Reason,
)
from gpu_dra.driver.resourceapi import API_GROUP
from gpu_dra.kube import errors
from gpu_dra.kube.client import (
    CLAIMS_API,
    decoded_items,
    list_namespaced_objects,
    read_resource_claim,
    translated_errors,
)
from gpu_dra.kube.events import InvolvedObject, KubernetesEventApi, event

log = logging.getLogger(__name__)

COMPONENT: Final = "gpu-dra-controller"
REASON_IDLE: Final = "GpuClaimIdle"
REASON_ACTIVE: Final = "GpuClaimActive"
REASON_EVICTED: Final = "GpuClaimIdleEvicted"
REASON_BLOCKED: Final = "GpuIdleEvictionBlocked"
REASON_WOULD_EVICT: Final = "GpuClaimIdleWouldEvict"
REASON_INVALID: Final = "GpuIdleReclaimInvalid"

Obj = Mapping[str, Any]


class EvictionRefused(errors.ApiError):
    """The Eviction API answered 429: a PodDisruptionBudget does not allow it now."""


class IdleReclaimApi(Protocol):
    """What the policy reads and writes; every call blocks and raises `errors.ApiError`."""

    def list_policy_namespaces(self) -> list[Obj]:
        """The Namespaces carrying the label ``gpu.nvidia.com/idle-reclaim`` (any value)."""
        ...

    def list_claims(self, namespace: str) -> list[Obj]: ...

    def read_claim(self, namespace: str, name: str) -> Obj: ...

    def list_pods(self, namespace: str) -> list[Obj]: ...

    def patch_pod_condition(
        self, namespace: str, name: str, uid: str, condition: Mapping[str, str]
    ) -> None:
        """Merge `condition` (by type) into the pod's ``status.conditions``, if its UID is
        `uid`."""
        ...

    def evict(self, namespace: str, name: str, uid: str, *, dry_run: bool) -> None:
        """Evict the pod if its UID is `uid`; `EvictionRefused` on 429."""
        ...

    def create_event(self, namespace: str, event: dict[str, Any]) -> None: ...

    def list_plugin_pods(self, selector: str) -> list[Obj]:
        """The kubelet plugin pods `selector` matches, in every namespace."""
        ...


class KubernetesIdleReclaimApi:
    """`IdleReclaimApi` on the `kubernetes` client (raw JSON in and out)."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 30.0) -> None:
        self._client = api_client
        self._core: Any = k8s.CoreV1Api(api_client)
        self._objects: Any = k8s.CustomObjectsApi(api_client)
        self._events = KubernetesEventApi(api_client, request_timeout_s=request_timeout_s)
        self._timeout = request_timeout_s

    def list_policy_namespaces(self) -> list[Obj]:
        action = f"list Namespaces labelled {policy.LABEL}"
        with translated_errors(action):
            response = self._core.list_namespace(
                label_selector=policy.LABEL, _preload_content=False, _request_timeout=self._timeout
            )
        return [*decoded_items(response.data, action)]

    def list_claims(self, namespace: str) -> list[Obj]:
        claims: list[Obj] = [
            *list_namespaced_objects(
                self._client, CLAIMS_API, "resourceclaims", namespace,
                request_timeout_s=self._timeout,
            )
        ]  # fmt: skip
        return claims

    def read_claim(self, namespace: str, name: str) -> Obj:
        return read_resource_claim(self._client, namespace, name, request_timeout_s=self._timeout)

    def list_plugin_pods(self, selector: str) -> list[Obj]:
        action = f"list kubelet plugin Pods ({selector})"
        with translated_errors(action):
            response = self._core.list_pod_for_all_namespaces(
                label_selector=selector, _preload_content=False, _request_timeout=self._timeout
            )
        return [*decoded_items(response.data, action)]

    def list_pods(self, namespace: str) -> list[Obj]:
        action = f"list Pods in {namespace}"
        with translated_errors(action):
            response = self._core.list_namespaced_pod(
                namespace, _preload_content=False, _request_timeout=self._timeout
            )
        return [*decoded_items(response.data, action)]

    def patch_pod_condition(
        self, namespace: str, name: str, uid: str, condition: Mapping[str, str]
    ) -> None:
        body = {"metadata": {"uid": uid}, "status": {"conditions": [dict(condition)]}}
        with translated_errors(f"patch the status of Pod {namespace}/{name}"):
            self._core.patch_namespaced_pod_status(
                name, namespace, body,
                _content_type="application/strategic-merge-patch+json",
                _preload_content=False, _request_timeout=self._timeout,
            )  # fmt: skip

    def evict(self, namespace: str, name: str, uid: str, *, dry_run: bool) -> None:
        options: dict[str, Any] = {"preconditions": {"uid": uid}}
        if dry_run:
            options["dryRun"] = ["All"]
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": options,
        }
        action = f"evict Pod {namespace}/{name}" + (" (dry run)" if dry_run else "")
        try:
            with translated_errors(action):
                # dryRun both in the query (admission sees it: request.dryRun) and the body
                # (the apiserver requires the two to match when both are given).
                self._core.create_namespaced_pod_eviction(
                    name, namespace, body, dry_run="All" if dry_run else None,
                    _preload_content=False, _request_timeout=self._timeout,
                )  # fmt: skip
        except errors.ApiError as error:
            if error.status == 429:
                raise EvictionRefused(str(error), status=429, reason=error.reason) from error
            raise

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        self._events.create_event(namespace, event)


def pod_target(namespace: str, pod: PodRef) -> InvolvedObject:
    return InvolvedObject("v1", "Pod", namespace, pod.name, pod.uid)


def claim_target(claim: ClaimActivity) -> InvolvedObject:
    return InvolvedObject(f"{API_GROUP}/v1", "ResourceClaim", claim.namespace, claim.name,
                          claim.uid)  # fmt: skip


@dataclass
class PassResult:
    """What one pass did, for logs and tests."""

    actions: list[tuple[str, str, str]] = field(default_factory=list)
    """(namespace, pod, action) of every action taken (metric names: warned, evicted, ...)."""
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Pod:
    policy: NamespacePolicy
    ref: PodRef
    claims: tuple[ClaimActivity, ...]
    warning: IdleCondition | None
    started: float | None
    """``status.startTime``: a pod is idle no longer than it has run (a claim it took over from
    an earlier pod may have been idle before)."""

    def idle_since(self, claims: tuple[ClaimActivity, ...] | None = None) -> float | None:
        since = policy.pod_idle_since(self.claims if claims is None else claims)
        if since is None or self.started is None:
            return since
        return max(since, self.started)


class IdleReclaimer:
    """One pass at a time (`reconcile`); see the module doc."""

    def __init__(
        self,
        api: IdleReclaimApi,
        metrics: IdleReclaimMetrics,
        *,
        driver: str,
        instance: str,
        default_window_s: float = policy.DEFAULT_WINDOW_S,
        default_grace_s: float = policy.DEFAULT_GRACE_S,
        plugin_selector: str = "",
        max_sample_age_s: float = policy.DEFAULT_MAX_SAMPLE_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`plugin_selector`: label selector of the kubelet plugin pods; a pod is evicted only
        while the plugin pod of each of its claims' nodes is Ready (empty: no such check).
        `max_sample_age_s`: how old the sample behind a claim's Active condition may be before
        the policy stops acting on it."""
        self._api = api
        self._metrics = metrics
        self._driver = driver
        self._instance = instance
        self._default_window_s = default_window_s
        self._default_grace_s = default_grace_s
        self._clock = clock
        self._reported_invalid: dict[str, str] = {}
        self._acting: Callable[[], bool] = lambda: True
        self._plugin_selector = plugin_selector
        self._max_sample_age_s = max_sample_age_s
        self._stale_logged: dict[tuple[str, str], str] = {}
        self._ready_nodes: set[str] | None = None  # per pass, read when first needed

    def reconcile(self, acting: Callable[[], bool] = lambda: True) -> PassResult:
        """One pass; it stops before the next pod once `acting()` is False (the leader lost its
        Lease while the pass ran in its thread)."""
        self._acting = acting
        self._ready_nodes = None
        result = PassResult()
        try:
            namespaces = self._api.list_policy_namespaces()
        except errors.ApiError as error:
            self._fail(result, "list-namespaces", str(error))
            return result
        modes: dict[tuple[str, str], int] = {}
        idle_claims: dict[str, int] = {}
        stale_claims: dict[str, int] = {}
        for namespace in namespaces:
            name = str((namespace.get("metadata") or {}).get("name") or "")
            try:
                found = policy.namespace_policy(
                    namespace,
                    default_window_s=self._default_window_s,
                    default_grace_s=self._default_grace_s,
                )
            except policy.PolicyError as error:
                modes[(name, "invalid")] = 1
                self._report_invalid(namespace, str(error))
                continue
            self._reported_invalid.pop(name, None)
            if found is None:  # the label went away between list and read
                continue
            modes[(name, str(found.mode))] = 1
            try:
                idle_claims[name], stale_claims[name] = self._namespace(found, result)
            except errors.ApiError as error:
                self._fail(result, "list", str(error))
        self._metrics.set_snapshot(idle_claims, modes, stale_claims)
        return result

    def _fail(self, result: PassResult, call: str, message: str) -> None:
        log.warning("idle policy: %s", message)
        result.failures.append(message)
        self._metrics.count_error(call)

    def _report_invalid(self, namespace: Obj, message: str) -> None:
        metadata = namespace.get("metadata") or {}
        name = str(metadata.get("name") or "")
        if self._reported_invalid.get(name) == message:
            return
        self._reported_invalid[name] = message
        log.warning("idle policy: %s", message)
        target = InvolvedObject("v1", "Namespace", name, name, str(metadata.get("uid") or ""))
        self._post(target, REASON_INVALID, message, warning=True)

    def _activity(self, claim: Obj) -> ClaimActivity:
        return policy.claim_activity(
            claim, self._driver, now=self._clock(), max_sample_age_s=self._max_sample_age_s
        )

    def _namespace(self, found: NamespacePolicy, result: PassResult) -> tuple[int, int]:
        """Act on the namespace's pods; the number of its claims idle for its window, and of
        those whose activity report is stale."""
        now = self._clock()
        claims = [self._activity(claim) for claim in self._api.list_claims(found.namespace)]
        claims = [claim for claim in claims if claim.holds_devices]
        pods = {
            str((pod.get("metadata") or {}).get("name") or ""): pod
            for pod in self._api.list_pods(found.namespace)
        }
        held: dict[PodRef, list[ClaimActivity]] = defaultdict(list)
        for claim in claims:
            for ref in claim.pods:
                held[ref].append(claim)
        for ref, pod_claims in sorted(held.items(), key=lambda item: item[0].name):
            if not self._acting():
                break
            pod = pods.get(ref.name)
            if pod is None or not _live(pod, ref.uid):
                continue
            warning = policy.pod_warning(pod)
            started = policy.parse_time((pod.get("status") or {}).get("startTime"))
            try:
                self._pod(_Pod(found, ref, tuple(pod_claims), warning, started), now, result)
            except errors.ApiError as error:
                self._fail(result, "pod", f"pod {found.namespace}/{ref.name}: {error}")
        idle = sum(
            1 for claim in claims if (claim.idle_for(now) or 0.0) >= found.window_s
            and claim.idle_since is not None
        )  # fmt: skip
        return idle, sum(1 for claim in claims if claim.stale)

    def _pod(self, pod: _Pod, now: float, result: PassResult) -> None:
        if self._left_stale(pod, pod.claims, result):
            return
        idle_since = pod.idle_since()
        action = policy.decide(pod.policy, pod.warning, idle_since, now)
        if action is Action.NONE:
            return
        if action is Action.CLEAR:
            self._clear(pod, now, result)
            return
        assert idle_since is not None
        if action is Action.WARN:
            self._warn(pod, idle_since, now, result)
            return
        assert pod.warning is not None
        assert pod.warning.since is not None
        if not self._reported_live(pod):
            self._count(pod, "deferred", result)
            return
        if action is Action.EVICT:
            fresh = tuple(
                self._activity(self._api.read_claim(pod.policy.namespace, claim.name))
                for claim in pod.claims
            )
            if self._left_stale(pod, fresh, result):
                return
            since = pod.idle_since(fresh)
            if since is None or now - since < pod.policy.window_s:
                self._clear(_Pod(pod.policy, pod.ref, fresh, pod.warning, pod.started), now,
                            result)  # fmt: skip
                return
            self._evict(pod, pod.warning.since, dry_run=False, result=result, now=now)
        else:
            self._evict(pod, pod.warning.since, dry_run=True, result=result, now=now)

    def _left_stale(self, pod: _Pod, claims: tuple[ClaimActivity, ...], result: PassResult) -> bool:
        """Whether a claim of the pod has a stale activity report: then the pod is left alone
        this pass (neither warned, cleared nor evicted), counted and logged (once until the
        reasons change)."""
        key = (pod.policy.namespace, pod.ref.name)
        stale = [f"claim {c.name}: {line}" for c in claims for line in c.stale]
        if not stale:
            self._stale_logged.pop(key, None)
            return False
        self._count(pod, "stale", result)
        what = "; ".join(stale)
        reasons = "; ".join(line.split(", ", 1)[0] for line in stale)  # without the age
        if self._stale_logged.get(key) != reasons:
            self._stale_logged[key] = reasons
            log.warning("idle policy: %s/%s left alone (not warned, cleared or evicted): its "
                        "activity report is stale: %s; acted on again once the kubelet plugin "
                        "reports afresh", pod.policy.namespace, pod.ref.name, what)  # fmt: skip
        return True

    def _reported_live(self, pod: _Pod) -> bool:
        """Whether the plugin of every node the pod's claims are on is Ready: one that is down
        reports nothing new, so its last "idle" may be stale."""
        if not self._plugin_selector:
            return True
        if self._ready_nodes is None:
            self._ready_nodes = {
                str((plugin.get("spec") or {}).get("nodeName") or "")
                for plugin in self._api.list_plugin_pods(self._plugin_selector)
                if _ready(plugin)
            }
        down = sorted({p for c in pod.claims for p in c.pools} - self._ready_nodes)
        if down:
            log.warning("idle policy: %s/%s not evicted now: no Ready kubelet plugin on %s "
                        "(its idle report may be stale); tried again next pass",
                        pod.policy.namespace, pod.ref.name, ", ".join(down))  # fmt: skip
        return not down

    def _describe(self, pod: _Pod) -> str:
        names = ", ".join(claim.name for claim in pod.claims)
        return f"claim{'s' if len(pod.claims) > 1 else ''} {names}"

    def _warn(self, pod: _Pod, idle_since: float, now: float, result: PassResult) -> None:
        found = pod.policy
        idle = (
            f"the GPU of {self._describe(pod)} has been idle since {policy.rfc3339(idle_since)} "
            f"(namespace window {policy.duration_text(found.window_s)})"
        )
        message = policy.warning_message(found.mode, idle, pod.ref.name, now + found.grace_s)
        reason = policy.warned_reason(found.mode)
        self._api.patch_pod_condition(
            found.namespace, pod.ref.name, pod.ref.uid, policy.condition(reason, message, now)
        )
        self._to_all(pod, REASON_IDLE, message, warning=True)
        self._count(pod, "warned", result)

    def _clear(self, pod: _Pod, now: float, result: PassResult) -> None:
        message = f"the GPU of {self._describe(pod)} is in use again (or no longer idle)"
        self._api.patch_pod_condition(
            pod.policy.namespace, pod.ref.name, pod.ref.uid,
            policy.condition(Reason.ACTIVE, message, now),
        )  # fmt: skip
        self._post(pod_target(pod.policy.namespace, pod.ref), REASON_ACTIVE, message,
                   warning=False)  # fmt: skip
        self._count(pod, "cleared", result)

    def _evict(
        self, pod: _Pod, warned_at: float, *, dry_run: bool, result: PassResult, now: float
    ) -> None:
        found = pod.policy
        ref = pod.ref
        try:
            self._api.evict(found.namespace, ref.name, ref.uid, dry_run=dry_run)
        except EvictionRefused as error:
            blocked = Reason.WOULD_BE_BLOCKED if dry_run else Reason.EVICTION_BLOCKED
            self._count(pod, "would-block" if dry_run else "blocked", result)
            if pod.warning is not None and pod.warning.reason == blocked:
                return  # reported when it was first refused; retried every pass
            message = (
                f"pod {ref.name} {'would not be' if dry_run else 'was not'} evicted for its idle "
                f"{self._describe(pod)}: the Eviction API refused ({error}); "
                + ("dry-run namespace" if dry_run else "retried every pass until it allows it")
            )
            self._api.patch_pod_condition(
                found.namespace, ref.name, ref.uid, policy.condition(blocked, message, warned_at)
            )
            self._to_all(pod, REASON_BLOCKED, message, warning=True)
            return
        except errors.NotFoundError:
            return  # gone (or recreated under another UID) meanwhile
        idle = f"its {self._describe(pod)} stayed idle through the grace period"
        if dry_run:
            message = f"pod {ref.name} would have been evicted (dry-run namespace): {idle}"
            self._api.patch_pod_condition(
                found.namespace, ref.name, ref.uid,
                policy.condition(Reason.WOULD_EVICT, message, warned_at),
            )  # fmt: skip
            self._to_all(pod, REASON_WOULD_EVICT, message, warning=True)
            self._count(pod, "would-evict", result)
        else:
            message = f"pod {ref.name} evicted by the namespace's GPU idle policy: {idle}"
            self._to_all(pod, REASON_EVICTED, message, warning=True)
            self._count(pod, "evicted", result)
        log.info("idle policy: %s/%s: %s", found.namespace, ref.name, message)

    def _count(self, pod: _Pod, action: str, result: PassResult) -> None:
        self._metrics.count_action(pod.policy.namespace, action)
        result.actions.append((pod.policy.namespace, pod.ref.name, action))

    def _to_all(self, pod: _Pod, reason: str, message: str, *, warning: bool) -> None:
        self._post(pod_target(pod.policy.namespace, pod.ref), reason, message, warning=warning)
        for claim in pod.claims:
            self._post(claim_target(claim), reason, message, warning=warning)

    def _post(self, target: InvolvedObject, reason: str, message: str, *, warning: bool) -> None:
        body = event(target, reason, message, warning=warning, component=COMPONENT,
                     instance=self._instance, now=self._clock())  # fmt: skip
        try:
            self._api.create_event(target.namespace, body)
        except errors.ApiError as error:
            log.warning("idle policy: Event %s on %s %s/%s not recorded: %s", reason,
                        target.kind, target.namespace, target.name, error)  # fmt: skip
            self._metrics.count_error("event")


def _ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _live(pod: Obj, uid: str) -> bool:
    """The pod the claim names (same UID), not terminating, not finished."""
    metadata = pod.get("metadata") or {}
    phase = (pod.get("status") or {}).get("phase")
    return (
        metadata.get("uid") == uid
        and not metadata.get("deletionTimestamp")
        and phase not in ("Succeeded", "Failed")
    )


async def idle_reclaim_loop(
    reclaimer: IdleReclaimer, interval_s: float, stop: asyncio.Event
) -> None:
    """`reclaimer.reconcile` now and every `interval_s` seconds until `stop` (or cancelled: the
    leader lost its Lease)."""
    leading = threading.Event()
    leading.set()
    try:
        while not stop.is_set():
            try:
                result = await asyncio.to_thread(reclaimer.reconcile, leading.is_set)
            except Exception:
                log.exception("idle policy pass failed")
            else:
                for namespace, pod, action in result.actions:
                    log.info("idle policy: %s/%s %s", namespace, pod, action)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
    finally:
        leading.clear()  # a pass still running in its thread stops before its next pod
