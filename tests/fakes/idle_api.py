"""An in-memory `gpu_dra.controller.idle_reclaim.IdleReclaimApi`: namespaces, claims and pods as
the apiserver keeps them, where the idle policy can tell.

Claims are read as a live kubelet plugin keeps them when ``plugin_clock`` is set: every ``Active``
True or False entry without a ``data.sampledAt`` of its own names a sample of that clock's now.
Pod status patches merge conditions by type (strategic merge) and refuse a UID mismatch;
evictions honour a UID precondition, answer 429 for pods in ``blocked`` (a PodDisruptionBudget)
and, unless dry run, mark the pod terminating. Every call is recorded with its namespace, so a
test can prove what was never touched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from gpu_dra.controller.idle_reclaim import EvictionRefused
from gpu_dra.driver.cluster.idle_policy import LABEL, rfc3339
from gpu_dra.kube import errors

Obj = dict[str, Any]


class FakeIdleApi:
    def __init__(self) -> None:
        self.namespaces: dict[str, Obj] = {}
        self.claims: dict[tuple[str, str], Obj] = {}
        self.pods: dict[tuple[str, str], Obj] = {}
        self.events: list[Obj] = []
        self.evictions: list[tuple[str, str, str, bool]] = []
        self.calls: list[tuple[str, str]] = []
        """(call, namespace) of every call."""
        self.blocked: set[tuple[str, str]] = set()
        self.on_read_claim: Callable[[Obj], Obj] | None = None
        self.fail: dict[str, errors.ApiError] = {}
        self.plugins: list[Obj] = []
        """Kubelet plugin pods, for `list_plugin_pods`."""
        self.plugin_clock: Callable[[], float] | None = None
        """A live plugin's clock: claims read name a sample of its now (see the module doc)."""

    # -- test setup ------------------------------------------------------------------------

    def add_namespace(
        self, name: str, label: str | None = None, annotations: Mapping[str, str] | None = None
    ) -> None:
        metadata: Obj = {"name": name, "uid": f"ns-{name}"}
        if label is not None:
            metadata["labels"] = {LABEL: label}
        if annotations:
            metadata["annotations"] = dict(annotations)
        self.namespaces[name] = {"metadata": metadata}

    def add_pod(
        self, namespace: str, name: str, uid: str | None = None, started: str | None = None
    ) -> None:
        """A running pod; `started`: its ``status.startTime`` (none by default)."""
        status: Obj = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        if started is not None:
            status["startTime"] = started
        self.pods[(namespace, name)] = {
            "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}"},
            "status": status,
        }

    def add_claim(self, claim: Obj) -> None:
        metadata = claim["metadata"]
        self.claims[(metadata["namespace"], metadata["name"])] = claim

    def condition(self, namespace: str, pod: str, kind: str) -> Obj | None:
        for condition in self.pods[(namespace, pod)]["status"].get("conditions", []):
            if condition["type"] == kind:
                return dict(condition)
        return None

    def reasons(self, namespace: str | None = None) -> list[tuple[str, str, str]]:
        """(kind, name, reason) of the Events, in order."""
        return [
            (e["involvedObject"]["kind"], e["involvedObject"]["name"], e["reason"])
            for e in self.events
            if namespace is None or e["metadata"]["namespace"] == namespace
        ]

    def writes(self, namespace: str) -> list[str]:
        return [call for call, ns in self.calls if ns == namespace and call not in ("list", "read")]

    # -- IdleReclaimApi --------------------------------------------------------------------

    def _call(self, call: str, namespace: str) -> None:
        self.calls.append((call, namespace))
        if call in self.fail:
            raise self.fail[call]

    def list_policy_namespaces(self) -> list[Obj]:
        self._call("list-namespaces", "")
        return [
            copy.deepcopy(ns)
            for ns in self.namespaces.values()
            if LABEL in (ns["metadata"].get("labels") or {})
        ]

    def _sampled(self, claim: Obj) -> Obj:
        claim = copy.deepcopy(claim)
        if self.plugin_clock is None:
            return claim
        now = rfc3339(self.plugin_clock())
        for entry in (claim.get("status") or {}).get("devices") or []:
            active = [c for c in entry.get("conditions") or [] if c.get("type") == "Active"]
            if active and active[0].get("status") in ("True", "False"):
                entry.setdefault("data", {}).setdefault("sampledAt", now)
        return claim

    def list_claims(self, namespace: str) -> list[Obj]:
        self._call("list", namespace)
        return [self._sampled(c) for (ns, _), c in self.claims.items() if ns == namespace]

    def read_claim(self, namespace: str, name: str) -> Obj:
        self._call("read", namespace)
        claim = copy.deepcopy(self.claims[(namespace, name)])
        return self._sampled(self.on_read_claim(claim) if self.on_read_claim else claim)

    def list_pods(self, namespace: str) -> list[Obj]:
        self._call("list", namespace)
        return [copy.deepcopy(p) for (ns, _), p in self.pods.items() if ns == namespace]

    def patch_pod_condition(
        self, namespace: str, name: str, uid: str, condition: Mapping[str, str]
    ) -> None:
        self._call("patch-status", namespace)
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise errors.NotFoundError(f"pod {name} not found", status=404)
        if pod["metadata"]["uid"] != uid:
            raise errors.InvalidError("metadata.uid: field is immutable", status=422)
        conditions = [c for c in pod["status"]["conditions"] if c["type"] != condition["type"]]
        pod["status"]["conditions"] = [*conditions, dict(condition)]

    def evict(self, namespace: str, name: str, uid: str, *, dry_run: bool) -> None:
        self._call("evict", namespace)
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise errors.NotFoundError(f"pod {name} not found", status=404)
        if pod["metadata"]["uid"] != uid:
            raise errors.ConflictError("Precondition failed: UID", status=409)
        if (namespace, name) in self.blocked:
            raise EvictionRefused(
                "evict: 429 TooManyRequests: Cannot evict pod as it would violate the pod's "
                "disruption budget.",
                status=429,
            )
        self.evictions.append((namespace, name, uid, dry_run))
        if not dry_run:
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"

    def add_plugin(self, node: str, ready: bool = True) -> None:
        state = "True" if ready else "False"
        self.plugins.append({
            "metadata": {"name": f"plugin-{node}", "namespace": "gpu-dra",
                         "labels": {"app.kubernetes.io/component": "kubelet-plugin"}},
            "spec": {"nodeName": node},
            "status": {"conditions": [{"type": "Ready", "status": state}]},
        })  # fmt: skip

    def list_plugin_pods(self, selector: str) -> list[Obj]:
        self._call("list-plugins", "gpu-dra")
        assert selector == "app.kubernetes.io/component=kubelet-plugin"
        return copy.deepcopy(self.plugins)

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        self._call("event", namespace)
        assert event["involvedObject"]["namespace"] == namespace
        self.events.append(event)


