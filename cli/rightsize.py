"""`gpu-dra rightsize`: per claim, what its devices used at most over a window (memory, GPU
utilization) and the smallest tier of the catalog that would have held it with headroom, with a
ResourceClaimTemplate asking for it (the rule: `gpu_dra.driver.rightsizing`). The peaks come from
the kubelet plugins' metrics (the plugin's memory: since the claim's prepare or the plugin's
start; `gpu_dra.cli.peaks`) or, with ``--prometheus``, from Prometheus over ``--window``; GPU
models, what the cluster offers and the claims' request names from the cluster's
ResourceSlices and ResourceClaims. See docs/metrics.md#right-sizing.
"""

from __future__ import annotations

import argparse
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

import yaml

from gpu_dra.cli import peaks as peak_sources
from gpu_dra.cli import utilization
from gpu_dra.cli.cluster import add_cluster_arguments, api_client, cluster_errors, read_objects
from gpu_dra.cli.command import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Streams,
    Subcommand,
    add_env_argument,
    write_data,
    write_table,
)
from gpu_dra.cli.peaks import DevicePeak, PrometheusError
from gpu_dra.driver.cluster.state import PoolDevice, build_cluster_state
from gpu_dra.driver.config.quantity import QuantityError, quantity_value
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.driver.rightsizing import (
    DEFAULT_HEADROOM_PERCENT,
    GIB,
    Advice,
    Held,
    Observed,
    Option,
    TemplateRequest,
    advise,
    claim_template,
    gpu_shape,
    offered_options,
)

Obj = dict[str, Any]
_WIDE: Final = 10_000
"""YAML line width: a selector's expression on one line."""
PLUGIN_WINDOW: Final = (
    "the plugins' memory: since each claim device's first sample (the claim's prepare or the "
    "plugin's start); --prometheus URL reads a longer window"
)


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument(
        "claims",
        nargs="*",
        metavar="CLAIM",
        help="only these claims (NAME, or NAMESPACE/NAME; default: every claim with peaks)",
    )
    parser.add_argument("-n", "--namespace", help="only the claims of this namespace")
    parser.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM_PERCENT,
        metavar="PERCENT",
        help="added to the peak memory and utilization before sizing (default: %(default)g)",
    )
    parser.add_argument(
        "--templates",
        action="store_true",
        help="print only the ResourceClaimTemplates, as a YAML stream for kubectl apply -f -",
    )
    add_env_argument(
        parser,
        environ,
        "--driver-name",
        env=("GPU_DRA_DRIVER_NAME",),
        metavar="NAME",
        help="DRA driver whose devices the claims hold",
        default=DEFAULT_DRIVER_NAME,
    )
    add_cluster_arguments(parser, environ)
    source = parser.add_argument_group("where the peaks come from (docs/metrics.md)")
    add_env_argument(
        parser,
        environ,
        "--prometheus",
        env=("GPU_DRA_PROMETHEUS_URL",),
        metavar="URL",
        help="read max_over_time over --window from this Prometheus HTTP API (e.g. "
        "http://prometheus.monitoring:9090) instead of the plugins' in-memory peaks",
        shown_default="none: the plugins' peaks",
    )
    source.add_argument(
        "--window",
        metavar="DURATION",
        help="the window read from --prometheus (7d, 36h, 1d12h; default: 7d)",
    )
    source.add_argument(
        "--plugin-metrics",
        metavar="URL",
        action="append",
        default=[],
        help="a kubelet plugin's metrics URL (repeatable); default: every pod "
        "--plugin-selector matches, through the apiserver's pod proxy",
    )
    source.add_argument(
        "--plugin-selector",
        metavar="SELECTOR",
        default=utilization.DEFAULT_PLUGIN_SELECTOR,
        help="label selector of the kubelet plugin pods (default: %(default)s)",
    )
    source.add_argument(
        "--plugin-namespace",
        metavar="NAMESPACE",
        help="namespace of the kubelet plugin pods (default: all namespaces)",
    )


