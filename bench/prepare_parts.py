"""What the parts of one whole-GPU prepare cost, each timed alone (no gRPC, no concurrency).

Attributes the numbers of ``prepare_latency`` and ``prepare_throughput``:

* ``Checkpoint.get`` / ``all`` / ``put`` with 0, 32, 64 and 128 other claims recorded (reads
  use the parsed file kept in memory while the file is unchanged; ``put`` re-writes the whole
  file, without fsync: docs/architecture.md, "Durable for the boot");
* ``ClaimSpecStore.write`` of a one-device CDI spec, and its YAML dump alone, with PyYAML's
  pure-Python ``safe_dump`` (what cdi.py uses) and with libyaml's ``CSafeDumper``;
* the checkpoint's JSON encoding at 64 entries with ``indent=2`` (which makes ``json`` fall back
  to its pure-Python encoder) and compact (what checkpoint.py writes);
* ``NodeInventory.container_edits`` of a simulated GPU (it finds the device's shared fact file,
  written at the first prepare of the device);
* one ``asyncio.to_thread`` round trip, and one write + fsync of a small file and its directory;
* one whole-GPU claim prepared and unprepared by the preparer as the plugin wires it, awaited in
  this process (no gRPC, no servicer, no logging set up): wall time per call (median), CPU of the
  process per prepare + unprepare, and the fsyncs each makes (independent of the machine's load);
* the parts of those prepares, each timed where it runs (``part_*``, median ms): checkpoint
  lookup and claim read, config resolve, planning, check and commit, and inside the commit a
  simulated GPU's fact file, the CDI spec and the checkpoint's write (the
  metrics docs/performance.md's table of one prepare's parts comes from).

The checkpoint lives in ``$TMPDIR`` (disk, as under /var/lib/kubelet on a node), the CDI specs
on /dev/shm (tmpfs, as /var/run/cdi), like ``bench/plugin.py``'s default layout.

    python -m bench.prepare_parts [--calls 100] [--prepares 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import yaml

from bench.claims import claim_ref
from bench.plugin import DEFAULT_CDI_PARENT, bench_preparer, file_system
from bench.report import Reporter
from gpu_dra.driver.discovery import discover_gpus
from gpu_dra.driver.naming import gpu_device_name
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin import checkpoint as checkpoint_module
from gpu_dra.kubelet_plugin import prepare as prepare_module
from gpu_dra.kubelet_plugin.cdi import CdiDevice, ClaimSpecStore, build_claim_spec
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint, CheckpointEntry, ClaimPhase
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice

BENCH: Final = "prepare_parts"
NODE: Final = "bench-node"
ENTRY_COUNTS: Final = (0, 32, 64, 128)


def per_call_ms(call: Callable[[], object], calls: int) -> float:
    """Median over 5 batches of the mean time of one call, in ms."""
    batches = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        batches.append((time.perf_counter() - started) / calls * 1000)
    return sorted(batches)[2]


def _entry(index: int) -> CheckpointEntry:
    uid = str(uuid.uuid4())
    device = f"gpu-{index}"
    return CheckpointEntry(
        claim=ClaimRef("bench", uid, f"bench-{index}"),
        phase=ClaimPhase.PREPARE_COMPLETED,
        devices=(
            PreparedDevice(
                request_names=("gpu",),
                pool_name=NODE,
                device_name=device,
                cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={uid}-{device}",),
            ),
        ),
    )


def checkpoint_costs(reporter: Reporter, directory: Path, calls: int) -> None:
    document: object = None
    for count in ENTRY_COUNTS:
        checkpoint = Checkpoint(directory / f"checkpoint-{count}")
        checkpoint.load()
        for index in range(count):
            checkpoint.put(_entry(index))
        entry = _entry(count)
        put = per_call_ms(functools.partial(checkpoint.put, entry), calls)
        reporter.metric(f"checkpoint_put_{count}_entries", put, "ms")
        get = per_call_ms(functools.partial(checkpoint.get, entry.uid), calls)
        reporter.metric(f"checkpoint_get_{count}_entries", get, "ms")
        every = per_call_ms(checkpoint.all, calls)
        reporter.metric(f"checkpoint_all_{count}_entries", every, "ms")
        if count == 64:
            document = json.loads(checkpoint.path.read_bytes())

    indented = per_call_ms(lambda: json.dumps(document, indent=2, sort_keys=True), calls)
    reporter.metric("checkpoint_json_64_entries_indent2", indented, "ms")
    compact = per_call_ms(lambda: json.dumps(document, sort_keys=True), calls)
    reporter.metric("checkpoint_json_64_entries_compact", compact, "ms")


def cdi_costs(reporter: Reporter, inventory: NodeInventory, directory: Path, calls: int) -> None:
    uid = str(uuid.uuid4())
    gpu = inventory.gpus[0]
    claim_dir = directory / "claims" / uid
    edits = inventory.container_edits(gpu, claim_dir)
    devices = [CdiDevice(gpu_device_name(gpu.minor), edits)]
    spec = build_claim_spec(uid, devices)

    edits_ms = per_call_ms(lambda: inventory.container_edits(gpu, claim_dir), calls)
    reporter.metric("simulated_container_edits", edits_ms, "ms")
    store = ClaimSpecStore(
        Path(tempfile.mkdtemp(prefix="gpu-dra-bench-cdi-", dir=DEFAULT_CDI_PARENT))
    )
    try:
        reporter.metric("cdi_write", per_call_ms(lambda: store.write(uid, devices), calls), "ms")
    finally:
        store.remove(uid)
        store.cdi_root.rmdir()
    # The options cdi.py uses.
    pure = functools.partial(yaml.safe_dump, spec, sort_keys=False, default_flow_style=False)
    reporter.metric("cdi_yaml_safe_dump", per_call_ms(pure, calls), "ms")
    if yaml.__with_libyaml__:
        libyaml = functools.partial(
            yaml.dump, spec, Dumper=yaml.CSafeDumper, sort_keys=False, default_flow_style=False
        )
        reporter.metric("cdi_yaml_csafe_dump", per_call_ms(libyaml, calls), "ms")


def io_costs(reporter: Reporter, directory: Path, calls: int) -> None:
    target = directory / "fsync-probe"

    def write_and_fsync() -> None:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"x" * 1024)
            os.fsync(fd)
        finally:
            os.close(fd)
        directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory_fd)
        finally:
            os.close(directory_fd)

    reporter.metric("file_and_dir_fsync", per_call_ms(write_and_fsync, calls), "ms")

    async def hops() -> float:
        started = time.perf_counter()
        for _ in range(calls):
            await asyncio.to_thread(lambda: None)
        return (time.perf_counter() - started) / calls * 1000

    reporter.metric("to_thread_round_trip", asyncio.run(hops()), "ms")


def preparer_costs(reporter: Reporter, directory: Path, iterations: int) -> None:
    warmup = max(iterations // 10, 5)
    cdi_root = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-cdi-", dir=DEFAULT_CDI_PARENT))
    preparer, instance, _ = bench_preparer(
        directory / "preparer", cdi_root, "hgx-h100", iterations + warmup
    )
    fsyncs = [0]
    real_fsync = os.fsync

    def counting_fsync(fd: Any) -> None:
        fsyncs[0] += 1
        real_fsync(fd)

    async def run() -> tuple[list[float], list[float], list[float], list[int], list[int]]:
        await preparer.recover()
        prepare_ms, unprepare_ms, cpu_ms, prepare_fsyncs, unprepare_fsyncs = [], [], [], [], []
        for index in range(iterations + warmup):
            claim = claim_ref(index)
            cpu, fsyncs[0] = time.process_time(), 0
            started = time.perf_counter()
            results = await preparer.prepare([claim])
            prepared = time.perf_counter()
            done_fsyncs = fsyncs[0]
            if not results[claim.uid].ok:
                raise RuntimeError(f"prepare failed: {results[claim.uid]}")
            errors = await preparer.unprepare([claim])
            if errors[claim.uid] is not None:
                raise RuntimeError(f"unprepare failed: {errors[claim.uid]}")
            if index >= warmup:
                prepare_ms.append((prepared - started) * 1000)
                unprepare_ms.append((time.perf_counter() - prepared) * 1000)
                cpu_ms.append((time.process_time() - cpu) * 1000)
                prepare_fsyncs.append(done_fsyncs)
                unprepare_fsyncs.append(fsyncs[0] - done_fsyncs)
        return prepare_ms, unprepare_ms, cpu_ms, prepare_fsyncs, unprepare_fsyncs

    os.fsync = counting_fsync
    try:
        prepare_ms, unprepare_ms, cpu_ms, prepare_fsyncs, unprepare_fsyncs = asyncio.run(run())
    finally:
        os.fsync = real_fsync
        instance.close()
        shutil.rmtree(cdi_root, ignore_errors=True)
    reporter.metric("preparer_prepare_p50", statistics.median(prepare_ms), "ms")
    reporter.metric("preparer_unprepare_p50", statistics.median(unprepare_ms), "ms")
    reporter.metric("preparer_cpu_per_iteration", statistics.median(cpu_ms), "ms")
    reporter.metric("preparer_fsyncs_per_prepare", statistics.median(prepare_fsyncs), "fsyncs")
    reporter.metric("preparer_fsyncs_per_unprepare", statistics.median(unprepare_fsyncs), "fsyncs")


PREPARER_PARTS: Final = (
    # (metric, owner, attribute): what is timed, where it is looked up.
    ("part_lookup_and_claim_read", prepare_module.NodeClaimPreparer, "_lookup"),
    ("part_config_resolve", prepare_module.NodeClaimPreparer, "_request"),
    ("part_planning", prepare_module.NodeClaimPreparer, "_plan"),
    ("part_check_and_commit", prepare_module.NodeClaimPreparer, "_check_and_commit"),
    ("part_others_records", ClaimRecords, "others"),
    ("part_claim_files_and_cdi_spec", prepare_module.NodeClaimPreparer, "_write_spec"),
    ("part_simulated_fact_file", NodeInventory, "container_edits"),
    ("part_cdi_spec", ClaimSpecStore, "write"),
    ("part_checkpoint_file_write", checkpoint_module, "write_atomically"),
)


@contextlib.contextmanager
def timed_parts(samples: dict[str, list[float]]) -> Iterator[None]:
    """Time every call of the `PREPARER_PARTS` (ms, into ``samples``) while in the block."""
    originals = [(owner, name, getattr(owner, name)) for _, owner, name in PREPARER_PARTS]

    def timer(metric: str, original: Callable[..., Any]) -> Callable[..., Any]:
        if asyncio.iscoroutinefunction(original):

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    samples[metric].append((time.perf_counter() - started) * 1000)

            return timed_async

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                samples[metric].append((time.perf_counter() - started) * 1000)

        return timed

    for (metric, owner, name), (_, _, original) in zip(PREPARER_PARTS, originals, strict=True):
        samples[metric] = []
        setattr(owner, name, timer(metric, original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def preparer_parts(reporter: Reporter, directory: Path, iterations: int) -> None:
    """`PREPARER_PARTS` of ``iterations`` whole-GPU prepares (each claim unprepared after it;
    the checkpoint writes of unprepares are left out), and the prepare itself."""
    warmup = max(iterations // 10, 5)
    cdi_root = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-cdi-", dir=DEFAULT_CDI_PARENT))
    preparer, instance, _ = bench_preparer(
        directory / "parts", cdi_root, "hgx-h100", iterations + warmup
    )
    samples: dict[str, list[float]] = {}
    prepare_ms: list[float] = []

    async def run() -> None:
        await preparer.recover()
        for index in range(iterations + warmup):
            claim = claim_ref(index)
            if index == warmup:
                for values in samples.values():
                    values.clear()
            started = time.perf_counter()
            results = await preparer.prepare([claim])
            if index >= warmup:
                prepare_ms.append((time.perf_counter() - started) * 1000)
            if not results[claim.uid].ok:
                raise RuntimeError(f"prepare failed: {results[claim.uid]}")
            writes = len(samples["part_checkpoint_file_write"])
            errors = await preparer.unprepare([claim])
            del samples["part_checkpoint_file_write"][writes:]
            if errors[claim.uid] is not None:
                raise RuntimeError(f"unprepare failed: {errors[claim.uid]}")

    try:
        with timed_parts(samples):
            asyncio.run(run())
    finally:
        instance.close()
        shutil.rmtree(cdi_root, ignore_errors=True)
    reporter.metric("part_prepare_total", statistics.median(prepare_ms), "ms")
    for metric, _, _ in PREPARER_PARTS:
        reporter.metric(metric, statistics.median(samples[metric]), "ms")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per batch (100)")
    parser.add_argument(
        "--prepares", type=int, default=200, help="claims the preparer prepares (200)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    args = parser.parse_args(argv)
    reporter = Reporter(BENCH, json_lines=args.json)
    host = SimulatedHost.load("hgx-h100", NODE)
    inventory = NodeInventory(tuple(discover_gpus(host.nvml, host.pci)), simulated=True)
    with tempfile.TemporaryDirectory(prefix="gpu-dra-bench-") as tmp:
        directory = Path(tmp)
        reporter.run(
            calls=args.calls,
            state_fs=file_system(directory),
            cdi_fs=file_system(DEFAULT_CDI_PARENT or directory),
            libyaml=yaml.__with_libyaml__,
        )
        checkpoint_costs(reporter, directory, args.calls)
        cdi_costs(reporter, inventory, directory, args.calls)
        io_costs(reporter, directory, args.calls)
        preparer_costs(reporter, directory, args.prepares)
        preparer_parts(reporter, directory, args.prepares)
    return 0


if __name__ == "__main__":
    sys.exit(main())
