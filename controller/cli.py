"""`gpu-dra`: the operator's command line; only ``explain`` and ``inventory`` need a cluster.

* ``profiles`` lists the built-in simulated machine profiles.
* ``devices`` prints the devices the kubelet plugin would publish for this node's GPUs (or for a
  simulated machine), as a table or as the exact ``resource.k8s.io/v1`` device objects.
* ``check-config`` validates the opaque ``GpuConfig``/``MigDeviceConfig`` entries of
  ResourceClaims, ResourceClaimTemplates and DeviceClasses before they are applied, with the
  messages the kubelet plugin would put in pod events.
* ``lint`` compiles the CEL selectors of DeviceClasses and claims and evaluates the classes on
  the devices of the simulated machines (`gpu_dra.controller.lint`).
* ``explain <namespace>/<claim>`` reads a live cluster and says why a ResourceClaim is (not)
  allocatable (`gpu_dra.controller.explain`); ``inventory`` lists the driver's devices per node
  with their holders and each DeviceClass's total and free devices (`gpu_dra.controller.inventory`).

Each subcommand is a `Subcommand`: one function adding its arguments, one running it. To add one,
write those two functions and list it in `SUBCOMMANDS`. Flags describing the node (``--simulate``,
``--node``, ``--driver-root``, ``--driver-name``) default to the kubelet plugin's environment
variables, so ``gpu-dra devices`` run in the plugin's container shows what that plugin publishes.

Exit status: 0 success, 1 the check or discovery failed (for ``devices`` also: a GPU NVML cannot
describe, or nothing to publish), 2 usage error or unusable input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, TextIO

import yaml

from gpu_dra.controller.explain import explain, render_explanation
from gpu_dra.controller.inventory import inventory, render_inventory
from gpu_dra.controller.lint import (
    LintReport,
    PublishedNames,
    SimulatedDevice,
    Source,
    lint,
    publishable_names,
)
from gpu_dra.driver.attributes import (
    NUMA_NODE,
    PCI_BUS_ID,
    DeviceAttributeError,
    published_devices,
)
from gpu_dra.driver.cel import CelRuntimeError, to_cel_device
from gpu_dra.driver.config import ConfigError, ConfigProblem, resolve_configs
from gpu_dra.driver.config.resolve import NOT_OPAQUE
from gpu_dra.driver.discovery import DiscoveryError, discover_devices
from gpu_dra.driver.model import NodeDevices
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.driver.nvml.interface import NvmlLibrary, PciTopology
from gpu_dra.driver.nvml.profiles import ProfileError, builtin_profile_names, load_profile
from gpu_dra.driver.nvml.real import RealNvml
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.sysfs import SysfsPciTopology
from gpu_dra.driver.partitions import partitioned_node
from gpu_dra.driver.resourceapi import API_GROUP, Device
from gpu_dra.driver.shares import ShareSelection, with_shares
from gpu_dra.kube import errors as api_errors
from gpu_dra.kube.client import list_resource_objects, new_api_client, read_resource_claim

PROG: Final = "gpu-dra"
MPS_SHARES_VARIANT: Final = "+mps-shares"
"""Suffix of the profile name under which `gpu-dra lint` evaluates a machine's whole GPUs as
they are published when offered as MPS shares (``--mps-shares=all``)."""
DYNAMIC_MIG_VARIANT: Final = "+dynamic-mig"
"""Suffix of the profile name under which `gpu-dra lint` evaluates a machine's partitionable
GPUs as they are published with ``--dynamic-mig`` (the whole GPU and every MIG placement)."""

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

OUTPUT_FORMATS: Final = ("table", "json", "yaml")
STDIN: Final = "-"
_STDIN_LABEL: Final = "<stdin>"
_MISSING: Final = "-"


class CliError(Exception):
    """A failure the user can act on: printed as one line on stderr, never as a traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Streams:
    """Where a subcommand reads and writes; `main` passes the process's streams."""

    out: TextIO
    err: TextIO
    stdin: TextIO


