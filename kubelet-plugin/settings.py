"""Settings of `gpu-dra-kubelet-plugin`: every flag has a `GPU_DRA_*` environment twin."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gpu_dra.driver.health import (
    DEFAULT_IGNORED_XIDS,
    HealthPolicy,
    TaintEffect,
    parse_taint_effect,
    parse_xids,
)
from gpu_dra.driver.mig_policy import DEFAULT as DEFAULT_MIG_POLICY
from gpu_dra.driver.mig_policy import (
    DEFAULT_POLICY_TEXT,
    MigPolicy,
    MigPolicyError,
    parse_policy,
)
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.driver.shares import (
    MigShareSelection,
    PartitionShareSelection,
    ShareSelection,
    ShareSelectionError,
)
from gpu_dra.driver.slices import SliceLayout
from gpu_dra.kube.logs import LOG_LEVELS, parse_log_level
from gpu_dra.kubelet_plugin.mps.warm_policy import DEFAULT as DEFAULT_WARM
from gpu_dra.kubelet_plugin.mps.warm_policy import WarmPolicy, WarmPolicyError
from gpu_dra.kubelet_plugin.nvidia_userspace import ALL_HOOKS, DEFAULT_CDI_HOOK_PATH, HOOK_NAMES
from gpu_dra.kubelet_plugin.plugin_instances import check_instance_id

DEFAULT_MPS_CONTROL_BINARY = "nvidia-cuda-mps-control"
DEFAULT_NVIDIA_SMI = "nvidia-smi"
MPS_DAEMON_RUNNERS = ("process", "pod")
EXCLUSIVE_COMPUTE_MODES = ("shares", "all", "none")
"""`--mps-exclusive-compute-mode`: the GPUs of shared daemons (MPS shares), of every daemon, or
none; `true`/`false` (and yes/no, 1/0) are read as `all`/`none`."""
DEFAULT_MPS_DAEMON_NAMESPACE = "gpu-dra"
DEFAULT_MPS_DAEMON_PRIORITY_CLASS = "system-node-critical"
"""When an MPS daemon goes, every workload using it loses MPS: under node pressure its pod must
be the last the kubelet evicts (a built-in class the apiserver creates)."""

# NVIDIA's driver feature gates (nvidia-compat.md §10) and what gpu-dra does with them.
GATE_DYNAMIC_MIG = "DynamicMIG"
GATE_HEALTH_CHECK = "NVMLDeviceHealthCheck"
GATES_ALWAYS_ON = frozenset({"TimeSlicingSettings", "MPSSupport"})
"""Behaviour gpu-dra always has: accepted either way, no effect."""
GATES_NOT_IMPLEMENTED = frozenset(
    {
        "IMEXDaemonsWithDNSNames",
        "PassthroughSupport",
        "ComputeDomainCliques",
        "CrashOnNVLinkFabricErrors",
        "DeviceMetadata",
        "DRAListTypeAttributes",
        "FabricManagerPartitioning",
        "HostManagedIMEXDaemon",
        "ConsumableShares",
    }
)
"""Accepted when false; true is an error, as gpu-dra does not implement them."""

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off", ""})


def parse_bool(text: str, what: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off, any case); ValueError names `what`."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{what} must be true or false, got {text!r}")


def parse_feature_gates(text: str) -> tuple[str, ...]:
    """NVIDIA's ``--feature-gates`` / ``FEATURE_GATES`` (``K1=v1,K2=v2,``): the gates turned on.

    ``DynamicMIG`` turns on dynamic MIG, ``NVMLDeviceHealthCheck`` the health monitor;
    ``TimeSlicingSettings`` and ``MPSSupport`` are always on in gpu-dra; NVIDIA's other gates may
    only be false. Unknown names are an error.
    """
    enabled = []
    for item in text.split(","):
        if not item.strip():
            continue
        name, separator, raw = item.partition("=")
        name = name.strip()
        if not separator:
            raise ValueError(f"feature gate {item.strip()!r} must be written Name=true|false")
        value = parse_bool(raw, f"feature gate {name}")
        if name in (GATE_DYNAMIC_MIG, GATE_HEALTH_CHECK) or name in GATES_ALWAYS_ON:
            pass
        elif name in GATES_NOT_IMPLEMENTED:
            if value:
                raise ValueError(f"feature gate {name} is not implemented by gpu-dra")
        else:
            known = sorted(
                {GATE_DYNAMIC_MIG, GATE_HEALTH_CHECK, *GATES_ALWAYS_ON, *GATES_NOT_IMPLEMENTED}
            )
            raise ValueError(f"unknown feature gate {name!r}; known: {', '.join(known)}")
        if value:
            enabled.append(name)
    return tuple(dict.fromkeys(enabled))


@dataclass(frozen=True)
class KubeletPluginSettings:
    """Everything the plugin process needs, built once in `__main__`."""

    node_name: str
    """Name of this node: the pool name and `spec.nodeName` of its ResourceSlices."""
    driver_name: str = DEFAULT_DRIVER_NAME
    """DRA driver name; `gpu.nvidia.com` keeps NVIDIA-driver manifests working."""
    simulate: str | None = None
    """Simulated machine profile (name like `hgx-h100` or a profile file); None = real NVML."""
    driver_root: Path = Path("/")
    """Root of the NVIDIA driver installation as this process sees it: where NVML, `nvidia-smi`,
    the driver's libraries and procfs are read (a mount such as `/driver-root`, or the host
    path itself when mounted at the same path)."""
    nvidia_driver_root: PurePosixPath | None = None
    """The same root as the host sees it (`/` for a host-installed driver, `/run/nvidia/driver`
    with the GPU Operator): the prefix of host paths in CDI specs and of the MPS daemon pods'
    mount. None = `driver_root` (mounted at the same path)."""
    nvidia_cdi_hook_path: str = DEFAULT_CDI_HOOK_PATH
    """Host path of NVIDIA's `nvidia-cdi-hook`, which the runtime runs for the specs' hooks."""
    disable_cdi_hooks: frozenset[str] = frozenset()
    """`nvidia-cdi-hook` hooks left out of the specs (names, or `all`)."""
    kubelet_plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    """Where the DRA socket lives: `<dir>/<driver>/dra.sock`."""
    kubelet_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    """Where the kubelet watches for registration sockets."""
    cdi_root: Path = Path("/var/run/cdi")
    """Directory for per-claim CDI spec files (the runtime must list it in its CDI spec dirs)."""
    data_dir: Path | None = None
    """Checkpoint and per-claim files; default `<kubelet_plugins_dir>/<driver>`."""
    instance_id: str = ""
    """This instance's own socket names (the pod UID), so that a new instance serves beside the
    old one during a rolling update; empty: the fixed names `dra.sock`, `<driver>-reg.sock`."""
    kubelet_device_plugins_dir: Path | None = None
    """The kubelet's device-plugins directory, where NVIDIA's device plugin has its socket;
    default `<kubelet_plugins_dir>/../device-plugins`."""
    allow_nvidia_device_plugin: bool = False
    """Start although NVIDIA's device plugin serves this node's GPUs (logged as a warning)."""
    event_namespace: str = "default"
    """Namespace of the Events recorded about this node (start-up refusals)."""
    kubeconfig: Path | None = None
    """Kubeconfig for the API server; None = the pod's service account."""
    call_timeout_s: float = 40.0
    """Deadline of one prepare/unprepare call, below the kubelet's 45 s."""
    metrics_port: int = 8081
    """Port of the Prometheus `/metrics` endpoint; 0 turns it off."""
    utilization_interval_s: float = 10.0
    """Seconds between utilization samples of the claims' devices (docs/metrics.md); 0 off."""
    utilization_idle_threshold: float = 5.0
    """GPU utilization below which a claim's device counts as idle in a sample."""
    healthcheck_port: int = -1
    """TCP port of the gRPC health service (`grpc.health.v1`): 0 any free port, negative off
    (NVIDIA's `--healthcheck-port`)."""
    log_level: str = "INFO"
    """Python log level of the plugin's own logs (`gpu_dra.kube.logs.LOG_LEVELS`)."""
    mps_control_binary: str = DEFAULT_MPS_CONTROL_BINARY
    """The MPS control program: a path, or a name looked up on `PATH`, then under
    `<driver_root>/usr/bin` (`resolved_mps_control_binary`)."""
    nvidia_smi: str = DEFAULT_NVIDIA_SMI
    """`nvidia-smi`, which sets time-slice intervals on real GPUs: a path, or a name looked up
    on `PATH`, then under `<driver_root>/usr/bin` (`resolved_nvidia_smi`)."""
    mps_shares: ShareSelection = field(default_factory=ShareSelection)
    """GPUs offered as MPS shares through consumable capacity (`all`, `none`, or indexes /
    UUIDs); none by default, so that default publishing is NVIDIA's."""
    capped_shares: ShareSelection = field(
        default_factory=lambda: ShareSelection(flag="--capped-shares")
    )
    """GPUs offered as capped time-sliced shares (`all`, `none`, or indexes / UUIDs): the same
    consumable capacities, memory capped per container by the driver, no MPS; only those where
    the driver's cap was found to work at start are published (docs/shares.md)."""
    mps_shares_on_mig: MigShareSelection = field(default_factory=MigShareSelection)
    """Static MIG devices offered as MPS shares (`all`, `none`, or MIG profiles / MIG UUIDs):
    one shared daemon per MIG device, caps within the slice; none by default."""
    mps_shares_on_dynamic_mig: PartitionShareSelection = field(
        default_factory=PartitionShareSelection
    )
    """Dynamic MIG partitions offered as MPS shares (`all`, `none`, or MIG profiles): the first
    share makes the MIG device, the last one's unprepare destroys it; needs ``--dynamic-mig``."""
    mps_share_max_percent: int = 100
    """The largest MPS share, in percent of a GPU's SMs and memory: the shared daemon's default
    caps, which bind a client that drops its `CUDA_MPS_*` environment; larger shares are
    refused at prepare."""
    mps_share_memory_limits: str = "auto"
    """`auto`: MPS shares on GPUs whose driver can limit a cgroup's GPU memory (checked at start)
    get `NVIDIA_GPU_MEMORY_LIMIT`/`_REQUEST` and the `apply-cuda-memory-limits` hook; `off`:
    none do."""
    mps_memory_watchdog: str = "kill"
    """What the MPS memory watchdog does when a share's processes together use more than its
    memory, on shares the driver does not cap (`mps.memory_watchdog`): `report`, `kill` (the
    newest process), `evict` (the pods) or `off`. Shares the driver caps are never watched."""
    mps_memory_watchdog_interval_s: float = 1.0
    """Seconds between the watchdog's checks."""
    mps_daemon_runner: str = "process"
    """How MPS control daemons run: `process` (a host process started by the plugin; local and
    dev setups) or `pod` (a pod bound to this node; the DaemonSet's setting)."""
    mps_daemon_image: str = ""
    """Image of the daemon pods (runner `pod`): runs `nvidia-cuda-mps-control -f`."""
    mps_daemon_namespace: str = DEFAULT_MPS_DAEMON_NAMESPACE
    """Namespace of the daemon pods (runner `pod`); default `$POD_NAMESPACE`, else `gpu-dra`."""
    mps_daemon_priority_class: str = DEFAULT_MPS_DAEMON_PRIORITY_CLASS
    """Priority class of the daemon pods (runner `pod`); empty = none."""
    mps_daemon_image_pull_secrets: tuple[str, ...] = ()
    """Names of the Secrets in the daemon pods' `imagePullSecrets` (runner `pod`)."""
    mps_exclusive_compute_mode: str = "shares"
    """Which MPS daemons' full GPUs get the compute mode EXCLUSIVE_PROCESS while they run
    (DEFAULT again when they stop), as NVIDIA's driver does: `shares` (the GPUs offered as MPS
    shares), `all` (per-claim daemons too) or `none`; never MIG devices."""
    mps_daemon_check_interval_s: float = 10.0
    """Seconds between checks of the MPS daemons of prepared claims (a dead one is restarted in
    place, changed settings are set back); 0 turns the checks off."""
    mps_share_daemon_warm: WarmPolicy = DEFAULT_WARM
    """Whether the shared MPS daemon of a GPU offered as shares runs before its first share:
    `always` (started at plugin start and again after the last share left), `idle:<duration>`
    (the same, stopped after that long without a share) or `off` (started by the first share,
    stopped with the last)."""
    dynamic_mig: bool = False
    """Publish MIG-capable GPUs as partitionable devices (MIG slices made on demand)."""
    dynamic_mig_profiles: MigPolicy = DEFAULT_MIG_POLICY
    """Which MIG profiles dynamic MIG publishes (`gpu_dra.driver.mig_policy`)."""
    feature_gates: tuple[str, ...] = ()
    """NVIDIA feature gates turned on (``DynamicMIG`` implies `dynamic_mig`)."""
    slice_layout: SliceLayout | None = None
    """Where shared counters go; None = from the apiserver's version (1.34 combined, else
    split)."""
    health_monitor: bool | None = None
    """Watch the GPUs (NVML events, the daemons of MPS shares), taint unhealthy devices and
    report their health to the kubelet; None = on with real NVML, off with `simulate`."""
    health_ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    """XIDs taken as application errors, not device faults: ignored."""
    additional_xids_to_ignore: frozenset[int] = frozenset()
    """Further ignored XIDs (NVIDIA's ``ADDITIONAL_XIDS_TO_IGNORE``)."""
    health_taint_effect_degraded: TaintEffect = TaintEffect.NO_SCHEDULE
    """Taint effect of a degraded device (a critical XID, a double-bit ECC error, a dead MPS
    share daemon)."""
    health_taint_effect_lost: TaintEffect = TaintEffect.NO_EXECUTE
    """Taint effect of a lost GPU's devices (XID 79, NVML answering GPU_IS_LOST)."""

    @property
    def health_monitor_enabled(self) -> bool:
        """`health_monitor` (None: whether NVML is real), or NVIDIA's spelling
        ``--feature-gates NVMLDeviceHealthCheck=true``."""
        if GATE_HEALTH_CHECK in self.feature_gates:
            return True
        return self.simulate is None if self.health_monitor is None else self.health_monitor

    @property
    def health_policy(self) -> HealthPolicy:
        return HealthPolicy(
            ignored_xids=self.health_ignored_xids | self.additional_xids_to_ignore,
            degraded_effect=self.health_taint_effect_degraded,
            lost_effect=self.health_taint_effect_lost,
        )

    @property
    def dynamic_mig_enabled(self) -> bool:
        """`dynamic_mig`, or NVIDIA's spelling ``--feature-gates DynamicMIG=true``."""
        return self.dynamic_mig or GATE_DYNAMIC_MIG in self.feature_gates

    @property
    def host_driver_root(self) -> PurePosixPath:
        """`nvidia_driver_root`, else `driver_root`: the driver root's host path."""
        if self.nvidia_driver_root is not None:
            return self.nvidia_driver_root
        return PurePosixPath(self.driver_root)

    @property
    def device_plugins_dir(self) -> Path:
        """`kubelet_device_plugins_dir`, else `device-plugins` beside the plugins directory."""
        return self.kubelet_device_plugins_dir or self.kubelet_plugins_dir.parent / "device-plugins"

    @property
    def state_dir(self) -> Path:
        return self.data_dir or self.kubelet_plugins_dir / self.driver_name

    def resolved_mps_control_binary(self, path: str | None = None) -> Path | None:
        """The MPS control program to run, or None when it is not found.

        A value with a ``/`` is taken as it is (if it is an executable file; made absolute, as
        the daemon outlives the working directory's meaning); a bare name is
        looked up on ``path`` (default: this process's ``PATH``), then in
        ``<driver_root>/usr/bin``.
        """
        return self._resolve_program(self.mps_control_binary, path)

    def resolved_nvidia_smi(self, path: str | None = None) -> Path | None:
        """The ``nvidia-smi`` program to run, or None when it is not found; looked up as
        `resolved_mps_control_binary` does."""
        return self._resolve_program(self.nvidia_smi, path)

    def _resolve_program(self, name: str, path: str | None) -> Path | None:
        if "/" in name:
            candidate = Path(name).absolute()
            return candidate if os.access(candidate, os.X_OK) and candidate.is_file() else None
        found = shutil.which(name, path=os.environ.get("PATH", "") if path is None else path)
        if found:
            return Path(found)
        under_root = self.driver_root / "usr" / "bin" / name
        if under_root.is_file() and os.access(under_root, os.X_OK):
            return under_root
        return None

    @classmethod
    def parse(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> KubeletPluginSettings:
        environ = os.environ if env is None else env
        parser = argparse.ArgumentParser(
            prog="gpu-dra-kubelet-plugin",
            description="gpu-dra kubelet plugin: publishes this node's GPUs and prepares claims.",
        )

        def option(flag: str, help_text: str, default: str | None, **kwargs: object) -> None:
            var = "GPU_DRA_" + flag.lstrip("-").upper().replace("-", "_")
            parser.add_argument(
                flag,
                default=environ.get(var, default),
                help=f"{help_text} [env {var}; default: {default if default else 'none'}]",
                **kwargs,  # type: ignore[arg-type]
            )

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
        _add_share_memory_options(option)
        _add_mps_daemon_options(option, environ)
        _add_dynamic_mig_options(option, environ)
        _add_guard_options(option, environ)
        _add_health_options(option, environ)
        _add_utilization_options(option)
        _add_capped_share_options(option)
        args = parser.parse_args(argv)
        if not args.node_name:
            parser.error("--node-name (or GPU_DRA_NODE_NAME / NODE_NAME) is required")
        metrics_port = _port(parser, "--metrics-port", args.metrics_port, minimum=0)
        # NVIDIA's convention: any negative port turns the health service off.
        healthcheck_port = _port(parser, "--healthcheck-port", args.healthcheck_port, minimum=None)
        return cls(
            node_name=args.node_name,
            driver_name=args.driver_name,
            simulate=args.simulate or None,
            driver_root=Path(args.driver_root),
            **_driver_root_settings(parser, args),
            kubelet_plugins_dir=Path(args.kubelet_plugins_dir),
            kubelet_registry_dir=Path(args.kubelet_registry_dir),
            cdi_root=Path(args.cdi_root),
            data_dir=Path(args.data_dir) if args.data_dir else None,
            instance_id=_instance_id(parser, args.instance_id or ""),
            kubeconfig=Path(args.kubeconfig) if args.kubeconfig else None,
            call_timeout_s=_call_timeout(parser, args.call_timeout),
            metrics_port=metrics_port,
            healthcheck_port=max(healthcheck_port, -1),
            log_level=_log_level(parser, args.log_level),
            mps_control_binary=args.mps_control_binary or DEFAULT_MPS_CONTROL_BINARY,
            nvidia_smi=args.nvidia_smi or DEFAULT_NVIDIA_SMI,
            capped_shares=_capped_shares(parser, args),
            **_mps_share_settings(parser, args),
            **_watchdog_settings(parser, args),
            **_mps_daemon_settings(parser, args),
            **_dynamic_mig_settings(parser, args),
            **_guard_settings(parser, args),
            **_health_settings(parser, args),
            **_utilization_settings(parser, args),
        )


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


def _mps_share_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> dict[str, Any]:
    """The MPS share fields of the settings from parsed ``args``; usage errors exit."""
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
    return {
        "mps_shares": mps_shares,
        "mps_shares_on_mig": mps_shares_on_mig,
        "mps_shares_on_dynamic_mig": on_dynamic_mig,
        "mps_share_max_percent": max_share,
        "mps_share_memory_limits": _memory_limits_mode(parser, args),
    }


def _mps_daemon_settings(
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


def _add_mps_daemon_options(option: Callable[..., None], environ: Mapping[str, str]) -> None:
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


def _add_dynamic_mig_options(option: Callable[..., None], environ: Mapping[str, str]) -> None:
    """`--dynamic-mig`, `--dynamic-mig-profiles`, `--feature-gates` and `--slice-layout`."""
    option(
        "--dynamic-mig",
        "publish MIG-capable GPUs as partitionable devices: every placement of every MIG "
        "profile --dynamic-mig-profiles offers, MIG slices made on demand (true/false; a bare "
        "flag means true)",
        "false",
        nargs="?",
        const="true",
    )
    option(
        "--dynamic-mig-profiles",
        "MIG profiles dynamic MIG publishes: [<model>=]<profile>,... entries separated by ';'; "
        "a profile is a name (1g.10gb, 1g.10gb+me), a shape (1g, 3g, 1g+me: the shape's "
        "smallest profile) or all",
        DEFAULT_POLICY_TEXT,
    )
    option(
        "--feature-gates",
        "NVIDIA's feature gates, Name=true|false,...: DynamicMIG=true is --dynamic-mig; "
        "also read from FEATURE_GATES",
        environ.get("FEATURE_GATES"),
    )
    option(
        "--slice-layout",
        "where shared counters go: auto (from the apiserver version), split (Kubernetes "
        "1.35+: own slices) or combined (1.34: with their devices)",
        "auto",
    )


def _dynamic_mig_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> dict[str, Any]:
    """`--dynamic-mig`, `--dynamic-mig-profiles`, `--feature-gates` and `--slice-layout` (None =
    auto), or a usage error."""
    try:
        dynamic_mig = parse_bool(args.dynamic_mig or "", "--dynamic-mig")
        feature_gates = parse_feature_gates(args.feature_gates or "")
    except ValueError as error:
        parser.error(str(error))
    try:
        mig_policy = parse_policy(args.dynamic_mig_profiles or DEFAULT_POLICY_TEXT)
    except MigPolicyError as error:
        parser.error(f"--dynamic-mig-profiles: {error}")
    layout_name = (args.slice_layout or "auto").strip().lower()
    layouts = {layout.value: layout for layout in SliceLayout}
    if layout_name != "auto" and layout_name not in layouts:
        parser.error(f"--slice-layout must be auto, split or combined, got {args.slice_layout!r}")
    return {
        "dynamic_mig": dynamic_mig,
        "dynamic_mig_profiles": mig_policy,
        "feature_gates": feature_gates,
        "slice_layout": layouts.get(layout_name),
    }


def _add_guard_options(option: Callable[..., None], environ: Mapping[str, str]) -> None:
    """The start-up guard's `--kubelet-device-plugins-dir`, `--allow-nvidia-device-plugin` and
    `--event-namespace`."""
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
        "--event-namespace",
        "namespace of the Events recorded about this node: the apiserver takes Events about a "
        "Node only in default or kube-system",
        "default",
    )


def _guard_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The start-up guard's settings from parsed `args`; usage errors exit."""
    try:
        allow = parse_bool(args.allow_nvidia_device_plugin or "", "--allow-nvidia-device-plugin")
    except ValueError as error:
        parser.error(str(error))
    directory = args.kubelet_device_plugins_dir
    return {
        "kubelet_device_plugins_dir": Path(directory) if directory else None,
        "allow_nvidia_device_plugin": allow,
        "event_namespace": args.event_namespace or "default",
    }


def _add_health_options(option: Callable[..., None], environ: Mapping[str, str]) -> None:
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


def _health_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
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
    except ValueError as error:
        parser.error(str(error))
    return {
        "health_monitor": monitor,
        "health_ignored_xids": ignored,
        "additional_xids_to_ignore": additional,
        "health_taint_effect_degraded": degraded,
        "health_taint_effect_lost": lost,
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


def _add_capped_share_options(option: Callable[..., None]) -> None:
    """`--capped-shares` (docs/shares.md, "Capped shares")."""
    option(
        "--capped-shares",
        "GPUs offered as capped time-sliced shares (memory capped per container by the "
        "driver, no MPS) through consumable capacity: all, none, or comma-separated GPU "
        "indexes or UUIDs; published only where the driver's cap works",
        "none",
    )


def _capped_shares(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ShareSelection:
    try:
        return ShareSelection.parse(args.capped_shares or "none", "--capped-shares")
    except ShareSelectionError as error:
        parser.error(str(error))


def _add_utilization_options(option: Callable[..., None]) -> None:
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


def _utilization_settings(
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
