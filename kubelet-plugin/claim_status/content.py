"""The ``status.devices`` entries of one prepared claim: one per device this driver prepared for
it (driver, pool, device, shareID), with ``data`` saying what the device is (UUIDs, MIG profile,
MPS share caps, time-slice interval) and the conditions ``Ready``, ``Healthy`` and ``Active``.

Pure: facts in, entries out. Conditions carry no ``lastTransitionTime`` here; the writer stamps
it (kept while a condition's status stays). ``data.sampledAt`` is the time of the utilization
sample an ``Active`` True or False was derived from, so that a reader (the idle policy) can tell
a live report from one a stopped plugin left behind. See docs/architecture.md#claim-status.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from gpu_dra.driver.attributes import binary_si_quantity
from gpu_dra.driver.health import (
    KEY_ECC,
    KEY_GPU_LOST,
    KEY_MPS_DAEMON,
    KEY_UNMONITORED,
    KEY_XID,
    DeviceHealth,
    HealthStatus,
)
from gpu_dra.driver.model import Gpu, MigDevice, MigPartition
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, JsonValue
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.time_slicer import interval_name
from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice

MAX_DATA_BYTES: Final = 10 * 1024
"""The API's bound on one entry's ``data`` (serialized JSON)."""
MAX_MESSAGE: Final = 1024
"""Condition messages are cut to this many characters."""
_REASON: Final = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


@dataclass(frozen=True)
class Condition:
    """A ``metav1.Condition`` without its transition time."""

    type: str
    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class Activity:
    """A device's use as the utilization sampler saw it: when it was last active (or first
    sampled), as of which sample; ``idle_after_s``: how long inactive counts as idle."""

    last_active: float
    sampled_at: float
    idle_after_s: float


@dataclass(frozen=True)
class DeviceStatus:
    """One ``status.devices`` entry, its conditions unstamped."""

    driver: str
    pool: str
    device: str
    share_id: str | None
    data: Mapping[str, JsonValue]
    conditions: tuple[Condition, ...]

    @property
    def key(self) -> tuple[str, str, str, str | None]:
        """The list map's key: driver, pool, device, shareID."""
        return (self.driver, self.pool, self.device, self.share_id)


def claim_status(
    entry: CheckpointEntry,
    inventory: NodeInventory,
    claim_devices: Sequence[ClaimDevice],
    *,
    driver: str,
    node: str,
    health: Mapping[str, DeviceHealth] | None,
    activity: Mapping[str, Activity] | None,
    time_slices: Mapping[str, int],
) -> list[DeviceStatus]:
    """The entries of `entry`'s devices. ``claim_devices``: the claim's devices as utilization
    reads them (tier, UUID, share caps); ``health`` by published device name (None: monitor
    off); ``activity`` by device name (None: sampling off); ``time_slices`` by GPU UUID."""
    by_name = {device.device: device for device in claim_devices}
    entries = []
    for prepared in sorted(entry.devices, key=lambda d: (d.pool_name, d.device_name)):
        name = prepared.device_name
        held = by_name.get(name)
        data = _data(name, held, inventory, time_slices)
        conditions = [Condition("Ready", "True", "Prepared", f"prepared by gpu-dra on node {node}")]
        if health is not None and name in health:
            conditions.append(_healthy(health[name]))
        if activity is not None:
            active = _active(activity.get(name))
            conditions.append(active)
            if active.status != "Unknown":  # derived from a sample: say which one
                data["sampledAt"] = _rfc3339(activity[name].sampled_at)
            if active.status == "False":
                data["idleSince"] = _rfc3339(activity[name].last_active)
        entries.append(
            DeviceStatus(
                driver, prepared.pool_name, name, prepared.share_id, data, tuple(conditions)
            )
        )
    return entries


def _data(
    name: str,
    held: ClaimDevice | None,
    inventory: NodeInventory,
    time_slices: Mapping[str, int],
) -> dict[str, JsonValue]:
    data: dict[str, JsonValue] = {}
    if held is not None:
        data["tier"] = held.tier
        if held.uuid is not None:
            data["uuid"] = held.uuid
    published = inventory.by_name(name)
    if isinstance(published, Gpu):
        data["productName"] = published.product_name
        data.setdefault("uuid", published.uuid)
    elif isinstance(published, MigDevice):
        data["migProfile"] = published.profile
        data["parentUUID"] = published.parent.uuid
    elif isinstance(published, MigPartition):
        data["migProfile"] = published.profile_name
        data["parentUUID"] = published.parent.uuid
    if held is not None and held.share_memory_bytes is not None:
        data["memory"] = binary_si_quantity(held.share_memory_bytes)
    if held is not None and held.share_compute_percent is not None:
        data["computePercent"] = held.share_compute_percent
    if held is not None and held.share_memory_enforcement is not None:
        data["memoryEnforcement"] = held.share_memory_enforcement
    gpu_uuid = published.uuid if isinstance(published, Gpu) else None
    if gpu_uuid is not None and gpu_uuid in time_slices:
        data["timeSliceInterval"] = interval_name(time_slices[gpu_uuid])
    if len(json.dumps(data)) > MAX_DATA_BYTES:  # cannot happen with these fields; bound anyway
        data = {"tier": data.get("tier", ""), "truncated": True}
    return data


def _healthy(health: DeviceHealth) -> Condition:
    status = HealthStatus(health.status)
    if status is HealthStatus.HEALTHY:
        return Condition("Healthy", "True", "Healthy", "no problem reported")
    worst = max(health.problems, key=lambda p: p.severity)
    if status is HealthStatus.UNKNOWN:
        return Condition("Healthy", "Unknown", "NotMonitored", health.message[:MAX_MESSAGE])
    return Condition("Healthy", "False", _problem_reason(worst.key, worst.value),
                     health.message[:MAX_MESSAGE])  # fmt: skip


def _problem_reason(key: str, value: str) -> str:
    reason = {
        KEY_XID: f"Xid{value}",
        KEY_ECC: "DoubleBitEccError",
        KEY_GPU_LOST: "GpuLost",
        KEY_MPS_DAEMON: "MpsDaemonNotRunning",
        KEY_UNMONITORED: "NotMonitored",
    }.get(key, "Unhealthy")
    return reason if _REASON.match(reason) else "Unhealthy"


def _active(activity: Activity | None) -> Condition:
    if activity is None:
        return Condition("Active", "Unknown", "NotSampled", "not sampled yet")
    idle_s = activity.sampled_at - activity.last_active
    if idle_s < activity.idle_after_s:
        return Condition("Active", "True", "InUse",
                         f"used within the last {_duration(activity.idle_after_s)}")  # fmt: skip
    return Condition(
        "Active",
        "False",
        "Idle",
        f"idle: no GPU activity since {_rfc3339(activity.last_active)} (sampled every "
        "--utilization-interval; docs/metrics.md#idle-claims)",
    )


def _duration(seconds: float) -> str:
    whole = int(seconds)
    if whole % 3600 == 0 and whole:
        return f"{whole // 3600}h"
    if whole % 60 == 0 and whole:
        return f"{whole // 60}m"
    return f"{whole}s"


def _rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
