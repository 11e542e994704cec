"""What the tiers record in a claim's checkpoint ``state``: every key, its writer and reader.

A claim's `CheckpointEntry.state` is a JSON object; each tier writes only its own keys (below)
and reads the others' only through the readers here, so the schema is in one place. Readers
raise the owning package's error (`MpsStateError`, `MigError`, `TimeSlicingStateError`) when a
value is unusable: an unreadable record is never read as "nothing recorded". The checkpoint file
itself (phases, versions) is `checkpoint_format`'s. See docs/architecture.md, "Crash safety".

| key | written by | value |
|---|---|---|
| `ADMIN_ACCESS_STATE_KEY` | `.whole_gpu` | device names held with adminAccess |
| `MPS_STATE_KEY` | `.claim_mps`, `.mps_shares` | `DaemonHandle`s of the claim's MPS daemons |
| `SHARES_STATE_KEY` | `.mps_shares` | ``{device name: share}`` of its MPS shares |
| `CAPPED_SHARES_STATE_KEY` | `.capped_shares` | ``{device name: share}`` of its capped shares |
| `TIME_SLICE_STATE_KEY` | `.timeslicing` | ``{GPU UUID: --set-timeslice value}`` |
| `DYNAMIC_MIG_STATE_KEY` | `.dynamic_mig` | its `MigIntent`s |
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from gpu_dra.driver.shares import ShareSize
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.mig.instances import MigError
from gpu_dra.kubelet_plugin.mig.intents import MigIntent
from gpu_dra.kubelet_plugin.mps.daemon_model import DaemonHandle, MpsStateError
from gpu_dra.kubelet_plugin.time_slicer import INTERVAL_NAMES, TimeSlicingStateError

ADMIN_ACCESS_STATE_KEY: Final = "adminAccessDevices"
"""Devices the claim holds with adminAccess (they block no one)."""
MPS_STATE_KEY: Final = "mpsDaemons"
"""The claim's MPS daemons (per-claim ones and the shared ones it joined), a list of handles."""
SHARES_STATE_KEY: Final = "mpsShares"
"""``{device name: share}`` of the claim's MPS shares."""
MEMORY_ENFORCEMENT_KEY: Final = "memoryEnforcement"
"""Key of one MPS share's record naming its `memory_limits.Enforcement`."""
CAPPED_SHARES_STATE_KEY: Final = "cappedShares"
"""``{device name: share}`` of the claim's capped shares."""
TIME_SLICE_STATE_KEY: Final = "timeSliceApplied"
"""``{GPU UUID: --set-timeslice value}`` the claim applied (or applies)."""
DYNAMIC_MIG_STATE_KEY: Final = "dynamicMig"
"""The claim's `MigIntent`s, as a list of objects."""


def admin_access_devices(state: Mapping[str, JsonValue]) -> set[str]:
    """Device names the claim holds with adminAccess."""
    admin = state.get(ADMIN_ACCESS_STATE_KEY)
    return {name for name in admin if isinstance(name, str)} if isinstance(admin, list) else set()


def share_devices(state: Mapping[str, JsonValue]) -> set[str]:
    """Device names the claim holds as MPS shares."""
    value = state.get(SHARES_STATE_KEY)
    return {str(name) for name in value} if isinstance(value, dict) else set()


def capped_share_devices(state: Mapping[str, JsonValue]) -> set[str]:
    """Device names the claim holds as capped shares."""
    value = state.get(CAPPED_SHARES_STATE_KEY)
    return {name for name in value if isinstance(name, str)} if isinstance(value, dict) else set()


def exclusive_devices(entry: CheckpointEntry) -> set[str]:
    """Devices ``entry`` holds for itself: all but those it was given with adminAccess and its
    MPS and capped shares."""
    state = entry.state
    not_held = admin_access_devices(state) | share_devices(state) | capped_share_devices(state)
    return {d.device_name for d in entry.devices} - not_held


def shares_from_state(state: Mapping[str, JsonValue]) -> dict[str, ShareSize]:
    """``{device name: size}`` of the MPS shares the claim records (bad entries skipped)."""
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


def handles_to_state(handles: Sequence[DaemonHandle]) -> JsonValue:
    """The value to keep under `MPS_STATE_KEY`."""
    return [handle.to_state() for handle in handles]


def handles_from_state(state: Mapping[str, JsonValue]) -> list[DaemonHandle]:
    """The MPS daemon handles the claim records (none without `MPS_STATE_KEY`);
    `MpsStateError` when unusable."""
    value = state.get(MPS_STATE_KEY)
    if value is None:
        return []
    if not isinstance(value, list):
        raise MpsStateError(f"checkpoint state {MPS_STATE_KEY!r} is not a list")
    return [DaemonHandle.from_state(item) for item in value]


def claims_using(states: Mapping[str, Mapping[str, JsonValue]], daemon_id: str) -> list[str]:
    """UIDs of the claims whose ``state`` records daemon ``daemon_id``, sorted.

    The reference count of a shared (per-device) daemon: derived from the checkpoint, so it
    cannot drift from the claims after a crash. Unprepare stops the daemon when the claim being
    removed is the last one listed. ``states`` maps claim UID -> that claim's ``state``.
    """
    return sorted(
        uid
        for uid, state in states.items()
        if any(handle.daemon_id == daemon_id for handle in handles_from_state(state))
    )


def time_slices_to_state(applied: Mapping[str, int]) -> dict[str, JsonValue]:
    """The value to keep under `TIME_SLICE_STATE_KEY`."""
    return {uuid: applied[uuid] for uuid in sorted(applied)}


def time_slices_from_state(state: Mapping[str, JsonValue]) -> dict[str, int]:
    """The ``{uuid: value}`` the claim records; `TimeSlicingStateError` when unusable."""
    raw = state.get(TIME_SLICE_STATE_KEY)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TimeSlicingStateError(f"{TIME_SLICE_STATE_KEY} is not an object: {raw!r}"[:200])
    slices: dict[str, int] = {}
    for uuid, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int) or value not in INTERVAL_NAMES:
            raise TimeSlicingStateError(
                f"{TIME_SLICE_STATE_KEY}[{uuid}] is not a time-slice value 0-3: {value!r}"[:200]
            )
        slices[uuid] = value
    return slices


def intents_to_state(intents: Iterable[MigIntent]) -> JsonValue:
    """The value to keep under `DYNAMIC_MIG_STATE_KEY`."""
    return [intent.to_json() for intent in intents]


def intents_from_state(state: Mapping[str, JsonValue]) -> list[MigIntent]:
    """The MIG intents the claim records; `MigError` when they are unusable."""
    raw = state.get(DYNAMIC_MIG_STATE_KEY)
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise MigError(f"checkpoint state {DYNAMIC_MIG_STATE_KEY} is not a list: {raw!r}")
    intents = []
    for item in raw:
        if not isinstance(item, dict):
            raise MigError(f"checkpoint state {DYNAMIC_MIG_STATE_KEY} entry {item!r} is no object")
        try:
            intents.append(MigIntent.from_json(item))
        except (KeyError, TypeError) as error:
            raise MigError(
                f"checkpoint state {DYNAMIC_MIG_STATE_KEY} entry {item!r} is unusable: {error}"
            ) from error
    return intents
