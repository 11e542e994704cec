"""The devices prepared claims hold, as the utilization sampler sees them: which NVML device
(UUID) to read for each, in which tier, for which pods, and an MPS share's size and
what caps its memory.

Read from the checkpoint (`PrepareCompleted` entries only) and the inventory; the pods are the
claim's ``status.reservedFor`` pods as the claim cache has them (none while it is not serving).
Tiers: ``gpu`` (whole GPU), ``mig`` (static or dynamic MIG device), ``mps`` (per-claim MPS
daemon), ``mps-share`` (MPS share of a GPU or static MIG device), ``timeslicing`` (a
time-sliced GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from gpu_dra.driver.model import Gpu, MigDevice
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, ClaimPhase, JsonValue
from gpu_dra.kubelet_plugin.mig.instances import MigError
from gpu_dra.kubelet_plugin.mps.daemon_model import MpsError
from gpu_dra.kubelet_plugin.mps.ids import is_shared_daemon
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.tiers.state import (
    MEMORY_ENFORCEMENT_KEY,
    SHARES_STATE_KEY,
    TIME_SLICE_STATE_KEY,
    handles_from_state,
    intents_from_state,
)

TIERS: Final = ("gpu", "mig", "mps", "mps-share", "timeslicing")


@dataclass(frozen=True)
class PodRef:
    uid: str
    name: str


PodLookup = Callable[[str, str], tuple[PodRef, ...]]
"""(namespace, claim name) -> the pods the claim is reserved for."""


@dataclass(frozen=True)
class ClaimDevice:
    """One device of one prepared claim."""

    claim: ClaimRef
    device: str
    """The published device name (``gpu-0``, ``gpu-0-mig-1g.10gb-0``)."""
    tier: str
    uuid: str | None
    """The NVML device to read (``GPU-...``, ``MIG-...``); None when not known (a dynamic MIG
    device whose UUID was not recorded)."""
    pods: tuple[PodRef, ...] = ()
    share_memory_bytes: int | None = None
    share_compute_percent: int | None = None
    share_memory_enforcement: str | None = None
    """What caps an MPS share's memory (`memory_limits.Enforcement` value: ``driver`` or
    ``mps-client``); None for other tiers and shares recorded without it."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.claim.uid, self.device)


def claim_devices(
    entries: Mapping[str, CheckpointEntry], inventory: NodeInventory, pods: PodLookup
) -> list[ClaimDevice]:
    """Every device of every prepared claim, by claim UID then device name."""
    found: list[ClaimDevice] = []
    for entry in (e for _, e in sorted(entries.items())):
        if entry.phase != ClaimPhase.PREPARE_COMPLETED:
            continue
        claim_pods = pods(entry.claim.namespace, entry.claim.name)
        shares = _shares(entry.state)
        dynamic = _dynamic_mig_uuids(entry.state)
        claim_tier = _claim_tier(entry.state)
        for name in sorted({device.device_name for device in entry.devices}):
            share = shares.get(name)
            if share is not None:
                found.append(
                    ClaimDevice(
                        entry.claim,
                        name,
                        "mps-share",
                        _str(share, "uuid"),
                        claim_pods,
                        _int(share, "memoryBytes"),
                        _int(share, "computePercent"),
                        _str(share, MEMORY_ENFORCEMENT_KEY),
                    )
                )
                continue
            published = inventory.by_name(name)
            is_mig = not isinstance(published, Gpu) or name in dynamic
            if name in dynamic:
                uuid = dynamic[name]
            elif isinstance(published, Gpu | MigDevice):
                uuid = published.uuid
            else:
                uuid = None
            tier = claim_tier or ("mig" if is_mig else "gpu")
            found.append(ClaimDevice(entry.claim, name, tier, uuid, claim_pods))
    return found


def pods_from_claim(claim: Mapping[str, object] | None) -> tuple[PodRef, ...]:
    """The pods in a ResourceClaim's ``status.reservedFor``."""
    status = claim.get("status") if claim else None
    reserved = status.get("reservedFor") if isinstance(status, dict) else None
    pods = []
    for ref in reserved if isinstance(reserved, list) else []:
        if isinstance(ref, dict) and ref.get("resource") == "pods":
            uid, name = ref.get("uid"), ref.get("name")
            if isinstance(uid, str) and isinstance(name, str):
                pods.append(PodRef(uid, name))
    return tuple(pods)


def _claim_tier(state: Mapping[str, JsonValue]) -> str | None:
    try:
        handles = handles_from_state(state)
    except MpsError:
        handles = []
    if any(not is_shared_daemon(handle.daemon_id) for handle in handles):
        return "mps"
    if state.get(TIME_SLICE_STATE_KEY):
        return "timeslicing"
    return None


def _shares(state: Mapping[str, JsonValue]) -> dict[str, dict[str, JsonValue]]:
    value = state.get(SHARES_STATE_KEY)
    if not isinstance(value, dict):
        return {}
    return {name: share for name, share in value.items() if isinstance(share, dict)}


def _dynamic_mig_uuids(state: Mapping[str, JsonValue]) -> dict[str, str | None]:
    try:
        return {intent.device: intent.uuid for intent in intents_from_state(state)}
    except MigError:
        return {}


def _str(value: Mapping[str, JsonValue], key: str) -> str | None:
    found = value.get(key)
    return found if isinstance(found, str) else None


def _int(value: Mapping[str, JsonValue], key: str) -> int | None:
    found = value.get(key)
    return found if isinstance(found, int) and not isinstance(found, bool) else None