@dataclass
class DeviceAdvice:
    peak: DevicePeak
    product: str | None
    advice: Advice | None
    offered: set[str]
    request: str
    notes: list[str] = field(default_factory=list)

    @property
    def recommended(self) -> Option | None:
        return None if self.advice is None else self.advice.recommended(self.offered)


@dataclass
class ClaimAdvice:
    namespace: str
    name: str
    devices: list[DeviceAdvice]

    def template(self, driver: str) -> Obj | None:
        """One request per request of the claim, so the pods' references still hold: a request
        with several devices asks for as many of the largest option its devices need."""
        by_request: dict[str, list[tuple[Option, str]]] = {}
        for device in self.devices:
            option = device.recommended
            if option is None or device.product is None:
                return None
            by_request.setdefault(device.request, []).append((option, device.product))
        requests = [
            TemplateRequest(name, *max(found, key=_option_order), count=len(found))
            for name, found in by_request.items()
        ]
        return claim_template(self.namespace, f"{self.name}-rightsized", requests, driver=driver)


def _option_order(found: tuple[Option, str]) -> tuple[float, int, float]:
    option = found[0]
    return (option.size, option.memory_bytes, option.compute_percent)


def run(args: argparse.Namespace, streams: Streams) -> int:
    if not 0 <= args.headroom <= 1000:  # NaN too
        raise CliError("--headroom: give a percent between 0 and 1000", EXIT_USAGE)
    if args.prometheus and urllib.parse.urlsplit(args.prometheus).scheme not in ("http", "https"):
        raise CliError(
            f"--prometheus: {args.prometheus!r} is not an http:// or https:// URL (e.g. "
            "http://prometheus.monitoring:9090)",
            EXIT_USAGE,
        )
    if args.window is not None and not args.prometheus:
        raise CliError(
            "--window needs --prometheus: without it the window is the plugins' memory",
            EXIT_USAGE,
        )
    try:
        window_s = utilization.parse_duration(args.window or "7d")
    except ValueError as error:
        raise CliError(f"--window: {error}", EXIT_USAGE) from error
    if window_s <= 0:
        raise CliError("--window: give a duration longer than 0", EXIT_USAGE)
    warnings: list[str] = []
    with cluster_errors():
        client = api_client(args.kubeconfig)
        _, slices, claims = read_objects(client)
        if args.prometheus:
            try:
                found = peak_sources.from_prometheus(
                    peak_sources.prometheus_query(args.prometheus), window_s
                )
            except PrometheusError as error:
                raise CliError(f"--prometheus: {error}") from error
        else:
            if args.plugin_metrics:
                scrapes = utilization.read_urls(args.plugin_metrics)
            else:
                scrapes = utilization.read_plugin_pods(
                    client, args.plugin_selector, args.plugin_namespace
                )
                if not scrapes:
                    warnings.append(
                        f"no kubelet plugin pod matches {args.plugin_selector!r}: give the "
                        "plugins' metrics URLs with --plugin-metrics"
                    )
            found, more = peak_sources.from_scrapes(scrapes)
            warnings += more
    advice = right_size(found, slices, claims, args)
    warnings += _missing(args, advice, claims)
    source = (
        f"Prometheus {args.prometheus}, the last {utilization.duration_text(window_s)} "
        "(max_over_time)"
        if args.prometheus
        else PLUGIN_WINDOW
    )
    if args.templates:
        templates = [t for c in advice if (t := c.template(args.driver_name)) is not None]
        streams.out.write(yaml.safe_dump_all(templates, sort_keys=False, width=_WIDE))
    elif args.output != "table":
        write_data(streams, _json(advice, source, args, warnings), args.output)
    else:
        _render(streams, advice, source, args, warnings)
    return EXIT_OK


