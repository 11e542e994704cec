"""The start-up guard's flags: where NVIDIA's device plugin would have its socket, whether to
start beside it, how often to check again while the node is taken, and the namespace of the
Events about this node. See
docs/deployment.md#start-up-guard and docs/config.md#gpu-dra-kubelet-plugin.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpu_dra.kubelet_plugin.settings.values import parse_bool


def add_guard_options(option: Callable[..., None], environ: Mapping[str, str]) -> None:
    """The start-up guard's `--kubelet-device-plugins-dir`, `--allow-nvidia-device-plugin`,
    `--guard-recheck-interval` and `--event-namespace`."""
    option(
        "--kubelet-device-plugins-dir",
        "the kubelet's device-plugins directory, checked for NVIDIA's device plugin socket "
        "(default <kubelet-plugins-dir>/../device-plugins)",
        None,
    )
    option(
        "--allow-nvidia-device-plugin",
        "start although NVIDIA's device plugin serves this node's GPUs (only warn); both may "
        "then hand the same GPU to two pods",
        "false",
        nargs="?",
        const="true",
    )
    option(
        "--guard-recheck-interval",
        "seconds between the start-up guard's checks while NVIDIA's device plugin or another DRA "
        "driver serves this node (the plugin waits, not ready, and starts once it is gone)",
        "30",
    )
    option(
        "--event-namespace",
        "namespace of the Events recorded about this node: the apiserver takes Events about a "
        "Node only in default or kube-system",
        "default",
    )


def guard_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The start-up guard's settings from parsed `args`; usage errors exit."""
    try:
        allow = parse_bool(args.allow_nvidia_device_plugin or "", "--allow-nvidia-device-plugin")
    except ValueError as error:
        parser.error(str(error))
    directory = args.kubelet_device_plugins_dir
    text = args.guard_recheck_interval or ""
    try:
        interval = float(text)
    except ValueError:
        interval = -1.0
    if not 0 < interval < float("inf"):
        parser.error(f"--guard-recheck-interval must be seconds > 0, got {text!r}")
    return {
        "guard_recheck_interval_s": interval,
        "kubelet_device_plugins_dir": Path(directory) if directory else None,
        "allow_nvidia_device_plugin": allow,
        "event_namespace": args.event_namespace or "default",
    }
