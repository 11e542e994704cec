"""Warm shared MPS daemons: the daemon of every GPU (and static MIG device) offered as MPS shares
runs before its first share, so a share's prepare joins a running daemon instead of starting one.

`WarmDaemons.check` is one pass over the offered devices, each under the daemon's lock (node-wide:
the lock join and release hold). A daemon a claim records is the supervisor's and left alone.
Otherwise, as `WarmPolicy` says: none runs -> start one with the shares' settings
(`SharedDaemons.settings`) but the compute mode left alone (the first share sets it); one runs
(``daemon.json``, adopted across plugin restarts) -> kept: restarted in place if it died, settings
set back, a compute mode left by a share that never got recorded reset; one recorded otherwise,
or not at all (a start the plugin died in) -> started anew, why logged; idle past
``idle:<duration>``, or ``off`` -> stopped. Passes run only while ``repair()`` holds (this
instance publishes), at start, after every last release (`SharedDaemons.add_idle_listener`) and
every interval. See docs/mps.md, "Warm daemons".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from gpu_dra.driver.shares import SharedDevice
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonHandle,
    MpsControl,
    MpsDaemonGoneError,
    MpsError,
    MpsSettings,
)
from gpu_dra.kubelet_plugin.mps.ids import shared_daemon_id
from gpu_dra.kubelet_plugin.mps.shared_daemons import SharedDaemons, warm_mismatch
from gpu_dra.kubelet_plugin.mps.warm_policy import WarmPolicy

log = logging.getLogger(__name__)

IN_USE = "in use"
STARTED = "started"
KEPT = "kept"
STOPPED = "stopped"
NONE = "none"
FAILED = "failed"
MAX_PARALLEL_STARTS = 8


class WarmDaemons:
    """Keeps the shared daemons of the offered GPUs warm as the policy says (module doc)."""

    def __init__(
        self,
        shared: SharedDaemons,
        mps: MpsControl,
        gpus: Sequence[SharedDevice],
        *,
        policy: WarmPolicy,
        interval_s: float,
        repair: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``gpus``: the GPUs and static MIG devices offered as MPS shares. ``repair`` is asked
        at every pass: only the instance that publishes starts, repairs and stops daemons."""
        if interval_s <= 0:
            raise ValueError(f"warm check interval must be positive, got {interval_s}")
        self._shared = shared
        self._mps = mps
        self._gpus = tuple(gpus)
        self.policy = policy
        self.interval_s = interval_s
        self._repair = repair
        self._clock = clock
        self._idle_since: dict[str, float] = {}
        self._pids: dict[str, int] = {}  # daemon id -> PID of the warm daemon this one keeps
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.first_pass = asyncio.Event()
        shared.add_idle_listener(self.idle)

    def idle(self, daemon_id: str) -> None:
        """The last share of ``daemon_id`` left: its idle time starts now, and a pass comes at
        once (from any thread)."""
        self._idle_since[daemon_id] = self._clock()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            loop.call_soon_threadsafe(wake.set)

    def check(self) -> dict[str, str]:
        """One pass; what it found or did per GPU UUID (`IN_USE`, `STARTED`, `KEPT`,
        `STOPPED`, `NONE`, `FAILED`); empty when this instance does not repair. Blocking."""
        if not self._gpus or not self._repair():
            return {}
        workers = min(MAX_PARALLEL_STARTS, len(self._gpus))
        with ThreadPoolExecutor(workers, thread_name_prefix="mps-warm") as pool:
            results = list(pool.map(self._check_gpu, self._gpus))
        return {gpu.uuid: result for gpu, result in zip(self._gpus, results, strict=True)}

    async def run(self) -> None:
        """`check` at once, after every last release and every ``interval_s``, until
        cancelled; `first_pass` is set after the first."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        log.info("mps warm shared daemons: %s, %d device(s), checked every %gs",
                 self.policy, len(self._gpus), self.interval_s)  # fmt: skip
        while True:
            self._wake.clear()
            try:
                await asyncio.to_thread(self.check)
            except Exception:
                log.exception("mps warm daemon pass failed")
            self.first_pass.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    # -- steps -----------------------------------------------------------------------------

    def _check_gpu(self, gpu: SharedDevice) -> str:
        daemon_id = shared_daemon_id(gpu.uuid)
        try:
            with self._shared.lock(daemon_id):
                return self._reconcile(gpu, daemon_id)
        except (MpsError, OSError, TimeoutError) as error:
            log.error("mps warm daemon of %s daemon_id=%s: %s", gpu.uuid, daemon_id, error)
            return FAILED

    def _reconcile(self, gpu: SharedDevice, daemon_id: str) -> str:
        """Under the daemon's lock: what the module doc says for one GPU."""
        if self._shared.users(daemon_id):
            self._idle_since.pop(daemon_id, None)
            return IN_USE
        now = self._clock()
        since = self._idle_since.setdefault(daemon_id, now)
        warm = self._mps.recorded(daemon_id)
        idle_s = self.policy.idle_s
        wanted = self.policy.warm and (idle_s is None or now - since < idle_s)
        if not wanted:
            if warm is None:
                return NONE
            why = "off" if not self.policy.warm else f"idle for {now - since:.0f}s"
            self._stop(daemon_id, warm)
            log.info("mps warm daemon stopped daemon_id=%s uuid=%s (%s)", daemon_id, gpu.uuid,
                     why)  # fmt: skip
            return STOPPED
        settings = self._shared.settings(gpu)
        kept, why = self._keep(gpu, daemon_id, warm, settings)
        if kept is not None:
            if self._pids.get(daemon_id) != kept.pid:
                log.info("mps warm daemon adopted daemon_id=%s pid=%d uuid=%s", daemon_id,
                         kept.pid, gpu.uuid)  # fmt: skip
                self._pids[daemon_id] = kept.pid
            return KEPT
        started = time.monotonic()
        # Removes what is left of an unusable one first (`MpsControl.start`).
        handle = self._mps.start(daemon_id, (gpu.uuid,), settings, exclusive=False)
        self._pids[daemon_id] = handle.pid
        log.info("mps warm daemon started daemon_id=%s pid=%d uuid=%s in %.3fs (%s)", daemon_id,
                 handle.pid, gpu.uuid, time.monotonic() - started, why)  # fmt: skip
        return STARTED

    def _keep(
        self, gpu: SharedDevice, daemon_id: str, warm: DaemonHandle | None, settings: MpsSettings
    ) -> tuple[DaemonHandle | None, str]:
        """Keep the recorded warm daemon ``warm`` (restarted in place if it died, settings set
        back, a compute mode a share left reset): its current instance, or None and why not -
        never silent: the caller starts one anew and logs it."""
        if warm is None:
            # No daemon.json: never started, stopped, or a start that did not finish (the
            # plugin died during it: its settings were never verified, so it is not adopted).
            return None, "none recorded"
        mismatch = warm_mismatch(warm, gpu, settings)
        if mismatch is not None:
            log.warning("mps warm daemon daemon_id=%s not kept, started anew: its record "
                        "(daemon.json) has %s", daemon_id, mismatch)  # fmt: skip
            return None, f"the recorded one has {mismatch}"
        try:
            repair = self._mps.ensure(warm)
            self._mps.reset_exclusive(repair.handle)
        except MpsDaemonGoneError as error:
            log.warning("mps warm daemon daemon_id=%s gone meanwhile, started anew: %s",
                        daemon_id, error)  # fmt: skip
            return None, f"the recorded one is gone: {error}"
        except MpsError as error:
            log.warning("mps warm daemon daemon_id=%s not kept, started anew: %s",
                        daemon_id, error)  # fmt: skip
            return None, f"the recorded one is not usable: {error}"
        return repair.handle, "kept"

    def _stop(self, daemon_id: str, warm: DaemonHandle) -> None:
        self._mps.stop(warm)
        self._mps.remove_leftover(daemon_id)  # whatever else runs under the id
