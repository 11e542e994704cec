"""The utilization sampler's flags: its interval and the idle threshold (docs/metrics.md)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


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


def utilization_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> dict[str, Any]:
    """The utilization sampler's settings from parsed `args`; usage errors exit."""
    values = {}
    for flag, text, low, high in (
        ("--utilization-interval", args.utilization_interval, 0.0, 86400.0),
        ("--utilization-idle-threshold", args.utilization_idle_threshold, 0.0, 100.0),
    ):
        try:
            value = float(text)
        except (TypeError, ValueError):
            parser.error(f"{flag} must be a number, got {text!r}")
        if not low <= value <= high:
            parser.error(f"{flag} must be between {low:g} and {high:g}, got {text!r}")
        values[flag] = value
    return {
        "utilization_interval_s": values["--utilization-interval"],
        "utilization_idle_threshold": values["--utilization-idle-threshold"],
    }