def gpu_claim(
    namespace: str,
    name: str,
    *,
    pods: tuple[str, ...] = (),
    devices: Mapping[str, str | None] | None = None,
    driver: str = "gpu.nvidia.com",
    sampled_at: str | None = None,
) -> Obj:
    """A claim allocated `devices` (name -> idleSince RFC 3339, or None: Active True; a device
    named with ``!`` first has no status entry), reserved for `pods` (``uid-<name>``);
    `sampled_at`: every entry's ``data.sampledAt`` (None: none, or the fake's plugin clock)."""
    devices = {"gpu-0": None} if devices is None else devices
    results = []
    entries = []
    for device, idle_since in devices.items():
        bare = device.lstrip("!")
        results.append({"request": "gpu", "driver": driver, "pool": "node-a", "device": bare})
        if device.startswith("!"):
            continue
        active = (
            {"type": "Active", "status": "True", "reason": "InUse"}
            if idle_since is None
            else {"type": "Active", "status": "False", "reason": "Idle"}
        )
        entry: Obj = {"driver": driver, "pool": "node-a", "device": bare,
                      "conditions": [{"type": "Ready", "status": "True"}, active]}  # fmt: skip
        entry["data"] = {"tier": "gpu"}
        if idle_since is not None:
            entry["data"]["idleSince"] = idle_since
        if sampled_at is not None:
            entry["data"]["sampledAt"] = sampled_at
        entries.append(entry)
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"claim-{name}"},
        "status": {
            "allocation": {"devices": {"results": results}},
            "devices": entries,
            "reservedFor": [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods],
        },
    }
