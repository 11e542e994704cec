"""Kubernetes Events about MPS daemons and shares, for the tenants who are affected.

`MpsEvents` is the `DaemonObserver` of the daemon manager: a daemon restarted in place gets a
Warning ``MpsDaemonRestarted`` on the pods of every claim that uses it (the claim's
``status.reservedFor``; the claim itself when none can be read), settings set back a Warning
``MpsDaemonSettingsRestored`` on those claims, a daemon that could not be repaired a Warning
``MpsDaemonUnhealthy`` on them (the same reason again at most every `REPEAT_S`). `share_prepared`
records a Normal ``MpsShareMemoryEnforcement`` on a share's claim (``CappedShareMemoryEnforcement``
on a capped share's: `capped_share_prepared`); `post` any Event on given objects (the MPS memory
watchdog's). Events are posted by one
background thread, so callers (the manager's lock holders) never wait for the API server; a
failed post is logged. See docs/mps.md, "Daemon supervision".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

from gpu_dra.kube import errors
from gpu_dra.kube.events import EventApi, InvolvedObject, event
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry
from gpu_dra.kubelet_plugin.kubeapi import ClaimReader, ClaimReadError
from gpu_dra.kubelet_plugin.mps.daemon_model import DaemonHandle, DaemonRepair, MpsError
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.tiers.state import handles_from_state

log = logging.getLogger(__name__)

COMPONENT: Final = "gpu-dra-kubelet-plugin"
REASON_RESTARTED: Final = "MpsDaemonRestarted"
REASON_RESTORED: Final = "MpsDaemonSettingsRestored"
REASON_UNHEALTHY: Final = "MpsDaemonUnhealthy"
REASON_SHARE_MEMORY: Final = "MpsShareMemoryEnforcement"
REASON_CAPPED_SHARE: Final = "CappedShareMemoryEnforcement"
REPEAT_S: Final = 600.0
"""An unrepaired daemon's Event is repeated with the same reason at most this often."""

Entries = Callable[[], Mapping[str, CheckpointEntry]]


def claim_object(claim: ClaimRef) -> InvolvedObject:
    return InvolvedObject("resource.k8s.io/v1", "ResourceClaim", claim.namespace, claim.name,
                          claim.uid)  # fmt: skip


def pod_object(namespace: str, name: str, uid: str) -> InvolvedObject:
    return InvolvedObject("v1", "Pod", namespace, name, uid)


