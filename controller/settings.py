"""Settings of `gpu-dra-controller`, read once from flags and `GPU_DRA_*` environment variables.

Every setting is one field of `ControllerSettings` and has a flag and an environment twin; the flag
wins over the environment, the environment over the default. `--help` lists them with defaults.
"""

from __future__ import annotations

import argparse
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gpu_dra.kube.logs import LOG_LEVELS, parse_log_level

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True)
class Option:
    """How one settings field is spelled on the command line and in the environment."""

    flag: str
    env: str
    help: str
    parse: Callable[[str], Any]
    show_default: str | None = None


def option(
    flag: str,
    env: str,
    help: str,
    parse: Callable[[str], Any],
    *,
    show_default: str | None = None,
) -> dict[str, Option]:
    """Field metadata: the flag and environment spelling of a settings field."""
    return {"option": Option(flag=flag, env=env, help=help, parse=parse, show_default=show_default)}


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def parse_object_ref(text: str) -> str:
    """``namespace/name`` of a namespaced object, or empty."""
    name = r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?"
    if text and not re.fullmatch(f"{name}/{name}", text):
        raise ValueError(f"expected namespace/name, got {text!r}")
    return text


def parse_port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0-65535, got {port}")
    return port


def parse_seconds(text: str) -> float:
    seconds = float(text)
    if seconds <= 0:
        raise ValueError(f"must be more than 0 seconds, got {text}")
    return seconds


def parse_interval_or_off(text: str) -> float:
    seconds = float(text)
    if seconds < 0:
        raise ValueError(f"must be 0 (off) or more seconds, got {text}")
    return seconds


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds from a number of seconds (``15``) or a Go duration (``15s``, ``1m30s``,
    ``500ms``), as NVIDIA's chart writes its leader election values; more than 0."""
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        parts = list(_DURATION_PART.finditer(value))
        if not value or "".join(m.group(0) for m in parts) != value:
            raise ValueError(
                f"expected seconds or a duration such as 15s, 1m30s, 500ms; got {text!r}"
            ) from None
        seconds = sum(float(m.group(1)) * _UNIT_SECONDS[m.group(2)] for m in parts)
    if seconds <= 0:
        raise ValueError(f"must be more than 0 seconds, got {text!r}")
    return seconds


