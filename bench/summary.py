"""Summary of several runs of the benchmarks: the median run of each, and the spread.

Reads JSON-lines files written by ``python -m bench.<name> --json`` (one run per file). For each
benchmark, the run whose primary metric is the median of all runs is shown (the lower median for
an even count); next to each of its values, the minimum and maximum over all runs show the noise.
A benchmark without a primary metric (a set of independent micro-measurements) shows the median
of each metric over the runs instead.

    python -m bench.summary RESULTS/*.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import Target

Record = dict[str, Any]


def load_runs(paths: Sequence[Path]) -> dict[str, list[list[Record]]]:
    """Runs by benchmark name; each run is the list of its records."""
    runs: dict[str, list[list[Record]]] = collections.defaultdict(list)
    for path in paths:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if records:
            runs[records[0]["bench"]].append(records)
    return runs


def _metrics(run: list[Record]) -> dict[str, Record]:
    return {r["metric"]: r for r in run if r["type"] == "metric"}


def _with_value(record: Record, value: float) -> Record:
    """The metric record with another value (and its verdict recomputed)."""
    updated = {**record, "value": value}
    if "target" in record:
        op, bound = record["target"].split()
        updated["pass"] = Target(op, float(bound)).met_by(value)
    return updated


def median_run(runs: list[list[Record]]) -> list[Record]:
    """The run whose primary metric is the (lower) median over ``runs``.

    Without a primary metric: the first run, each metric's value replaced by its median.
    """
    if not any(r.get("primary") for r in runs[0]):
        values: dict[str, list[float]] = collections.defaultdict(list)
        for run in runs:
            for name, record in _metrics(run).items():
                values[name].append(record["value"])
        return [
            _with_value(r, statistics.median_low(values[r["metric"]])) if "metric" in r else r
            for r in runs[0]
        ]

    def primary(run: list[Record]) -> float:
        return float(next(r["value"] for r in run if r.get("primary")))

    ordered = sorted(runs, key=primary)
    return ordered[(len(ordered) - 1) // 2]


def print_summary(runs_by_bench: dict[str, list[list[Record]]]) -> list[str]:
    """Print the table; return ``bench/metric`` of every missed target (of the median runs)."""
    missed = []
    for bench, runs in runs_by_bench.items():
        chosen = median_run(runs)
        parameters = next(r for r in chosen if r["type"] == "run")
        shown = {
            k: v
            for k, v in parameters.items()
            if k not in {"bench", "type", "python", "grpcio", "platform"}
        }
        how = "median run" if any(r.get("primary") for r in runs[0]) else "median per metric"
        print(f"\n== {bench}: {how} of {len(runs)} run(s)")
        print("   " + ", ".join(f"{k}={v}" for k, v in shown.items()))
        all_metrics = [_metrics(run) for run in runs]
        for name, record in _metrics(chosen).items():
            values = [m[name]["value"] for m in all_metrics if name in m]
            spread = f"[{min(values):.3f} .. {max(values):.3f}]" if len(values) > 1 else ""
            verdict = ""
            if "target" in record:
                verdict = f"target {record['target']}: {'PASS' if record['pass'] else 'FAIL'}"
                if not record["pass"]:
                    missed.append(f"{bench}/{name}")
            print(
                f"   {name:<34} {record['value']:>10.3f} {record['unit']:<9} {spread:<22} {verdict}"
            )
    return missed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="JSON-lines files, one run each")
    args = parser.parse_args(argv)
    missed = print_summary(load_runs(args.files))
    print()
    print("targets missed: " + (", ".join(missed) if missed else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