class MpsEvents:
    """`DaemonObserver` posting Kubernetes Events (see the module doc)."""

    def __init__(
        self,
        api: EventApi,
        claims: ClaimReader,
        entries: Entries,
        *,
        node_name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``entries`` are the checkpoint's claims (`Checkpoint.all`): the users of a daemon;
        ``claims`` reads a claim's ``status.reservedFor`` (its pods)."""
        self._api = api
        self._claims = claims
        self._entries = entries
        self._node = node_name
        self._clock = clock
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._unhealthy: dict[str, tuple[str, float]] = {}

    # -- DaemonObserver ----------------------------------------------------------------------

    def daemon_repaired(self, repair: DaemonRepair) -> None:
        handle = repair.handle
        self._unhealthy.pop(handle.daemon_id, None)
        gpus = ", ".join(handle.devices)
        if repair.restarted is not None:
            message = (
                f"the MPS control daemon {handle.daemon_id} of {gpus} on node {self._node} was "
                f"not running ({repair.restarted}) and was restarted in place with its settings; "
                "CUDA processes started while it was down ran without MPS, and processes that "
                "were connected to it may have to be restarted"
            )
            self._submit(lambda: self._to_pods(handle, REASON_RESTARTED, message))
        if repair.restored:
            message = (
                f"the MPS control daemon {handle.daemon_id} of {gpus} on node {self._node} "
                f"reported {'; '.join(repair.restored)}: changed behind the plugin's back (by a "
                "client through the daemon's control socket, or the GPU's compute mode); set "
                "back"
            )
            self._submit(lambda: self._to_claims(handle, REASON_RESTORED, message, warning=True))

    def daemon_unrepaired(self, handle: DaemonHandle, reason: str) -> None:
        last = self._unhealthy.get(handle.daemon_id)
        now = self._clock()
        if last is not None and last[0] == reason and now - last[1] < REPEAT_S:
            return
        self._unhealthy[handle.daemon_id] = (reason, now)
        message = (
            f"the MPS control daemon {handle.daemon_id} of {', '.join(handle.devices)} on node "
            f"{self._node} is not serving: {reason}; until it is repaired, new CUDA processes "
            "of this claim's pods run without MPS or wait for it"
        )
        self._submit(lambda: self._to_claims(handle, REASON_UNHEALTHY, message, warning=True))

    # -- shares ------------------------------------------------------------------------------

    def share_prepared(self, claim: ClaimRef, message: str) -> None:
        """A Normal Event on a share's claim: which memory enforcement it got."""
        target = claim_object(claim)
        self._submit(lambda: self._post(target, REASON_SHARE_MEMORY, message, warning=False))

    def post(
        self, targets: Sequence[InvolvedObject], reason: str, message: str, *, warning: bool
    ) -> None:
        """The same Event on each of ``targets``, posted in the background (the MPS memory
        watchdog's; `mps.memory_watchdog`)."""
        listed = tuple(targets)

        def post_all() -> None:
            for target in listed:
                self._post(target, reason, message, warning=warning)

        self._submit(post_all)

    def capped_share_prepared(self, claim: ClaimRef, message: str) -> None:
        """A Normal Event on a capped share's claim: its memory cap (`tiers.capped_shares`)."""
        target = claim_object(claim)
        self._submit(lambda: self._post(target, REASON_CAPPED_SHARE, message, warning=False))

    # -- posting -----------------------------------------------------------------------------

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every Event submitted so far was posted (or failed); False at timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _submit(self, task: Callable[[], None]) -> None:
        with self._start_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="mps-events", daemon=True)
                self._worker.start()
        self._queue.put(task)

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            try:
                task()
            except Exception:
                log.exception("mps event not recorded")
            finally:
                self._queue.task_done()

    def _users(self, daemon_id: str) -> list[ClaimRef]:
        users = []
        for _, entry in sorted(self._entries().items()):
            try:
                handles = handles_from_state(entry.state)
            except MpsError:
                continue
            if any(h.daemon_id == daemon_id for h in handles):
                users.append(entry.claim)
        return users

    def _to_claims(self, handle: DaemonHandle, reason: str, message: str, *, warning: bool) -> None:
        for claim in self._users(handle.daemon_id):
            self._post(claim_object(claim), reason, message, warning=warning)

    def _to_pods(self, handle: DaemonHandle, reason: str, message: str) -> None:
        for claim in self._users(handle.daemon_id):
            pods = list(self._pods_of(claim))
            for target in pods or [claim_object(claim)]:
                self._post(target, reason, message, warning=True)

    def _pods_of(self, claim: ClaimRef) -> Iterable[InvolvedObject]:
        """The pods the claim is reserved for (none when it cannot be read)."""
        try:
            found = self._claims.get_claim(claim.namespace, claim.name)
        except (LookupError, ClaimReadError) as error:
            log.warning("mps event: claim %s/%s not read: %s", claim.namespace, claim.name, error)
            return
        if found.get("metadata", {}).get("uid") != claim.uid:
            return
        for consumer in found.get("status", {}).get("reservedFor") or []:
            if consumer.get("resource") == "pods" and not consumer.get("apiGroup"):
                yield InvolvedObject("v1", "Pod", claim.namespace, str(consumer.get("name", "")),
                                     str(consumer.get("uid", "")))  # fmt: skip

    def _post(self, target: InvolvedObject, reason: str, message: str, *, warning: bool) -> None:
        body = event(target, reason, message, warning=warning, component=COMPONENT,
                     instance=self._node, host=self._node, now=time.time())  # fmt: skip
        try:
            self._api.create_event(target.namespace, body)
        except errors.ApiError as error:
            log.warning("mps event %s on %s %s/%s not recorded: %s", reason, target.kind,
                        target.namespace, target.name, error)  # fmt: skip
            return
        log.info("mps event %s on %s %s/%s: %s", reason, target.kind, target.namespace,
                 target.name, message)  # fmt: skip