@dataclass(frozen=True)
class ControllerSettings:
    """Everything `gpu-dra-controller` is configured with."""

    kubeconfig: Path | None = field(
        default=None,
        metadata=option(
            "--kubeconfig",
            "GPU_DRA_KUBECONFIG",
            "kubeconfig file to reach the apiserver; empty: the pod's service account (in-cluster)",
            parse_optional_path,
            show_default="in-cluster",
        ),
    )
    deviceclasses_dir: Path = field(
        default=Path("/etc/gpu-dra/deviceclasses"),
        metadata=option(
            "--deviceclasses-dir",
            "GPU_DRA_DEVICECLASSES_DIR",
            "directory of DeviceClass YAML files to apply",
            Path,
        ),
    )
    field_manager: str = field(
        default="gpu-dra-controller",
        metadata=option(
            "--field-manager",
            "GPU_DRA_FIELD_MANAGER",
            "field manager name of the controller's server-side applies",
            str,
        ),
    )
    resync_interval_s: float = field(
        default=600.0,
        metadata=option(
            "--resync-interval",
            "GPU_DRA_RESYNC_INTERVAL",
            "seconds between re-applies of the catalog (which also reloads the directory)",
            parse_seconds,
        ),
    )
    retry_interval_s: float = field(
        default=10.0,
        metadata=option(
            "--retry-interval",
            "GPU_DRA_RETRY_INTERVAL",
            "seconds before retrying when some DeviceClasses could not be applied",
            parse_seconds,
        ),
    )
    once: bool = field(
        default=False,
        metadata=option(
            "--once",
            "GPU_DRA_ONCE",
            "apply the catalog once and exit (status 1 if a class failed) instead of running",
            parse_bool,
        ),
    )
    metrics_port: int = field(
        default=8080,
        metadata=option(
            "--metrics-port",
            "GPU_DRA_METRICS_PORT",
            "port of the Prometheus /metrics endpoint; 0: no endpoint",
            parse_port,
        ),
    )
    inventory_interval_s: float = field(
        default=30.0,
        metadata=option(
            "--inventory-interval",
            "GPU_DRA_INVENTORY_INTERVAL",
            "seconds between inventory reads exported as gpu_dra_devices and "
            "gpu_dra_deviceclass_devices gauges; 0: off",
            parse_interval_or_off,
        ),
    )
    webhook_port: int = field(
        default=0,
        metadata=option(
            "--webhook-port",
            "GPU_DRA_WEBHOOK_PORT",
            "HTTPS port of the validating admission webhook for the driver's opaque configs; "
            "0: no webhook",
            parse_port,
        ),
    )
    webhook_tls_cert_file: Path = field(
        default=Path("/etc/gpu-dra/webhook-tls/tls.crt"),
        metadata=option(
            "--webhook-tls-cert-file",
            "GPU_DRA_WEBHOOK_TLS_CERT_FILE",
            "PEM certificate (chain) the webhook serves; re-read when it changes",
            Path,
        ),
    )
    webhook_tls_private_key_file: Path = field(
        default=Path("/etc/gpu-dra/webhook-tls/tls.key"),
        metadata=option(
            "--webhook-tls-private-key-file",
            "GPU_DRA_WEBHOOK_TLS_PRIVATE_KEY_FILE",
            "PEM private key of --webhook-tls-cert-file; re-read when it changes",
            Path,
        ),
    )
    webhook_tls_secret: str = field(
        default="",
        metadata=option(
            "--webhook-tls-secret",
            "GPU_DRA_WEBHOOK_TLS_SECRET",
            "namespace/name of a kubernetes.io/tls Secret in which the controller keeps a "
            "self-signed CA and the webhook's certificate: made when missing or unusable, else "
            "reused, and written to the certificate and key files; empty: the files come from "
            "elsewhere",
            parse_object_ref,
        ),
    )
    webhook_service: str = field(
        default="",
        metadata=option(
            "--webhook-service",
            "GPU_DRA_WEBHOOK_SERVICE",
            "namespace/name of the webhook's Service: the DNS names of the certificate "
            "--webhook-tls-secret keeps",
            parse_object_ref,
        ),
    )
    webhook_configuration: str = field(
        default="",
        metadata=option(
            "--webhook-configuration",
            "GPU_DRA_WEBHOOK_CONFIGURATION",
            "ValidatingWebhookConfiguration whose caBundle the controller keeps at the CA of "
            "--webhook-tls-secret",
            str,
        ),
    )
    share_memory_quota: bool = field(
        default=False,
        metadata=option(
            "--share-memory-quota",
            "GPU_DRA_SHARE_MEMORY_QUOTA",
            "serve /validate-share-memory on the webhook port: refuse a ResourceClaim whose "
            "share memory would bring its namespace over gpu.nvidia.com/share-memory of its "
            "ResourceQuota labelled gpu.nvidia.com/tier-quota (docs/shares.md#share-memory-quota)",
            parse_bool,
        ),
    )
    share_memory_ledger_namespace: str = field(
        default="gpu-dra",
        metadata=option(
            "--share-memory-ledger-namespace",
            "GPU_DRA_SHARE_MEMORY_LEDGER_NAMESPACE",
            "namespace of the share-memory ledgers (ConfigMaps gpu-dra-share-memory.<namespace>; "
            "the chart: the release namespace, which tenants cannot write)",
            str,
        ),
    )
    idle_reclaim: bool = field(
        default=False,
        metadata=option(
            "--idle-reclaim",
            "GPU_DRA_IDLE_RECLAIM",
            "act on idle GPU pods of namespaces labelled gpu.nvidia.com/idle-reclaim (enabled "
            "or dry-run): warn, then evict through the Eviction API (leader only; "
            "docs/idle-reclaim.md)",
            parse_bool,
        ),
    )
    idle_reclaim_interval_s: float = field(
        default=30.0,
        metadata=option(
            "--idle-reclaim-interval",
            "GPU_DRA_IDLE_RECLAIM_INTERVAL",
            "seconds between passes of the idle policy",
            parse_seconds,
        ),
    )
    idle_reclaim_default_window_s: float = field(
        default=7200.0,
        metadata=option(
            "--idle-reclaim-default-window",
            "GPU_DRA_IDLE_RECLAIM_DEFAULT_WINDOW",
            "how long a pod's GPUs must be idle before it is warned, where its namespace has no "
            "gpu.nvidia.com/idle-window annotation (seconds or a duration: 2h)",
            parse_duration,
        ),
    )
    idle_reclaim_default_grace_s: float = field(
        default=1800.0,
        metadata=option(
            "--idle-reclaim-default-grace",
            "GPU_DRA_IDLE_RECLAIM_DEFAULT_GRACE",
            "how long after the warning an idle pod is evicted, where its namespace has no "
            "gpu.nvidia.com/idle-grace annotation (seconds or a duration: 30m)",
            parse_duration,
        ),
    )
    idle_reclaim_plugin_selector: str = field(
        default="",
        metadata=option(
            "--idle-reclaim-plugin-selector",
            "GPU_DRA_IDLE_RECLAIM_PLUGIN_SELECTOR",
            "label selector of the kubelet plugin pods (all namespaces): an idle pod is evicted "
            "only while the plugin pod of its claims' node is Ready (the chart sets it); "
            "empty: no such check",
            str,
        ),
    )
    idle_reclaim_max_sample_age_s: float = field(
        default=126.0,
        metadata=option(
            "--idle-reclaim-max-sample-age",
            "GPU_DRA_IDLE_RECLAIM_MAX_SAMPLE_AGE",
            "how old the utilization sample behind a claim's Active condition (status.devices "
            "data.sampledAt) may be before the idle policy stops acting on the claim's pods "
            "(seconds or a duration: 2m; the chart sets 3 x (the plugins' "
            "--claim-status-min-interval + --utilization-interval + 2 s))",
            parse_duration,
        ),
    )
    log_level: str = field(
        default="INFO",
        metadata=option(
            "--log-level",
            "GPU_DRA_LOG_LEVEL",
            f"log level: {', '.join(LOG_LEVELS)}",
            parse_log_level,
        ),
    )

    leader_election_enabled: bool = field(
        default=False,
        metadata=option(
            "--leader-election-enabled",
            "GPU_DRA_LEADER_ELECTION_ENABLED",
            "elect a leader through a coordination.k8s.io Lease: only the leader applies the "
            "catalog; every replica serves health and metrics (NVIDIA's flag)",
            parse_bool,
        ),
    )
    leader_election_lease_lock_name: str = field(
        default="gpu-dra-controller",
        metadata=option(
            "--leader-election-lease-lock-name",
            "GPU_DRA_LEADER_ELECTION_LEASE_LOCK_NAME",
            "name of the Lease",
            str,
        ),
    )
    leader_election_lease_lock_namespace: str = field(
        default="gpu-dra",
        metadata=option(
            "--leader-election-lease-lock-namespace",
            "GPU_DRA_LEADER_ELECTION_LEASE_LOCK_NAMESPACE",
            "namespace of the Lease (the chart: the release namespace)",
            str,
        ),
    )
    leader_election_identity: str = field(
        default="",
        metadata=option(
            "--leader-election-identity",
            "GPU_DRA_LEADER_ELECTION_IDENTITY",
            "this candidate's holderIdentity in the Lease (the chart: the pod name); empty: the "
            "host name, which is the pod name in a pod",
            str,
            show_default="the host name",
        ),
    )
    leader_election_lease_duration_s: float = field(
        default=15.0,
        metadata=option(
            "--leader-election-lease-duration",
            "GPU_DRA_LEADER_ELECTION_LEASE_DURATION",
            "how long candidates wait after the leader's last renewal they saw before taking "
            "over (seconds or a duration: 15s)",
            parse_duration,
        ),
    )
    leader_election_renew_deadline_s: float = field(
        default=10.0,
        metadata=option(
            "--leader-election-renew-deadline",
            "GPU_DRA_LEADER_ELECTION_RENEW_DEADLINE",
            "how long the leader keeps trying to renew before it stops its duties; shorter "
            "than the lease duration",
            parse_duration,
        ),
    )
    leader_election_retry_period_s: float = field(
        default=2.0,
        metadata=option(
            "--leader-election-retry-period",
            "GPU_DRA_LEADER_ELECTION_RETRY_PERIOD",
            "time between tries to acquire or renew the Lease",
            parse_duration,
        ),
    )

    @property
    def leader_election_identity_or_host(self) -> str:
        """`leader_election_identity`, else the host name (the pod name in a pod)."""
        return self.leader_election_identity or socket.gethostname()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ControllerSettings:
        """Settings from the environment alone (no flags)."""
        return cls.from_args([], environ)

    @classmethod
    def from_args(cls, argv: Sequence[str], environ: Mapping[str, str]) -> ControllerSettings:
        """Settings from flags over environment over defaults; exits with usage on bad input."""
        parser = build_parser(environ)
        namespace = parser.parse_args(list(argv))
        settings = cls(**{item.name: getattr(namespace, item.name) for item in fields(cls)})
        lease = settings.leader_election_lease_duration_s
        renew = settings.leader_election_renew_deadline_s
        retry = settings.leader_election_retry_period_s
        if not lease > renew > 1.2 * retry:
            parser.error(
                "leader election needs lease duration > renew deadline > 1.2 x retry period "
                f"(as client-go), got {lease:g}s, {renew:g}s, {retry:g}s"
            )
        if settings.webhook_tls_secret and not (
            settings.webhook_service and settings.webhook_configuration
        ):
            parser.error(
                "--webhook-tls-secret needs --webhook-service (the certificate's names) and "
                "--webhook-configuration (whose caBundle to keep)"
            )
        if settings.share_memory_quota and not settings.webhook_port:
            parser.error("--share-memory-quota needs --webhook-port (it is served by the webhook)")
        return settings

    def log_fields(self) -> dict[str, str]:
        """The settings as strings, for the start-up log line."""
        return {item.name: str(getattr(self, item.name)) for item in fields(self)}


def options() -> dict[str, Option]:
    """Each settings field's flag and environment spelling, by field name."""
    return {item.name: item.metadata["option"] for item in fields(ControllerSettings)}


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The `gpu-dra-controller` parser; defaults come from `environ` where set."""
    parser = argparse.ArgumentParser(
        prog="gpu-dra-controller",
        description="Cluster-level part of the gpu-dra DRA driver: applies the DeviceClass "
        "catalog and serves the admission webhook. Every flag can also be set through the "
        "environment variable named with it.",
    )
    for item in fields(ControllerSettings):
        option: Option = item.metadata["option"]
        default = item.default
        if option.env in environ:
            try:
                default = option.parse(environ[option.env])
            except ValueError as error:
                parser.error(f"{option.env}={environ[option.env]!r}: {error}")
        shown = option.show_default if option.show_default is not None else item.default
        help_text = f"{option.help} (env {option.env}; default: {shown})"
        if isinstance(item.default, bool):
            parser.add_argument(
                option.flag,
                dest=item.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
        else:
            parser.add_argument(
                option.flag,
                dest=item.name,
                type=_argument_type(option.parse),
                default=default,
                metavar=item.name.upper(),
                help=help_text,
            )
    return parser


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    return convert
