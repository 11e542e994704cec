"""`gpu-dra inventory`: the driver's devices per node with their holders, and each DeviceClass's
total and free devices, from a live cluster (the model: `gpu_dra.driver.cluster.usage`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Final

from gpu_dra.cli.cluster import add_cluster_arguments, api_client, cluster_errors, read_objects
from gpu_dra.cli.command import (
    EXIT_OK,
    Streams,
    Subcommand,
    add_env_argument,
    write_blocks,
    write_data,
)
from gpu_dra.driver.cluster.availability import CapacityLeft, quantity_text
from gpu_dra.driver.cluster.usage import Inventory, inventory
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_env_argument(
        parser,
        environ,
        "--driver-name",
        env=("GPU_DRA_DRIVER_NAME",),
        metavar="NAME",
        help="DRA driver whose devices are listed per node (classes count every driver's)",
        default=DEFAULT_DRIVER_NAME,
    )
    add_cluster_arguments(parser, environ)


def run(args: argparse.Namespace, streams: Streams) -> int:
    with cluster_errors():
        client = api_client(args.kubeconfig)
        classes, slices, claims = read_objects(client)
    report = inventory(slices, classes, claims, driver=args.driver_name)
    if args.output != "table":
        write_data(streams, report.to_json(), args.output)
    else:
        write_blocks(streams, render_inventory(report))
    return EXIT_OK


def _capacity_text(capacity: Mapping[str, CapacityLeft]) -> str:
    """``memory 50Gi/80Gi, compute 30/100`` (left/value), or ``-``."""
    return (
        ", ".join(
            f"{name} {quantity_text(left.remaining)}/{quantity_text(left.value)}"
            for name, left in sorted(capacity.items())
        )
        or "-"
    )


def render_inventory(report: Inventory) -> list[tuple[list[str], list[list[str]]] | str]:
    """The table output: section titles (str) and tables (headers, rows), in order."""
    out: list[tuple[list[str], list[list[str]]] | str] = []
    for pool in report.pools:
        if pool.incomplete:
            out.append(
                f"warning: pool {pool.key} is incomplete ({pool.slices} of "
                f"{pool.slice_count} slices at generation {pool.generation})"
            )
    nodes = report.nodes()
    node_rows = []
    for node, summary in nodes.items():
        kinds = ", ".join(
            f"{t}: {c['free']}/{c['devices']} free" for t, c in sorted(summary["types"].items())
        )
        counts = [str(summary[k]) for k in ("devices", "free", "allocated", "shared", "blocked")]
        node_rows.append([node, *counts, kinds])
    out.append(f"nodes ({report.driver}):")
    out.append(
        (["NODE", "DEVICES", "FREE", "ALLOCATED", "SHARED", "BLOCKED", "BY TYPE"], node_rows)
    )
    out.append("devices:")
    out.append(
        (
            ["NODE", "POOL", "DEVICE", "TYPE", "PRODUCT", "STATE", "HELD BY", "CAPACITY LEFT"],
            [
                [
                    r.node,
                    r.pool,
                    r.device,
                    r.type,
                    r.product,
                    f"{r.state} ({r.reason})" if r.reason else r.state,
                    ", ".join(r.holders) or "-",
                    _capacity_text(r.capacity),
                ]
                for r in report.devices
            ],
        )
    )
    out.append("device classes:")
    out.append(
        (
            ["CLASS", "DEVICES", "FREE", "BLOCKED", "FREE CAPACITY", "CEL ERRORS", "NOTE"],
            [
                [
                    c.name,
                    str(c.total),
                    str(c.free),
                    str(c.blocked),
                    _capacity_text(c.capacity),
                    str(c.errors),
                    c.error or "-",
                ]
                for c in report.classes
            ],
        )
    )
    for line in report.unknown_allocations:
        out.append(f"warning: allocated device not in any current slice: {line}")
    return out


COMMAND: Final = Subcommand(
    name="inventory",
    summary="devices per node with their holders, free devices per DeviceClass (reads the cluster)",
    description="Read every ResourceSlice (highest generation per pool), DeviceClass and\n"
    "ResourceClaim and print, per node, the driver's devices (type gpu / mig / ...) with\n"
    "their allocation state (free, allocated, shared, admin) and the claims holding them,\n"
    "and per DeviceClass the devices its selectors match and how many are free.\n"
    "Exit status: 0 success, 1 the cluster cannot be read, 2 usage error.",
    examples=("gpu-dra inventory", "gpu-dra inventory -o json | jq .classes"),
    add_arguments=add_arguments,
    run=run,
)
