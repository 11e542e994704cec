"""Each claim device's peaks for `gpu-dra rightsize`: from the kubelet plugins' ``/metrics`` (the
peaks the plugin keeps in memory since the device's first sample, `gpu_dra.cli.utilization`
reads the endpoints) or from a Prometheus HTTP API over a window (``max_over_time``). A
Prometheus that cannot be queried is an error naming it, never an empty answer. See
docs/metrics.md#right-sizing.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from gpu_dra.cli.utilization import Scrape, parse_scrapes

KEY_LABELS: Final = ("node", "namespace", "claim", "device", "tier")
_FROM_PLUGIN: Final = {
    "gpu_dra_claim_memory_used_peak_bytes": "memory_used_bytes",
    "gpu_dra_claim_gpu_utilization_peak_percent": "gpu_percent",
    "gpu_dra_claim_processes_peak": "processes",
    "gpu_dra_claim_observed_since_timestamp_seconds": "since",
    "gpu_dra_claim_compute_limit_percent": "compute_limit_percent",
}


@dataclass
class DevicePeak:
    """One claim device's peaks over [since, until] (None: not known)."""

    node: str
    namespace: str
    claim: str
    device: str
    tier: str
    memory_used_bytes: float | None = None
    gpu_percent: float | None = None
    processes: float | None = None
    since: float | None = None
    until: float | None = None
    compute_limit_percent: float | None = None
    """An MPS share's compute (its cap), percent of the GPU or MIG device."""

    @property
    def window_s(self) -> float | None:
        if self.since is None or self.until is None:
            return None
        return max(self.until - self.since, 0.0)


def _device(labels: dict[str, str]) -> DevicePeak:
    node, namespace, claim, device, tier = (labels.get(name, "") for name in KEY_LABELS)
    return DevicePeak(node, namespace, claim, device, tier)


def parse_plugin_metrics(text: str) -> list[DevicePeak]:
    """The claim devices with peaks in one plugin's metrics text (until: its newest sample);
    ValueError when it is not the format."""
    peaks: dict[tuple[str, ...], DevicePeak] = {}
    sampled: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpu_dra_utilization_last_sample_timestamp_seconds":
                sampled[sample.labels.get("node", "")] = sample.value
                continue
            field = _FROM_PLUGIN.get(sample.name)
            if field is None:
                continue
            key = tuple(sample.labels.get(name, "") for name in KEY_LABELS)
            peak = peaks.get(key) or peaks.setdefault(key, _device(sample.labels))
            setattr(peak, field, sample.value)
    found = [peak for peak in peaks.values() if peak.since is not None]
    for peak in found:
        peak.until = sampled.get(peak.node)
    return found


def from_scrapes(scrapes: Iterable[Scrape]) -> tuple[list[DevicePeak], list[str]]:
    """The claim devices of every scrape, and a warning per endpoint that gave none."""
    return parse_scrapes(scrapes, parse_plugin_metrics)


class PrometheusError(Exception):
    """Prometheus could not answer a query; the message names it and says why."""


Query = Callable[[str], list[tuple[dict[str, str], float, float]]]
"""PromQL -> [(labels, value, evaluation time)] of an instant vector."""


def prometheus_query(url: str, timeout_s: float = 30.0) -> Query:
    """Instant queries against the Prometheus HTTP API at `url` (``/api/v1/query``)."""
    endpoint = url.rstrip("/") + "/api/v1/query"

    def query(promql: str) -> list[tuple[dict[str, str], float, float]]:
        body = urllib.parse.urlencode({"query": promql}).encode()
        request = urllib.request.Request(  # noqa: S310 (the user's URL)
            endpoint, data=body, headers={"Content-Type": "application/x-www-form-urlencoded"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
                data = json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise PrometheusError(f"{endpoint}: {_http_error(error)}") from error
        except (OSError, ValueError) as error:
            raise PrometheusError(f"cannot query {endpoint}: {error}") from error
        return _vector(endpoint, promql, data)

    return query


def _http_error(error: urllib.error.HTTPError) -> str:
    try:
        data = json.loads(error.read())
    except (OSError, ValueError):
        data = None
    if isinstance(data, dict) and data.get("error"):
        return f"HTTP {error.code}: {data.get('errorType', 'error')}: {data['error']}"
    return f"HTTP {error.code} {error.reason}"


def _vector(endpoint: str, promql: str, data: Any) -> list[tuple[dict[str, str], float, float]]:
    if not isinstance(data, dict) or data.get("status") != "success":
        detail = data.get("error") if isinstance(data, dict) else None
        raise PrometheusError(f"{endpoint}: query {promql!r} failed: {detail or data!r}")
    result = data.get("data") or {}
    if result.get("resultType") != "vector":
        raise PrometheusError(
            f"{endpoint}: query {promql!r} gave a {result.get('resultType')!r}, not a vector: "
            "is this a Prometheus query API?"
        )
    rows = []
    for item in result.get("result") or []:
        try:
            at, value = item["value"]
            rows.append(({str(k): str(v) for k, v in item["metric"].items()}, float(value), at))
        except (KeyError, TypeError, ValueError) as error:
            raise PrometheusError(f"{endpoint}: unreadable sample {item!r}") from error
    return rows


def from_prometheus(query: Query, window_s: float) -> list[DevicePeak]:
    """Peaks over the last `window_s` seconds: the larger of ``max_over_time`` of the sampled
    gauge and of the plugin's peak gauge (which catches peaks between two scrapes, and may reach
    back before the window); since: the window's start or the device's first sample in it."""
    window = f"{int(window_s)}s"
    by = ", ".join(KEY_LABELS)
    peaks: dict[tuple[str, ...], DevicePeak] = {}

    def collect(
        field: str, promql: str, combine: Callable[[float, float], float] = max
    ) -> float | None:
        evaluated = None
        for labels, value, at in query(promql):
            key = tuple(labels.get(name, "") for name in KEY_LABELS)
            peak = peaks.get(key) or peaks.setdefault(key, _device(labels))
            kept = getattr(peak, field)
            setattr(peak, field, value if kept is None else combine(kept, value))
            evaluated = at
        return evaluated

    now = None
    for field, metrics in (
        ("memory_used_bytes", ("memory_used_bytes", "memory_used_peak_bytes")),
        ("gpu_percent", ("gpu_utilization_percent", "gpu_utilization_peak_percent")),
        ("processes", ("processes", "processes_peak")),
    ):
        for metric in metrics:
            at = collect(field, f"max by ({by}) (max_over_time(gpu_dra_claim_{metric}[{window}]))")
            now = at if at is not None else now
    collect(
        "since",
        f"min by ({by}) (min_over_time(gpu_dra_claim_observed_since_timestamp_seconds[{window}]))",
        min,
    )
    collect(
        "compute_limit_percent",
        f"max by ({by}) (last_over_time(gpu_dra_claim_compute_limit_percent[{window}]))",
    )
    until = now if now is not None else time.time()
    found = []
    for peak in peaks.values():
        if peak.memory_used_bytes is None and peak.gpu_percent is None:
            continue
        peak.until = until
        peak.since = until - window_s if peak.since is None else max(peak.since, until - window_s)
        found.append(peak)
    return found
