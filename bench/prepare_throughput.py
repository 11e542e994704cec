"""Throughput of preparing 64 whole-GPU claims at once, over the plugin's real Unix socket.

The plugin (``bench.plugin``) runs on ``bench/profiles/hgx-h100-x64.yaml``, 64 simulated H100s,
because whole GPUs are exclusive: 64 claims prepared together need 64 GPUs. Two shapes of load,
on one gRPC channel (the kubelet keeps one connection per plugin):

* ``concurrent``: 64 NodePrepareResources calls in flight at once, one claim each (64 pods
  of one claim each starting together);
* ``batched``: one NodePrepareResources call carrying 64 claims (one pod with 64 claims).

A round prepares 64 fresh claims (claim ``i`` holds GPU ``i % 64``), then unprepares them in the
same shape. Throughput is 64 / (time from the first request sent to the last response
received). The shapes alternate round by round; ``--warmup`` rounds of each are discarded.
Excluded, as in ``bench/prepare_latency.py``: the API server GET of each claim.

    python -m bench.prepare_throughput [--rounds 5] [--warmup 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, TypeVar

import grpc

from bench.claims import claim_ref
from bench.plugin import (
    DEFAULT_CDI_PARENT,
    REPO_ROOT,
    CpuTimes,
    Plugin,
    launch_plugin,
    run_plugin_bench,
)
from bench.report import Reporter, Target
from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2 as v1
from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2_grpc as v1_grpc

BENCH: Final = "prepare_throughput"
MACHINE: Final = str(REPO_ROOT / "bench" / "profiles" / "hgx-h100-x64.yaml")
CLAIMS_PER_ROUND: Final = 64
TARGET: Final = Target(">=", 200)
CALL_TIMEOUT_S: Final = 45.0

Shape = Literal["concurrent", "batched"]
SHAPES: Final[tuple[Shape, ...]] = ("concurrent", "batched")

_T = TypeVar("_T")


class PrepareFailedError(RuntimeError):
    """The plugin answered with a per-claim error: the numbers would mean nothing."""


def _claims(first: int) -> list[v1.Claim]:
    refs = (claim_ref(index) for index in range(first, first + CLAIMS_PER_ROUND))
    return [v1.Claim(namespace=r.namespace, uid=r.uid, name=r.name) for r in refs]


def _check_prepared(response: v1.NodePrepareResourcesResponse, claims: list[v1.Claim]) -> None:
    for claim in claims:
        result = response.claims[claim.uid]
        if result.error or len(result.devices) != 1:
            raise PrepareFailedError(f"prepare of {claim.name}: {result}")


def _check_unprepared(response: v1.NodeUnprepareResourcesResponse, claims: list[v1.Claim]) -> None:
    for claim in claims:
        if response.claims[claim.uid].error:
            raise PrepareFailedError(
                f"unprepare of {claim.name}: {response.claims[claim.uid].error}"
            )


async def _timed(call: Awaitable[_T], latencies: list[float]) -> _T:
    started = time.perf_counter()
    response = await call
    latencies.append((time.perf_counter() - started) * 1000)
    return response


@dataclass(frozen=True)
class Round:
    """One round's wall-clock and plugin CPU seconds, for its prepare and unprepare halves."""

    prepare_s: float
    unprepare_s: float
    prepare_cpu: CpuTimes
    unprepare_cpu: CpuTimes


async def one_round(
    stub: v1_grpc.DRAPluginStub,
    plugin: Plugin,
    shape: Shape,
    claims: list[v1.Claim],
    latencies: list[float],
) -> Round:
    """Prepare then unprepare ``claims`` in ``shape``.

    Each prepare call's own latency is appended to ``latencies`` (ms).
    """
    batches = [[claim] for claim in claims] if shape == "concurrent" else [claims]

    cpu_started = plugin.cpu_seconds()
    started = time.perf_counter()
    prepared = await asyncio.gather(
        *(
            _timed(
                stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=batch), timeout=CALL_TIMEOUT_S
                ),
                latencies,
            )
            for batch in batches
        )
    )
    between = time.perf_counter()
    cpu_between = plugin.cpu_seconds()
    unprepared = await asyncio.gather(
        *(
            stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=batch), timeout=CALL_TIMEOUT_S
            )
            for batch in batches
        )
    )
    ended = time.perf_counter()
    cpu_ended = plugin.cpu_seconds()

    for batch, prepare_response, unprepare_response in zip(
        batches, prepared, unprepared, strict=True
    ):
        _check_prepared(prepare_response, batch)
        _check_unprepared(unprepare_response, batch)
    return Round(
        prepare_s=between - started,
        unprepare_s=ended - between,
        prepare_cpu=cpu_between - cpu_started,
        unprepare_cpu=cpu_ended - cpu_between,
    )


