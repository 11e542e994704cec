"""Utilization per claim for `gpu-dra inventory --utilization` and ``--idle``, read from the
kubelet plugins' ``/metrics`` endpoints: given as URLs (``--plugin-metrics``), or every pod of
the plugin DaemonSet (``--plugin-selector``) through the apiserver's pod proxy. An endpoint that
cannot be read is a warning naming it, never an empty answer. See docs/metrics.md.
"""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from gpu_dra.kube.client import translated_errors
from gpu_dra.kube.errors import ApiError

DEFAULT_PLUGIN_SELECTOR: Final = "app.kubernetes.io/component=kubelet-plugin"
_PER_CLAIM: Final = {
    "gpu_dra_claim_gpu_utilization_percent": "gpu_percent",
    "gpu_dra_claim_memory_used_bytes": "memory_used_bytes",
    "gpu_dra_claim_memory_limit_bytes": "memory_limit_bytes",
    "gpu_dra_claim_processes": "processes",
    "gpu_dra_claim_last_active_timestamp_seconds": "last_active",
}
_KEY_LABELS: Final = ("node", "namespace", "claim", "device")
_NUMBER: Final = r"\d+(?:\.\d+)?"
_DURATION: Final = re.compile("".join(f"(?:({_NUMBER}){unit})?" for unit in "dhms"))
"""Days, hours, minutes, seconds, each at most once and in that order: what `duration_text`
prints (``5d2h``, ``1h5m``) and what users write (``1d12h``, ``90s``)."""
_UNIT_SECONDS: Final = (86400, 3600, 60, 1)


@dataclass
class DeviceUse:
    """One device of one claim as a plugin last sampled it (None: not reported)."""

    node: str
    namespace: str
    claim: str
    device: str
    tier: str = ""
    pod: str = ""
    gpu_percent: float | None = None
    memory_used_bytes: float | None = None
    memory_limit_bytes: float | None = None
    processes: float | None = None
    last_active: float | None = None
    sampled_at: float | None = None

    @property
    def idle_for_s(self) -> float | None:
        """Seconds between the device's last activity and the plugin's newest sample."""
        if self.last_active is None or self.sampled_at is None:
            return None
        return max(self.sampled_at - self.last_active, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "namespace": self.namespace,
            "claim": self.claim,
            "device": self.device,
            "tier": self.tier,
            "pods": self.pod,
            "gpuUtilizationPercent": self.gpu_percent,
            "memoryUsedBytes": self.memory_used_bytes,
            "memoryLimitBytes": self.memory_limit_bytes,
            "processes": self.processes,
            "idleSeconds": self.idle_for_s,
        }


@dataclass(frozen=True)
class Scrape:
    """What one endpoint gave: its text, or why not."""

    source: str
    text: str | None = None
    error: str | None = None


def parse_metrics(text: str) -> list[DeviceUse]:
    """The claim devices in one plugin's metrics text; ValueError when it is not the format."""
    uses: dict[tuple[str, ...], DeviceUse] = {}
    sampled: dict[str, float] = {}
    pods: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gpu_dra_utilization_last_sample_timestamp_seconds":
                sampled[labels.get("node", "")] = sample.value
                continue
            if sample.name == "gpu_dra_claim_pod_info":
                claim_key = tuple(labels.get(name, "") for name in _KEY_LABELS[:3])
                pods[claim_key].add(labels.get("pod", ""))
                continue
            field = _PER_CLAIM.get(sample.name)
            if field is None and sample.name != "gpu_dra_claim_devices":
                continue
            key = tuple(labels.get(name, "") for name in _KEY_LABELS)
            use = uses.get(key)
            if use is None:
                node, namespace, claim, device = key
                use = uses[key] = DeviceUse(node, namespace, claim, device)
            use.tier = labels.get("tier", use.tier)
            use.pod = labels.get("pod", use.pod)  # plugins before gpu_dra_claim_pod_info
            if field is not None:
                setattr(use, field, sample.value)
    for use in uses.values():
        use.sampled_at = sampled.get(use.node)
        claim_pods = pods.get((use.node, use.namespace, use.claim))
        if claim_pods:
            use.pod = ",".join(sorted(claim_pods - {""}))
    return list(uses.values())


def read_urls(urls: Sequence[str], timeout_s: float = 10.0) -> list[Scrape]:
    scrapes = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
                scrapes.append(Scrape(url, text=response.read().decode("utf-8")))
        except (OSError, ValueError) as error:
            scrapes.append(Scrape(url, error=str(error)))
    return scrapes


