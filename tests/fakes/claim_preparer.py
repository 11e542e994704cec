"""In-memory ClaimPreparer double for the kubelet plugin's gRPC tests."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice, PrepareResult


@dataclass
class InMemoryClaimPreparer:
    """Scripted :class:`gpu_dra.kubelet_plugin.prepare_protocol.ClaimPreparer`.

    Claims listed in ``devices`` prepare to those devices (others to no devices), claims in
    ``prepare_errors`` / ``unprepare_errors`` fail with that message, claims in ``forget`` are
    left out of the result (a driver bug), ``extra_results`` adds unrequested UIDs,
    ``raise_error`` makes the whole call raise, ``hang`` makes it block until cancelled, and
    ``delay_s`` makes every call take that long (a thread hop and a checkpoint read, say).
    Every call is recorded in ``calls``; prepared claims are tracked in ``prepared``.
    """

    devices: dict[str, tuple[PreparedDevice, ...]] = field(default_factory=dict)
    prepare_errors: dict[str, str] = field(default_factory=dict)
    unprepare_errors: dict[str, str] = field(default_factory=dict)
    forget: set[str] = field(default_factory=set)
    extra_results: set[str] = field(default_factory=set)
    raise_error: Exception | None = None
    hang: bool = False
    delay_s: float = 0.0
    calls: list[tuple[str, tuple[ClaimRef, ...]]] = field(default_factory=list)
    prepared: dict[str, ClaimRef] = field(default_factory=dict)
    cancelled: int = 0

    async def _enter(self, operation: str, claims: Sequence[ClaimRef]) -> None:
        self.calls.append((operation, tuple(claims)))
        if self.raise_error is not None:
            raise self.raise_error
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        await self._enter("prepare", claims)
        results: dict[str, PrepareResult] = {}
        for claim in claims:
            if claim.uid in self.forget:
                continue
            if claim.uid in self.prepare_errors:
                results[claim.uid] = PrepareResult.failure(self.prepare_errors[claim.uid])
                continue
            self.prepared[claim.uid] = claim
            results[claim.uid] = PrepareResult.success(self.devices.get(claim.uid, ()))
        for uid in self.extra_results:
            results[uid] = PrepareResult.success(())
        return results

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        await self._enter("unprepare", claims)
        results: dict[str, str | None] = {}
        for claim in claims:
            if claim.uid in self.forget:
                continue
            if claim.uid in self.unprepare_errors:
                results[claim.uid] = self.unprepare_errors[claim.uid]
                continue
            self.prepared.pop(claim.uid, None)
            results[claim.uid] = None
        for uid in self.extra_results:
            results[uid] = None
        return results
