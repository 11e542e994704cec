"""The whole-GPU tier: devices handed out as published (whole GPUs, static MIG devices).

Nothing to make or undo: the claim's CDI spec is the hand-out (static MIG devices need nothing
more, so they have no tier of their own). The tier guards against double allocation: a device
another prepared claim holds for itself is refused (the scheduler prevents it; this guards races
and stale slices). Results with adminAccess neither are refused nor block others (the claim
records them under `state.ADMIN_ACCESS_STATE_KEY`); MPS shares of one GPU do not exclude each
other, but a share and a whole-GPU hold do. See docs/architecture.md, "Prepare and
unprepare".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.tiers.protocol import (
    ClaimRequest,
    Planned,
    PrepareError,
    PrepareRun,
    Tier,
    TierPlan,
)
from gpu_dra.kubelet_plugin.tiers.state import (
    ADMIN_ACCESS_STATE_KEY,
    capped_share_devices,
    exclusive_devices,
    share_devices,
)


@dataclass(frozen=True)
class WholeGpuPlan(TierPlan):
    """The devices a claim holds: for itself (``held``; ``whole`` are those that are not MPS
    or capped shares) and with adminAccess."""

    held: frozenset[str]
    whole: frozenset[str]
    admin: tuple[str, ...]

    @property
    def changes_node(self) -> bool:
        """False: the CDI spec is the whole hand-out, and the device locks (held from `check`
        to `PrepareCompleted`) keep other claims' checks from running beside it."""
        return False

    def check(self, others: Mapping[str, CheckpointEntry]) -> None:
        for entry in others.values():
            taken = (self.held & exclusive_devices(entry)) | (
                self.whole & (share_devices(entry.state) | capped_share_devices(entry.state))
            )
            if taken:
                other = entry.claim
                raise PrepareError(
                    f"device {', '.join(sorted(taken))} is already prepared for claim "
                    f"{other.namespace}/{other.name} ({other.uid}); refusing to hand one GPU to "
                    "two claims (unprepare that claim or delete its pod first)"
                )

    def intents(self) -> Mapping[str, JsonValue]:
        """The adminAccess devices, so that a `PrepareStarted` record does not hold them."""
        return {ADMIN_ACCESS_STATE_KEY: list(self.admin)} if self.admin else {}

    def apply(self, run: PrepareRun) -> None:
        if self.admin:
            run.completed[ADMIN_ACCESS_STATE_KEY] = list(self.admin)


class WholeGpuTier(Tier):
    """`Tier` of devices handed out as published; plan it after the share tiers."""

    def plan(self, request: ClaimRequest, planned: Planned) -> WholeGpuPlan:
        held = frozenset(r.device for r in request.results if not r.admin_access)
        return WholeGpuPlan(
            held=held,
            whole=held - planned.shared_devices,
            admin=tuple(sorted({r.device for r in request.results if r.admin_access})),
        )