def read_plugin_pods(client: Any, selector: str, namespace: str | None) -> list[Scrape]:
    """The metrics of every pod `selector` matches, through the apiserver's pod proxy (port
    ``metrics`` of the pod's containers). Raises `ApiError` when the pods cannot be listed."""
    from kubernetes.client import CoreV1Api  # noqa: PLC0415 (only the cluster commands need it)

    core = CoreV1Api(client)
    pods: list[Any]
    with translated_errors(f"list pods {selector}"):
        if namespace:
            pods = core.list_namespaced_pod(namespace, label_selector=selector).items
        else:
            pods = core.list_pod_for_all_namespaces(label_selector=selector).items
    scrapes = []
    for pod in pods:
        metadata: Any = pod.metadata
        name, pod_namespace = str(metadata.name), str(metadata.namespace)
        source = f"pod {pod_namespace}/{name}"
        port = _metrics_port(pod)
        if port is None:
            scrapes.append(Scrape(source, error="no container port named metrics"))
            continue
        try:
            with translated_errors(f"read metrics of {source} through the apiserver"):
                text = core.connect_get_namespaced_pod_proxy_with_path(
                    f"{name}:{port}", pod_namespace, "metrics"
                )
        except ApiError as error:
            scrapes.append(Scrape(source, error=str(error)))
        else:
            scrapes.append(Scrape(source, text=str(text)))
    return scrapes


def _metrics_port(pod: Any) -> int | None:
    for container in pod.spec.containers or []:
        for port in container.ports or []:
            if port.name == "metrics":
                return int(port.container_port)
    return None


T = TypeVar("T")


def parse_scrapes(
    scrapes: Iterable[Scrape], parse: Callable[[str], list[T]]
) -> tuple[list[T], list[str]]:
    """``parse`` of every scrape's text, and a warning per endpoint that gave none."""
    found: list[T] = []
    warnings = []
    for scrape in scrapes:
        if scrape.text is None:
            warnings.append(f"cannot read the metrics of {scrape.source}: {scrape.error}")
            continue
        try:
            found.extend(parse(scrape.text))
        except ValueError as error:
            warnings.append(f"the metrics of {scrape.source} do not parse: {error}")
    return found, warnings


def collect(scrapes: Iterable[Scrape]) -> tuple[list[DeviceUse], list[str]]:
    """The claim devices of every scrape, and a warning per endpoint that gave none."""
    uses, warnings = parse_scrapes(scrapes, parse_metrics)
    uses.sort(key=lambda u: (u.namespace, u.claim, u.node, u.device))
    return uses, warnings


@dataclass(frozen=True)
class IdleClaim:
    namespace: str
    claim: str
    devices: tuple[DeviceUse, ...]

    @property
    def idle_for_s(self) -> float:
        return min(device.idle_for_s or 0.0 for device in self.devices)


def idle_claims(uses: Iterable[DeviceUse], window_s: float) -> list[IdleClaim]:
    """Claims every device of which has been inactive for at least `window_s` (devices never
    sampled make a claim not idle: unknown is not idle)."""
    by_claim: dict[tuple[str, str], list[DeviceUse]] = defaultdict(list)
    for use in uses:
        by_claim[(use.namespace, use.claim)].append(use)
    idle = []
    for (namespace, claim), devices in sorted(by_claim.items()):
        spans = [device.idle_for_s for device in devices]
        if all(span is not None and span >= window_s for span in spans):
            idle.append(IdleClaim(namespace, claim, tuple(devices)))
    return idle


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``2h``, ``1h30m``, ``1d``, ``1d12h`` (the forms `duration_text` prints)
    or plain seconds -> seconds; ValueError otherwise."""
    value = text.strip()
    if re.fullmatch(_NUMBER, value):
        return float(value)
    match = _DURATION.fullmatch(value)
    if not value or match is None:
        raise ValueError(
            f"{text!r} is not a duration like 90s, 30m, 2h, 1h30m, 1d or 1d12h (units d, h, m, "
            "s, largest first) or a number of seconds"
        )
    return sum(
        float(number) * scale
        for number, scale in zip(match.groups(), _UNIT_SECONDS, strict=True)
        if number is not None
    )


def duration_text(seconds: float) -> str:
    """``3d4h``, ``1h5m``, ``12m``, ``40s``."""
    whole = int(seconds)
    days, whole = divmod(whole, 86400)
    if days:
        hours = whole // 3600
        return f"{days}d{hours}h" if hours else f"{days}d"
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m" if minutes else f"{hours}h"
    if minutes:
        return f"{minutes}m"
    return f"{secs}s"