@dataclass(frozen=True)
class Subcommand:
    """One ``gpu-dra <name>`` command."""

    name: str
    summary: str
    """One line in ``gpu-dra --help``."""
    description: str
    """What ``gpu-dra <name> --help`` explains above the arguments."""
    examples: tuple[str, ...]
    """Command lines shown in both help texts."""
    add_arguments: Callable[[argparse.ArgumentParser, Mapping[str, str]], None]
    """Adds the command's arguments; defaults may come from the environment passed."""
    run: Callable[[argparse.Namespace, Streams], int]
    """Runs the command; returns the exit status or raises `CliError`."""


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None) -> int:
    """Run ``gpu-dra`` with `argv` (default ``sys.argv[1:]``); the process exit status.

    `environ` (default ``os.environ``) supplies the defaults of the flags with environment twins.
    """
    streams = Streams(out=sys.stdout, err=sys.stderr, stdin=sys.stdin)
    parser = build_parser(os.environ if environ is None else environ)
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exit_request:  # --help, or a usage error argparse has already printed
        return exit_request.code if isinstance(exit_request.code, int) else EXIT_USAGE
    command: Subcommand | None = getattr(args, "command", None)
    if command is None:
        parser.print_help(streams.err)
        return EXIT_USAGE
    try:
        return command.run(args, streams)
    except CliError as error:
        _error(streams, command, str(error))
        return error.exit_code


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The ``gpu-dra`` parser with every subcommand of `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Operator tools of gpu-dra, the Kubernetes DRA driver for NVIDIA GPUs.\n"
        "Only explain and inventory read a cluster; `gpu-dra COMMAND --help` explains each.",
        epilog=_examples(SUBCOMMANDS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for command in SUBCOMMANDS:
        subparser = subparsers.add_parser(
            command.name,
            help=command.summary,
            description=command.description,
            epilog=_examples([command]),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(subparser, environ)
        subparser.set_defaults(command=command)
    return parser


# ---- gpu-dra profiles ----------------------------------------------------------------------------


def add_profiles_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    _add_output_argument(parser)


def run_profiles(args: argparse.Namespace, streams: Streams) -> int:
    summaries = [_profile_summary(name) for name in builtin_profile_names()]
    if args.output != "table":
        _write_data(streams, summaries, args.output)
        return EXIT_OK
    rows = [
        [
            str(summary["name"]),
            str(summary["gpus"]),
            ", ".join(f"{count}x {product}" for product, count in summary["products"].items()),
        ]
        for summary in summaries
    ]
    _write_table(streams, ["NAME", "GPUS", "PRODUCTS"], rows)
    return EXIT_OK


def _profile_summary(name: str) -> dict[str, Any]:
    # The node name only seeds UUIDs, which the summary does not show.
    profile = load_profile(name, node_name=PROG)
    products = Counter(gpu.model.name for gpu in profile.gpus)
    return {
        "name": profile.name,
        "gpus": len(profile.gpus),
        "products": dict(products),
        "description": profile.description,
    }


# ---- gpu-dra devices -----------------------------------------------------------------------------


def add_devices_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    _add_env_argument(
        parser,
        environ,
        "--simulate",
        env=("GPU_DRA_SIMULATE",),
        metavar="PROFILE",
        help="simulated machine profile: a built-in name (see `gpu-dra profiles`) or the path "
        "of a .json/.yaml profile file",
        shown_default="none: the real GPUs through NVML",
    )
    parser.add_argument(
        "--dynamic-mig",
        action="store_true",
        help="show the devices as the kubelet plugin publishes them with --dynamic-mig: "
        "MIG-capable GPUs as the whole GPU and every placement of every MIG profile",
    )
    _add_env_argument(
        parser,
        environ,
        "--node",
        "--node-name",
        env=("GPU_DRA_NODE_NAME", "NODE_NAME"),
        metavar="NAME",
        help="node name; simulated GPU UUIDs are derived from it, as on the node itself",
        shown_default="the host name",
    )
    _add_env_argument(
        parser,
        environ,
        "--driver-root",
        env=("GPU_DRA_DRIVER_ROOT",),
        metavar="DIR",
        help="root of the NVIDIA driver installation, searched for libnvidia-ml.so.1 "
        "(/run/nvidia/driver with the GPU Operator); ignored with --simulate",
        default="/",
    )
    _add_output_argument(parser)


def run_devices(args: argparse.Namespace, streams: Streams) -> int:
    """Print the usable devices; every GPU that could not be read is an error line on stderr
    (with its NVML return code) and exit status 1, as is a node with nothing to publish."""
    nvml, pci = _node(args)
    try:
        found = _discover(nvml, pci, dynamic_mig=args.dynamic_mig)
    except OSError as error:  # libnvidia-ml.so.1 exists but cannot be loaded
        raise CliError(f"cannot load the NVML library under {args.driver_root}: {error}") from error
    devices = _publish(found, dynamic_mig=args.dynamic_mig)
    if args.output != "table":
        _write_data(streams, devices, args.output)
    elif devices:
        headers = ["NAME", "PRODUCT", "MEMORY", "ARCHITECTURE", "COMPUTE CAPABILITY"]
        headers += ["PCI BUS ID", "NUMA", "UUID"]
        _write_table(streams, headers, [_device_row(device) for device in devices])
    failures = [f"{problem.message}; not published" for problem in found.problems]
    if not devices:
        failures.append(_nothing_published(found))
    for failure in failures:
        _error(streams, args.command, failure)
    return EXIT_FAILED if failures else EXIT_OK


def _nothing_published(found: NodeDevices) -> str:
    """Why a node publishes no device: no GPU at all, unreadable GPUs, or MIG without slices."""
    if not found.gpus and not found.problems:
        return (
            "no GPUs found: NVML reports 0 GPUs (is the driver root right, and are the GPUs' "
            "device nodes visible here?)"
        )
    if not found.gpus:
        return f"no usable GPU: all {len(found.problems)} GPU(s) NVML reports cannot be read"
    idle = [f"GPU {gpu.index} ({gpu.pci_bus_id}, {gpu.uuid})" for gpu in found.gpus]
    return (
        f"no device to publish: {', '.join(idle)} {'has' if len(idle) == 1 else 'have'} MIG "
        "mode on and no MIG device (make MIG devices, or publish with --dynamic-mig)"
    )


def _published_devices(
    nvml: NvmlLibrary, pci: PciTopology, *, mps_shares: bool = False, dynamic_mig: bool = False
) -> list[Device]:
    """The devices the kubelet plugin publishes for the node, in its order: whole GPUs with MIG
    off and static MIG devices, by PCI bus id then placement; with ``mps_shares``, every whole
    GPU offered as MPS shares (``--mps-shares=all``); with ``dynamic_mig``, partitionable GPUs in
    partitionable form (``--dynamic-mig``). `CliError` when discovery or publishing fails, or a
    GPU cannot be read. `gpu-dra lint` evaluates on these."""
    found = _discover(nvml, pci, dynamic_mig=dynamic_mig)
    if found.problems:
        raise CliError("; ".join(problem.message for problem in found.problems))
    return _publish(found, mps_shares=mps_shares, dynamic_mig=dynamic_mig)


def _discover(nvml: NvmlLibrary, pci: PciTopology, *, dynamic_mig: bool) -> NodeDevices:
    """`discover_devices`, a node-wide failure as `CliError`; per-GPU problems are returned."""
    try:
        return discover_devices(nvml, pci, mig_profiles=dynamic_mig)
    except DiscoveryError as error:
        raise CliError(str(error)) from error


def _publish(
    found: NodeDevices, *, mps_shares: bool = False, dynamic_mig: bool = False
) -> list[Device]:
    """The devices of the usable GPUs of `found`, as `_published_devices` describes them."""
    try:
        if dynamic_mig:
            node = partitioned_node(found.gpus, found.mig_devices, found.mig_profiles)
            return list(node.devices)
        published = published_devices(found.gpus, found.mig_devices)
        if mps_shares:
            published = with_shares(published, ShareSelection(every_gpu=True).select(found.gpus))
        return published
    except DeviceAttributeError as error:
        raise CliError(f"cannot publish the GPUs: {error}") from error


def _node(args: argparse.Namespace) -> tuple[NvmlLibrary, PciTopology]:
    if not args.simulate:
        return RealNvml(Path(args.driver_root)), SysfsPciTopology()
    try:
        host = SimulatedHost.load(args.simulate, args.node or socket.gethostname())
    except ProfileError as error:
        raise CliError(str(error), EXIT_USAGE) from error
    return host.nvml, host.pci


def _device_row(device: Device) -> list[str]:
    attributes = device.get("attributes", {})

    def attribute(key: str) -> str:
        value = attributes.get(key)
        return _MISSING if not value else str(next(iter(value.values())))

    memory = device.get("capacity", {}).get("memory")
    return [
        device["name"],
        attribute("productName"),
        _MISSING if memory is None else memory["value"],
        attribute("architecture"),
        attribute("cudaComputeCapability"),
        attribute(PCI_BUS_ID),
        attribute(NUMA_NODE),
        attribute("uuid"),
    ]


# ---- gpu-dra check-config ------------------------------------------------------------------------

Verdict = Literal["OK", "ERROR", "SKIP"]

# Kind -> where its config list is and the config source the scheduler gives its entries.
_CONFIG_LISTS: Final[dict[str, tuple[tuple[str, ...], str]]] = {
    "ResourceClaim": (("spec", "devices", "config"), "FromClaim"),
    "ResourceClaimTemplate": (("spec", "spec", "devices", "config"), "FromClaim"),
    "DeviceClass": (("spec", "config"), "FromClass"),
}


@dataclass(frozen=True)
class ConfigCheck:
    """The verdict on one config entry (or on a config list that is not a list)."""

    file: str
    object: str
    """``<kind>/<name>``."""
    path: str
    """``spec.devices.config[0]``."""
    verdict: Verdict
    message: str = ""

    def __str__(self) -> str:
        line = f"{self.verdict} {self.file} {self.object} {self.path}"
        return f"{line}: {self.message}" if self.message else line


def add_check_config_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help=f"YAML manifest file, may hold several documents and List objects; {STDIN} reads "
        "standard input",
    )
    _add_env_argument(
        parser,
        environ,
        "--driver-name",
        env=("GPU_DRA_DRIVER_NAME",),
        metavar="NAME",
        help="DRA driver name whose opaque configs are checked; others are skipped",
        default=DEFAULT_DRIVER_NAME,
    )


def run_check_config(args: argparse.Namespace, streams: Streams) -> int:
    checks: list[ConfigCheck] = []
    unusable = False
    for file in args.files:
        try:
            documents = _load_documents(file, streams.stdin)
        except CliError as error:
            _error(streams, CHECK_CONFIG, str(error))
            unusable = True
            continue
        label = _STDIN_LABEL if file == STDIN else file
        for document in documents:
            for check in check_object(label, document, driver=args.driver_name):
                print(check, file=streams.out)
                checks.append(check)
    if unusable:
        return EXIT_USAGE
    if not checks:
        print(
            "no config entries found in ResourceClaims, ResourceClaimTemplates or DeviceClasses",
            file=streams.err,
        )
    return EXIT_FAILED if any(check.verdict == "ERROR" for check in checks) else EXIT_OK


def check_object(file: str, manifest: Mapping[str, Any], *, driver: str) -> list[ConfigCheck]:
    """The verdict on each config entry of a manifest (other kinds have none)."""
    kind = manifest.get("kind")
    api_version = manifest.get("apiVersion")
    if not (
        isinstance(kind, str)
        and kind in _CONFIG_LISTS
        and isinstance(api_version, str)
        and api_version.startswith(f"{API_GROUP}/")
    ):
        return []
    metadata = manifest.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    label = f"{kind}/{name or '<unnamed>'}"
    keys, source = _CONFIG_LISTS[kind]
    entries: object = manifest
    for depth, key in enumerate(keys):
        if entries is None:
            return []
        if not isinstance(entries, Mapping):
            path = ".".join(keys[:depth])
            return [ConfigCheck(file, label, path, "ERROR", "expected an object")]
        entries = entries.get(key)
    if entries is None:
        return []
    if not isinstance(entries, list):
        message = "expected a list of config entries"
        return [ConfigCheck(file, label, ".".join(keys), "ERROR", message)]
    checks = []
    for index, entry in enumerate(entries):
        verdict, message = check_entry(entry, source=source, driver=driver)
        path = f"{'.'.join(keys)}[{index}]"
        checks.append(ConfigCheck(file, label, path, verdict, message))
    return checks


def check_entry(entry: object, *, source: str, driver: str) -> tuple[Verdict, str]:
    """Verdict and message for one ``config`` entry, as the kubelet plugin would judge it.

    The entry goes through `resolve_configs`, the plugin's own code path, with no devices: every
    entry for `driver` is decoded and validated whether or not it would be used. Its problems
    come back labelled ``config[0] (FromClaim)``; the caller names the entry by its path instead.
    """
    if not isinstance(entry, Mapping):
        return "ERROR", "expected an object with opaque.driver and opaque.parameters"
    opaque = entry.get("opaque")
    if not isinstance(opaque, Mapping):
        return "ERROR", NOT_OPAQUE
    entry_driver = opaque.get("driver")
    if entry_driver != driver:
        return "SKIP", f"driver {entry_driver} is not {driver}"
    try:
        resolve_configs([{**entry, "source": source}], [], driver=driver, claim="")
    except ConfigError as error:
        problems = (
            ConfigProblem(problem.reason, field=problem.field) for problem in error.problems
        )
        return "ERROR", "; ".join(str(problem) for problem in problems)
    return "OK", ""


def _load_documents(file: str, stdin: TextIO) -> list[Mapping[str, Any]]:
    """The objects in `file` (non-empty YAML documents, Lists opened); `CliError` (usage) if it
    cannot be used."""
    label = _STDIN_LABEL if file == STDIN else file
    try:
        text = stdin.read() if file == STDIN else Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"cannot read {label}: {error}", EXIT_USAGE) from error
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        raise CliError(f"{label}: not valid YAML: {_yaml_message(error)}", EXIT_USAGE) from error
    for number, document in enumerate(documents, start=1):
        if document is not None and not isinstance(document, Mapping):
            raise CliError(
                f"{label}: document {number} is not a Kubernetes object (a YAML mapping)",
                EXIT_USAGE,
            )
    return [obj for document in documents if document is not None for obj in _objects(document)]


def _objects(document: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The objects of a document: itself, or the items of a `kind: List` (nested ones too)."""
    items = document.get("items")
    if document.get("kind") == "List" and isinstance(items, list):
        for item in items:
            if isinstance(item, Mapping):
                yield from _objects(item)
    else:
        yield document


def _yaml_message(error: yaml.YAMLError) -> str:
    """The parser's message on one line, with the position of the problem."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        text = ", ".join(part for part in (error.context, error.problem) if part)
        return f"line {mark.line + 1}, column {mark.column + 1}: {text}"
    return " ".join(str(error).split())


# ---- gpu-dra lint --------------------------------------------------------------------------------

_LINT_NODE: Final = "lint-node"  # seeds the simulated UUIDs, which no selector should read


def add_lint_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="YAML manifest file (several documents and List objects allowed), directory (its "
        f"*.yaml and *.yml files) or {STDIN} for standard input",
    )
    parser.add_argument(
        "--profile",
        action="append",
        metavar="PROFILE",
        help="evaluate on this simulated machine only: a built-in name (see `gpu-dra profiles`) "
        "or the path of a .json/.yaml profile file; repeatable (default: every built-in profile)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="warnings fail the lint too (exit status 1)"
    )
    _add_env_argument(
        parser,
        environ,
        "--driver-name",
        env=("GPU_DRA_DRIVER_NAME",),
        metavar="NAME",
        help="DRA driver name: the domain of the published attributes and device.driver",
        default=DEFAULT_DRIVER_NAME,
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=("text", "json", "yaml"),
        default="text",
        help="output format (default: text, one line per finding and a summary)",
    )


def run_lint(args: argparse.Namespace, streams: Streams) -> int:
    every_builtin = _lint_devices(builtin_profile_names(), variants=True)
    devices = _lint_devices(args.profile) if args.profile else every_builtin
    sources: list[Source] = []
    unreadable: list[str] = []
    for path in args.paths:
        try:
            files = _lint_files(path)
        except CliError as error:
            _error(streams, LINT, str(error))
            unreadable.append(str(error))
            continue
        for file in files:
            try:
                documents = _load_documents(file, streams.stdin)
            except CliError as error:
                _error(streams, LINT, str(error))
                unreadable.append(str(error))
                continue
            sources.append(Source(_STDIN_LABEL if file == STDIN else file, documents))
    try:
        report = lint(
            sources,
            devices,
            driver=args.driver_name,
            published=_published(every_builtin, args.driver_name),
        )
    except CelRuntimeError as error:
        raise CliError(f"a simulated device cannot be evaluated: {error}", EXIT_USAGE) from error
    _write_lint_report(streams, report, len(sources), unreadable, args.output)
    if unreadable:
        return EXIT_USAGE
    return EXIT_FAILED if report.failed(strict=args.strict) else EXIT_OK


def _lint_files(path: str) -> list[str]:
    """`path` itself, or the sorted *.yaml / *.yml files of a directory (CliError if none)."""
    if path == STDIN or not Path(path).is_dir():
        return [path]
    files = sorted(
        str(child)
        for child in Path(path).iterdir()
        if child.suffix in (".yaml", ".yml") and child.is_file()
    )
    if not files:
        raise CliError(f"no .yaml or .yml files in directory {path}", EXIT_USAGE)
    return files


def _lint_devices(profiles: Sequence[str], *, variants: bool = False) -> list[SimulatedDevice]:
    """The published devices of each profile; with ``variants`` also, as profile
    ``<name>+mps-shares``, its whole GPUs as published with ``--mps-shares=all``, and as
    ``<name>+dynamic-mig``, its partitionable GPUs' devices as published with ``--dynamic-mig``
    (profiles without such GPUs add nothing)."""
    devices: list[SimulatedDevice] = []
    for spec in profiles:
        try:
            host = SimulatedHost.load(spec, _LINT_NODE)
        except ProfileError as error:
            raise CliError(str(error), EXIT_USAGE) from error
        try:
            published = _published_devices(host.nvml, host.pci)
        except CliError as error:  # a profile with injected NVML faults
            raise CliError(f"simulated machine {spec}: {error}", EXIT_USAGE) from error
        devices.extend(SimulatedDevice(host.profile.name, device) for device in published)
        if not variants:
            continue
        shared = _published_devices(host.nvml, host.pci, mps_shares=True)
        devices.extend(
            SimulatedDevice(f"{host.profile.name}{MPS_SHARES_VARIANT}", device)
            for device in shared
            if device.get("allowMultipleAllocations")
        )
        partitioned = _published_devices(host.nvml, host.pci, dynamic_mig=True)
        devices.extend(
            SimulatedDevice(f"{host.profile.name}{DYNAMIC_MIG_VARIANT}", device)
            for device in partitioned
            if device.get("consumesCounters")
        )
    return devices


def _published(devices: Sequence[SimulatedDevice], driver: str) -> PublishedNames:
    """What gpu-dra publishes on any built-in profile, and can publish on any whole GPU."""
    converted = [to_cel_device(driver, device.device) for device in devices]
    return publishable_names(driver) | PublishedNames.of(converted)


def _write_lint_report(
    streams: Streams, report: LintReport, files: int, unreadable: Sequence[str], output: str
) -> None:
    if output != "text":
        data = report.to_json(files)
        data["unreadable"] = list(unreadable)
        _write_data(streams, data, output)
        return
    for finding in report.findings:
        print(finding, file=streams.out)
    if not report.objects:
        print("no DeviceClasses, ResourceClaims or ResourceClaimTemplates found", file=streams.err)
    summary = report.summary(files)
    if unreadable:
        summary += f"; {len(unreadable)} inputs unreadable"
    print(f"{PROG} lint: {summary}", file=streams.out)


# ---- gpu-dra explain / inventory (live cluster) -----------------------------------------------


def add_explain_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument(
        "claim", metavar="NAMESPACE/CLAIM", help="the ResourceClaim to explain, e.g. default/gpu"
    )
    _add_cluster_arguments(parser, environ)


def run_explain(args: argparse.Namespace, streams: Streams) -> int:
    namespace, slash, name = str(args.claim).partition("/")
    if not (slash and namespace and name and "/" not in name):
        raise CliError(f"expected NAMESPACE/CLAIM, got {args.claim!r}", EXIT_USAGE)
    with _cluster_errors():
        client = _api_client(args.kubeconfig)
        claim = read_resource_claim(client, namespace, name)
        classes = list_resource_objects(client, "deviceclasses")
        slices = list_resource_objects(client, "resourceslices")
        claims = list_resource_objects(client, "resourceclaims")
    report = explain(claim, classes, slices, claims)
    if args.output != "table":
        _write_data(streams, report.to_json(), args.output)
    else:
        _write_blocks(streams, render_explanation(report))
    satisfied = report.allocated or all(r.satisfied for r in report.requests)
    return EXIT_OK if satisfied and all(c.satisfiable for c in report.constraints) else EXIT_FAILED


def add_inventory_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    _add_env_argument(
        parser,
        environ,
        "--driver-name",
        env=("GPU_DRA_DRIVER_NAME",),
        metavar="NAME",
        help="DRA driver whose devices are listed per node (classes count every driver's)",
        default=DEFAULT_DRIVER_NAME,
    )
    _add_cluster_arguments(parser, environ)


def run_inventory(args: argparse.Namespace, streams: Streams) -> int:
    with _cluster_errors():
        client = _api_client(args.kubeconfig)
        classes = list_resource_objects(client, "deviceclasses")
        slices = list_resource_objects(client, "resourceslices")
        claims = list_resource_objects(client, "resourceclaims")
    report = inventory(slices, classes, claims, driver=args.driver_name)
    if args.output != "table":
        _write_data(streams, report.to_json(), args.output)
    else:
        _write_blocks(streams, render_inventory(report))
    return EXIT_OK


def _add_cluster_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    _add_output_argument(parser)
    _add_env_argument(
        parser,
        environ,
        "--kubeconfig",
        env=("KUBECONFIG",),
        metavar="FILE",
        help="kubeconfig of the cluster to read",
        shown_default="~/.kube/config if it exists, else the pod's service account",
    )


def _api_client(kubeconfig: str | None) -> Any:
    if kubeconfig:
        path: Path | None = Path(kubeconfig.split(os.pathsep)[0])
    else:
        default = Path.home() / ".kube" / "config"
        path = default if default.exists() else None
    return new_api_client(path)


@contextlib.contextmanager
def _cluster_errors() -> Iterator[None]:
    """Turns client configuration and API failures into `CliError`s."""
    try:
        yield
    except api_errors.ClientConfigError as error:
        raise CliError(str(error), EXIT_USAGE) from error
    except api_errors.ApiError as error:
        raise CliError(str(error)) from error


def _write_blocks(
    streams: Streams, blocks: Sequence[tuple[list[str], list[list[str]]] | str]
) -> None:
    for block in blocks:
        if isinstance(block, str):
            print(block, file=streams.out)
        elif block[1]:
            _write_table(streams, block[0], block[1])
        else:
            print("  (none)", file=streams.out)


# ---- the command table ---------------------------------------------------------------------------

PROFILES: Final = Subcommand(
    name="profiles",
    summary="list the built-in simulated machine profiles",
    description="List the built-in simulated machine profiles (for --simulate of `gpu-dra\n"
    "devices` and of the kubelet plugin) with their GPU count and products.",
    examples=("gpu-dra profiles", "gpu-dra profiles -o yaml"),
    add_arguments=add_profiles_arguments,
    run=run_profiles,
)

