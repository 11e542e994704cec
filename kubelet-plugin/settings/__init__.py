"""Settings of `gpu-dra-kubelet-plugin`: every flag has a `GPU_DRA_*` environment twin.

`KubeletPluginSettings.parse` builds the settings once in `__main__`: each flag group's module
adds its flags and reads them back into fields (usage errors exit with status 2): `core` (node,
driver root, directories, ports, programs), `shares` (MPS and capped shares, memory limits, the
memory watchdog), `mps_daemons`, `dynamic_mig`, `guard`, `health` and `utilization`; `values`
holds the syntaxes they share. The flags: docs/config.md#gpu-dra-kubelet-plugin.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gpu_dra.driver.health import DEFAULT_IGNORED_XIDS, HealthPolicy, TaintEffect
from gpu_dra.driver.mig_policy import DEFAULT as DEFAULT_MIG_POLICY
from gpu_dra.driver.mig_policy import MigPolicy
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.driver.shares import (
    DEFAULT_SHARE_REPLICAS,
    MigShareSelection,
    PartitionShareSelection,
    ShareSelection,
)
from gpu_dra.driver.slices import SliceLayout
from gpu_dra.kubelet_plugin.mps.warm_policy import DEFAULT as DEFAULT_WARM
from gpu_dra.kubelet_plugin.mps.warm_policy import WarmPolicy
from gpu_dra.kubelet_plugin.nvidia_userspace import DEFAULT_CDI_HOOK_PATH
from gpu_dra.kubelet_plugin.settings.core import (
    DEFAULT_MPS_CONTROL_BINARY,
    DEFAULT_NVIDIA_SMI,
    add_core_options,
    core_settings,
    parse_hook_names,
)
from gpu_dra.kubelet_plugin.settings.dynamic_mig import (
    add_dynamic_mig_options,
    dynamic_mig_settings,
)
from gpu_dra.kubelet_plugin.settings.guard import add_guard_options, guard_settings
from gpu_dra.kubelet_plugin.settings.health import add_health_options, health_settings
from gpu_dra.kubelet_plugin.settings.mps_daemons import (
    DEFAULT_MPS_DAEMON_NAMESPACE,
    DEFAULT_MPS_DAEMON_PRIORITY_CLASS,
    EXCLUSIVE_COMPUTE_MODES,
    MPS_DAEMON_RUNNERS,
    add_mps_daemon_options,
    mps_daemon_settings,
)
from gpu_dra.kubelet_plugin.settings.shares import (
    add_capped_share_options,
    add_mps_share_options,
    capped_share_settings,
    mps_share_settings,
)
from gpu_dra.kubelet_plugin.settings.utilization import (
    add_utilization_options,
    utilization_settings,
)
from gpu_dra.kubelet_plugin.settings.values import (
    GATE_DYNAMIC_MIG,
    GATE_HEALTH_CHECK,
    GATES_ALWAYS_ON,
    GATES_NOT_IMPLEMENTED,
    parse_bool,
    parse_feature_gates,
)

__all__ = [
    "DEFAULT_MPS_CONTROL_BINARY",
    "DEFAULT_MPS_DAEMON_NAMESPACE",
    "DEFAULT_MPS_DAEMON_PRIORITY_CLASS",
    "DEFAULT_NVIDIA_SMI",
    "EXCLUSIVE_COMPUTE_MODES",
    "GATES_ALWAYS_ON",
    "GATES_NOT_IMPLEMENTED",
    "GATE_DYNAMIC_MIG",
    "GATE_HEALTH_CHECK",
    "MPS_DAEMON_RUNNERS",
    "KubeletPluginSettings",
    "parse_bool",
    "parse_feature_gates",
    "parse_hook_names",
]


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
    guard_recheck_interval_s: float = 30.0
    """Seconds between the start-up guard's checks while something else serves the node."""
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
    claim_status: bool = True
    """Write prepared claims' ``status.devices`` (docs/architecture.md#claim-status)."""
    claim_status_min_interval_s: float = 30.0
    claim_status_idle_after_s: float = 300.0
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
    mps_share_replicas: int = DEFAULT_SHARE_REPLICAS
    """The equal parts of a device offered as shares (MPS or capped; the device plugin's
    ``replicas``): an amount a share does not name is 1/N of the device's memory or SMs, so
    a request naming none is 1/N of the device (`gpu_dra.driver.shares.default_share`)."""
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
    health_taint_effect_unmonitored: TaintEffect | None = None
    """Taint effect of the devices of a GPU NVML cannot watch; None: no taint."""

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
            unmonitored_effect=self.health_taint_effect_unmonitored,
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

        # One group after the other: the order of --help.
        add_core_options(option, environ)
        add_mps_share_options(option)
        add_mps_daemon_options(option, environ)
        add_dynamic_mig_options(option, environ)
        add_guard_options(option, environ)
        add_health_options(option, environ)
        add_utilization_options(option)
        add_capped_share_options(option)
        args = parser.parse_args(argv)
        # Read in this order: the first bad value is the usage error.
        return cls(
            **core_settings(parser, args),
            **capped_share_settings(parser, args),
            **mps_share_settings(parser, args),
            **mps_daemon_settings(parser, args),
            **dynamic_mig_settings(parser, args),
            **guard_settings(parser, args),
            **health_settings(parser, args),
            **utilization_settings(parser, args),
        )
