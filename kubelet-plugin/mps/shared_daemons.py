"""MPS shares: many claims holding scheduler-accounted parts of one GPU, served by one daemon.

A GPU offered as MPS shares (``--mps-shares``, `gpu_dra.driver.shares`) can be allocated to
many claims; each allocation result carries a ``shareID`` and the ``consumedCapacity`` of
``memory`` and ``compute``. A result is an **MPS share** when it consumed less than the whole
GPU in either; one that consumed all of both holds the GPU exclusively and is prepared like any
whole GPU (per-claim MPS included). A share needs an MPS config (``sharing.strategy: MPS``, the
``mps.gpu.nvidia.com`` class carries it) without ``mpsConfig`` fields: its caps come from its
capacity, not from daemon defaults it cannot own.

The shares of a GPU join ONE control daemon, id `shared_daemon_id(UUID)`, started with the
largest share allowed (``--mps-share-max-percent``) as its default caps before any server
spawns. Each claim records the daemon's handle (checkpoint ``state.mpsDaemons``, as per-claim
daemons are recorded) and its share (``state.mpsShares``); the daemon's reference count is the
set of claims recording it (`claims_using`), so it cannot drift from the claims across crashes.
`SharedDaemons.join` starts the daemon for the first share or reuses the running one;
`SharedDaemons.release` stops it when the claim being removed is the last one recording it.
Both run under the daemon's lock (one per GPU), and join records the claim before the lock is
let go, so a release never stops a daemon that a join is handing out.

Each claim's CDI devices get the pipe dir and shm of the daemon (`workload_edits`) and the
share's caps as client environment: ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<UUID>=<MiB>M`` and
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=<compute>``. Those are cooperative (per CUDA process, and a
process can drop them); the daemon defaults are what a process that drops them gets.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from gpu_dra.driver.config import ConfigGroup, mps_config
from gpu_dra.driver.model import Gpu
from gpu_dra.driver.shares import ShareSize, ceiling, consumed_share, is_partial
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint, JsonObject, JsonValue
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonHandle,
    MpsControl,
    MpsDaemonGoneError,
    MpsError,
    MpsSettings,
    claims_using,
    handles_from_state,
)
from gpu_dra.kubelet_plugin.mps.edits import ClientCaps
from gpu_dra.kubelet_plugin.mps.ids import SHARED_PREFIX, shared_daemon_id

log = logging.getLogger(__name__)

SHARES_STATE_KEY: Final = "mpsShares"
"""Checkpoint ``state`` key of a claim: ``{device name: share}`` of its MPS shares."""


class ShareRefusedError(ValueError):
    """A share cannot be prepared as allocated or configured; the message says what to change."""


class ShareResult(Protocol):
    """What `plan_shares` reads of one allocation result."""

    @property
    def request(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def admin_access(self) -> bool: ...
    @property
    def share_id(self) -> str | None: ...
    @property
    def consumed(self) -> Mapping[str, str] | None: ...


@dataclass(frozen=True)
class PlannedShare:
    """One MPS share a claim is about to get."""

    device_name: str
    gpu: Gpu
    size: ShareSize
    share_id: str | None

    @property
    def daemon_id(self) -> str:
        return shared_daemon_id(self.gpu.uuid)

    def caps(self) -> ClientCaps:
        """The client environment that caps this share's CUDA processes."""
        return ClientCaps(
            pinned_limits={self.gpu.uuid: f"{self.size.memory_mib}M"},
            active_thread_percentage=self.size.compute_percent,
        )

    def to_state(self) -> JsonObject:
        return {
            "uuid": self.gpu.uuid,
            "daemonId": self.daemon_id,
            "shareID": self.share_id,
            "memoryBytes": self.size.memory_bytes,
            "computePercent": self.size.compute_percent,
        }


def is_shared_daemon(daemon_id: str) -> bool:
    """Whether ``daemon_id`` is a per-GPU shared daemon (not a per-claim one)."""
    return daemon_id.startswith(SHARED_PREFIX)


def plan_shares(
    results: Sequence[ShareResult],
    groups: Sequence[ConfigGroup],
    shared_gpu: Callable[[str], Gpu | None],
    *,
    max_percent: int,
) -> list[PlannedShare]:
    """The results of ``results`` that are MPS shares, checked; `ShareRefusedError` (or
    `gpu_dra.driver.shares.ShareError` for an unreadable consumedCapacity) naming the device and
    what to change. ``shared_gpu`` maps a device name to its
    GPU when that GPU is offered as MPS shares."""
    planned: dict[str, PlannedShare] = {}
    for result in results:
        gpu = shared_gpu(result.device)
        if gpu is None or result.admin_access:
            continue
        size = consumed_share(result.consumed, gpu)
        if not is_partial(size, gpu):
            continue  # the whole GPU: exclusive, prepared as any whole GPU
        where = f"device {result.device} (request {result.request}, {size})"
        group = next((g for g in groups if _has(g, result)), None)
        mps = None if group is None else mps_config(group.config)
        if group is None or mps is None:
            raise ShareRefusedError(
                f"{where} is an MPS share of the GPU, but its config has no "
                "sharing.strategy MPS, so its caps could not be applied; use DeviceClass "
                "mps.gpu.nvidia.com, or add a GpuConfig with sharing.strategy MPS"
            )
        fields = sorted(name for name, value in mps.model_dump(by_alias=True).items() if value)
        if fields:
            raise ShareRefusedError(
                f"{where}: {group.origin.label} sets mpsConfig {', '.join(fields)}, but an MPS "
                "share's caps come from its capacity request (memory, compute) and its GPU's "
                "daemon is shared; remove mpsConfig"
            )
        largest = ceiling(gpu, max_percent)
        if size.memory_bytes > largest.memory_bytes or size.compute_percent > max_percent:
            raise ShareRefusedError(
                f"{where} is larger than the largest MPS share this node allows ({largest}; "
                f"--mps-share-max-percent={max_percent}); ask for at most that"
            )
        if result.device in planned:
            raise ShareRefusedError(
                f"{where}: the claim holds two MPS shares of this GPU; ask for one share of the "
                "combined size in one request"
            )
        planned[result.device] = PlannedShare(result.device, gpu, size, result.share_id)
    return [planned[name] for name in sorted(planned)]


