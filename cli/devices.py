"""`gpu-dra devices`: the devices the kubelet plugin would publish for this node's GPUs (or for a
simulated machine), as a table or as the exact ``resource.k8s.io/v1`` device objects.

`plugin_devices` is also what `gpu-dra lint` evaluates selectors on. Flags describing the node
default to the kubelet plugin's environment variables. See docs/config.md#gpu-dra.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from gpu_dra.cli.command import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Streams,
    Subcommand,
    add_env_argument,
    add_output_argument,
    print_error,
    write_data,
    write_table,
)
from gpu_dra.driver.attributes import (
    NUMA_NODE,
    PCI_BUS_ID,
    DeviceAttributeError,
    published_devices,
)
from gpu_dra.driver.discovery import DiscoveryError, discover_devices
from gpu_dra.driver.mig_policy import DEFAULT as DEFAULT_MIG_POLICY
from gpu_dra.driver.mig_policy import DEFAULT_POLICY_TEXT, MigPolicy, MigPolicyError, parse_policy
from gpu_dra.driver.model import NodeDevices
from gpu_dra.driver.nvml.interface import NvmlLibrary, PciTopology
from gpu_dra.driver.nvml.real import RealNvml
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.simulated_profiles import ProfileError
from gpu_dra.driver.nvml.sysfs import SysfsPciTopology
from gpu_dra.driver.partitions import partitioned_node
from gpu_dra.driver.resourceapi import Device
from gpu_dra.driver.shares import MigShareSelection, SharedDevice, ShareSelection, with_shares

_MISSING: Final = "-"


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_env_argument(
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
        "MIG-capable GPUs as the whole GPU and every placement of each MIG profile "
        "--dynamic-mig-profiles offers",
    )
    add_env_argument(
        parser,
        environ,
        "--dynamic-mig-profiles",
        env=("GPU_DRA_DYNAMIC_MIG_PROFILES",),
        metavar="POLICY",
        help="with --dynamic-mig: the MIG profiles published, as the kubelet plugin's flag "
        "(names, shapes such as 1g, or all; [<model>=]... entries separated by ';')",
        default=DEFAULT_POLICY_TEXT,
    )
    add_env_argument(
        parser,
        environ,
        "--node",
        "--node-name",
        env=("GPU_DRA_NODE_NAME", "NODE_NAME"),
        metavar="NAME",
        help="node name; simulated GPU UUIDs are derived from it, as on the node itself",
        shown_default="the host name",
    )
    add_env_argument(
        parser,
        environ,
        "--driver-root",
        env=("GPU_DRA_DRIVER_ROOT",),
        metavar="DIR",
        help="root of the NVIDIA driver installation, searched for libnvidia-ml.so.1 "
        "(/run/nvidia/driver with the GPU Operator); ignored with --simulate",
        default="/",
    )
    add_output_argument(parser)


def run(args: argparse.Namespace, streams: Streams) -> int:
    """Print the usable devices; every GPU that could not be read is an error line on stderr
    (with its NVML return code) and exit status 1, as is a node with nothing to publish."""
    try:
        policy = parse_policy(args.dynamic_mig_profiles)
    except MigPolicyError as error:
        raise CliError(f"--dynamic-mig-profiles: {error}", EXIT_USAGE) from error
    nvml, pci = _node(args)
    try:
        found = _discover(nvml, pci, dynamic_mig=args.dynamic_mig)
    except OSError as error:  # libnvidia-ml.so.1 exists but cannot be loaded
        raise CliError(f"cannot load the NVML library under {args.driver_root}: {error}") from error
    devices = _publish(found, dynamic_mig=args.dynamic_mig, mig_policy=policy)
    if args.output != "table":
        write_data(streams, devices, args.output)
    elif devices:
        headers = ["NAME", "TYPE", "PROFILE", "PRODUCT", "MEMORY", "ARCHITECTURE"]
        headers += ["COMPUTE CAPABILITY"]
        headers += ["PCI BUS ID", "NUMA", "UUID"]
        write_table(streams, headers, [_device_row(device) for device in devices])
    failures = [f"{problem.message}; not published" for problem in found.problems]
    if not devices:
        failures.append(_nothing_published(found))
    for failure in failures:
        print_error(streams, args.command, failure)
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


def plugin_devices(
    nvml: NvmlLibrary,
    pci: PciTopology,
    *,
    mps_shares: bool = False,
    dynamic_mig: bool = False,
    mig_policy: MigPolicy = DEFAULT_MIG_POLICY,
    capped_shares: bool = False,
) -> list[Device]:
    """The devices the kubelet plugin publishes for the node, in its order: whole GPUs with MIG
    off and static MIG devices, by PCI bus id then placement; with ``mps_shares``, every whole
    GPU and static MIG device offered as MPS shares (``--mps-shares=all``,
    ``--mps-shares-on-mig=all``); with ``capped_shares`` every whole GPU as capped shares
    (``--capped-shares=all`` where the driver enforces the cap); with ``dynamic_mig``,
    partitionable GPUs in partitionable form (``--dynamic-mig``, the profiles of `mig_policy`).
    `CliError` when discovery or publishing fails, or a GPU cannot be read. `gpu-dra lint`
    evaluates on these."""
    found = _discover(nvml, pci, dynamic_mig=dynamic_mig)
    if found.problems:
        raise CliError("; ".join(problem.message for problem in found.problems))
    return _publish(
        found,
        mps_shares=mps_shares,
        dynamic_mig=dynamic_mig,
        mig_policy=mig_policy,
        capped_shares=capped_shares,
    )


def _discover(nvml: NvmlLibrary, pci: PciTopology, *, dynamic_mig: bool) -> NodeDevices:
    """`discover_devices`, a node-wide failure as `CliError`; per-GPU problems are returned."""
    try:
        return discover_devices(nvml, pci, mig_profiles=dynamic_mig)
    except DiscoveryError as error:
        raise CliError(str(error)) from error


def _publish(
    found: NodeDevices,
    *,
    mps_shares: bool = False,
    dynamic_mig: bool = False,
    mig_policy: MigPolicy = DEFAULT_MIG_POLICY,
    capped_shares: bool = False,
) -> list[Device]:
    """The devices of the usable GPUs of `found`, as `plugin_devices` describes them."""
    try:
        if dynamic_mig:
            node = partitioned_node(found.gpus, found.mig_devices, found.mig_profiles, mig_policy)
            return list(node.devices)
        published = published_devices(found.gpus, found.mig_devices)
        if mps_shares:
            offered: list[SharedDevice] = [
                *ShareSelection(every_gpu=True).select(found.gpus),
                *MigShareSelection(every_device=True).select(found.mig_devices),
            ]
            published = with_shares(published, offered)
        elif capped_shares:
            every = ShareSelection(every_gpu=True, flag="--capped-shares").select(found.gpus)
            published = with_shares(published, (), every)
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
        device_form(device),
        attribute("profile"),
        attribute("productName"),
        _MISSING if memory is None else memory["value"],
        attribute("architecture"),
        attribute("cudaComputeCapability"),
        attribute(PCI_BUS_ID),
        attribute(NUMA_NODE),
        attribute("uuid"),
    ]


def device_form(device: Device) -> str:
    """What a published device is, for the TYPE column: its ``type`` attribute (``gpu`` or
    ``mig``, what selectors read), then ``share`` for a device offered as shares (several claims
    may hold it), ``partitionable`` for a whole GPU published with ``--dynamic-mig`` (it consumes
    the GPU's counters) and ``partition`` for a dynamic MIG device."""
    kind = str(next(iter(device.get("attributes", {}).get("type", {}).values()), _MISSING))
    if device.get("allowMultipleAllocations"):
        return f"{kind} share"
    if device.get("consumesCounters"):
        return f"{kind} partition" if kind == "mig" else f"{kind} partitionable"
    return kind


COMMAND: Final = Subcommand(
    name="devices",
    summary="print the devices gpu-dra would publish for a node",
    description="Discover the GPUs (real ones through NVML, or a simulated machine) and print\n"
    "the devices the kubelet plugin would publish in the node's ResourceSlice: a table\n"
    "(TYPE: gpu or mig, the type attribute, with 'share' for a device offered as shares,\n"
    "'partitionable'/'partition' for the --dynamic-mig forms; PROFILE: the MIG profile),\n"
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
    add_arguments=add_arguments,
    run=run,
)
