"""`ClaimStatusWriter`: keeps each prepared claim's ``status.devices`` entries of this driver up
to date, by server-side apply of the status subresource (field manager `FIELD_MANAGER`: other
drivers' entries of the same claim are theirs and stay).

Every pass (``pass_interval_s``) it builds the wanted entries of every prepared claim
(`content.claim_status`); a claim whose entries differ from what was last written is applied at
once the first time and then at most once per ``min_interval_s``, and at most
``max_writes_per_pass`` claims per pass. Condition transition times are kept while a
condition's status stays. A write that fails is logged (once per claim and message), counted,
and tried again after ``min_interval_s``; it never touches the claim's prepare. Only while
``is_turn()`` (the publishing instance) does it write. See docs/architecture.md#claim-status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from kubernetes import client as k8s
from prometheus_client import CollectorRegistry, Counter

from gpu_dra.kube import errors
from gpu_dra.kube.client import translated_errors
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase, JsonValue
from gpu_dra.kubelet_plugin.claim_status.content import DeviceStatus

log = logging.getLogger(__name__)

FIELD_MANAGER: Final = "gpu-dra-kubelet-plugin"
MAX_CONDITIONS: Final = 8
"""The API's bound on conditions per entry."""


class ClaimStatusApi(Protocol):
    def apply_devices(
        self, namespace: str, name: str, uid: str, devices: Sequence[Mapping[str, Any]]
    ) -> None:
        """Apply ``status.devices`` (this driver's entries) of the claim with ``uid``."""


class KubernetesClaimStatusApi:
    """`ClaimStatusApi` by server-side apply of ``resourceclaims/status`` (forced; the UID in
    the applied object makes it fail for a claim recreated under the same name)."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 10.0) -> None:
        self._objects = k8s.CustomObjectsApi(api_client)
        self._timeout = request_timeout_s

    def apply_devices(
        self, namespace: str, name: str, uid: str, devices: Sequence[Mapping[str, Any]]
    ) -> None:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"devices": list(devices)},
        }
        with translated_errors(f"apply status.devices of ResourceClaim {namespace}/{name}"):
            self._objects.patch_namespaced_custom_object_status(
                "resource.k8s.io",
                "v1",
                namespace,
                "resourceclaims",
                name,
                body,
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type="application/apply-patch+yaml",
                _request_timeout=self._timeout,
            )


@dataclass
class _Written:
    wanted: tuple[DeviceStatus, ...]
    """What was last applied (or tried), unstamped."""
    stamps: dict[tuple[object, ...], tuple[str, str]]
    """(entry key, condition type) -> (status, lastTransitionTime)."""
    at: float
    ok: bool
    error: str | None = None


Build = Callable[[CheckpointEntry], list[DeviceStatus]]


class ClaimStatusWriter:
    def __init__(
        self,
        api: ClaimStatusApi,
        entries: Callable[[], Mapping[str, CheckpointEntry]],
        build: Build,
        *,
        registry: CollectorRegistry | None = None,
        is_turn: Callable[[], bool] = lambda: True,
        min_interval_s: float = 30.0,
        pass_interval_s: float = 2.0,
        max_writes_per_pass: int = 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api = api
        self._entries = entries
        self._build = build
        self._is_turn = is_turn
        self._min_interval_s = min_interval_s
        self._pass_interval_s = pass_interval_s
        self._max_writes = max_writes_per_pass
        self._clock = clock
        self._written: dict[str, _Written] = {}
        self._stopping = asyncio.Event()
        self.writes = Counter(
            "gpu_dra_claim_status_writes",
            "Applies of prepared claims' status.devices, by result (ok, error).",
            ["result"],
            registry=registry,
        )

    @property
    def claims(self) -> list[str]:
        """UIDs of the prepared claims whose status it has written (or tried to)."""
        return sorted(self._written)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await asyncio.to_thread(self.pass_once)
            except Exception:  # a bug here must not stop the plugin; it is logged
                log.exception("claim status pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._pass_interval_s)

    def pass_once(self) -> int:
        """One pass; returns how many claims it applied (successfully or not)."""
        entries = {
            uid: entry
            for uid, entry in self._entries().items()
            if entry.phase == ClaimPhase.PREPARE_COMPLETED
        }
        for gone in set(self._written) - set(entries):
            del self._written[gone]
        if not self._is_turn():
            return 0
        now = self._clock()
        applied = 0
        for uid, entry in sorted(entries.items()):
            if applied >= self._max_writes:
                break
            wanted = tuple(self._build(entry))
            last = self._written.get(uid)
            if last is not None and (
                (last.ok and last.wanted == wanted) or now - last.at < self._min_interval_s
            ):
                continue
            self._apply(uid, entry, wanted, last, now)
            applied += 1
        return applied

    def _apply(
        self,
        uid: str,
        entry: CheckpointEntry,
        wanted: tuple[DeviceStatus, ...],
        last: _Written | None,
        now: float,
    ) -> None:
        stamps = dict(last.stamps) if last is not None else {}
        devices = [_stamped(status, stamps, now) for status in wanted]
        claim = entry.claim
        try:
            self._api.apply_devices(claim.namespace, claim.name, uid, devices)
        except errors.ApiError as error:
            message = str(error)
            if last is None or last.error != message:
                log.warning("claim %s/%s: status.devices not written (the claim works as "
                            "prepared; retried in %gs): %s", claim.namespace, claim.name,
                            self._min_interval_s, message)  # fmt: skip
            self.writes.labels(result="error").inc()
            self._written[uid] = _Written(wanted, stamps, now, ok=False, error=message)
            return
        self.writes.labels(result="ok").inc()
        self._written[uid] = _Written(wanted, stamps, now, ok=True)


def _stamped(
    status: DeviceStatus, stamps: dict[tuple[object, ...], tuple[str, str]], now: float
) -> dict[str, JsonValue]:
    conditions: list[JsonValue] = []
    for condition in status.conditions[:MAX_CONDITIONS]:
        key = (*status.key, condition.type)
        previous = stamps.get(key)
        if previous is None or previous[0] != condition.status:
            previous = (condition.status, _rfc3339(now))
            stamps[key] = previous
        conditions.append(
            {
                "type": condition.type,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message,
                "lastTransitionTime": previous[1],
            }
        )
    entry: dict[str, JsonValue] = {
        "driver": status.driver,
        "pool": status.pool,
        "device": status.device,
        "conditions": conditions,
        "data": dict(status.data),
    }
    if status.share_id is not None:
        entry["shareID"] = status.share_id
    return entry


def _rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