def right_size(
    found: Sequence[DevicePeak], slices: Sequence[Obj], claims: Sequence[Obj], args: Any
) -> list[ClaimAdvice]:
    """The advice for every claim in `claims` that `found` has peaks of and the filters keep."""
    state = build_cluster_state(slices, claims)
    driver = args.driver_name
    devices = [d for d in state.devices if d.driver == driver]
    by_node = {(d.node, d.name): d for d in devices}
    current = {_claim_key(c): c for c in claims}
    by_claim: dict[tuple[str, str], list[DeviceAdvice]] = {}
    for peak in sorted(found, key=lambda p: (p.namespace, p.claim, p.node, p.device)):
        claim = current.get((peak.namespace, peak.claim))
        if claim is None or not _wanted(peak, args):
            continue
        created = _created(claim)
        if created is not None and peak.since is not None:
            peak.since = max(peak.since, created)
        published = by_node.get((peak.node, peak.device))
        key = f"{peak.namespace}/{peak.claim}"
        request = next(
            (h.request for h in (published.holders if published else []) if h.claim == key),
            "gpu",
        )
        device = _advise(peak, published, devices, driver, args.headroom)
        device.request = request.split("/", 1)[0]  # a subrequest's: its request's name
        by_claim.setdefault((peak.namespace, peak.claim), []).append(device)
    return [ClaimAdvice(ns, name, found) for (ns, name), found in sorted(by_claim.items())]


def _advise(
    peak: DevicePeak,
    published: PoolDevice | None,
    devices: Sequence[PoolDevice],
    driver: str,
    headroom: float,
) -> DeviceAdvice:
    if published is None:
        note = f"device {peak.device} is not in any current ResourceSlice of node {peak.node}"
        return DeviceAdvice(peak, None, None, set(), "", [f"{note}: no advice"])
    product = published.product
    memory = _quantity_bytes(published.raw, "memory") if published.type == "gpu" else None
    shape = gpu_shape(product, memory)
    if shape is None:
        return DeviceAdvice(
            peak, product, None, set(), "", [f"{product}: its memory is not known: no advice"]
        )
    notes = []
    if not shape.mig:
        notes.append(f"{product}: no MIG profiles known, MIG not considered")
    profile = _attribute(published, "profile") if published.type == "mig" else None
    slice_percent = next((m.compute_percent for m in shape.mig if m.name == profile), None)
    held_compute = 100.0 if slice_percent is None else slice_percent
    if peak.tier == "mps-share":
        share = peak.compute_limit_percent if peak.compute_limit_percent is not None else 100.0
        held_compute = share * held_compute / 100
    held = Held(peak.tier, held_compute, profile)
    observed = Observed(peak.memory_used_bytes, peak.gpu_percent, peak.processes)
    advice = advise(shape, observed, held, headroom_percent=headroom)
    offered = offered_options([d.raw for d in devices], product, driver)
    return DeviceAdvice(peak, product, advice, offered, "", notes)


def _missing(args: Any, advice: Sequence[ClaimAdvice], claims: Sequence[Obj]) -> list[str]:
    """A warning per claim named on the command line that has no advice."""
    existing = {_claim_key(c) for c in claims}
    warnings = []
    for wanted in args.claims:
        namespace, _, name = wanted.rpartition("/")
        namespace = namespace or args.namespace or ""
        if any(a.name == name and (not namespace or a.namespace == namespace) for a in advice):
            continue
        known = any(n == name and (not namespace or ns == namespace) for ns, n in existing)
        why = (
            "no plugin that was read has sampled it (not prepared, or sampling is off)"
            if known
            else "no such ResourceClaim"
        )
        warnings.append(f"claim {wanted}: {why}")
    return warnings


def _wanted(peak: DevicePeak, args: Any) -> bool:
    if args.namespace and peak.namespace != args.namespace:
        return False
    if not args.claims:
        return True
    return any(c in (peak.claim, f"{peak.namespace}/{peak.claim}") for c in args.claims)


