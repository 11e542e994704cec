"""`gpu-dra profiles`: the built-in simulated machine profiles, with GPU counts and products."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Mapping
from typing import Any, Final

from gpu_dra.cli.command import (
    EXIT_OK,
    PROG,
    Streams,
    Subcommand,
    add_output_argument,
    write_data,
    write_table,
)
from gpu_dra.driver.nvml.simulated_profiles import builtin_profile_names, load_profile


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_output_argument(parser)


def run(args: argparse.Namespace, streams: Streams) -> int:
    summaries = [_profile_summary(name) for name in builtin_profile_names()]
    if args.output != "table":
        write_data(streams, summaries, args.output)
        return EXIT_OK
    rows = [
        [
            str(summary["name"]),
            str(summary["gpus"]),
            ", ".join(f"{count}x {product}" for product, count in summary["products"].items()),
        ]
        for summary in summaries
    ]
    write_table(streams, ["NAME", "GPUS", "PRODUCTS"], rows)
    return EXIT_OK


def _profile_summary(name: str) -> dict[str, Any]:
    # The node name only seeds UUIDs, which the summary does not show.
    profile = load_profile(name, node_name=PROG)
    products = Counter(gpu.model.name for gpu in profile.gpus)
    return {
        "name": profile.name,
        "gpus": len(profile.gpus),
        "products": dict(products),
        "description": profile.description,
    }


COMMAND: Final = Subcommand(
    name="profiles",
    summary="list the built-in simulated machine profiles",
    description="List the built-in simulated machine profiles (for --simulate of `gpu-dra\n"
    "devices` and of the kubelet plugin) with their GPU count and products.",
    examples=("gpu-dra profiles", "gpu-dra profiles -o yaml"),
    add_arguments=add_arguments,
    run=run,
)