DEVICES: Final = Subcommand(
    name="devices",
    summary="print the devices gpu-dra would publish for a node",
    description="Discover the GPUs (real ones through NVML, or a simulated machine) and print\n"
    "the devices the kubelet plugin would publish in the node's ResourceSlice: a table,\n"
    "or the exact resource.k8s.io/v1 device objects with -o json|yaml.\n"
    "A GPU that NVML cannot describe (an NVML error, e.g. MIG on but its MIG profiles\n"
    "unreadable) is left out, as the plugin leaves it out: one error line each on stderr,\n"
    "naming the GPU, the NVML call and its return code; the other GPUs are printed.\n"
    "Exit status: 0 success, 1 discovery failed (no NVML library, driver not loaded),\n"
    "a GPU could not be read, or there is no device to publish (no GPU, or only GPUs in\n"
    "MIG mode without MIG devices), 2 usage error (unknown profile).",
    examples=(
        "gpu-dra devices --simulate hgx-h100 --node node-1",
        "gpu-dra devices --simulate t4 -o json",
        "gpu-dra devices --driver-root /run/nvidia/driver",
    ),
    add_arguments=add_devices_arguments,
    run=run_devices,
)

CHECK_CONFIG: Final = Subcommand(
    name="check-config",
    summary="validate the opaque GPU configs of claims, templates and DeviceClasses",
    description="Check every config entry of the ResourceClaims (spec.devices.config),\n"
    "ResourceClaimTemplates (spec.spec.devices.config) and DeviceClasses (spec.config)\n"
    "in the files, with the messages the kubelet plugin would put in pod events.\n"
    "One line per entry:\n"
    "  OK <file> <kind>/<name> <path>\n"
    "  ERROR <file> <kind>/<name> <path>: <message>\n"
    "  SKIP <file> <kind>/<name> <path>: <why>      (an entry for another driver)\n"
    "Entries that are not opaque are errors: the driver cannot tell whom they are for.\n"
    "Other objects are ignored.\n"
    "Exit status: 0 all entries OK, 1 some entry has an error, 2 a file cannot be read\n"
    "or parsed.",
    examples=(
        "gpu-dra check-config claim.yaml deviceclasses/*.yaml",
        "kubectl kustomize overlays/prod | gpu-dra check-config -",
    ),
    add_arguments=add_check_config_arguments,
    run=run_check_config,
)

