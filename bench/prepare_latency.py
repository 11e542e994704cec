"""Latency of NodePrepareResources and NodeUnprepareResources for one whole-GPU claim.

A real grpc.aio client calls the plugin (``bench.plugin``: real PluginServer, NodeClaimPreparer,
Checkpoint and CDI store on the simulated ``hgx-h100``) over its Unix socket, the way the kubelet
does: prepare one claim, then unprepare it, one call at a time. Each iteration uses a new claim
(claim ``i`` holds GPU ``i % 8``), so every prepare does the full work: the fact file (shared
by the claims of a GPU: docs/architecture.md "What a container gets"), CDI spec (fsynced, on
tmpfs by default), checkpoint PrepareCompleted (not fsynced: docs/architecture.md
"Durable for the boot"; a whole GPU has no PrepareStarted record, "Claims without a
PrepareStarted record").

Timed per call, on the client: from sending the request to receiving the response (protobuf
encoding, the socket, the servicer, the preparer, file I/O). Not included: the GET of
the claim from the API server (see ``bench/claims.py``). The first ``--warmup`` iterations are
discarded.

    python -m bench.prepare_latency [--iterations 500] [--warmup 50] [--json]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from bench.claims import claim_ref
from bench.plugin import DEFAULT_CDI_PARENT, Plugin, launch_plugin, run_plugin_bench
from bench.report import Reporter, Target
from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2 as v1
from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2_grpc as v1_grpc

BENCH = "prepare_latency"
TARGETS = {"prepare": {"p50": Target("<=", 5), "p99": Target("<=", 20)}}
CALL_TIMEOUT_S = 45.0  # the kubelet's deadline


class PrepareFailedError(RuntimeError):
    """The plugin answered with a per-claim error: the numbers would mean nothing."""


def _request_claim(index: int) -> v1.Claim:
    ref = claim_ref(index)
    return v1.Claim(namespace=ref.namespace, uid=ref.uid, name=ref.name)


@dataclass
class Samples:
    """Milliseconds per call, after warm-up."""

    prepare: list[float] = field(default_factory=list)
    unprepare: list[float] = field(default_factory=list)
    empty: list[float] = field(default_factory=list)


async def measure(plugin: Plugin, *, iterations: int, warmup: int) -> Samples:
    """Prepare and unprepare claims ``0..warmup+iterations-1``, one call at a time.

    Each iteration also sends one empty NodePrepareResources, which the servicer answers
    without calling the preparer: the cost of the RPC itself, under the same noise.
    """
    samples = Samples()
    empty = v1.NodePrepareResourcesRequest()
    async with grpc.aio.insecure_channel(plugin.target) as channel:
        stub = v1_grpc.DRAPluginStub(channel)  # type: ignore[no-untyped-call]
        for index in range(warmup + iterations):
            claim = _request_claim(index)
            prepare = v1.NodePrepareResourcesRequest(claims=[claim])
            unprepare = v1.NodeUnprepareResourcesRequest(claims=[claim])

            started = time.perf_counter()
            await stub.NodePrepareResources(empty, timeout=CALL_TIMEOUT_S)
            empty_ms = (time.perf_counter() - started) * 1000
            started = time.perf_counter()
            prepared = await stub.NodePrepareResources(prepare, timeout=CALL_TIMEOUT_S)
            between = time.perf_counter()
            unprepared = await stub.NodeUnprepareResources(unprepare, timeout=CALL_TIMEOUT_S)
            ended = time.perf_counter()

            result = prepared.claims[claim.uid]
            if result.error or len(result.devices) != 1:
                raise PrepareFailedError(f"prepare of {claim.name}: {result}")
            if unprepared.claims[claim.uid].error:
                raise PrepareFailedError(
                    f"unprepare of {claim.name}: {unprepared.claims[claim.uid].error}"
                )
            if index >= warmup:
                samples.empty.append(empty_ms)
                samples.prepare.append((between - started) * 1000)
                samples.unprepare.append((ended - between) * 1000)
    return samples


def leftover_files(plugin: Plugin) -> int:
    """CDI specs and claim files still on disk (0 after every claim was unprepared)."""
    roots = (plugin.cdi_root, plugin.root / "state" / "claims")
    return sum(1 for root in roots if root.exists() for _ in root.iterdir())


async def run(args: argparse.Namespace, reporter: Reporter) -> None:
    async with launch_plugin(
        machine=args.machine,
        claims=args.warmup + args.iterations,
        cdi_parent=None if args.cdi_with_state else DEFAULT_CDI_PARENT,
        cprofile=args.cprofile,
    ) as plugin:
        reporter.run(
            machine=args.machine,
            iterations=args.iterations,
            warmup=args.warmup,
            claims_per_call=1,
            excluded="API server GET of the claim",
            **plugin.layout(),
        )
        cpu_started = plugin.cpu_seconds()
        samples = await measure(plugin, iterations=args.iterations, warmup=args.warmup)
        cpu = plugin.cpu_seconds() - cpu_started
        leftovers = leftover_files(plugin)
    reporter.distribution("prepare", samples.prepare, targets=TARGETS["prepare"], primary="p50")
    reporter.distribution("unprepare", samples.unprepare)
    reporter.distribution("empty_call", samples.empty)
    # Plugin CPU (all threads) per iteration of one empty call, one prepare and one unprepare;
    # the kernel's share is file system work (fsync, rename, mkdir) and the socket.
    iterations = args.warmup + args.iterations
    reporter.metric("plugin_cpu_per_iteration", cpu.total / iterations * 1000, "ms")
    reporter.metric("plugin_sys_cpu_per_iteration", cpu.system / iterations * 1000, "ms")
    reporter.metric("leftover_files", leftovers, "files", target=Target("==", 0))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=500, help="measured calls (500)")
    parser.add_argument("--warmup", type=int, default=50, help="discarded calls first (50)")
    parser.add_argument("--machine", default="hgx-h100", help="simulated profile (hgx-h100)")
    return run_plugin_bench(parser, argv, BENCH, run)


if __name__ == "__main__":
    sys.exit(main())
