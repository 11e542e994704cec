"""Prometheus metrics of the kubelet plugin: its DRA calls, the GPUs discovery left out, its
MPS daemons and caps, and claims whose recorded state cannot be read.

Registered on a registry passed in (no process-global default), exported by `__main__` on
`--metrics-port` together with the slice publisher's metrics.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_dra.driver.model import GpuProblem
from gpu_dra.driver.shares import FULL_COMPUTE
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry, CheckpointError, JsonValue
from gpu_dra.kubelet_plugin.mig.instances import MigError
from gpu_dra.kubelet_plugin.mps.daemon import current_handle
from gpu_dra.kubelet_plugin.mps.daemon_model import DaemonHandle, MpsError
from gpu_dra.kubelet_plugin.mps.ids import is_shared_daemon
from gpu_dra.kubelet_plugin.mps.process import ProcessIdentity, is_alive
from gpu_dra.kubelet_plugin.tiers.state import (
    DYNAMIC_MIG_STATE_KEY,
    MEMORY_ENFORCEMENT_KEY,
    MPS_STATE_KEY,
    SHARES_STATE_KEY,
    handles_from_state,
    intents_from_state,
    shares_from_state,
)

log = logging.getLogger(__name__)

Operation = Literal["prepare", "unprepare"]
OPERATIONS: tuple[Operation, ...] = ("prepare", "unprepare")

# Prepare targets are milliseconds; the kubelet gives up at 45 s.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 45)


class PluginMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.call_duration = Histogram(
            "gpu_dra_kubelet_plugin_call_duration_seconds",
            "Duration of NodePrepareResources / NodeUnprepareResources calls, by operation.",
            ["operation"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.claims = Counter(
            "gpu_dra_kubelet_plugin_claims",
            "Claims handled, by operation and result (ok, error).",
            ["operation", "result"],
            registry=registry,
        )
        for operation in OPERATIONS:
            self.call_duration.labels(operation=operation)
            for result in ("ok", "error"):
                self.claims.labels(operation=operation, result=result)

    def observe_call(self, operation: Operation, seconds: float) -> None:
        self.call_duration.labels(operation=operation).observe(seconds)

    def count_claim(self, operation: Operation, ok: bool) -> None:
        self.claims.labels(operation=operation, result="ok" if ok else "error").inc()


class DiscoveryMetrics:
    """``gpu_dra_gpu_discovery_errors``: 1 per GPU that discovery left out at start (not
    published because NVML could not describe it), labelled with the failed NVML call and its
    return code name; no series when every GPU was read."""

    def __init__(self, registry: CollectorRegistry, node: str) -> None:
        self._node = node
        self.errors = Gauge(
            "gpu_dra_gpu_discovery_errors",
            "GPUs left out at start because NVML could not describe them (1 each), by NVML "
            "index, PCI bus id, UUID ('' when not read), the failed NVML call and its return "
            "code name (reason).",
            ["node", "gpu", "pci_bus_id", "uuid", "call", "reason"],
            registry=registry,
        )

    def set_problems(self, problems: Iterable[GpuProblem]) -> None:
        self.errors.clear()
        for problem in problems:
            self.errors.labels(
                node=self._node,
                gpu=str(problem.index),
                pci_bus_id=problem.pci_bus_id or "",
                uuid=problem.uuid or "",
                call=problem.call or "",
                reason=problem.reason,
            ).set(1)


CheckpointEntries = Callable[[], Mapping[str, CheckpointEntry]]
"""The checkpoint's entries by claim UID (`Checkpoint.all`)."""


