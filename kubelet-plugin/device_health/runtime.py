"""The health monitor as the plugin runs it: built from the settings, feeding the slices and the
kubelet's health service, and on simulated nodes taking events from the inbox.

`start_health` returns None when the monitor is off (``--health-monitor``). Otherwise it
starts the monitor (and the inbox poll) in the running event loop, until `close_health`; every
change of device health calls ``republish`` with the taints of every tainted device (the
caller renders them into its desired pool), and `HealthRuntime.service` is the
``DRAResourceHealth`` service for the DRA socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from prometheus_client import CollectorRegistry

from gpu_dra.driver.health import HealthState, Target, device_health, device_taints
from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.resourceapi import DeviceTaint
from gpu_dra.kube.errors import ApiError
from gpu_dra.kube.events import EventApi
from gpu_dra.kubelet_plugin.device_health.inbox import SIMULATED_EVENTS_DIR, SimulatedEventInbox
from gpu_dra.kubelet_plugin.device_health.metrics import (
    DeviceHealthCollector,
    HealthEventMetrics,
)
from gpu_dra.kubelet_plugin.device_health.monitor import HealthMonitor, Snapshot
from gpu_dra.kubelet_plugin.device_health.monitor_inputs import MpsLiveness
from gpu_dra.kubelet_plugin.device_health.record import HealthRecord
from gpu_dra.kubelet_plugin.device_health.service import DeviceHealthService
from gpu_dra.kubelet_plugin.guard import node_warning
from gpu_dra.kubelet_plugin.mig.claims import shared_mig_devices
from gpu_dra.kubelet_plugin.mps.supervisor import DaemonSupervisor, Entries
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings

log = logging.getLogger(__name__)

INBOX_POLL_S: Final = 0.25

Republish = Callable[[Mapping[str, Sequence[DeviceTaint]]], None]


@dataclass
class HealthRuntime:
    monitor: HealthMonitor
    service: DeviceHealthService
    inbox: SimulatedEventInbox | None = None
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run in the background (in the running event loop) until `close`."""
        self._task = asyncio.create_task(self.run(), name="health")

    async def close(self) -> None:
        """Stop and wait until NVML is released (at most about one NVML wait)."""
        self.stop()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.monitor.run(), name="health-monitor")]
        if self.inbox is not None:
            tasks.append(asyncio.create_task(self._poll_inbox(), name="health-inbox"))
        try:
            await self._stopping.wait()
        finally:
            self.monitor.stop()
            self._stopping.set()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, Exception):
                    log.error("health monitor ended with an error: %r", result)

    def stop(self) -> None:
        self._stopping.set()

    async def _poll_inbox(self) -> None:
        assert self.inbox is not None
        while not self._stopping.is_set():
            try:
                await asyncio.to_thread(self.inbox.poll)
            except OSError as error:
                log.error("simulated NVML event inbox %s: %s", self.inbox.directory, error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), INBOX_POLL_S)


@dataclass(frozen=True)
class RecordedHealth:
    """The node's health record as the plugin found it at start (`recorded_health`)."""

    record: HealthRecord
    state: HealthState
    taints: Mapping[str, Sequence[DeviceTaint]]
    """The published devices' taints from the recorded problems: the first pool has them."""


def recorded_health(settings: KubeletPluginSettings, inventory: NodeInventory) -> RecordedHealth:
    """Read ``<data-dir>/device-health.json`` (`HealthRecordError` when it is unusable) and
    the taints its problems give the published devices."""
    record = HealthRecord(settings.state_dir)
    state = record.load()
    snapshot = device_health(state, inventory.health_scopes())
    taints = device_taints(snapshot, settings.health_policy, settings.driver_name)
    for name in sorted(taints):
        log.warning("health: device %s starts tainted from the health record: %s",
                    name, snapshot[name].message)  # fmt: skip
    return RecordedHealth(record, state, taints)


def start_health(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    *,
    supervisor: DaemonSupervisor | None,
    republish: Republish,
    entries: Entries | None = None,
    recorded: RecordedHealth | None = None,
    events: EventApi | None = None,
    registry: CollectorRegistry | None = None,
) -> HealthRuntime | None:
    """`health_runtime`, started in the running event loop; None when the monitor is off."""
    runtime = health_runtime(
        settings,
        nvml,
        inventory,
        supervisor=supervisor,
        republish=republish,
        entries=entries,
        recorded=recorded,
        events=events,
        registry=registry,
    )
    if runtime is not None:
        runtime.start()
    return runtime


