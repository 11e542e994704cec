"""Prometheus metrics of utilization per claim (docs/metrics.md): the claims' devices (read at
every scrape) and the newest sample's values (only those NVML reported: a failed or unsupported
value has no series, never 0), each claim device's last activity and its peaks since it was first
sampled (for right-sizing), the sampler's errors and cost.
A claim device's series carry no pod: ``gpu_dra_claim_pod_info`` has one series per pod a claim
is reserved for, to join with kube-state-metrics on ``namespace`` and ``pod``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice, PodRef
from gpu_dra.kubelet_plugin.utilization.monitor import UtilizationMonitor, claim_reading
from gpu_dra.kubelet_plugin.utilization.sampler import Sample

LABELS = ["node", "namespace", "claim", "device", "tier"]
POD_LABELS = ["node", "namespace", "claim", "pod", "pod_uid"]
_SAMPLE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class SampleMetrics:
    """Counters fed by every sample: errors by device, call and reason; the sample's cost."""

    def __init__(self, registry: CollectorRegistry, node: str) -> None:
        self._node = node
        self.errors = Counter(
            "gpu_dra_utilization_errors",
            "NVML calls (and cgroup reads) of utilization samples that failed, by device UUID, "
            "call and reason (the NVML return code name); the value they would give is absent.",
            ["node", "device", "call", "reason"],
            registry=registry,
        )
        self.duration = Histogram(
            "gpu_dra_utilization_sample_duration_seconds",
            "Time one utilization sample of every claimed device takes.",
            ["node"],
            buckets=_SAMPLE_BUCKETS,
            registry=registry,
        )
        self.duration.labels(node=node)

    def observe(self, sample: Sample) -> None:
        self.duration.labels(node=self._node).observe(sample.duration_s)
        for error in sample.errors:
            self.errors.labels(
                node=self._node, device=error.device, call=error.call, reason=error.reason
            ).inc()


class ClaimUtilizationCollector(Collector):
    """Per claim device gauges, from `devices()` at scrape and the monitor's newest sample."""

    def __init__(
        self,
        node: str,
        devices: Callable[[], list[ClaimDevice]],
        monitor: UtilizationMonitor | None,
    ) -> None:
        self._node = node
        self._devices = devices
        self._monitor = monitor

    def collect(self) -> Iterator[Metric]:
        def family(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=LABELS)

        held = family(
            "gpu_dra_claim_devices",
            "Devices prepared claims hold (1 each), by namespace, claim, device and tier.",
        )
        pods = GaugeMetricFamily(
            "gpu_dra_claim_pod_info",
            "1 per pod a prepared claim is reserved for (status.reservedFor): joins the claim "
            "series (on namespace, claim) with kube-state-metrics (on namespace, pod).",
            labels=POD_LABELS,
        )
        gpu = family(
            "gpu_dra_claim_gpu_utilization_percent",
            "GPU utilization of a claim's device in the newest sample (whole GPU, time-sliced "
            "or per-claim MPS GPU: the GPU's; MPS share: the sum of its processes' SM shares).",
        )
        memory_util = family(
            "gpu_dra_claim_memory_utilization_percent",
            "Memory bandwidth utilization of a claim's full GPU in the newest sample.",
        )
        used = family(
            "gpu_dra_claim_memory_used_bytes",
            "Device memory used on a claim's device (MPS share: by its pods' processes).",
        )
        total = family(
            "gpu_dra_claim_memory_limit_bytes",
            "Device memory a claim's device has (MPS share: the share's memory).",
        )
        compute = family(
            "gpu_dra_claim_compute_limit_percent",
            "An MPS share's compute (percent of the GPU's SMs).",
        )
        processes = family(
            "gpu_dra_claim_processes",
            "Compute processes on a claim's device (MPS share: in its pods).",
        )
        active = family(
            "gpu_dra_claim_last_active_timestamp_seconds",
            "Last sample in which a claim's device was active (utilization at least the idle "
            "threshold; MIG: a compute process ran), else its first sample.",
        )
        used_peak = family(
            "gpu_dra_claim_memory_used_peak_bytes",
            "Most device memory a claim's device used in any sample since "
            "gpu_dra_claim_observed_since_timestamp_seconds (kept in the plugin's memory).",
        )
        gpu_peak = family(
            "gpu_dra_claim_gpu_utilization_peak_percent",
            "Highest GPU utilization of a claim's device in any sample since "
            "gpu_dra_claim_observed_since_timestamp_seconds (absent for MIG without GPM).",
        )
        processes_peak = family(
            "gpu_dra_claim_processes_peak",
            "Most compute processes on a claim's device in any sample since "
            "gpu_dra_claim_observed_since_timestamp_seconds.",
        )
        since = family(
            "gpu_dra_claim_observed_since_timestamp_seconds",
            "The first sample of a claim's device: its peaks cover the samples since (the "
            "claim's prepare or the plugin's start, whichever came later).",
        )
        sampled = GaugeMetricFamily(
            "gpu_dra_utilization_last_sample_timestamp_seconds",
            "When the newest utilization sample was taken.",
            labels=["node"],
        )
        claim_pods: dict[tuple[str, str, str], tuple[PodRef, ...]] = {}
        for device in self._devices():
            held.add_metric(self._labels(device), 1)
            claim = device.claim
            claim_pods.setdefault((claim.namespace, claim.name, claim.uid), device.pods)
        for (namespace, name, _), claim_pod_refs in sorted(claim_pods.items()):
            for pod in sorted(claim_pod_refs, key=lambda p: p.name):
                pods.add_metric([self._node, namespace, name, pod.name, pod.uid], 1)
        sample = None if self._monitor is None else self._monitor.latest
        if sample is not None and self._monitor is not None:
            sampled.add_metric([self._node], sample.at)
            for device in sample.devices:
                labels = self._labels(device)
                reading = claim_reading(device, sample.readings.get(device.uuid or ""))
                for target, value in (
                    (gpu, reading.gpu_percent),
                    (memory_util, reading.memory_percent),
                    (used, reading.memory_used_bytes),
                    (total, reading.memory_total_bytes),
                    (processes, reading.processes),
                    (compute, device.share_compute_percent),
                    (active, self._monitor.last_active(device.key)),
                ):
                    if value is not None:
                        target.add_metric(labels, value)
                peak = self._monitor.peak(device.key)
                if peak is None:
                    continue
                since.add_metric(labels, peak.since)
                for target, value in (
                    (used_peak, peak.memory_used_bytes),
                    (gpu_peak, peak.gpu_percent),
                    (processes_peak, peak.processes),
                ):
                    if value is not None:
                        target.add_metric(labels, value)
        yield from (held, pods, gpu, memory_util, used, total, compute, processes, active, sampled)
        yield from (used_peak, gpu_peak, processes_peak, since)

    def _labels(self, device: ClaimDevice) -> list[str]:
        claim = device.claim
        return [self._node, claim.namespace, claim.name, device.device, device.tier]