def _claim_key(claim: Mapping[str, Any]) -> tuple[str, str]:
    metadata = claim.get("metadata") or {}
    return (str(metadata.get("namespace", "")), str(metadata.get("name", "")))


def _created(claim: Mapping[str, Any]) -> float | None:
    created = (claim.get("metadata") or {}).get("creationTimestamp")
    if isinstance(created, datetime):
        return created.timestamp()
    if not isinstance(created, str):
        return None
    try:
        return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _quantity_bytes(device: Mapping[str, Any], name: str) -> int | None:
    value = ((device.get("capacity") or {}).get(name) or {}).get("value")
    if not isinstance(value, str):
        return None
    try:
        return quantity_value(value)
    except QuantityError:
        return None


def _attribute(device: PoolDevice, name: str) -> str | None:
    attributes = device.raw.get("attributes") or {}
    value = attributes.get(name) or attributes.get(f"{device.driver}/{name}") or {}
    found = value.get("string") if isinstance(value, Mapping) else None
    return found if isinstance(found, str) else None


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f} GiB"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g} %"


def _over(peak: DevicePeak) -> str:
    window = peak.window_s
    return "-" if window is None else utilization.duration_text(window)


def sentence(claim: ClaimAdvice, device: DeviceAdvice, headroom: float) -> str:
    """``team/nb (node-a/gpu-0, gpu): used at most 6.0 GiB and 12 % of its NVIDIA A100-SXM4-80GB
    over 7d: a 1g.10gb MIG slice or a 7Gi / 15 % MPS share or the whole GPU would do (...)``:
    the recommended option first."""
    peak = device.peak
    used = f"used at most {_gib(peak.memory_used_bytes)}"
    if peak.gpu_percent is not None:
        used += f" and {peak.gpu_percent:.3g} %"
    what = f"{claim.namespace}/{claim.name} ({peak.node}/{peak.device}, {peak.tier})"
    text = f"{what}: {used} of its {device.product or 'GPU (model unknown)'} over {_over(peak)}"
    advice = device.advice
    if advice is None or not advice.options:
        return text
    recommended = device.recommended
    ordered = [o for o in (recommended, *advice.options) if o is not None]
    if [o.kind for o in advice.options] == ["gpu"]:
        text += ": only the whole GPU holds it"
    else:
        text += ": " + " or ".join(o.text() for o in dict.fromkeys(ordered)) + " would do"
    need = f"{_gib(advice.need_memory_bytes)}, {_percent(advice.need_compute_percent)}"
    return text + f" (with {headroom:g} % headroom it needs {need})"


def _option_json(option: Option, offered: set[str]) -> Obj:
    return {
        "kind": option.kind,
        "profile": option.profile,
        "deviceClassName": option.device_class,
        "memoryBytes": option.memory_bytes,
        "computePercent": option.compute_percent,
        "offered": option.key in offered,
    }


def _json(advice: Sequence[ClaimAdvice], source: str, args: Any, warnings: list[str]) -> Obj:
    claims = []
    for claim in advice:
        devices = []
        for device in claim.devices:
            peak, found = device.peak, device.advice
            recommended = device.recommended
            devices.append(
                {
                    "node": peak.node,
                    "device": peak.device,
                    "tier": peak.tier,
                    "product": device.product,
                    "since": peak.since,
                    "until": peak.until,
                    "windowSeconds": peak.window_s,
                    "peak": {
                        "memoryUsedBytes": peak.memory_used_bytes,
                        "gpuUtilizationPercent": peak.gpu_percent,
                        "processes": peak.processes,
                    },
                    "need": None
                    if found is None
                    else {
                        "memoryBytes": found.need_memory_bytes,
                        "computePercent": found.need_compute_percent,
                        "computeObserved": found.compute_observed,
                    },
                    "options": [] if found is None else [
                        _option_json(o, device.offered) for o in found.options
                    ],
                    "recommended": None
                    if recommended is None
                    else _option_json(recommended, device.offered),
                    "unused": bool(found and found.unused),
                    "notes": _notes(device),
                    "advice": sentence(claim, device, args.headroom),
                }
            )  # fmt: skip
        claims.append(
            {
                "namespace": claim.namespace,
                "name": claim.name,
                "devices": devices,
                "template": claim.template(args.driver_name),
            }
        )
    return {
        "source": source,
        "headroomPercent": args.headroom,
        "claims": claims,
        "warnings": warnings,
    }


