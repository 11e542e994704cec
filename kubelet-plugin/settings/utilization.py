"""The utilization sampler's flags: its interval and the idle threshold (docs/metrics.md); and
the claim status writer's, which reports the same activity (docs/architecture.md#claim-status)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from gpu_dra.kubelet_plugin.settings.values import parse_bool


def add_utilization_options(option: Callable[..., None]) -> None:
    """`--utilization-interval` and `--utilization-idle-threshold` (docs/metrics.md)."""
    option(
        "--utilization-interval",
        "seconds between utilization samples of the devices prepared claims hold (NVML; "
        "exported as gpu_dra_claim_* metrics); 0 turns sampling off",
        "10",
    )
    option(
        "--utilization-idle-threshold",
        "GPU utilization in percent below which a claim's device counts as idle in a sample",
        "5",
    )
    option(
        "--claim-status",
        "write what each prepared claim holds (UUIDs, MIG profile, share caps, health, "
        "Active/Idle) to its ResourceClaim status.devices: true or false",
        "true",
    )
    option(
        "--claim-status-min-interval",
        "seconds between two writes of one claim's status.devices (the first is at once)",
        "30",
    )
    option(
        "--claim-status-idle-after",
        "seconds without GPU activity after which a claim's device is Active=False (Idle) in "
        "its status",
        "300",
    )


def utilization_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> dict[str, Any]:
    """The utilization sampler's settings from parsed `args`; usage errors exit."""
    values = {}
    for flag, text, low, high in (
        ("--utilization-interval", args.utilization_interval, 0.0, 86400.0),
        ("--utilization-idle-threshold", args.utilization_idle_threshold, 0.0, 100.0),
        ("--claim-status-min-interval", args.claim_status_min_interval, 1.0, 86400.0),
        ("--claim-status-idle-after", args.claim_status_idle_after, 1.0, 30 * 86400.0),
    ):
        try:
            value = float(text)
        except (TypeError, ValueError):
            parser.error(f"{flag} must be a number, got {text!r}")
        if not low <= value <= high:
            parser.error(f"{flag} must be between {low:g} and {high:g}, got {text!r}")
        values[flag] = value
    try:
        claim_status = parse_bool(str(args.claim_status), "--claim-status")
    except ValueError as error:
        parser.error(str(error))
    return {
        "utilization_interval_s": values["--utilization-interval"],
        "utilization_idle_threshold": values["--utilization-idle-threshold"],
        "claim_status": claim_status,
        "claim_status_min_interval_s": values["--claim-status-min-interval"],
        "claim_status_idle_after_s": values["--claim-status-idle-after"],
    }