def _has(group: ConfigGroup, result: ShareResult) -> bool:
    return any(d.request == result.request and d.device == result.device for d in group.devices)


def share_devices(state: Mapping[str, JsonValue]) -> set[str]:
    """Device names a claim's checkpoint ``state`` holds as MPS shares."""
    value = state.get(SHARES_STATE_KEY)
    return {str(name) for name in value} if isinstance(value, dict) else set()


def shares_from_state(state: Mapping[str, JsonValue]) -> dict[str, ShareSize]:
    """``{device name: size}`` of the shares a claim's ``state`` records (bad entries skipped)."""
    value = state.get(SHARES_STATE_KEY)
    if not isinstance(value, dict):
        return {}
    sizes = {}
    for name, share in value.items():
        if not isinstance(share, dict):
            continue
        memory, compute = share.get("memoryBytes"), share.get("computePercent")
        if isinstance(memory, int) and isinstance(compute, int):
            sizes[str(name)] = ShareSize(memory, compute)
    return sizes


class SharedDaemons:
    """Starts, reuses and stops the per-GPU daemons of MPS shares, reference-counted through
    the checkpoint (see the module doc). Blocking: call it from a worker thread."""

    def __init__(self, mps: MpsControl, checkpoint: Checkpoint, *, max_percent: int) -> None:
        self._mps = mps
        self._checkpoint = checkpoint
        self._max_percent = max_percent
        self._locks: dict[str, threading.Lock] = {}  # one per shared daemon (offered GPU)
        self._locks_lock = threading.Lock()

    def _lock(self, daemon_id: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(daemon_id, threading.Lock())

    def settings(self, gpu: Gpu) -> MpsSettings:
        """The daemon defaults: the largest share allowed, so a client that drops its caps from
        its environment still cannot take more than that."""
        largest = ceiling(gpu, self._max_percent)
        return MpsSettings(
            active_thread_percentage=largest.compute_percent,
            pinned_limits={gpu.uuid: f"{largest.memory_mib}M"},
        )

    def join(
        self, claim_uid: str, share: PlannedShare, record: Callable[[DaemonHandle], None]
    ) -> DaemonHandle:
        """The running daemon of ``share``'s GPU, started if none runs; ``record`` (which must
        write the handle into the claim's checkpoint entry) is called before others can stop
        it."""
        with self._lock(share.daemon_id):
            handle = self._running(claim_uid, share.daemon_id)
            if handle is None:
                handle = self._mps.start(
                    share.daemon_id, (share.gpu.uuid,), self.settings(share.gpu)
                )
                log.info(
                    "mps shared daemon started daemon_id=%s uuid=%s for claim_uid=%s",
                    share.daemon_id,
                    share.gpu.uuid,
                    claim_uid,
                )
            record(handle)
            return handle

    def release(self, claim_uid: str, handle: DaemonHandle) -> None:
        """Stop the shared daemon of ``handle`` unless a claim other than ``claim_uid`` still
        records it; idempotent."""
        with self._lock(handle.daemon_id):
            users = [u for u in self._users(handle.daemon_id) if u != claim_uid]
            if users:
                log.info(
                    "mps shared daemon kept daemon_id=%s claims=%d", handle.daemon_id, len(users)
                )
                return
            self._mps.stop(handle)
            # A daemon restarted under the same id after this handle's died is not this
            # handle's to stop, but no claim uses it any more either.
            self._mps.remove_leftover(handle.daemon_id)
            log.info("mps shared daemon stopped daemon_id=%s (last share gone)", handle.daemon_id)

    def _users(self, daemon_id: str) -> list[str]:
        states = {uid: entry.state for uid, entry in self._checkpoint.all().items()}
        return claims_using(states, daemon_id)

    def _running(self, claim_uid: str, daemon_id: str) -> DaemonHandle | None:
        """A live handle of ``daemon_id`` that another claim records, or None (then a new
        daemon is to be started; a dead one's leftovers go with that start)."""
        for uid, entry in self._checkpoint.all().items():
            if uid == claim_uid:
                continue
            for handle in handles_from_state(entry.state):
                if handle.daemon_id != daemon_id:
                    continue
                try:
                    return self._mps.adopt(handle)
                except MpsDaemonGoneError:
                    continue
                except MpsError as error:
                    raise MpsError(
                        f"the MPS daemon {daemon_id} that serves this GPU's shares does not "
                        f"answer ({error}); new shares wait until it does"
                    ) from error
        return None
