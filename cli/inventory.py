"""`gpu-dra inventory`: per node the driver's device counts by state and type, and each
DeviceClass's total and free devices, from a live cluster (the model:
`gpu_dra.driver.cluster.usage`); with ``--devices`` also the devices with their holders, a GPU's
MIG devices on one line. See docs/cel.md, "gpu-dra explain and gpu-dra inventory".
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Mapping, Sequence
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
from gpu_dra.driver.cluster.availability import DEVICE_STATES, CapacityLeft, quantity_text
from gpu_dra.driver.cluster.usage import DeviceRow, Inventory, inventory
from gpu_dra.driver.naming import (
    DEFAULT_DRIVER_NAME,
    InvalidNameError,
    MigDeviceName,
    parse_device_name,
)

DEVICES_HINT: Final = "(the devices and their holders: gpu-dra inventory --devices)"


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
    parser.add_argument(
        "--devices",
        action="store_true",
        help="also print the devices with their state and holders, a GPU's MIG devices on one "
        "line (-o json|yaml always has them)",
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
        write_blocks(streams, render_inventory(report, devices=args.devices))
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


def render_inventory(
    report: Inventory, *, devices: bool = False
) -> list[tuple[list[str], list[list[str]]] | str]:
    """The table output: section titles (str) and tables (headers, rows), in order. The node and
    class summary; with `devices` the device table between them (`device_table_rows`)."""
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
    if devices:
        out.append("devices:")
        out.append(
            (
                ["NODE", "POOL", "DEVICE", "TYPE", "PRODUCT", "STATE", "HELD BY", "CAPACITY LEFT"],
                device_table_rows(report.devices),
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
    if not devices and report.devices:
        out.append(DEVICES_HINT)
    return out


def device_table_rows(rows: Sequence[DeviceRow]) -> list[list[str]]:
    """One line per device, except that the MIG devices of one GPU (named
    ``gpu-<minor>-mig-...``, two or more in a pool) share one line, where the first of them
    stands: ``gpu-0-mig-* (25)``, the count per state (``7 free, 5 allocated, 13 blocked``, the
    reason when all blocked ones share it) and the holders (``ns/a (request)``, or ``ns/b x5``
    for a claim holding several of them)."""
    groups: dict[tuple[str, str, int], list[DeviceRow]] = {}
    for row in rows:
        minor = _mig_parent(row)
        if minor is not None:
            groups.setdefault((row.node, row.pool, minor), []).append(row)
    table: list[list[str]] = []
    for row in rows:
        minor = _mig_parent(row)
        group = groups.get((row.node, row.pool, minor)) if minor is not None else None
        if group is None or len(group) < 2:
            table.append(_device_line(row))
        elif group[0] is row:
            table.append(_group_line(group, minor))
    return table


def _mig_parent(row: DeviceRow) -> int | None:
    if row.type != "mig":
        return None
    try:
        name = parse_device_name(row.device)
    except InvalidNameError:
        return None
    return name.parent_minor if isinstance(name, MigDeviceName) else None


def _device_line(row: DeviceRow) -> list[str]:
    return [
        row.node,
        row.pool,
        row.device,
        row.type,
        row.product,
        f"{row.state} ({row.reason})" if row.reason else row.state,
        ", ".join(row.holders) or "-",
        _capacity_text(row.capacity),
    ]


def _claim_of(holder: str) -> str:
    """``ns/name`` of a holder ``ns/name (request)``."""
    return holder.split(" (", 1)[0]


def _group_line(group: Sequence[DeviceRow], minor: int | None) -> list[str]:
    states = Counter(row.state for row in group)
    reasons = {row.reason for row in group if row.state == "blocked"}
    parts = []
    for state in (state for state in DEVICE_STATES if states[state]):
        part = f"{states[state]} {state}"
        if state == "blocked" and len(reasons) == 1 and "" not in reasons:
            part += f" ({next(iter(reasons))})"
        parts.append(part)
    holders = [holder for row in group for holder in row.holders]  # "ns/name (request)"
    claims = Counter(_claim_of(holder) for holder in holders)
    held = ", ".join(
        dict.fromkeys(
            holder if claims[claim] == 1 else f"{claim} x{claims[claim]}"
            for holder, claim in ((holder, _claim_of(holder)) for holder in holders)
        )
    )
    products = dict.fromkeys(row.product for row in group)
    return [
        group[0].node,
        group[0].pool,
        f"gpu-{minor}-mig-* ({len(group)})",
        "mig",
        ", ".join(products),
        ", ".join(parts),
        held or "-",
        "-",
    ]


COMMAND: Final = Subcommand(
    name="inventory",
    summary="devices per node with their holders, free devices per DeviceClass (reads the cluster)",
    description="Read every ResourceSlice (highest generation per pool), DeviceClass and\n"
    "ResourceClaim and print, per node, how many of the driver's devices are free,\n"
    "allocated, shared or blocked (and free per type gpu / mig / ...), and per DeviceClass\n"
    "the devices its selectors match and how many are free. --devices adds the devices\n"
    "with their state and the claims holding them, a GPU's MIG devices on one line.\n"
    "Exit status: 0 success, 1 the cluster cannot be read, 2 usage error.",
    examples=(
        "gpu-dra inventory",
        "gpu-dra inventory --devices",
        "gpu-dra inventory -o json | jq .classes",
    ),
    add_arguments=add_arguments,
    run=run,
)
