"""Kueue's part of `gpu-dra explain`: whether a claim's pod, or a Job, waits for its Kueue
Workload to be admitted, and where and why (pure, over raw objects).

Kueue (docs/kueue.md) keeps a queued Job suspended, with no pods and so no claims made from its
ResourceClaimTemplates, until its Workload gets quota in the ClusterQueue behind the Job's
LocalQueue (the ``kueue.x-k8s.io/queue-name`` label). The Workload's ``QuotaReserved``
condition carries Kueue's reason (``couldn't assign flavors to pod set main: insufficient
unused quota for gpu.nvidia.com/gpu in flavor default-flavor, 1 more needed``). `job_wait`
reads a Job's Workload; `claim_wait` the Workload of the pods or Jobs that use a claim (pods
gated by Kueue's pod integration, a Job that names the claim). A Workload is found by its owner
reference to the Job or pod, as Kueue makes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

Obj = Mapping[str, Any]

KUEUE_API: Final = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"


@dataclass(frozen=True)
class QueueWait:
    """The state of one Kueue Workload, as `gpu-dra explain` reports it."""

    workload: str
    """``namespace/name`` of the Workload."""
    local_queue: str
    """``namespace/name`` of its LocalQueue (``spec.queueName``)."""
    cluster_queue: str
    """Its ClusterQueue: the admission's, else the LocalQueue's; empty when unknown."""
    state: str
    """``waiting`` (no quota reserved), ``checks`` (quota reserved, admission checks
    pending), ``admitted``, ``finished``."""
    message: str
    """Kueue's reason: the ``QuotaReserved`` (or ``Evicted``) condition's message; a missing
    LocalQueue is said so."""

    @property
    def waiting(self) -> bool:
        return self.state in ("waiting", "checks")

    def where(self) -> str:
        queue = f"LocalQueue {self.local_queue}" if self.local_queue else "no LocalQueue"
        cluster = f" (ClusterQueue {self.cluster_queue})" if self.cluster_queue else ""
        return f"Workload {self.workload} in {queue}{cluster}"

    def verdict(self, subject: str) -> str:
        """One sentence about `subject` (``job ns/name``, ``claim ns/name``)."""
        if self.state == "admitted":
            return f"{subject} is admitted by Kueue: {self.where()}"
        if self.state == "finished":
            return f"{subject} has finished in Kueue: {self.where()}"
        if self.state == "checks":
            return (
                f"{subject} waits in Kueue: {self.where()} has quota reserved and waits for "
                f"admission checks: {self.message or 'no message'}"
            )
        return (
            f"{subject} waits in Kueue: {self.where()} has no quota reserved: "
            f"{self.message or 'no message from Kueue yet'}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "localQueue": self.local_queue,
            "clusterQueue": self.cluster_queue,
            "state": self.state,
            "message": self.message,
        }


def _meta(item: Obj) -> Obj:
    meta = item.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _key(item: Obj) -> str:
    meta = _meta(item)
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _condition(workload: Obj, kind: str) -> Obj:
    for item in (workload.get("status") or {}).get("conditions") or []:
        if isinstance(item, Mapping) and item.get("type") == kind:
            return item
    return {}


def _is_true(workload: Obj, kind: str) -> bool:
    return _condition(workload, kind).get("status") == "True"


def workload_state(workload: Obj, local_queues: Sequence[Obj]) -> QueueWait:
    """`workload`'s queue, ClusterQueue, state and Kueue's message (`local_queues`: those of
    its namespace)."""
    namespace = str(_meta(workload).get("namespace", ""))
    queue = str((workload.get("spec") or {}).get("queueName") or "")
    local = next((q for q in local_queues if _meta(q).get("name") == queue), None)
    admission = (workload.get("status") or {}).get("admission") or {}
    cluster_queue = str(admission.get("clusterQueue") or "")
    if not cluster_queue and local is not None:
        cluster_queue = str((local.get("spec") or {}).get("clusterQueue") or "")
    reserved = _condition(workload, "QuotaReserved")
    evicted = _condition(workload, "Evicted")
    message = str(reserved.get("message") or "")
    if evicted.get("status") == "True" and evicted.get("message"):
        message = (
            f"{message}; evicted: {evicted['message']}" if message else str(evicted["message"])
        )
    if queue and local is None:
        missing = f"LocalQueue {namespace}/{queue} does not exist"
        message = f"{missing}; {message}" if message else missing
    if _is_true(workload, "Finished"):
        state = "finished"
    elif _is_true(workload, "Admitted"):
        state = "admitted"
    elif reserved.get("status") == "True":
        state = "checks"
        message = str(_condition(workload, "Admitted").get("message") or message)
    else:
        state = "waiting"
    return QueueWait(
        workload=_key(workload),
        local_queue=f"{namespace}/{queue}" if queue else "",
        cluster_queue=cluster_queue,
        state=state,
        message=message,
    )


def _owned_by(workloads: Iterable[Obj], uids: set[str]) -> list[Obj]:
    return [
        w
        for w in workloads
        if any(
            isinstance(o, Mapping) and str(o.get("uid", "")) in uids
            for o in _meta(w).get("ownerReferences") or []
        )
    ]


def _uid(item: Obj) -> str:
    return str(_meta(item).get("uid", ""))


def job_wait(job: Obj, workloads: Sequence[Obj], local_queues: Sequence[Obj]) -> QueueWait | None:
    """The Kueue state of Job `job` (its Workload), or None when Kueue manages no Workload
    for it. A Job with a queue label and no Workload yet is waiting, said so."""
    owned = _owned_by(workloads, {_uid(job)})
    if owned:
        return workload_state(owned[-1], local_queues)
    queue = str((_meta(job).get("labels") or {}).get(QUEUE_LABEL) or "")
    if not queue:
        return None
    namespace = str(_meta(job).get("namespace", ""))
    local = next((q for q in local_queues if _meta(q).get("name") == queue), None)
    cluster_queue = str(((local or {}).get("spec") or {}).get("clusterQueue") or "")
    message = "Kueue has made no Workload for the Job yet (is Kueue's manager running?)"
    if local is None:
        message = f"LocalQueue {namespace}/{queue} does not exist; {message}"
    return QueueWait(
        workload="(none)",
        local_queue=f"{namespace}/{queue}",
        cluster_queue=cluster_queue,
        state="waiting",
        message=message,
    )


def _claim_names(pod_spec: Obj) -> set[str]:
    return {
        str(c["resourceClaimName"])
        for c in pod_spec.get("resourceClaims") or []
        if isinstance(c, Mapping) and c.get("resourceClaimName")
    }


def claim_wait(
    claim: Obj,
    pods: Sequence[Obj],
    jobs: Sequence[Obj],
    workloads: Sequence[Obj],
    local_queues: Sequence[Obj],
) -> QueueWait | None:
    """The Kueue state of the first Workload that holds back a user of `claim` (all objects of
    the claim's namespace), or None when no user's Workload waits. Users: the pod that owns a
    claim made from a template, pods and Jobs that name the claim."""
    name = str(_meta(claim).get("name", ""))
    owners = {
        str(o.get("uid", ""))
        for o in _meta(claim).get("ownerReferences") or []
        if isinstance(o, Mapping) and o.get("kind") == "Pod"
    }
    users: list[Obj] = [
        p for p in pods if _uid(p) in owners or name in _claim_names(p.get("spec") or {})
    ]
    uids = {_uid(p) for p in users}
    uids |= {
        str(o.get("uid", ""))
        for p in users
        for o in _meta(p).get("ownerReferences") or []
        if isinstance(o, Mapping)
    }
    for job in jobs:
        template = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
        if name in _claim_names(template):
            uids.add(_uid(job))
    uids.discard("")
    for workload in _owned_by(workloads, uids):
        state = workload_state(workload, local_queues)
        if state.waiting:
            return state
    return None