class MpsCollector(Collector):
    """MPS daemons and per-claim caps, read from the checkpoint at every scrape.

    The checkpoint is what the plugin knows about prepared claims, so gauges of a daemon or a
    claim disappear as soon as its last claim is unprepared. Per-claim daemons report their
    defaults as the claim's caps; MPS shares report their own caps (`mps.shared_daemons`).
    """

    def __init__(
        self,
        node: str,
        entries: CheckpointEntries,
        alive: Callable[[DaemonHandle], bool] | None = None,
    ) -> None:
        """``alive`` says whether a daemon's process runs (default: its PID and start time)."""
        self._node = node
        self._entries = entries
        self._alive = alive or _process_runs

    def collect(self) -> Iterator[Metric]:
        daemons = GaugeMetricFamily(
            "gpu_dra_mps_daemons",
            "MPS control daemons of prepared claims whose process runs, by kind (shared: the "
            "daemon of a GPU's MPS shares; claim: a claim's own daemon).",
            labels=["node", "kind"],
        )
        clients = GaugeMetricFamily(
            "gpu_dra_mps_daemon_claims",
            "Claims an MPS control daemon serves (its reference count for a shared daemon).",
            labels=["node", "daemon"],
        )
        memory = GaugeMetricFamily(
            "gpu_dra_mps_claim_pinned_memory_limit_bytes",
            "Pinned device memory cap of a claim's MPS clients per GPU (a share's allocated "
            "memory, or a claim daemon's default limit).",
            labels=["node", "daemon", "claim", "claim_uid", "gpu"],
        )
        threads = GaugeMetricFamily(
            "gpu_dra_mps_claim_active_thread_percentage",
            "Active thread percentage (percent of SMs) a claim's MPS clients may use (a share's "
            "allocated compute, or a claim daemon's default).",
            labels=["node", "daemon", "claim", "claim_uid"],
        )
        enforcement = GaugeMetricFamily(
            "gpu_dra_mps_share_memory_enforcement",
            "1 per MPS share, labelled with what caps its memory: driver (a cgroup limit per "
            "container, NVIDIA_GPU_MEMORY_LIMIT and the apply-cuda-memory-limits hook, plus "
            "MPS's pinned limit) or mps-client (MPS's pinned limit per process only).",
            labels=["node", "claim", "claim_uid", "gpu", "enforcement"],
        )
        try:
            entries = self._entries()
        except (OSError, CheckpointError) as error:
            log.warning("MPS metrics: cannot read the checkpoint: %s", error)
            entries = {}
        users: dict[str, set[str]] = defaultdict(set)
        handles: dict[str, DaemonHandle] = {}
        for uid, entry in sorted(entries.items()):
            try:
                recorded = handles_from_state(entry.state)
            except MpsError as error:
                log.warning("MPS metrics: state of claim_uid=%s unusable: %s", uid, error)
                continue
            claim = f"{entry.claim.namespace}/{entry.claim.name}"
            shares = shares_from_state(entry.state)
            share_uuids = {_share_uuid(entry, name): size for name, size in shares.items()}
            for name in shares:
                enforced = _share_field(entry, name, MEMORY_ENFORCEMENT_KEY) or "mps-client"
                gpu = _share_uuid(entry, name)
                enforcement.add_metric([self._node, claim, uid, gpu, enforced], 1)
            for handle in recorded:
                users[handle.daemon_id].add(uid)
                handles.setdefault(handle.daemon_id, handle)
                base = [self._node, handle.daemon_id, claim, uid]
                if is_shared_daemon(handle.daemon_id):
                    for gpu, size in share_uuids.items():
                        if gpu in handle.devices:
                            memory.add_metric([*base, gpu], size.memory_bytes)
                            threads.add_metric(base, size.compute_percent)
                    continue
                settings = handle.settings
                for gpu, limit in sorted(settings.pinned_limits.items()):
                    memory.add_metric([*base, gpu], int(limit.removesuffix("M")) * 2**20)
                percent = settings.active_thread_percentage
                threads.add_metric(base, FULL_COMPUTE if percent is None else percent)
        running = {"shared": 0, "claim": 0}
        for daemon_id, handle in handles.items():
            clients.add_metric([self._node, daemon_id], len(users[daemon_id]))
            if self._alive(handle):
                running["shared" if is_shared_daemon(daemon_id) else "claim"] += 1
        for kind, count in running.items():
            daemons.add_metric([self._node, kind], count)
        yield from (daemons, clients, memory, threads, enforcement)


class ClaimStateCollector(Collector):
    """``gpu_dra_claim_state_unreadable``: 1 per claim and state key (``dynamicMig``,
    ``mpsDaemons``) that the checkpoint records in a form the plugin cannot read. The start-up
    sweeps fail closed on them (what they may own is kept), so they need a person; read from
    the checkpoint at every scrape, a series goes with its claim's entry."""

    def __init__(self, node: str, entries: CheckpointEntries) -> None:
        self._node = node
        self._entries = entries

    def collect(self) -> Iterator[Metric]:
        unreadable = GaugeMetricFamily(
            "gpu_dra_claim_state_unreadable",
            "Claims whose recorded state (dynamic MIG devices, MPS daemons) cannot be read (1 "
            "each, by state key); start-up leaves alone what they may own.",
            labels=["node", "claim", "claim_uid", "state"],
        )
        try:
            entries = self._entries()
        except (OSError, CheckpointError) as error:
            log.warning("claim state metrics: cannot read the checkpoint: %s", error)
            entries = {}
        for uid, entry in sorted(entries.items()):
            claim = f"{entry.claim.namespace}/{entry.claim.name}"
            for key, read in _READERS.items():
                try:
                    read(entry.state)
                except (MigError, MpsError):
                    unreadable.add_metric([self._node, claim, uid, key], 1)
        yield unreadable


def register_checkpoint_collectors(
    registry: CollectorRegistry, node: str, entries: CheckpointEntries
) -> None:
    """The collectors that read the checkpoint at every scrape: `MpsCollector` and
    `ClaimStateCollector`."""
    registry.register(MpsCollector(node, entries))
    registry.register(ClaimStateCollector(node, entries))


_READERS: Mapping[str, Callable[[Mapping[str, JsonValue]], object]] = {
    DYNAMIC_MIG_STATE_KEY: intents_from_state,
    MPS_STATE_KEY: handles_from_state,
}


def _share_uuid(entry: CheckpointEntry, device_name: str) -> str:
    return _share_field(entry, device_name, "uuid")


def _share_field(entry: CheckpointEntry, device_name: str, key: str) -> str:
    """A string field of a share's record; "" when absent (records of older plugins)."""
    share = entry.state.get(SHARES_STATE_KEY, {})
    value = share.get(device_name) if isinstance(share, dict) else None
    field = value.get(key) if isinstance(value, dict) else None
    return field if isinstance(field, str) else ""


def _process_runs(handle: DaemonHandle) -> bool:
    """Whether the daemon's current instance runs (after a restart in place the claims may
    still record the instance they joined, `mps.daemon.current_handle`)."""
    current = current_handle(handle)
    return is_alive(ProcessIdentity(current.pid, current.pid_start_time))
