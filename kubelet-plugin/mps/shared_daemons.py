"""The per-GPU MPS daemons that MPS shares join, reference-counted through the claims' records.

The shares of a GPU (or of a static MIG device: one daemon per MIG device, keyed by its MIG
UUID) join ONE control daemon, id `shared_daemon_id(UUID)`, started by the first
share with the largest share allowed (``--mps-share-max-percent``) as its defaults. Each claim
records the daemon's handle (state ``mpsDaemons``) and its share (`SHARES_STATE_KEY`); the
daemon's reference count is the set of claims recording it (`claims_using`), so it cannot drift
from the claims across crashes. A join finds a dead daemon restarted in place and changed
settings restored (`MpsControl.ensure`); with a `DaemonChecker` (the supervisor, while it
repairs) a join of a live daemon that passed a check lately, or of a warm one, has the settings
read back at once beside the prepare instead of inside it; a daemon a share's join started
itself is checked beside it too, so the next share finds it checked. `SharedDaemons.join` and
`release` run under the daemon's lock (node-wide with `NodeLocks`: two plugin instances share
the daemons during a rolling update), and join records the claim before letting it go, so a
release never stops a daemon a join is handing out. A **warm** daemon (started ahead by
`mps.warm_daemons`, recorded only in its own ``daemon.json``) is joined as it is: the first
share sets its GPU's compute mode.
The last release stops the daemon and tells the idle listeners (the warmer starts a fresh one at
once): from then on the releasing claim counts as gone although its record stays until its
unprepare ends. See docs/mps.md, "MPS shares".
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from gpu_dra.driver.model import MigDevice, MigPartition
from gpu_dra.driver.shares import OfferedDevice, SharedDevice, ShareSize, ceiling
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.checkpoint import JsonObject
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonHandle,
    DaemonRepair,
    MpsControl,
    MpsDaemonGoneError,
    MpsError,
    MpsSettings,
    MpsStartError,
)
from gpu_dra.kubelet_plugin.mps.edits import ClientCaps
from gpu_dra.kubelet_plugin.mps.ids import shared_daemon_id
from gpu_dra.kubelet_plugin.node_locks import NodeLocks
from gpu_dra.kubelet_plugin.tiers.state import claims_using, handles_from_state

log = logging.getLogger(__name__)


class DaemonChecker(Protocol):
    """Who checks a shared daemon's settings beside a join (`DaemonSupervisor`)."""

    def vouches_for(self, daemon_id: str) -> bool:
        """Whether the daemon passed a check lately and a check now would repair it."""
        ...

    def check_soon(self, handle: DaemonHandle) -> bool:
        """Check the daemon at once, beside the caller (which may hold its lock); False when
        nothing was started (the checker does not repair)."""
        ...


@dataclass(frozen=True)
class PlannedShare:
    """One MPS share a claim is about to get."""

    device_name: str
    gpu: OfferedDevice
    """The GPU, or the MIG device (its daemon is keyed by the MIG UUID); a dynamic MIG
    partition until its MIG device is made (`pending`, then `on`)."""
    size: ShareSize
    share_id: str | None

    @property
    def pending(self) -> bool:
        """Whether the share waits for its MIG device to be made (a partition)."""
        return isinstance(self.gpu, MigPartition)

    @property
    def device(self) -> SharedDevice:
        """What the daemon serves; only once the MIG device of a partition is made."""
        if isinstance(self.gpu, MigPartition):
            raise AssertionError(f"share of {self.device_name}: its MIG device is not made yet")
        return self.gpu

    @property
    def daemon_id(self) -> str:
        return shared_daemon_id(self.device.uuid)

    def on(self, made: MigDevice) -> PlannedShare:
        """The share of a partition, on the MIG device made (or found) for it."""
        return replace(self, gpu=made)

    def caps(self) -> ClientCaps:
        """The client environment that caps this share's CUDA processes."""
        return ClientCaps(
            pinned_limits={self.device.uuid: f"{self.size.memory_mib}M"},
            active_thread_percentage=self.size.compute_percent,
        )

    def to_state(self) -> JsonObject:
        """What a claim records of the share; a pending one has no UUID or daemon yet."""
        where: JsonObject = (
            {"uuid": None, "daemonId": None}
            if self.pending
            else {"uuid": self.device.uuid, "daemonId": self.daemon_id}
        )
        return {
            **where,
            "shareID": self.share_id,
            "memoryBytes": self.size.memory_bytes,
            "computePercent": self.size.compute_percent,
        }