LINT: Final = Subcommand(
    name="lint",
    summary="check the CEL selectors of DeviceClasses and claims on simulated GPUs",
    description="Compile every CEL selector of the DeviceClasses, ResourceClaims and\n"
    "ResourceClaimTemplates in the files, and evaluate each DeviceClass (and each claim\n"
    "request on the devices of its class) against every device of the simulated machines,\n"
    "as the scheduler evaluates them. One line per finding:\n"
    "  LEVEL <file> <kind>/<name>: [<path>: ]<message>\n"
    "ERROR: a compile error, a runtime error on some device (e.g. a missing attribute read\n"
    "without has()), an attribute or capacity gpu-dra never publishes (with a suggestion).\n"
    "WARNING: a class selecting no device, two classes selecting the same devices, a name\n"
    "only NVIDIA's driver publishes (MIG). INFO: what each class selects, overlaps.\n"
    "Exit status: 0 no errors (warnings allowed unless --strict), 1 errors (or warnings\n"
    "with --strict), 2 an input or profile cannot be read or parsed.",
    examples=(
        "gpu-dra lint deviceclasses/",
        "gpu-dra lint --strict --profile hgx-h100 --profile my-node.yaml classes/ claim.yaml",
        "kubectl get deviceclasses -o yaml | gpu-dra lint -o json -",
    ),
    add_arguments=add_lint_arguments,
    run=run_lint,
)

