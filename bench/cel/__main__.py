"""One DeviceClass selector over a cluster-sized inventory: gpu_dra.driver.cel vs the Go reference.

The inventory (`bench.cel.inventory`: 8 GPUs per node, each whole plus every MIG partition, as the
driver renders them) is written node by node as JSON lines (the selector, then one device per
line). The Go program of ``bench/cel/go`` (the scheduler's ``k8s.io/dynamic-resource-allocation/
cel`` at the e2e cluster's version) decodes it into ``dracel.Device`` values, compiles the
selector and evaluates it over every device ``--repeat`` times, as the scheduler does (each
evaluation converts the device into CEL values). Then, in the same run, Python reads the file
into published device dicts (what a client of the apiserver holds) and times, from those dicts to
the match count:

* ``select``: `select` over a fresh `DeviceTable` of the dicts, ``--repeat`` times (which devices
  can be grouped, grouping by the published values the selector reads, one conversion and one
  evaluation per group); the primary metric is its median against Go's median;
* ``per_device``: `to_cel_device` + `Selector.matches` on every device, the plain loop `select`
  replaces (once; ``--no-per-device-loop`` skips it at large sizes).

Both sides must agree on the matched-device count and the runtime-error count. Memory: RSS of the
loaded dicts; the peak RSS during the ``select`` passes above that (the kernel's high-water mark,
reset before them); the Python allocations of one pass (tracemalloc peak); RSS after each of
``--rss-runs`` (10) more passes; and RSS over ``--evaluations`` (10,000,000) plain evaluations of
the selector, sampled before and after (cel-expr-python leaks per call into Python; docs/cel.md).

    python -m bench.cel [--nodes 1000] [--repeat 5] [--evaluations 10000000] [--json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from bench.cel.inventory import DRIVER, inventory
from bench.report import Reporter, Target
from e2e.cluster.paths import ClusterPaths
from e2e.cluster.toolchain import go_env
from gpu_dra.driver.cel import (
    DeviceTable,
    PublishedDevice,
    compile_selector,
    select,
    to_cel_device,
)

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


def reset_peak_rss() -> None:
    """Start the kernel's high-water mark of RSS (VmHWM) again from the current RSS."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_rss_mib() -> float:
    """VmHWM: the peak RSS since the start or the last `reset_peak_rss`."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def write_inventory(path: Path, nodes: int, selector: str) -> int:
    """The inventory file the Go side reads, written node by node; the number of devices."""
    count = 0
    with path.open("w") as out:
        out.write(json.dumps({"selector": selector}) + "\n")
        for entry in inventory(nodes):
            out.write(json.dumps({"driver": DRIVER, "device": entry.device}) + "\n")
            count += 1
    return count


def read_inventory(path: Path) -> list[PublishedDevice]:
    """The published devices of `path`, decoded as a client of the apiserver holds them."""
    with path.open() as lines:
        next(lines)  # the selector
        found = []
        for line in lines:
            entry = json.loads(line)
            found.append((entry["driver"], entry["device"]))
    return found


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
    parser.add_argument(
        "--no-per-device-loop",
        dest="per_device_loop",
        action="store_false",
        help="skip the convert-and-match loop over every device",
    )
    parser.add_argument("--selector", default=SELECTOR, help="the CEL selector")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args(argv)
    reporter = Reporter(BENCH, json_lines=args.json)

    binary = reference_binary()
    with tempfile.TemporaryDirectory(prefix="gpu-dra-bench-cel-") as tmp:
        inventory_file = Path(tmp) / "inventory.jsonl"
        started = time.perf_counter()
        count = write_inventory(inventory_file, args.nodes, args.selector)
        render_s = time.perf_counter() - started
        size_mib = inventory_file.stat().st_size / 2**20
        go = run_reference(binary, inventory_file, args.repeat)
        rss_start = rss_mib()
        started = time.perf_counter()
        pool = read_inventory(inventory_file)
        read_s = time.perf_counter() - started
    gc.collect()
    rss_pool = rss_mib()
    reporter.run(
        nodes=args.nodes,
        devices=count,
        devices_per_gpu=count / (args.nodes * 8),
        selector=args.selector,
        repeat=args.repeat,
        inventory_json_mib=round(size_mib, 1),
        go=go["go_version"],
        load_average=round(os.getloadavg()[0], 1),
    )
    selector = compile_selector(args.selector)

    select_s, selection = [], None
    reset_peak_rss()
    for _ in range(args.repeat):
        gc.collect()
        started = time.perf_counter()
        selection = select(selector, DeviceTable(pool))
        select_s.append(time.perf_counter() - started)
    assert selection is not None
    select_peak = peak_rss_mib()

    per_device: int | None = None
    per_device_s = 0.0
    if args.per_device_loop:
        gc.collect()
        started = time.perf_counter()
        per_device = sum(
            1 for driver, device in pool if selector.matches(to_cel_device(driver, device))
        )
        per_device_s = time.perf_counter() - started

    go_s = statistics.median(go["eval_seconds"])
    python_s = statistics.median(select_s)
    reporter.metric("devices", len(pool), "devices")
    reporter.metric("render_inventory", render_s, "s")
    reporter.metric("read_inventory", read_s, "s")
    reporter.metric("go_decode", go["decode_seconds"], "s")
    reporter.metric("go_compile", go["compile_ms"], "ms")
    reporter.metric("go_eval", go_s * 1000, "ms")
    reporter.metric("go_per_device", go_s / len(pool) * 1e6, "us")
    reporter.metric("go_max_rss", go["max_rss_kib"] / 1024, "MiB")
    reporter.metric("python_select", python_s * 1000, "ms")
    reporter.metric("python_select_min", min(select_s) * 1000, "ms")
    reporter.metric("python_select_per_device", python_s / len(pool) * 1e6, "us")
    reporter.metric("python_select_evaluations", selection.evaluations, "evals")
    reporter.metric("select_vs_go", python_s / go_s, "x", target=Target("<=", 2.0), primary=True)
    if per_device is not None:
        reporter.metric("python_per_device_loop", per_device_s * 1000, "ms")
        reporter.metric("per_device_loop_vs_go", per_device_s / go_s, "x")
    agree = (
        len(selection.matched) == go["matched"]
        and len(selection.errors) == go["errors"]
        and per_device in (None, len(selection.matched))
    )
    reporter.metric("matched", len(selection.matched), "devices")
    reporter.metric("go_matched", go["matched"], "devices")
    reporter.metric("errors", len(selection.errors), "devices")
    reporter.metric("go_errors", go["errors"], "devices")
    reporter.metric("agree", float(agree), "bool", target=Target("==", 1))

    reporter.metric("rss_before_inventory", rss_start, "MiB")
    reporter.metric("rss_inventory", rss_pool - rss_start, "MiB")
    reporter.metric("inventory_per_device", (rss_pool - rss_start) * 2**20 / len(pool), "B")
    reporter.metric("select_peak_over_inventory", select_peak - rss_pool, "MiB")
    gc.collect()
    tracemalloc.start()
    select(selector, DeviceTable(pool))
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    reporter.metric("select_traced_peak", traced_peak / 2**20, "MiB")
    reporter.metric("select_traced_per_device", traced_peak / len(pool), "B")

    rss = []
    for _ in range(args.rss_runs):
        select(selector, DeviceTable(pool))
        gc.collect()
        rss.append(rss_mib())
    if rss:
        reporter.metric("rss_select_first", rss[0], "MiB")
        reporter.metric("rss_select_growth", rss[-1] - rss[0], "MiB")

    if args.evaluations:
        sample = [to_cel_device(*entry) for entry in pool[:: max(1, len(pool) // 1000)]]
        for device in sample:  # their engine form is built once, before the measurement
            selector.matches(device)
        gc.collect()
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
    reporter.metric(
        "python_max_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "MiB"
    )
    return 1 if reporter.failed else 0


if __name__ == "__main__":
    sys.exit(main())