def _notes(device: DeviceAdvice) -> list[str]:
    notes = list(device.notes) + (list(device.advice.notes) if device.advice else [])
    recommended = device.recommended
    if recommended is not None and recommended.key not in device.offered:
        notes.append(f"{recommended.text()} is not offered by any node now")
    return notes


def _render(
    streams: Streams, advice: Sequence[ClaimAdvice], source: str, args: Any, warnings: list[str]
) -> None:
    out = streams.out
    for warning in warnings:
        print(f"warning: {warning}", file=out)
    print(f"right-sizing (peaks from {source}; headroom {args.headroom:g} %):", file=out)
    rows = []
    for claim in advice:
        for device in claim.devices:
            peak = device.peak
            recommended = device.recommended
            rows.append(
                [
                    f"{claim.namespace}/{claim.name}",
                    f"{peak.node}/{peak.device} ({peak.tier})",
                    device.product or "-",
                    _gib(peak.memory_used_bytes),
                    "- (MIG)"
                    if peak.gpu_percent is None and peak.tier == "mig"
                    else _percent(peak.gpu_percent),
                    _over(peak),
                    "-" if recommended is None else _smallest(device, recommended),
                ]
            )
    headers = [
        "CLAIM",
        "DEVICE",
        "GPU",
        "PEAK MEMORY",
        "PEAK GPU",
        "OVER",
        "SMALLEST THAT HOLDS IT",
    ]
    if not rows:
        print("  (no claim with peaks)", file=out)
        return
    write_table(streams, headers, rows)
    for claim in advice:
        print("", file=out)
        for device in claim.devices:
            print(sentence(claim, device, args.headroom), file=out)
            for note in _notes(device):
                print(f"  note: {note}", file=out)
        template = claim.template(args.driver_name)
        if template is not None:
            print("  template:", file=out)
            text = yaml.safe_dump(template, sort_keys=False, width=_WIDE)
            out.write("".join(f"    {line}\n" for line in text.splitlines()))


def _smallest(device: DeviceAdvice, option: Option) -> str:
    unused = device.advice is not None and device.advice.unused
    return f"{option.text()} (unused)" if unused else option.text()


COMMAND: Final = Subcommand(
    name="rightsize",
    summary="per claim, its peak use and the smallest tier that holds it (reads the cluster)",
    description="For every claim the kubelet plugins have sampled, print what its devices used\n"
    "at most (memory, GPU utilization) and over which window, the smallest tier of the catalog\n"
    "that would have held it with --headroom (a MIG profile of its GPU model, an MPS share,\n"
    "the whole GPU), and a ResourceClaimTemplate asking for it. The peaks are the plugins'\n"
    "(kept in memory since the claim's prepare or the plugin's start) or, with --prometheus,\n"
    "Prometheus's over --window. MIG devices report no utilization: their compute is kept.\n"
    "docs/metrics.md#right-sizing. Exit status: 0 success, 1 the cluster or Prometheus cannot\n"
    "be read, 2 usage error.",
    examples=(
        "gpu-dra rightsize",
        "gpu-dra rightsize -n team-a notebook",
        "gpu-dra rightsize --prometheus http://prometheus.monitoring:9090 --window 7d",
        "gpu-dra rightsize team-a/notebook --templates | kubectl apply -f -",
    ),
    add_arguments=add_arguments,
    run=run,
)
