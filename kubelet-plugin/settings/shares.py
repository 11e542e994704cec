"""The share flags: GPUs, static MIG devices and dynamic MIG partitions offered as MPS shares,
the largest share, their memory limits and the MPS memory watchdog, and the GPUs offered as
capped time-sliced shares. See docs/shares.md and docs/config.md#gpu-dra-kubelet-plugin.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from gpu_dra.driver.shares import (
    DEFAULT_SHARE_REPLICAS,
    MigShareSelection,
    PartitionShareSelection,
    ShareSelection,
    ShareSelectionError,
    check_replicas,
)


def add_mps_share_options(option: Callable[..., None]) -> None:
    """`--mps-shares`, `--mps-shares-on-mig`, `--mps-shares-on-dynamic-mig`,
    `--mps-share-max-percent`, `--mps-share-replicas`, then the memory flags
    (`_add_share_memory_options`)."""
    option(
        "--mps-shares",
        "GPUs offered as MPS shares through consumable capacity: all, none, or "
        "comma-separated GPU indexes or UUIDs",
        "none",
    )
    option(
        "--mps-shares-on-mig",
        "static MIG devices offered as MPS shares through consumable capacity (one MPS "
        "daemon per MIG device, caps within the slice): all, none, or comma-separated MIG "
        "profiles (3g.40gb) or MIG device UUIDs",
        "none",
    )
    option(
        "--mps-shares-on-dynamic-mig",
        "dynamic MIG partitions offered as MPS shares through consumable capacity (the MIG "
        "device is made for the first share, one MPS daemon on it, destroyed after the "
        "last share; needs --dynamic-mig): all, none, or comma-separated MIG profiles "
        "(3g.40gb)",
        "none",
    )
    option(
        "--mps-share-max-percent",
        "largest MPS share in percent of a GPU's SMs and memory (1-100): the shared MPS "
        "daemon's default caps; larger shares are refused at prepare",
        "100",
    )
    option(
        "--mps-share-replicas",
        "equal parts of a device offered as shares (MPS or capped; 1-100): a share that names "
        "no memory gets 1/N of the device's memory, one that names no compute 1/N of its SMs; "
        "1: an unnamed amount is the whole device",
        str(DEFAULT_SHARE_REPLICAS),
    )
    _add_share_memory_options(option)


def mps_share_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The MPS share fields of the settings (with the memory watchdog's) from parsed ``args``;
    usage errors exit."""
    try:
        mps_shares = ShareSelection.parse(args.mps_shares or "none")
        mps_shares_on_mig = MigShareSelection.parse(args.mps_shares_on_mig or "none")
        on_dynamic_mig = PartitionShareSelection.parse(args.mps_shares_on_dynamic_mig or "none")
    except ShareSelectionError as error:
        parser.error(str(error))
    try:
        max_share = int(args.mps_share_max_percent)
    except ValueError:
        parser.error(
            f"--mps-share-max-percent must be a whole percentage, got "
            f"{args.mps_share_max_percent!r}"
        )
    if not 1 <= max_share <= 100:
        parser.error(f"--mps-share-max-percent must be between 1 and 100, got {max_share}")
    try:
        replicas = int(args.mps_share_replicas)
    except ValueError:
        parser.error(
            f"--mps-share-replicas must be a whole number, got {args.mps_share_replicas!r}"
        )
    try:
        check_replicas(replicas)
    except ValueError as error:
        parser.error(str(error))
    if replicas * max_share < 100:
        parser.error(
            f"--mps-share-replicas={replicas} makes an amount a share does not name 1/{replicas} "
            f"of its device, more than --mps-share-max-percent={max_share} allows, so every "
            f"such share would be refused at prepare; use at least {-(-100 // max_share)} "
            "replicas or a larger max percent"
        )
    return {
        "mps_shares": mps_shares,
        "mps_shares_on_mig": mps_shares_on_mig,
        "mps_shares_on_dynamic_mig": on_dynamic_mig,
        "mps_share_max_percent": max_share,
        "mps_share_replicas": replicas,
        "mps_share_memory_limits": _memory_limits_mode(parser, args),
        **_watchdog_settings(parser, args),
    }


def _add_share_memory_options(option: Callable[..., None]) -> None:
    """`--mps-share-memory-limits`, `--mps-memory-watchdog` and its interval (docs/shares.md)."""
    option(
        "--mps-share-memory-limits",
        "auto: cap each container of an MPS share at its memory through the driver "
        "(NVIDIA_GPU_MEMORY_LIMIT and nvidia-cdi-hook apply-cuda-memory-limits) on GPUs "
        "where that was found to work at start; off: never",
        "auto",
    )
    option(
        "--mps-memory-watchdog",
        "on MPS shares the driver does not cap (older drivers, cgroup v1, MIG): what to do "
        "when a share's processes together use more GPU memory than the share: report "
        "(Events, metrics), kill (also SIGKILL its newest process), evict (also evict its "
        "pods), off",
        "kill",
    )
    option(
        "--mps-memory-watchdog-interval",
        "seconds between the MPS memory watchdog's checks (0.1-3600)",
        "1",
    )


def _watchdog_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The memory watchdog's settings from parsed `args`; usage errors exit."""
    policy = str(args.mps_memory_watchdog).strip().lower()
    if policy not in ("report", "kill", "evict", "off"):
        parser.error(
            f"--mps-memory-watchdog must be report, kill, evict or off, got "
            f"{args.mps_memory_watchdog!r}"
        )
    text = args.mps_memory_watchdog_interval
    try:
        interval = float(text)
    except (TypeError, ValueError):
        parser.error(f"--mps-memory-watchdog-interval must be a number, got {text!r}")
    if not 0.1 <= interval <= 3600:
        parser.error(f"--mps-memory-watchdog-interval must be between 0.1 and 3600, got {text!r}")
    return {"mps_memory_watchdog": policy, "mps_memory_watchdog_interval_s": interval}


def _memory_limits_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    mode = str(args.mps_share_memory_limits).strip().lower()
    if mode not in ("auto", "off"):
        parser.error(
            f"--mps-share-memory-limits must be auto or off, got {args.mps_share_memory_limits!r}"
        )
    return mode


def add_capped_share_options(option: Callable[..., None]) -> None:
    """`--capped-shares` (docs/shares.md, "Capped shares")."""
    option(
        "--capped-shares",
        "GPUs offered as capped time-sliced shares (memory capped per container by the "
        "driver, no MPS) through consumable capacity: all, none, or comma-separated GPU "
        "indexes or UUIDs; published only where the driver's cap works",
        "none",
    )


def capped_share_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> dict[str, Any]:
    """`--capped-shares` from parsed `args`; a usage error exits."""
    try:
        selection = ShareSelection.parse(args.capped_shares or "none", "--capped-shares")
    except ShareSelectionError as error:
        parser.error(str(error))
    return {"capped_shares": selection}