def health_services(runtime: HealthRuntime | None) -> tuple[DeviceHealthService, ...]:
    """The services to serve on the DRA socket: the health service, or none."""
    return () if runtime is None else (runtime.service,)


async def close_health(runtime: HealthRuntime | None) -> None:
    """Stop the runtime (if any) and wait until NVML is released."""
    if runtime is not None:
        await runtime.close()


def health_runtime(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    *,
    supervisor: DaemonSupervisor | None,
    republish: Republish,
    entries: Entries | None = None,
    recorded: RecordedHealth | None = None,
    events: EventApi | None = None,
    registry: CollectorRegistry | None = None,
) -> HealthRuntime | None:
    """The monitor of this node's published devices, or None when it is off. ``events``
    records a Warning Event on the Node for the GPUs NVML cannot watch. The MPS share
    daemons' liveness is ``supervisor``'s verdict (it alone probes them), pushed on change;
    ``entries`` (the claims' records) tell which MIG devices were made from partitions offered
    as shares; ``recorded``: the health record read at start (None: the problems stay in
    memory); ``registry`` gets the health metrics (`metrics`)."""
    if not settings.health_monitor_enabled:
        log.info("health monitor off (--health-monitor)")
        return None
    policy = settings.health_policy
    shared = [gpu.uuid for gpu in inventory.mps_shares]
    migs = {m.uuid: Target(m.parent.uuid, (m.gi_id, m.ci_id)) for m in inventory.mig_mps_shares}
    partition_daemons = None
    if inventory.partition_shares and entries is not None:
        records = entries

        def partition_daemons() -> dict[str, Target]:
            return {
                uuid: Target(i.parent_uuid, placement=(i.gi_profile_id, i.placement_start))
                for uuid, i in shared_mig_devices(records()).items()
            }

    liveness: MpsLiveness | None = None
    if supervisor is not None and (shared or migs or partition_daemons is not None):
        liveness = supervisor
    monitor = HealthMonitor(
        nvml,
        inventory.gpus,
        inventory.health_scopes(),
        policy=policy,
        shared_gpus=shared,
        shared_migs=migs,
        partition_daemons=partition_daemons,
        mps=liveness,
        record=None if recorded is None else recorded.record,
        recorded=None if recorded is None else recorded.state,
        report_unwatched=None if events is None else _node_events(settings, events),
        observe_event=None
        if registry is None
        else HealthEventMetrics(registry, settings.node_name).observe,
    )
    if registry is not None:
        registry.register(DeviceHealthCollector(settings.node_name, monitor.snapshot))

    def changed(snapshot: Snapshot) -> None:
        republish(device_taints(snapshot, policy, settings.driver_name))

    monitor.add_listener(changed)
    if liveness is not None and supervisor is not None:
        supervisor.add_listener(monitor.mps_changed)
    inbox = None
    if isinstance(nvml, SimulatedNvml):
        inbox = SimulatedEventInbox(settings.state_dir / SIMULATED_EVENTS_DIR, nvml)
    log.info(
        "health monitor on: ignored XIDs %s, taint effects degraded=%s lost=%s, MPS share "
        "GPUs watched=%d, simulated event inbox=%s",
        ",".join(map(str, sorted(policy.ignored_xids))) or "none",
        policy.degraded_effect.value,
        policy.lost_effect.value,
        len(shared) if liveness is not None else 0,
        inbox.directory if inbox is not None else "-",
    )
    service = DeviceHealthService(monitor, pool=settings.node_name)
    return HealthRuntime(monitor, service, inbox)


UNWATCHED_REASON: Final = "GPUHealthNotMonitored"


def _node_events(
    settings: KubeletPluginSettings, events: EventApi
) -> Callable[[Mapping[str, str]], None]:
    """A Warning Event on the Node per GPU that NVML cannot watch (blocking; errors logged)."""
    effect = settings.health_policy.unmonitored_effect

    def report(unwatched: Mapping[str, str]) -> None:
        taint = "not tainted" if effect is None else f"tainted {effect.value}"
        for uuid, why in sorted(unwatched.items()):
            message = (
                f"gpu-dra kubelet plugin cannot watch GPU {uuid} for XIDs and ECC errors ({why}):"
                f" its health is Unknown and a fault would go unseen; its devices are {taint} "
                "(--health-taint-effect-unmonitored)"
            )
            event = node_warning(settings.node_name, settings.event_namespace,
                                 UNWATCHED_REASON, message, datetime.now(UTC))  # fmt: skip
            try:
                events.create_event(settings.event_namespace, event)
            except ApiError as error:
                log.warning("could not record that GPU %s is not watched as an Event: %s",
                            uuid, error)  # fmt: skip

    return report
