"""The device health monitor's flags: on, off or auto, the XIDs it ignores and the taint effects
of degraded and lost devices. See docs/config.md#gpu-dra-kubelet-plugin.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from gpu_dra.driver.health import (
    DEFAULT_IGNORED_XIDS,
    TaintEffect,
    parse_taint_effect,
    parse_xids,
)
from gpu_dra.kubelet_plugin.settings.values import parse_bool


def add_health_options(option: Callable[..., None], environ: Mapping[str, str]) -> None:
    """`--health-monitor`, `--health-ignored-xids`, `--additional-xids-to-ignore` and the
    taint effects."""
    option(
        "--health-monitor",
        "watch GPU health (NVML XID and ECC events, MPS share daemons), taint unhealthy "
        "devices and report device health to the kubelet: auto (on with real GPUs, off with "
        "--simulate), true or false; a bare flag means true",
        "auto",
        nargs="?",
        const="true",
    )
    option(
        "--health-ignored-xids",
        "comma-separated XIDs taken as application errors and ignored (NVIDIA's list)",
        ",".join(str(xid) for xid in sorted(DEFAULT_IGNORED_XIDS)),
    )
    option(
        "--additional-xids-to-ignore",
        "comma-separated XIDs ignored besides --health-ignored-xids; also read from "
        "ADDITIONAL_XIDS_TO_IGNORE",
        environ.get("ADDITIONAL_XIDS_TO_IGNORE"),
    )
    option(
        "--health-taint-effect-degraded",
        "taint effect of a degraded device (critical XID, double-bit ECC error, dead MPS share "
        "daemon): None, NoSchedule or NoExecute",
        TaintEffect.NO_SCHEDULE.value,
    )
    option(
        "--health-taint-effect-lost",
        "taint effect of the devices of a lost GPU (XID 79, NVML GPU_IS_LOST): None, "
        "NoSchedule or NoExecute",
        TaintEffect.NO_EXECUTE.value,
    )
    option(
        "--health-taint-effect-unmonitored",
        "taint of the devices of a GPU NVML cannot watch for XIDs (health Unknown): off (no "
        "taint), None, NoSchedule or NoExecute",
        "off",
    )


def health_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The health monitor's settings from parsed ``args``; usage errors exit."""
    try:
        text = (args.health_monitor or "auto").strip()
        monitor = None if text.lower() == "auto" else parse_bool(text, "--health-monitor")
        ignored = parse_xids(args.health_ignored_xids or "", "--health-ignored-xids")
        additional = parse_xids(args.additional_xids_to_ignore or "", "--additional-xids-to-ignore")
        degraded = parse_taint_effect(
            args.health_taint_effect_degraded or "NoSchedule", "--health-taint-effect-degraded"
        )
        lost = parse_taint_effect(
            args.health_taint_effect_lost or "NoExecute", "--health-taint-effect-lost"
        )
        text = (args.health_taint_effect_unmonitored or "off").strip()
        unwatched = (
            None
            if text.lower() == "off"
            else parse_taint_effect(text, "--health-taint-effect-unmonitored (or off)")
        )
    except ValueError as error:
        parser.error(str(error))
    return {
        "health_monitor": monitor,
        "health_ignored_xids": ignored,
        "additional_xids_to_ignore": additional,
        "health_taint_effect_degraded": degraded,
        "health_taint_effect_lost": lost,
        "health_taint_effect_unmonitored": unwatched,
    }