def warm_mismatch(warm: DaemonHandle, gpu: SharedDevice, settings: MpsSettings) -> str | None:
    """How the recorded warm daemon ``warm`` differs from the shared daemon of ``gpu`` (a GPU or
    static MIG device) with ``settings`` - both values, for the log - or None when it is that
    daemon. Compares what the daemon was started with (devices, the control commands, ``-M``),
    not the types the record was read back as."""
    differences = []
    if tuple(warm.devices) != (gpu.uuid,):
        differences.append(f"devices {list(warm.devices)}, not {[gpu.uuid]}")
    if warm.settings.commands() != settings.commands():
        differences.append(f"settings {warm.settings.commands()}, not {settings.commands()}")
    if warm.settings.multi_user != settings.multi_user:
        differences.append(f"multi-user {warm.settings.multi_user}, not {settings.multi_user}")
    return "; ".join(differences) or None


class SharedDaemons:
    """Starts, reuses and stops the per-GPU daemons of MPS shares, reference-counted through
    the checkpoint (see the module doc). Blocking: call it from a worker thread."""

    def __init__(
        self,
        mps: MpsControl,
        records: ClaimRecords,
        *,
        max_percent: int,
        locks: NodeLocks | None = None,
    ) -> None:
        """``locks``: the node's locks, taken beside the in-process ones (``mps-<daemon id>``)
        when other plugin instances may join and release the same daemons."""
        self._mps = mps
        self._records = records
        self._max_percent = max_percent
        self._node_locks = locks
        self._locks: dict[str, threading.Lock] = {}  # one per shared daemon (offered GPU)
        self._locks_lock = threading.Lock()
        self._idle_listeners: list[Callable[[str], None]] = []
        # daemon id -> claims whose release stopped it; their records stay until their
        # unprepare ends, but they use no daemon of the id any more.
        self._left: dict[str, set[str]] = {}
        self._left_lock = threading.Lock()
        self._checker: DaemonChecker | None = None

    def set_checker(self, checker: DaemonChecker | None) -> None:
        """Who checks a joined daemon's settings beside the join (see `DaemonChecker`)."""
        self._checker = checker

    def add_idle_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(daemon id)`` after the last share of a daemon left (it was stopped);
        called in the releasing thread, after the daemon's lock is let go."""
        self._idle_listeners.append(listener)

    def lock(self, daemon_id: str) -> contextlib.AbstractContextManager[None]:
        """The daemon's lock (node-wide too) that join and release hold."""
        return self._lock(daemon_id)

    def users(self, daemon_id: str) -> list[str]:
        """The claims whose records name the daemon and that did not leave it: its reference
        count. A claim whose release stopped the daemon left it, though its record stays until
        its unprepare ends (the warmer asks right after the release)."""
        return self._users(daemon_id)

    @contextlib.contextmanager
    def _lock(self, daemon_id: str) -> Iterator[None]:
        with self._locks_lock:
            lock = self._locks.setdefault(daemon_id, threading.Lock())
        with lock:
            if self._node_locks is None:
                yield
                return
            with self._node_locks.blocking(f"mps-{daemon_id}"):
                yield

    def settings(self, gpu: SharedDevice) -> MpsSettings:
        """The daemon defaults: the largest share allowed, so a client that drops its caps from
        its environment still cannot take more than that; and ``-M``: the shares' pods may run
        as any UIDs, and without it a client of a second UID waits until every client of the
        first has exited (seen on real GPUs: docs/mps.md, "Facts seen on real GPUs")."""
        largest = ceiling(gpu, self._max_percent)
        return MpsSettings(
            active_thread_percentage=largest.compute_percent,
            pinned_limits={gpu.uuid: f"{largest.memory_mib}M"},
            multi_user=True,
        )

    def join(
        self, claim_uid: str, share: PlannedShare, record: Callable[[DaemonHandle], None]
    ) -> DaemonHandle:
        """The running daemon of ``share``'s GPU, started if none runs; ``record`` (which must
        write the handle into the claim's checkpoint entry) is called before others can stop
        it."""
        with self._lock(share.daemon_id):
            self._forget_left(share.daemon_id, {claim_uid})  # it uses the daemon again
            handle = self._running(claim_uid, share.daemon_id)
            if handle is None:
                handle = self._warm(claim_uid, share)
            if handle is None:
                handle = self._mps.start(
                    share.daemon_id, (share.device.uuid,), self.settings(share.device)
                )
                log.info(
                    "mps shared daemon started daemon_id=%s uuid=%s for claim_uid=%s",
                    share.daemon_id,
                    share.device.uuid,
                    claim_uid,
                )
                if self._checker is not None:
                    # Checked beside, so the next share's join finds it checked (a partition's
                    # daemon, or any with warm daemons off, is started by its first share).
                    self._checker.check_soon(handle)
            crash_points.reached(crash_points.MPS_SHARE_AFTER_JOIN)
            record(handle)
            return handle

    def ensure(self, handle: DaemonHandle) -> DaemonRepair:
        """`MpsControl.ensure` of ``handle``'s daemon under its lock (node-wide too): a dead one
        is restarted in place, changed settings are set back."""
        with self._lock(handle.daemon_id):
            return self._mps.ensure(handle)

    def release(self, claim_uid: str, handle: DaemonHandle) -> None:
        """Stop the shared daemon of ``handle`` unless a claim other than ``claim_uid`` still
        records it; idempotent."""
        with self._lock(handle.daemon_id):
            if self._has_left(handle.daemon_id, claim_uid):
                # A retried release (its unprepare failed after this one): the daemon it used
                # is gone; one running now is a fresh warm daemon, or another claim's.
                log.info("mps shared daemon already left daemon_id=%s by claim_uid=%s",
                         handle.daemon_id, claim_uid)  # fmt: skip
                return
            users = [u for u in self._users(handle.daemon_id) if u != claim_uid]
            if users:
                log.info(
                    "mps shared daemon kept daemon_id=%s claims=%d", handle.daemon_id, len(users)
                )
                return
            self._mps.stop(handle)
            crash_points.reached(crash_points.MPS_SHARE_AFTER_LEAVE)
            # A daemon restarted under the same id after this handle's died is not this
            # handle's to stop, but no claim uses it any more either.
            self._mps.remove_leftover(handle.daemon_id)
            with self._left_lock:
                self._left.setdefault(handle.daemon_id, set()).add(claim_uid)
            log.info("mps shared daemon stopped daemon_id=%s (last share gone)", handle.daemon_id)
        for listener in self._idle_listeners:
            try:
                listener(handle.daemon_id)
            except Exception:
                log.exception("mps shared daemon idle listener failed")

    def _warm(self, claim_uid: str, share: PlannedShare) -> DaemonHandle | None:
        """The warm daemon of ``share``'s GPU - started ahead, recorded by no claim - ready
        for its first share: restarted in place if it died, its GPU set EXCLUSIVE_PROCESS (as
        a daemon the first share starts). None when there is none, or it has other settings
        or cannot be used (logged): then the first share starts the daemon anew, which
        removes what is left of it."""
        warm = self._mps.recorded(share.daemon_id)
        if warm is None:
            return None
        mismatch = warm_mismatch(warm, share.device, self.settings(share.device))
        if mismatch is not None:
            log.warning(
                "mps warm daemon daemon_id=%s not joined, started anew: its record (daemon.json) "
                "has %s",
                share.daemon_id,
                mismatch,
            )
            return None
        try:
            if self._mps.dead(warm) is not None:
                warm = self._mps.ensure(warm).handle
            self._mps.set_exclusive(warm)
        except MpsError as error:
            log.warning(
                "mps warm daemon daemon_id=%s not usable, started anew: %s", share.daemon_id, error
            )
            return None
        log.info(
            "mps shared daemon warm, joined daemon_id=%s pid=%d uuid=%s by claim_uid=%s",
            share.daemon_id,
            warm.pid,
            share.device.uuid,
            claim_uid,
        )
        if self._checker is not None:
            self._checker.check_soon(warm)  # its settings, read back beside the first share
        return warm

    def _checked_beside(self, daemon_id: str) -> DaemonHandle | None:
        """The current instance of a live ``daemon_id`` whose settings check the checker took
        over (it runs beside the prepare: a few control commands, each a process, kept off the
        pod's start), or None: the join runs `MpsControl.ensure` itself."""
        checker = self._checker
        if checker is None or not checker.vouches_for(daemon_id):
            return None
        current = self._mps.recorded(daemon_id)
        if current is None or not current.paths.pipe.is_dir():
            return None
        try:
            if self._mps.dead(current) is not None:
                return None  # restarted in place by ensure, in the join
        except MpsError:
            return None
        if not checker.check_soon(current):
            return None
        log.info("mps shared daemon live, joined daemon_id=%s pid=%d (settings checked beside)",
                 daemon_id, current.pid)  # fmt: skip
        return current

    def _users(self, daemon_id: str) -> list[str]:
        states = {uid: entry.state for uid, entry in self._records.all().items()}
        recorded = claims_using(states, daemon_id)
        with self._left_lock:
            left = self._left.get(daemon_id, set())
            left &= set(recorded)  # forget those whose records are gone
            if not left:
                self._left.pop(daemon_id, None)
        return [uid for uid in recorded if uid not in left]

    def _has_left(self, daemon_id: str, claim_uid: str) -> bool:
        with self._left_lock:
            return claim_uid in self._left.get(daemon_id, ())

    def _forget_left(self, daemon_id: str, claims: set[str]) -> None:
        with self._left_lock:
            left = self._left.get(daemon_id)
            if left is not None:
                left -= claims

    def _running(self, claim_uid: str, daemon_id: str) -> DaemonHandle | None:
        """The running daemon of ``daemon_id`` when another claim records it - restarted in
        place if it died, its settings restored if a client changed them (`MpsControl.ensure`:
        the directories the other claims' containers have mounted stay) - or None when no
        other claim records it (then a new daemon is started)."""
        users = set(self._users(daemon_id)) - {claim_uid}  # not those that left it
        recorded = [
            handle
            for uid, entry in self._records.all().items()
            if uid in users
            for handle in handles_from_state(entry.state)
            if handle.daemon_id == daemon_id
        ]
        if not recorded:
            return None
        checked = self._checked_beside(daemon_id)
        if checked is not None:
            return checked
        try:
            return self._mps.ensure(recorded[-1]).handle  # any handle: its current instance
        except MpsDaemonGoneError:
            return None  # its directory is gone: nothing of it is mounted any more
        except MpsStartError as error:
            raise MpsError(
                f"the MPS daemon {daemon_id} that serves this GPU's shares died and could not "
                f"be restarted ({error}); new shares wait until it is"
            ) from error
        except MpsError as error:
            raise MpsError(
                f"the MPS daemon {daemon_id} that serves this GPU's shares does not answer "
                f"({error}); new shares wait until it does"
            ) from error
