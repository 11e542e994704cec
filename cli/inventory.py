"""`gpu-dra inventory`: per node the driver's device counts by state and type, and each
DeviceClass's total and free devices, from a live cluster (the model:
`gpu_dra.driver.cluster.usage`); with ``--devices`` also the devices with their holders, a GPU's
MIG devices on one line. With ``--utilization`` also each claim's utilization, with ``--idle``
only the idle claims, both read from the kubelet plugins' metrics (`gpu_dra.cli.utilization`,
docs/metrics.md), each with its state in the idle policy (docs/idle-reclaim.md). See
docs/cel.md, "gpu-dra explain and gpu-dra inventory".
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final

from gpu_dra.cli import cluster, utilization
from gpu_dra.cli.cluster import add_cluster_arguments, api_client, cluster_errors, read_objects
from gpu_dra.cli.command import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Streams,
    Subcommand,
    add_env_argument,
    write_blocks,
    write_data,
)
from gpu_dra.driver.cluster import idle_policy
from gpu_dra.driver.cluster.availability import DEVICE_STATES, CapacityLeft, quantity_text
from gpu_dra.driver.cluster.usage import DeviceRow, Inventory, inventory
from gpu_dra.driver.naming import (
    DEFAULT_DRIVER_NAME,
    InvalidNameError,
    MigDeviceName,
    parse_device_name,
)
from gpu_dra.kube.errors import ApiError

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
    group = parser.add_argument_group(
        "utilization (read from the kubelet plugins' /metrics, docs/metrics.md)"
    )
    group.add_argument(
        "--utilization",
        action="store_true",
        help="also list each claim's devices with their utilization, memory and idle time",
    )
    group.add_argument(
        "--idle",
        action="store_true",
        help="list only the claims whose devices all stayed idle (under the plugins' "
        "--utilization-idle-threshold) for --idle-for, with their age and what they hold",
    )
    group.add_argument(
        "--idle-for",
        metavar="DURATION",
        default="30m",
        help="how long a claim's devices must have been idle for --idle (90s, 30m, 2h, 1h30m, "
        "1d, 1d12h: the forms the output prints; default: %(default)s)",
    )
    group.add_argument(
        "--plugin-metrics",
        metavar="URL",
        action="append",
        default=[],
        help="a kubelet plugin's metrics URL (repeatable, e.g. http://node-a:8081/metrics); "
        "default: every pod --plugin-selector matches, through the apiserver's pod proxy",
    )
    group.add_argument(
        "--plugin-selector",
        metavar="SELECTOR",
        default=utilization.DEFAULT_PLUGIN_SELECTOR,
        help="label selector of the kubelet plugin pods (default: %(default)s)",
    )
    group.add_argument(
        "--plugin-namespace",
        metavar="NAMESPACE",
        help="namespace of the kubelet plugin pods (default: all namespaces)",
    )


def run(args: argparse.Namespace, streams: Streams) -> int:
    try:
        window_s = utilization.parse_duration(args.idle_for)
    except ValueError as error:
        raise CliError(f"--idle-for: {error}", EXIT_USAGE) from error
    uses: list[utilization.DeviceUse] | None = None
    warnings: list[str] = []
    with cluster_errors():
        client = api_client(args.kubeconfig)
        classes, slices, claims = read_objects(client)
        if args.utilization or args.idle:
            uses, warnings = _read_utilization(client, args)
    if args.idle:
        assert uses is not None
        idle = utilization.idle_claims(uses, window_s)
        ages = _claim_ages(claims, time.time())
        states = _policy_states(client, claims, idle, warnings)
        if args.output != "table":
            write_data(streams, _idle_json(idle, ages, warnings, window_s, states), args.output)
        else:
            blocks = render_idle(idle, ages, window_s, states)
            write_blocks(streams, [*_warnings(warnings), *blocks])
        return EXIT_OK
    report = inventory(slices, classes, claims, driver=args.driver_name)
    if args.output != "table":
        data = report.to_json()
        if uses is not None:
            data["claimUtilization"] = [use.to_json() for use in uses]
            data["warnings"] = warnings
        write_data(streams, data, args.output)
    else:
        blocks = render_inventory(report, devices=args.devices)
        if uses is not None:
            blocks += [*_warnings(warnings), *render_utilization(uses)]
        write_blocks(streams, blocks)
    return EXIT_OK


def _read_utilization(
    client: Any, args: argparse.Namespace
) -> tuple[list[utilization.DeviceUse], list[str]]:
    if args.plugin_metrics:
        scrapes = utilization.read_urls(args.plugin_metrics)
    else:
        scrapes = utilization.read_plugin_pods(client, args.plugin_selector, args.plugin_namespace)
    uses, warnings = utilization.collect(scrapes)
    if not scrapes:
        warnings.append(
            f"no kubelet plugin pod matches {args.plugin_selector!r}: give the plugins' "
            "metrics URLs with --plugin-metrics"
        )
    return uses, warnings


ClaimKey = tuple[str, str]


def _policy_states(
    client: Any,
    claims: Sequence[Mapping[str, Any]],
    idle: Sequence[utilization.IdleClaim],
    warnings: list[str],
) -> dict[ClaimKey, idle_policy.PolicyState] | None:
    """Each idle claim's state with the idle policy (docs/idle-reclaim.md); None, with a
    warning, when it cannot be read."""
    wanted = {(claim.namespace, claim.claim) for claim in idle}
    held = {
        key: [pod.name for pod in idle_policy.reserved_pods(claim)]
        for claim in claims
        if (key := _claim_key(claim)) in wanted
    }
    try:
        namespaces, pods = cluster.read_idle_policy(
            client, [(key[0], pod) for key, names in held.items() for pod in names]
        )
    except ApiError as error:
        warnings.append(f"cannot read the idle policy's state (POLICY shows ?): {error}")
        return None
    return {
        key: idle_policy.policy_state(
            namespaces.get(key[0]), [pods[(key[0], n)] for n in names if (key[0], n) in pods]
        )
        for key, names in held.items()
    }


def _claim_key(claim: Mapping[str, Any]) -> ClaimKey:
    metadata = claim.get("metadata") or {}
    return (str(metadata.get("namespace")), str(metadata.get("name")))


def _policy_text(states: Mapping[ClaimKey, idle_policy.PolicyState] | None, key: ClaimKey) -> str:
    if states is None:
        return "?"
    state = states.get(key)
    return "?" if state is None else state.text


def _warnings(warnings: Sequence[str]) -> list[str]:
    return [f"warning: {warning}" for warning in warnings]


def _claim_ages(claims: Sequence[Mapping[str, Any]], now: float) -> dict[tuple[str, str], float]:
    ages = {}
    for claim in claims:
        metadata = claim.get("metadata") or {}
        created = metadata.get("creationTimestamp")
        if isinstance(created, datetime):
            created = created.isoformat()
        if not isinstance(created, str):
            continue
        try:
            stamp = datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        ages[(str(metadata.get("namespace")), str(metadata.get("name")))] = max(now - stamp, 0)
    return ages


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:g}%"


def _memory(used: float | None, limit: float | None) -> str:
    def gib(value: float | None) -> str:
        return "?" if value is None else f"{value / 2**30:.1f}"

    if used is None and limit is None:
        return "-"
    return f"{gib(used)}/{gib(limit)} GiB"


def _idle_text(seconds: float | None) -> str:
    return "-" if seconds is None else utilization.duration_text(seconds)


def render_utilization(
    uses: Sequence[utilization.DeviceUse],
) -> list[tuple[list[str], list[list[str]]] | str]:
    """The claims table of ``--utilization``."""
    rows = [
        [
            f"{u.namespace}/{u.claim}",
            u.pod or "-",
            u.node,
            u.device,
            u.tier,
            _percent(u.gpu_percent),
            _memory(u.memory_used_bytes, u.memory_limit_bytes),
            "-" if u.processes is None else f"{u.processes:g}",
            _idle_text(u.idle_for_s),
        ]
        for u in uses
    ]
    headers = ["CLAIM", "PODS", "NODE", "DEVICE", "TIER", "GPU", "MEMORY", "PROCS", "IDLE FOR"]
    return ["claims (utilization in the plugins' newest sample):", (headers, rows)]


def render_idle(
    idle: Sequence[utilization.IdleClaim],
    ages: Mapping[tuple[str, str], float],
    window_s: float,
    states: Mapping[ClaimKey, idle_policy.PolicyState] | None = None,
) -> list[tuple[list[str], list[list[str]]] | str]:
    """The ``--idle`` view; POLICY: where the claim stands with the idle policy."""
    rows = []
    for claim in idle:
        age = ages.get((claim.namespace, claim.claim))
        devices = claim.devices
        rows.append(
            [
                f"{claim.namespace}/{claim.claim}",
                "-" if age is None else utilization.duration_text(age),
                ", ".join(f"{d.node}/{d.device} ({d.tier})" for d in devices),
                ", ".join(sorted({d.pod for d in devices if d.pod})) or "-",
                utilization.duration_text(claim.idle_for_s),
                ", ".join(_memory(d.memory_used_bytes, d.memory_limit_bytes) for d in devices),
                _policy_text(states, (claim.namespace, claim.claim)),
            ]
        )
    title = f"idle claims (every device idle for at least {utilization.duration_text(window_s)}):"
    return [title, (["CLAIM", "AGE", "HOLDS", "PODS", "IDLE FOR", "MEMORY", "POLICY"], rows)]


def _idle_json(
    idle: Sequence[utilization.IdleClaim],
    ages: Mapping[tuple[str, str], float],
    warnings: list[str],
    window_s: float,
    states: Mapping[ClaimKey, idle_policy.PolicyState] | None,
) -> dict[str, Any]:
    def policy(key: ClaimKey) -> dict[str, Any] | None:
        state = None if states is None else states.get(key)
        return None if state is None else state.to_json()

    return {
        "idleForSeconds": window_s,
        "idleClaims": [
            {
                "namespace": claim.namespace,
                "name": claim.claim,
                "ageSeconds": ages.get((claim.namespace, claim.claim)),
                "idleSeconds": claim.idle_for_s,
                "devices": [device.to_json() for device in claim.devices],
                "policy": policy((claim.namespace, claim.claim)),
            }
            for claim in idle
        ],
        "warnings": warnings,
    }


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
    "--utilization adds each claim's utilization and --idle lists only the idle claims,\n"
    "both from the kubelet plugins' /metrics (docs/metrics.md).\n"
    "Exit status: 0 success, 1 the cluster cannot be read, 2 usage error.",
    examples=(
        "gpu-dra inventory",
        "gpu-dra inventory --devices",
        "gpu-dra inventory -o json | jq .classes",
        "gpu-dra inventory --utilization",
        "gpu-dra inventory --idle --idle-for 2h",
        "gpu-dra inventory --idle --plugin-metrics http://127.0.0.1:8081/metrics",
    ),
    add_arguments=add_arguments,
    run=run,
)
