"""The plugin's core flags: node and driver name, simulation, the driver root and the CDI hooks,
the kubelet's and the plugin's directories, the instance id, the API client, call timeout, log
level, the metrics and health ports, and the MPS control and nvidia-smi programs (docs/config.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.kube.logs import LOG_LEVELS, parse_log_level
from gpu_dra.kubelet_plugin.nvidia_userspace import ALL_HOOKS, DEFAULT_CDI_HOOK_PATH, HOOK_NAMES
from gpu_dra.kubelet_plugin.plugin_instances import check_instance_id

DEFAULT_MPS_CONTROL_BINARY = "nvidia-cuda-mps-control"
DEFAULT_NVIDIA_SMI = "nvidia-smi"


def add_core_options(option: Callable[..., None], environ: Mapping[str, str]) -> None:
    """`--node-name`, `--driver-name`, `--simulate`, the driver root and CDI hook flags, the
    directories, `--instance-id`, `--kubeconfig`, `--call-timeout`, `--log-level`, the ports,
    `--mps-control-binary` and `--nvidia-smi`."""
    option("--node-name", "this node's name", environ.get("NODE_NAME"))
    option("--driver-name", "DRA driver name", DEFAULT_DRIVER_NAME)
    option(
        "--simulate",
        "simulated machine profile (e.g. hgx-h100, dgx-a100, l4x4, t4, mixed, or a file); "
        "unset means real GPUs through NVML",
        None,
    )
    option(
        "--driver-root",
        "NVIDIA driver root as this process sees it (NVML, nvidia-smi, libraries are read "
        "there); also read from CONTAINER_DRIVER_ROOT",
        environ.get("CONTAINER_DRIVER_ROOT") or "/",
    )
    option(
        "--nvidia-driver-root",
        "the same driver root as the host sees it (/ or /run/nvidia/driver): host paths in "
        "CDI specs; default: --driver-root; also read from NVIDIA_DRIVER_ROOT",
        environ.get("NVIDIA_DRIVER_ROOT"),
    )
    option(
        "--nvidia-cdi-hook-path",
        "host path of nvidia-cdi-hook, run by the container runtime for the CDI hooks; "
        "also read from NVIDIA_CDI_HOOK_PATH",
        environ.get("NVIDIA_CDI_HOOK_PATH") or DEFAULT_CDI_HOOK_PATH,
    )
    option(
        "--disable-cdi-hooks",
        f"nvidia-cdi-hook hooks to leave out of CDI specs, comma-separated: "
        f"{', '.join(HOOK_NAMES)} or {ALL_HOOKS}",
        None,
    )
    option("--kubelet-plugins-dir", "kubelet plugins directory", "/var/lib/kubelet/plugins")
    option(
        "--kubelet-registry-dir",
        "kubelet plugin registration directory",
        "/var/lib/kubelet/plugins_registry",
    )
    option("--cdi-root", "CDI spec directory", "/var/run/cdi")
    option("--data-dir", "checkpoint directory (default <plugins-dir>/<driver>)", None)
    option(
        "--instance-id",
        "this instance's id (the pod UID) for its own socket names dra-<id>.sock and "
        "<driver>-<id>-reg.sock, so that two instances can serve during a rolling update; "
        "empty: the fixed names; also read from POD_UID",
        environ.get("POD_UID"),
    )
    option("--kubeconfig", "kubeconfig file (default: in-cluster service account)", None)
    option("--call-timeout", "seconds per prepare/unprepare call (< 45)", "40")
    option("--log-level", f"log level: {', '.join(LOG_LEVELS)}", "INFO")
    option("--metrics-port", "port of the Prometheus /metrics endpoint (0 = off)", "8081")
    option(
        "--healthcheck-port",
        "TCP port of the gRPC health service (grpc.health.v1; services '', liveness, "
        "readiness): 0 any free port, negative off; also read from HEALTHCHECK_PORT",
        environ.get("HEALTHCHECK_PORT") or "-1",
    )
    option(
        "--mps-control-binary",
        "MPS control program: a path, or a name looked up on PATH, then under "
        "<driver-root>/usr/bin",
        DEFAULT_MPS_CONTROL_BINARY,
    )
    option(
        "--nvidia-smi",
        "nvidia-smi program that sets time-slice intervals (real GPUs): a path, or a name "
        "looked up on PATH, then under <driver-root>/usr/bin",
        DEFAULT_NVIDIA_SMI,
    )


def core_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The core fields of the settings from parsed `args`; usage errors exit."""
    if not args.node_name:
        parser.error("--node-name (or GPU_DRA_NODE_NAME / NODE_NAME) is required")
    metrics_port = _port(parser, "--metrics-port", args.metrics_port, minimum=0)
    # NVIDIA's convention: any negative port turns the health service off.
    healthcheck_port = _port(parser, "--healthcheck-port", args.healthcheck_port, minimum=None)
    return {
        "node_name": args.node_name,
        "driver_name": args.driver_name,
        "simulate": args.simulate or None,
        "driver_root": Path(args.driver_root),
        **_driver_root_settings(parser, args),
        "kubelet_plugins_dir": Path(args.kubelet_plugins_dir),
        "kubelet_registry_dir": Path(args.kubelet_registry_dir),
        "cdi_root": Path(args.cdi_root),
        "data_dir": Path(args.data_dir) if args.data_dir else None,
        "instance_id": _instance_id(parser, args.instance_id or ""),
        "kubeconfig": Path(args.kubeconfig) if args.kubeconfig else None,
        "call_timeout_s": _call_timeout(parser, args.call_timeout),
        "metrics_port": metrics_port,
        "healthcheck_port": max(healthcheck_port, -1),
        "log_level": _log_level(parser, args.log_level),
        "mps_control_binary": args.mps_control_binary or DEFAULT_MPS_CONTROL_BINARY,
        "nvidia_smi": args.nvidia_smi or DEFAULT_NVIDIA_SMI,
    }


