"""One DeviceClass selector over a 1000-node inventory: gpu_dra.driver.cel vs the Go reference.

The inventory (`bench.cel.inventory`: 8 GPUs per node, each whole plus every MIG partition, as the
driver renders them) is written once as JSON; the Go program of ``bench/cel/go`` (the scheduler's
``k8s.io/dynamic-resource-allocation/cel`` at the e2e cluster's version) reads it, compiles the
selector and evaluates it over every device ``--repeat`` times, as the scheduler does. In the same
run, Python:

* ``convert``: `to_cel_device` for every device (once per device; the Go side converts inside
  every evaluation, so this is reported beside, not hidden);
* ``select``: `select` over a fresh `DeviceTable` (columns built, each distinct footprint
  evaluated once), ``--repeat`` times; the primary metric is its median against Go's median;
* ``per_device``: `Selector.matches` on every device, the plain loop `select` replaces (once).

Both sides must agree on the matched-device count and the runtime-error count. Memory: RSS after
each of ``--rss-runs`` (10) repetitions of ``select``, and over ``--evaluations`` (10,000,000)
plain evaluations of the selector, sampled every tenth (cel-expr-python leaks per call into
Python; docs/cel.md).

    python -m bench.cel [--nodes 1000] [--repeat 5] [--evaluations 10000000] [--json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from bench.cel.inventory import DRIVER, inventory
from bench.report import Reporter, Target
from e2e.cluster.paths import ClusterPaths
from e2e.cluster.toolchain import go_env
from gpu_dra.driver.cel import DeviceTable, compile_selector, select, to_cel_device

BENCH: Final = "cel"
GO_SOURCE: Final = Path(__file__).resolve().parent / "go"
# A MIG slice of at least 10 GiB on a Hopper-or-newer GPU: the mig.nvidia.com class's selector
# with a request's capacity and compute-capability conditions folded in.
SELECTOR: Final = (
    "device.driver == 'gpu.nvidia.com' && "
    "device.attributes['gpu.nvidia.com'].type == 'mig' && "
    "device.attributes['gpu.nvidia.com'].cudaComputeCapability.compareTo(semver('9.0.0')) >= 0 && "
    "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('10Gi')) >= 0"
)


def rss_mib() -> float:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def reference_binary() -> Path:
    """The Go reference program, built once per source (cached under the e2e Go cache)."""
    digest = hashlib.sha256()
    for path in sorted(GO_SOURCE.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    paths = ClusterPaths.from_env()
    binary = paths.cache / "bench" / f"celref-{digest.hexdigest()[:12]}"
    if not binary.is_file():
        if shutil.which("go") is None:
            raise SystemExit("bench/cel needs Go (the e2e toolchain's; see docs/e2e-cluster.md)")
        binary.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["go", "build", "-trimpath", "-o", str(binary), "."],
            cwd=GO_SOURCE,
            env=go_env(paths),
            check=True,
        )
    return binary


def run_reference(binary: Path, inventory_file: Path, repeat: int) -> dict[str, Any]:
    done = subprocess.run(
        [str(binary), f"-inventory={inventory_file}", f"-repeat={repeat}"],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000, help="nodes (1000)")
    parser.add_argument("--repeat", type=int, default=5, help="timed passes per side (5)")
    parser.add_argument("--rss-runs", type=int, default=10, help="select passes for RSS (10)")
    parser.add_argument(
        "--evaluations", type=int, default=10_000_000, help="plain evaluations for RSS (10M)"
    )
    parser.add_argument("--selector", default=SELECTOR, help="the CEL selector")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args(argv)
    reporter = Reporter(BENCH, json_lines=args.json)

    started = time.perf_counter()
    pool = list(inventory(args.nodes))
    render_s = time.perf_counter() - started
    binary = reference_binary()
    with tempfile.TemporaryDirectory(prefix="gpu-dra-bench-cel-") as tmp:
        inventory_file = Path(tmp) / "inventory.json"
        document = {
            "selector": args.selector,
            "devices": [{"driver": DRIVER, "device": entry.device} for entry in pool],
        }
        inventory_file.write_text(json.dumps(document))
        size_mib = inventory_file.stat().st_size / 2**20
        del document
        go = run_reference(binary, inventory_file, args.repeat)
    reporter.run(
        nodes=args.nodes,
        devices=len(pool),
        devices_per_gpu=len(pool) / (args.nodes * 8),
        selector=args.selector,
        repeat=args.repeat,
        inventory_json_mib=round(size_mib, 1),
        go=go["go_version"],
    )

    started = time.perf_counter()
    converted = [to_cel_device(DRIVER, entry.device) for entry in pool]
    convert_s = time.perf_counter() - started
    del pool
    selector = compile_selector(args.selector)

    select_s, selection = [], None
    for _ in range(args.repeat):
        gc.collect()
        started = time.perf_counter()
        selection = select(selector, DeviceTable(converted))
        select_s.append(time.perf_counter() - started)
    assert selection is not None

    gc.collect()
    started = time.perf_counter()
    per_device = sum(1 for device in converted if selector.matches(device))
    per_device_s = time.perf_counter() - started

    go_s = statistics.median(go["eval_seconds"])
    python_s = statistics.median(select_s)
    reporter.metric("devices", len(converted), "devices")
    reporter.metric("render_inventory", render_s, "s")
    reporter.metric("go_compile", go["compile_ms"], "ms")
    reporter.metric("go_eval", go_s * 1000, "ms")
    reporter.metric("go_per_device", go_s / len(converted) * 1e6, "us")
    reporter.metric("go_max_rss", go["max_rss_kib"] / 1024, "MiB")
    reporter.metric("python_convert", convert_s * 1000, "ms")
    reporter.metric("python_select", python_s * 1000, "ms")
    reporter.metric("python_select_min", min(select_s) * 1000, "ms")
    reporter.metric("python_select_evaluations", selection.evaluations, "evals")
    reporter.metric("python_per_device_loop", per_device_s * 1000, "ms")
    reporter.metric("select_vs_go", python_s / go_s, "x", target=Target("<=", 2.0), primary=True)
    reporter.metric("convert_and_select_vs_go", (convert_s + python_s) / go_s, "x")
    reporter.metric("per_device_loop_vs_go", per_device_s / go_s, "x")
    agree = (
        len(selection.matched) == go["matched"] == per_device
        and len(selection.errors) == go["errors"]
    )
    reporter.metric("matched", len(selection.matched), "devices")
    reporter.metric("go_matched", go["matched"], "devices")
    reporter.metric("agree", float(agree), "bool", target=Target("==", 1))

    rss = []
    for _ in range(args.rss_runs):
        select(selector, DeviceTable(converted))
        gc.collect()
        rss.append(rss_mib())
    reporter.metric("rss_select_first", rss[0], "MiB")
    reporter.metric("rss_select_growth", rss[-1] - rss[0], "MiB")

    sample = converted[:: max(1, len(converted) // 1000)]
    step = max(1, args.evaluations // 10)
    before = rss_mib()
    evaluations = 0
    started = time.perf_counter()
    while evaluations < args.evaluations:
        for i in range(step):
            selector.matches(sample[i % len(sample)])
        evaluations += step
    eval_s = time.perf_counter() - started
    gc.collect()
    after = rss_mib()
    reporter.metric("evaluations", evaluations, "evals")
    reporter.metric("evaluation_mean", eval_s / evaluations * 1e6, "us")
    reporter.metric(
        "rss_growth_per_eval",
        (after - before) * 2**20 / evaluations,
        "B",
        target=Target("<=", 0.01),
    )
    reporter.metric("rss_after_evaluations", after, "MiB")
    return 1 if reporter.failed else 0


if __name__ == "__main__":
    sys.exit(main())
