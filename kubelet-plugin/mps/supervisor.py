"""Daemon supervision: the one place that checks the MPS daemons of prepared claims.

`DaemonSupervisor.check` looks at every daemon id the ``PrepareCompleted`` claims record. While
``repair()`` holds (``--mps-daemon-check-interval`` > 0 and this is the newest ready plugin
instance, the one that publishes), it runs `MpsControl.ensure` under the daemon's node-wide
``mps-<id>`` lock (the lock join and release of a shared daemon hold): a dead daemon is
reported down, restarted in place and reported restored, changed settings are set back; the
manager's observer posts the Events. Otherwise it only reads (`MpsControl.dead`): a daemon dead
in two passes in a row is reported down. The down daemons of MPS shares are the health
monitor's `MpsLiveness` (`dead_shared_daemons`; listeners hear of every change).
`check_soon` checks one daemon at once, in its own thread, for a share that just joined it. See
docs/mps.md, "Daemon supervision".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, CheckpointError, ClaimPhase
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonHandle,
    DaemonRepair,
    MpsControl,
    MpsDaemonGoneError,
    MpsError,
    MpsStartError,
)
from gpu_dra.kubelet_plugin.mps.ids import is_shared_daemon
from gpu_dra.kubelet_plugin.tiers.state import handles_from_state

log = logging.getLogger(__name__)

Entries = Callable[[], Mapping[str, CheckpointEntry]]
DaemonLock = Callable[[str], AbstractContextManager[None]]
"""Daemon id -> its node-wide lock (``NodeLocks.blocking("mps-<id>")``), taken in a thread."""

STALE_PASSES = 3
"""`dead_shared_daemons` raises when no pass completed for this many intervals (plus
`STALE_GRACE_S`): a stuck supervisor is not read as "every daemon runs"."""
STALE_GRACE_S = 60.0


@dataclass(frozen=True)
class Down:
    """A daemon judged not running: its devices and why."""

    daemon_id: str
    devices: tuple[str, ...]
    reason: str


@contextlib.contextmanager
def _unlocked(_daemon_id: str) -> Iterator[None]:
    yield


class DaemonSupervisor:
    """Checks the daemons of prepared claims, repairs them while ``repair()`` holds, and keeps
    which are down (see the module doc)."""

    def __init__(
        self,
        mps: MpsControl,
        entries: Entries,
        *,
        interval_s: float,
        repair: Callable[[], bool] = lambda: True,
        lock: DaemonLock = _unlocked,
    ) -> None:
        """``repair`` is asked at every pass (it may read files: passes run in a thread)."""
        if interval_s <= 0:
            raise ValueError(f"check interval must be positive, got {interval_s}")
        self._mps = mps
        self._entries = entries
        self.interval_s = interval_s
        self._repair = repair
        self._lock = lock
        self._down: dict[str, Down] = {}
        self._dead_before: set[tuple[str, str]] = set()
        self._failure: str | None = None
        self._state_lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._last_pass: float | None = None
        self._started = time.monotonic()
        self._passed: dict[str, float] = {}  # daemon id -> when `_ensure` last found it well

    def repairs(self) -> bool:
        """Whether a pass now would repair (``repair()``), or only read."""
        return self._repair()

    def vouches_for(self, daemon_id: str) -> bool:
        """`shared_daemons.DaemonChecker`: this supervisor repairs and the daemon passed a
        check within two intervals, so a join may leave its settings to `check_soon`. A
        daemon not known to answer is checked in the join, which fails if it does not."""
        passed = self._passed.get(daemon_id)
        if passed is None or time.monotonic() - passed > 2 * self.interval_s:
            return False
        return self.repairs()

    def check_soon(self, handle: DaemonHandle) -> bool:
        """`shared_daemons.DaemonChecker`: check ``handle``'s daemon now, in a thread of its
        own (it waits for the daemon's lock, which a joining prepare holds until it recorded
        its share), as a pass does: changed settings restored, the claims told. False, and
        nothing started, unless this supervisor repairs."""
        if not self.repairs():
            return False
        threading.Thread(
            target=self._check_one,
            args=(handle,),
            name=f"mps-check-{handle.daemon_id}",
            daemon=True,
        ).start()
        return True

    def _check_one(self, handle: DaemonHandle) -> None:
        try:
            self._ensure(handle.daemon_id, handle)
        except Exception:
            log.exception("mps daemon check after a join failed daemon_id=%s", handle.daemon_id)

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Called (from the pass's thread) whenever the set of down daemons changes."""
        self._listeners.append(listener)

    def daemons(self) -> dict[str, DaemonHandle]:
        """One recorded handle per daemon id of the ``PrepareCompleted`` claims (any handle:
        `MpsControl.ensure` and `MpsControl.dead` resolve the current instance)."""
        found: dict[str, DaemonHandle] = {}
        for uid, entry in sorted(self._entries().items()):
            if entry.phase is not ClaimPhase.PREPARE_COMPLETED:
                continue  # a prepare, rollback or unprepare under way owns its daemons
            try:
                handles = handles_from_state(entry.state)
            except MpsError as error:
                log.error("mps state of claim_uid=%s unusable, not supervised: %s", uid, error)
                continue
            for handle in handles:
                found.setdefault(handle.daemon_id, handle)
        return found

    def down(self) -> dict[str, Down]:
        """The daemons judged not running now, by id."""
        with self._state_lock:
            return dict(self._down)

    def dead_shared_daemons(self) -> dict[str, str]:
        """`device_health.monitor.MpsLiveness`: GPU UUID -> why its shared daemon is down.
        Raises `RuntimeError` when the last pass failed (an unreadable checkpoint) or none
        completed for a while: an error is never read as "every daemon runs"."""
        failure = self._failure
        if failure is not None:
            raise RuntimeError(failure)
        now = time.monotonic()
        last = self._last_pass if self._last_pass is not None else self._started
        if now - last > STALE_PASSES * self.interval_s + STALE_GRACE_S:
            raise RuntimeError(f"no MPS daemon check completed for {now - last:.0f}s")
        return {
            uuid: f"{down.daemon_id}: {down.reason}"
            for down in self.down().values()
            if is_shared_daemon(down.daemon_id)
            for uuid in down.devices
        }

    def check(self) -> list[DaemonRepair]:
        """One pass over the supervised daemons; the repairs made. Blocking: call it from a
        worker thread."""
        repairing = self.repairs()
        repairs: list[DaemonRepair] = []
        down: dict[str, Down] = {}
        dead_now: set[tuple[str, str]] = set()
        try:
            supervised = self.daemons()
        except (OSError, CheckpointError) as error:
            self._failure = f"cannot read the checkpoint: {error}"
            raise
        self._failure = None
        for daemon_id, handle in sorted(supervised.items()):
            if repairing:
                repair, why = self._ensure(daemon_id, handle)
                if repair is not None and repair.changed:
                    repairs.append(repair)
            else:
                why = self._judge(handle)
                if why is not None:
                    # The same verdict (it names the instance) twice in a row: once may be the
                    # last share's unprepare on another instance, between stop and record.
                    dead_now.add((daemon_id, why))
                    if (daemon_id, why) not in self._dead_before:
                        why = None
            if why is not None:
                down[daemon_id] = Down(daemon_id, handle.devices, why)
        self._dead_before = dead_now
        self._last_pass = time.monotonic()
        self._set_down(down)
        return repairs

    async def run(self) -> None:
        """`check` every ``interval_s`` until cancelled."""
        log.info("mps daemon supervision every %gs", self.interval_s)
        while True:
            try:
                await asyncio.to_thread(self.check)
            except Exception:
                log.exception("mps daemon supervision pass failed")
            await asyncio.sleep(self.interval_s)

    # -- steps -----------------------------------------------------------------------------

    def _ensure(
        self, daemon_id: str, handle: DaemonHandle
    ) -> tuple[DaemonRepair | None, str | None]:
        """`MpsControl.ensure` under the daemon's node-wide lock: the repair, and why the
        daemon is down after it (None: it runs, or it was stopped meanwhile)."""
        started = time.monotonic()

        def went_down(current: DaemonHandle, why: str) -> None:
            self._mark_down(Down(daemon_id, current.devices, why))

        self._passed.pop(daemon_id, None)
        try:
            with self._lock(daemon_id):
                repair = self._mps.ensure(handle, on_dead=went_down)
        except MpsDaemonGoneError:
            log.debug("mps daemon stopped meanwhile daemon_id=%s", daemon_id)
            return None, None
        except MpsStartError as error:
            log.error("mps daemon dead and not restarted daemon_id=%s: %s", daemon_id, error)
            return None, f"not restarted: {error}"
        except (MpsError, TimeoutError) as error:
            log.error("mps daemon not repaired daemon_id=%s: %s", daemon_id, error)
            previous = self.down().get(daemon_id)
            return None, None if previous is None else previous.reason
        self._passed[daemon_id] = time.monotonic()
        if repair.changed:
            log.warning(
                "mps daemon repaired daemon_id=%s restarted=%s restored=%s in %.3fs",
                daemon_id,
                repair.restarted,
                list(repair.restored),
                time.monotonic() - started,
            )
        return repair, None

    def _judge(self, handle: DaemonHandle) -> str | None:
        try:
            return self._mps.dead(handle)
        except MpsError as error:
            log.warning("mps daemon %s cannot be checked: %s", handle.daemon_id, error)
            return None

    def _mark_down(self, down: Down) -> None:
        with self._state_lock:
            changed = self._down.get(down.daemon_id) != down
            self._down[down.daemon_id] = down
        if changed:
            self._notify()

    def _set_down(self, down: dict[str, Down]) -> None:
        with self._state_lock:
            changed = down != self._down
            self._down = down
        if changed:
            self._notify()

    def _notify(self) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                log.exception("mps supervision: a listener failed")