EXPLAIN: Final = Subcommand(
    name="explain",
    summary="say why a ResourceClaim is or is not allocatable (reads the cluster)",
    description="Read the claim, the DeviceClasses, every ResourceSlice (highest generation per\n"
    "pool; incomplete pools are marked) and every ResourceClaim, and show, for each request\n"
    "(or firstAvailable subrequest), how many devices in which pools pass each step: the\n"
    "class selectors, the request selectors (CEL evaluated as the scheduler does; runtime\n"
    "errors counted with an example), not allocated to another claim, capacity requests,\n"
    "shared counters; which claims hold the matching devices; which attribute values the\n"
    "matchAttribute / distinctAttribute constraints can use. The first line is the verdict.\n"
    "No backtracking search is made across requests: the verdict is a bound.\n"
    "Exit status: 0 allocated or allocatable, 1 not allocatable now or the cluster cannot\n"
    "be read, 2 usage error or unusable kubeconfig.",
    examples=(
        "gpu-dra explain default/my-claim",
        "gpu-dra explain team-a/training -o json --kubeconfig ~/.kube/prod",
    ),
    add_arguments=add_explain_arguments,
    run=run_explain,
)

INVENTORY: Final = Subcommand(
    name="inventory",
    summary="devices per node with their holders, free devices per DeviceClass (reads the cluster)",
    description="Read every ResourceSlice (highest generation per pool), DeviceClass and\n"
    "ResourceClaim and print, per node, the driver's devices (type gpu / mig / ...) with\n"
    "their allocation state (free, allocated, shared, admin) and the claims holding them,\n"
    "and per DeviceClass the devices its selectors match and how many are free.\n"
    "Exit status: 0 success, 1 the cluster cannot be read, 2 usage error.",
    examples=("gpu-dra inventory", "gpu-dra inventory -o json | jq .classes"),
    add_arguments=add_inventory_arguments,
    run=run_inventory,
)

