"""The MPS daemon flags: how daemons run (a host process or a pod of this node, and the pods'
image, namespace, priority class and pull secrets), their supervision interval, the compute mode
of their GPUs and whether shared daemons run before their first share. See docs/mps.md and
docs/config.md#gpu-dra-kubelet-plugin.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from gpu_dra.kubelet_plugin.mps.warm_policy import DEFAULT as DEFAULT_WARM
from gpu_dra.kubelet_plugin.mps.warm_policy import WarmPolicy, WarmPolicyError

MPS_DAEMON_RUNNERS = ("process", "pod")
EXCLUSIVE_COMPUTE_MODES = ("shares", "all", "none")
"""`--mps-exclusive-compute-mode`: the GPUs of shared daemons (MPS shares), of every daemon, or
none; `true`/`false` (and yes/no, 1/0) are read as `all`/`none`."""
DEFAULT_MPS_DAEMON_NAMESPACE = "gpu-dra"
DEFAULT_MPS_DAEMON_PRIORITY_CLASS = "system-node-critical"
"""When an MPS daemon goes, every workload using it loses MPS: under node pressure its pod must
be the last the kubelet evicts (a built-in class the apiserver creates)."""


def add_mps_daemon_options(option: Callable[..., None], environ: Mapping[str, str]) -> None:
    """`--mps-daemon-runner`, `-image`, `-namespace`, `-priority-class`,
    `-image-pull-secrets`, `-check-interval`, `--mps-exclusive-compute-mode` and
    `--mps-share-daemon-warm`."""
    option(
        "--mps-share-daemon-warm",
        "whether the shared MPS daemon of a GPU offered as shares runs before its first "
        "share: always (started at plugin start and again after the last share left), "
        "idle:<duration> (the same, stopped after e.g. idle:10m without a share) or off "
        "(started by the first share, stopped with the last)",
        str(DEFAULT_WARM),
    )
    option(
        "--mps-daemon-runner",
        "how MPS control daemons run: process (host process; local/dev) or pod (a pod bound "
        "to this node, needs --mps-daemon-image)",
        "process",
        choices=MPS_DAEMON_RUNNERS,
    )
    option("--mps-daemon-image", "image of the MPS control daemon pods (runner pod)", None)
    option(
        "--mps-daemon-namespace",
        "namespace of the MPS control daemon pods (runner pod); default $POD_NAMESPACE",
        environ.get("POD_NAMESPACE") or DEFAULT_MPS_DAEMON_NAMESPACE,
    )
    option(
        "--mps-daemon-priority-class",
        "priority class of the MPS control daemon pods (runner pod); empty = none",
        DEFAULT_MPS_DAEMON_PRIORITY_CLASS,
    )
    option(
        "--mps-daemon-image-pull-secrets",
        "comma-separated Secret names for the MPS control daemon pods' imagePullSecrets "
        "(runner pod)",
        None,
    )
    option(
        "--mps-daemon-check-interval",
        "seconds between checks of the MPS daemons of prepared claims: a dead daemon is "
        "restarted in place, settings a client changed are set back (0 = off)",
        "10",
    )
    option(
        "--mps-exclusive-compute-mode",
        "compute mode EXCLUSIVE_PROCESS on the full GPUs of MPS daemons while they run (needs "
        "root; never on MIG devices): shares (the GPUs offered as MPS shares), all (per-claim "
        "daemons too; also true) or none (also false)",
        "shares",
    )


def mps_daemon_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> dict[str, Any]:
    """The MPS daemon fields of the settings from parsed ``args``; usage errors exit."""
    text = str(args.mps_exclusive_compute_mode).strip().lower()
    exclusive = {"true": "all", "1": "all", "yes": "all"}.get(text, text)
    exclusive = {"false": "none", "0": "none", "no": "none"}.get(exclusive, exclusive)
    if exclusive not in EXCLUSIVE_COMPUTE_MODES:
        parser.error(
            f"--mps-exclusive-compute-mode must be one of {', '.join(EXCLUSIVE_COMPUTE_MODES)} "
            f"(or true = all, false = none), got {args.mps_exclusive_compute_mode!r}"
        )
    if args.mps_daemon_runner not in MPS_DAEMON_RUNNERS:
        parser.error(
            f"--mps-daemon-runner must be one of {', '.join(MPS_DAEMON_RUNNERS)}, got "
            f"{args.mps_daemon_runner!r}"
        )
    if args.mps_daemon_runner == "pod" and not args.mps_daemon_image:
        parser.error(
            "--mps-daemon-runner=pod needs --mps-daemon-image (or GPU_DRA_MPS_DAEMON_IMAGE): "
            "the image whose nvidia-cuda-mps-control the daemon pods run"
        )
    return {
        "mps_daemon_runner": args.mps_daemon_runner,
        "mps_daemon_image": args.mps_daemon_image or "",
        "mps_daemon_namespace": args.mps_daemon_namespace or DEFAULT_MPS_DAEMON_NAMESPACE,
        "mps_daemon_priority_class": args.mps_daemon_priority_class or "",
        "mps_daemon_image_pull_secrets": tuple(
            name.strip()
            for name in (args.mps_daemon_image_pull_secrets or "").split(",")
            if name.strip()
        ),
        "mps_exclusive_compute_mode": exclusive,
        "mps_daemon_check_interval_s": _check_interval(parser, args.mps_daemon_check_interval),
        "mps_share_daemon_warm": _warm_policy(parser, args.mps_share_daemon_warm),
    }


def _warm_policy(parser: argparse.ArgumentParser, text: str) -> WarmPolicy:
    try:
        return WarmPolicy.parse(text)
    except WarmPolicyError as error:
        parser.error(f"--mps-share-daemon-warm {error}")


def _check_interval(parser: argparse.ArgumentParser, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        parser.error(f"--mps-daemon-check-interval must be seconds >= 0 (0 = off), got {text!r}")
    return value
