"""The whole-GPU tier: devices handed out as published (whole GPUs, static MIG devices).

Nothing to make or undo: the claim's CDI spec is the hand-out. The tier guards against double
allocation: a device another prepared claim holds for itself is refused (the scheduler prevents
it; this guards races and stale slices). Results with adminAccess neither are refused nor block
others (the claim records them under `ADMIN_ACCESS_STATE`); MPS shares of one GPU do not exclude
each other, but a share and a whole-GPU hold do. See docs/architecture.md, "Prepare and
unprepare".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gpu_dra.kubelet_plugin.capped_share_tier import CappedSharePlan, capped_share_devices
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.mps.share_tier import SharePlan
from gpu_dra.kubelet_plugin.mps.shared_daemons import share_devices
from gpu_dra.kubelet_plugin.tier import (
    ClaimRequest,
    Planned,
    PrepareError,
    PrepareRun,
    Tier,
    TierPlan,
)

ADMIN_ACCESS_STATE: Final = "adminAccessDevices"
"""Checkpoint `state` key: devices the claim holds with adminAccess (they block no one)."""


@dataclass(frozen=True)
class WholeGpuPlan(TierPlan):
    """The devices a claim holds: for itself (``held``; ``whole`` are those that are not MPS
    or capped shares) and with adminAccess."""

    held: frozenset[str]
    whole: frozenset[str]
    admin: tuple[str, ...]

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
        return {ADMIN_ACCESS_STATE: list(self.admin)} if self.admin else {}

    def apply(self, run: PrepareRun) -> None:
        if self.admin:
            run.completed[ADMIN_ACCESS_STATE] = list(self.admin)


class WholeGpuTier(Tier):
    """`Tier` of devices handed out as published; plan it after the share tiers."""

    def plan(self, request: ClaimRequest, planned: Planned) -> WholeGpuPlan:
        shares = planned.of(SharePlan)
        capped = planned.of(CappedSharePlan)
        held = frozenset(r.device for r in request.results if not r.admin_access)
        return WholeGpuPlan(
            held=held,
            whole=held
            - (shares.devices if shares is not None else frozenset())
            - (capped.devices if capped is not None else frozenset()),
            admin=tuple(sorted({r.device for r in request.results if r.admin_access})),
        )


def exclusive_devices(entry: CheckpointEntry) -> set[str]:
    """Devices ``entry`` holds for itself: all but those it was given with adminAccess and its
    MPS and capped shares."""
    admin = entry.state.get(ADMIN_ACCESS_STATE)
    shared = {name for name in admin if isinstance(name, str)} if isinstance(admin, list) else set()
    shares = share_devices(entry.state) | capped_share_devices(entry.state)
    return {d.device_name for d in entry.devices} - shared - shares