SUBCOMMANDS: Final[tuple[Subcommand, ...]] = (
    PROFILES,
    DEVICES,
    CHECK_CONFIG,
    LINT,
    EXPLAIN,
    INVENTORY,
)


# ---- shared helpers ------------------------------------------------------------------------------


def _add_env_argument(
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str],
    *flags: str,
    env: tuple[str, ...],
    metavar: str,
    help: str,
    default: str | None = None,
    shown_default: str | None = None,
) -> None:
    """A string flag whose default is the first non-empty variable of `env`, else `default`."""
    value = next((environ[name] for name in env if environ.get(name)), default)
    shown = shown_default if shown_default is not None else default
    parser.add_argument(
        *flags,
        default=value,
        metavar=metavar,
        help=f"{help} (env {' or '.join(env)}; default: {shown})",
    )


def _add_output_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default="table",
        help="output format (default: table)",
    )


def _write_table(streams: Streams, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[column]) for row in [headers, *rows]) for column in range(len(headers))]
    for row in [headers, *rows]:
        line = "   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(line.rstrip(), file=streams.out)


def _write_data(streams: Streams, data: object, output: str) -> None:
    if output == "json":
        print(json.dumps(data, indent=2), file=streams.out)
    else:
        streams.out.write(yaml.safe_dump(data, sort_keys=False))


def _examples(commands: Sequence[Subcommand]) -> str:
    lines = [f"  {example}" for command in commands for example in command.examples]
    return "examples:\n" + "\n".join(lines)


def _error(streams: Streams, command: Subcommand, message: str) -> None:
    print(f"{PROG} {command.name}: error: {message}", file=streams.err)


if __name__ == "__main__":
    sys.exit(main())
