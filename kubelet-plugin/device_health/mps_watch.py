"""The MPS share daemons as the health monitor watches them: what it checks, and when.

`MpsWatch` holds what `monitor.HealthMonitor` checks with `MpsLiveness` (the GPUs offered as MPS
shares, the static MIG devices offered as shares, the MIG devices made from partitions offered
as shares). `check` reads the supervisor's verdicts in a worker thread and logs the daemons that
went down or came back, `applied_to` marks the latest ones in a health state, and `pause` waits
for the next check: the interval, or `poke` (`HealthMonitor.mps_changed`). See
docs/architecture.md, "Health monitor".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from gpu_dra.driver.health import HealthState, Target
from gpu_dra.kubelet_plugin.device_health.monitor_inputs import MpsLiveness

# The monitor's logger: these are its lines.
log = logging.getLogger("gpu_dra.kubelet_plugin.device_health.monitor")


class MpsWatch:
    """The share daemons `mps` judges: those of `shared_gpus` (UUIDs), of `shared_migs` (MIG
    UUID -> target) and of `partition_daemons` (MIG UUID -> the partition's target, as they are
    now: read at every check)."""

    def __init__(
        self,
        mps: MpsLiveness,
        shared_gpus: Sequence[str],
        shared_migs: Mapping[str, Target] | None,
        partition_daemons: Callable[[], Mapping[str, Target]] | None,
    ) -> None:
        self._mps = mps
        self._shared_gpus = tuple(shared_gpus)
        self._shared_migs = dict(shared_migs or {})
        self._partition_daemons = partition_daemons
        self._dead: Mapping[str, str] = {}
        """The latest verdicts: GPU UUID -> why its share daemon is judged dead."""
        self._migs: Mapping[str, Target] = {}
        """The MIG devices whose daemons counted at the latest check."""
        self._poke = asyncio.Event()

    @property
    def watches_any(self) -> bool:
        """Whether there are share daemons to check at all."""
        return bool(self._shared_gpus or self._shared_migs or self._partition_daemons is not None)

    async def check(self) -> bool:
        """Read the verdicts in a worker thread and log the daemons that went down or came
        back; False when the read failed (logged; the latest verdicts stay)."""
        try:
            dead, migs = await asyncio.to_thread(self._verdicts)
        except Exception:
            log.exception("health: checking the MPS share daemons failed")
            return False
        for uuid in sorted(set(dead) - set(self._dead)):
            log.warning("health: MPS daemon of GPU %s not running: %s", uuid, dead[uuid])
        for uuid in sorted(set(self._dead) - set(dead)):
            log.info("health: MPS daemon of GPU %s is no longer judged dead", uuid)
        self._dead, self._migs = dead, migs
        return True

    def _verdicts(self) -> tuple[Mapping[str, str], Mapping[str, Target]]:
        """The down share daemons (UUID -> why) and the MIG devices whose daemons count: the
        static ones offered, and those made from partitions offered (blocking)."""
        dead = self._mps.dead_shared_daemons()
        partitions = self._partition_daemons() if self._partition_daemons is not None else {}
        return dead, {**self._shared_migs, **partitions}

    def applied_to(self, state: HealthState, now: datetime) -> HealthState:
        """``state`` with the latest verdicts: a down daemon's share device degraded."""
        return state.with_mps_daemons(self._shared_gpus, self._dead, now, self._migs)

    def poke(self) -> None:
        """End the current `pause` now (in the event loop)."""
        self._poke.set()

    async def pause(self, stopping: asyncio.Event, interval_s: float) -> None:
        """Until ``interval_s`` passed, `poke` was called or ``stopping`` is set."""
        waits = [
            asyncio.ensure_future(stopping.wait()),
            asyncio.ensure_future(self._poke.wait()),
        ]
        try:
            await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        self._poke.clear()
