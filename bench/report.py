"""Percentiles and the two output forms of every benchmark: text, or JSON lines (``--json``).

One JSON object per line::

    {"bench": "prepare_latency", "type": "run", ...}              # parameters of the run
    {"bench": "prepare_latency", "type": "metric", "metric": "prepare_p50", "value": 3.1,
     "unit": "ms", "target": "<= 5", "pass": true, "primary": true}

``target`` and ``pass`` are present only for metrics with a target; ``primary`` marks the metric
``bench/summary.py`` uses to pick a benchmark's median run.
"""

from __future__ import annotations

import json
import math
import operator
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Final, Literal

_OPERATORS: Final[dict[str, Callable[[float, float], bool]]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
}


@dataclass(frozen=True)
class Target:
    """A goal for a metric: ``value <op> bound``."""

    op: Literal["<=", ">=", "=="]
    bound: float

    def met_by(self, value: float) -> bool:
        return _OPERATORS[self.op](value, self.bound)

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


def percentile(sorted_samples: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least ``p`` % of samples <= it."""
    if not sorted_samples:
        raise ValueError("no samples")
    rank = max(1, math.ceil(p / 100 * len(sorted_samples)))
    return sorted_samples[rank - 1]


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99, max and mean of ``samples``."""
    ordered = sorted(samples)
    return {
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
        "mean": sum(ordered) / len(ordered),
    }


def host_facts() -> dict[str, object]:
    """What the numbers depend on besides the code."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "grpcio": metadata.version("grpcio"),
        "platform": platform.platform(),
    }


class Reporter:
    """Prints a benchmark's parameters and metrics as text or as JSON lines."""

    def __init__(self, bench: str, *, json_lines: bool) -> None:
        self.bench = bench
        self.json_lines = json_lines
        self.failed: list[str] = []

    def run(self, **parameters: object) -> None:
        """The run's parameters (N, warm-up, machine profile...) plus the host facts."""
        record = {"bench": self.bench, "type": "run", **parameters, **host_facts()}
        if self.json_lines:
            self._emit(record)
        else:
            details = ", ".join(f"{key}={value}" for key, value in record.items() if key != "type")
            print(f"# {details}")

    def metric(
        self,
        metric: str,
        value: float,
        unit: str,
        *,
        target: Target | None = None,
        primary: bool = False,
    ) -> None:
        record: dict[str, object] = {
            "bench": self.bench,
            "type": "metric",
            "metric": metric,
            "value": round(value, 4),
            "unit": unit,
        }
        verdict = ""
        if target is not None:
            met = target.met_by(value)
            record.update({"target": str(target), "pass": met})
            verdict = f"   target {target} {unit}: {'PASS' if met else 'FAIL'}"
            if not met:
                self.failed.append(metric)
        if primary:
            record["primary"] = True
        if self.json_lines:
            self._emit(record)
        else:
            print(f"{self.bench:<20} {metric:<32} {value:>10.3f} {unit:<9}{verdict}")

    def distribution(
        self,
        name: str,
        samples_ms: Sequence[float],
        *,
        targets: dict[str, Target] | None = None,
        primary: str | None = None,
    ) -> None:
        """p50/p90/p99/max/mean of millisecond samples, as ``<name>_<stat>`` metrics."""
        targets = targets or {}
        for stat, value in summarize(samples_ms).items():
            self.metric(
                f"{name}_{stat}",
                value,
                "ms",
                target=targets.get(stat),
                primary=stat == primary,
            )

    def _emit(self, record: dict[str, object]) -> None:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