def parse_hook_names(text: str) -> frozenset[str]:
    """``--disable-cdi-hooks``: comma-separated hook names of `HOOK_NAMES`, or ``all``."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - {*HOOK_NAMES, ALL_HOOKS})
    if unknown:
        raise ValueError(
            f"unknown CDI hook(s) {', '.join(unknown)}; known: {', '.join(HOOK_NAMES)}, {ALL_HOOKS}"
        )
    return names


def _port(parser: argparse.ArgumentParser, flag: str, text: str, *, minimum: int | None) -> int:
    """A port number of `flag` up to 65535 and from `minimum` (None: any); usage errors exit."""
    try:
        port = int(text)
    except ValueError:
        parser.error(f"{flag} must be a port number, got {text!r}")
    if port > 65535 or (minimum is not None and port < minimum):
        low = "any negative number (off)" if minimum is None else str(minimum)
        parser.error(f"{flag} must be between {low} and 65535, got {port}")
    return port


def _instance_id(parser: argparse.ArgumentParser, text: str) -> str:
    """`--instance-id`, empty or fit for file and socket names; a usage error exits."""
    if text:
        try:
            check_instance_id(text)
        except ValueError as error:
            parser.error(f"--instance-id: {error}")
    return text


def _call_timeout(parser: argparse.ArgumentParser, text: str) -> float:
    """`--call-timeout` in seconds, more than 0 and less than 45; a usage error exits."""
    try:
        timeout = float(text)
    except ValueError:
        parser.error(f"--call-timeout must be a number of seconds, got {text!r}")
    if not 0 < timeout < 45:
        parser.error(f"--call-timeout must be between 0 and 45 seconds, got {timeout}")
    return timeout


def _log_level(parser: argparse.ArgumentParser, text: str) -> str:
    """`--log-level` as a Python level name; a usage error exits."""
    try:
        return parse_log_level(text)
    except ValueError as error:
        parser.error(f"--log-level {error}")
        raise  # parser.error exits


def _driver_root_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> dict[str, Any]:
    """`--nvidia-driver-root`, `--nvidia-cdi-hook-path`, `--disable-cdi-hooks`; usage errors
    exit."""
    host_root = None
    if args.nvidia_driver_root:
        host_root = PurePosixPath(args.nvidia_driver_root)
        if not host_root.is_absolute():
            parser.error(f"--nvidia-driver-root must be an absolute path, got {host_root}")
    hook_path = args.nvidia_cdi_hook_path or DEFAULT_CDI_HOOK_PATH
    if not PurePosixPath(hook_path).is_absolute():
        parser.error(f"--nvidia-cdi-hook-path must be an absolute path, got {hook_path!r}")
    try:
        disabled = parse_hook_names(args.disable_cdi_hooks or "")
    except ValueError as error:
        parser.error(f"--disable-cdi-hooks: {error}")
    return {
        "nvidia_driver_root": host_root,
        "nvidia_cdi_hook_path": hook_path,
        "disable_cdi_hooks": disabled,
    }