async def run(args: argparse.Namespace, reporter: Reporter) -> None:
    total_rounds = (args.warmup + args.rounds) * len(SHAPES)
    rounds: dict[Shape, list[Round]] = {shape: [] for shape in SHAPES}
    call_latencies: list[float] = []
    async with (
        launch_plugin(
            machine=args.machine,
            claims=total_rounds * CLAIMS_PER_ROUND,
            cdi_parent=None if args.cdi_with_state else DEFAULT_CDI_PARENT,
            cprofile=args.cprofile,
        ) as plugin,
        grpc.aio.insecure_channel(plugin.target) as channel,
    ):
        reporter.run(
            machine=Path(args.machine).name,
            claims_per_round=CLAIMS_PER_ROUND,
            rounds=args.rounds,
            warmup=args.warmup,
            excluded="API server GET of the claim",
            **plugin.layout(),
        )
        if len(plugin.devices) < CLAIMS_PER_ROUND:
            raise SystemExit(f"{args.machine} has {len(plugin.devices)} GPUs, need 64")
        stub = v1_grpc.DRAPluginStub(channel)  # type: ignore[no-untyped-call]
        for number in range(total_rounds):
            shape = SHAPES[number % len(SHAPES)]
            measured = number >= args.warmup * len(SHAPES)
            latencies: list[float] = []
            result = await one_round(
                stub, plugin, shape, _claims(number * CLAIMS_PER_ROUND), latencies
            )
            if measured:
                rounds[shape].append(result)
                if shape == "concurrent":
                    call_latencies += latencies

    for shape in SHAPES:
        rates = [CLAIMS_PER_ROUND / r.prepare_s for r in rounds[shape]]
        reporter.metric(
            f"{shape}_prepare_claims_per_s",
            statistics.median(rates),
            "claims/s",
            target=TARGET,
            primary=shape == "concurrent",
        )
        reporter.metric(f"{shape}_prepare_claims_per_s_min", min(rates), "claims/s")
        reporter.metric(
            f"{shape}_unprepare_claims_per_s",
            statistics.median(CLAIMS_PER_ROUND / r.unprepare_s for r in rounds[shape]),
            "claims/s",
        )
        # Plugin CPU per claim, its kernel share, and the busy share of the wall time (1.0 =
        # one core all the time): near 1.0, the plugin's one GIL is the limit.
        claims = CLAIMS_PER_ROUND * len(rounds[shape])
        prepare_user = sum(r.prepare_cpu.user for r in rounds[shape])
        prepare_sys = sum(r.prepare_cpu.system for r in rounds[shape])
        prepare_wall = sum(r.prepare_s for r in rounds[shape])
        unprepare_cpu = sum(r.unprepare_cpu.total for r in rounds[shape])
        reporter.metric(
            f"{shape}_prepare_cpu_per_claim", (prepare_user + prepare_sys) / claims * 1000, "ms"
        )
        reporter.metric(f"{shape}_prepare_sys_cpu_per_claim", prepare_sys / claims * 1000, "ms")
        reporter.metric(
            f"{shape}_prepare_cpu_busy", (prepare_user + prepare_sys) / prepare_wall, "cores"
        )
        reporter.metric(f"{shape}_unprepare_cpu_per_claim", unprepare_cpu / claims * 1000, "ms")
    reporter.distribution("concurrent_call", call_latencies)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per shape (5)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded rounds per shape (1)")
    parser.add_argument("--machine", default=MACHINE, help="profile with >= 64 GPUs")
    return run_plugin_bench(parser, argv, BENCH, run)


if __name__ == "__main__":
    sys.exit(main())
