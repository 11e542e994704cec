"""``gpu-dra-kubelet-plugin clear-health``: the operator's way to clear a GPU's recorded faults.

A GPU tainted for a fault NVML reported (an XID, an ECC error, falling off the bus) stays
tainted, across restarts, until evidence clears it; NVML reports no repair, so after a GPU reset
or a repair the operator says so, in the plugin's pod of that node::

    kubectl exec -n <namespace> <plugin pod> -- gpu-dra-kubelet-plugin clear-health --gpu <UUID>
    kubectl exec -n <namespace> <plugin pod> -- gpu-dra-kubelet-plugin clear-health --all

It leaves a request in the data dir (the plugin's settings, from the pod's environment, say
where) that the running plugin applies within seconds (`device_health.record`); a new fault
taints the GPU again. See docs/architecture.md, "Health monitor".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gpu_dra.kubelet_plugin.device_health.record import ALL_GPUS, request_clear
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings

COMMAND = "clear-health"


def clear_health(argv: Sequence[str]) -> int:
    """Run the command (``argv`` after its name); the exit status."""
    parser = argparse.ArgumentParser(
        prog=f"gpu-dra-kubelet-plugin {COMMAND}",
        description="Clear the recorded NVML faults of GPUs of this node (after a reset or a "
        "repair); the running plugin untaints them within seconds.",
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--gpu", action="append", metavar="UUID", help="a GPU's UUID (repeat)")
    which.add_argument("--all", action="store_true", help="every GPU of the node")
    parser.add_argument(
        "--data-dir", type=Path, help="the plugin's data dir (default: from its settings)"
    )
    args = parser.parse_args(argv)
    data_dir = args.data_dir or KubeletPluginSettings.parse([]).state_dir
    gpus = [ALL_GPUS] if args.all else args.gpu
    try:
        request = request_clear(data_dir, gpus)
    except OSError as error:
        print(f"{parser.prog}: cannot write the request in {data_dir}: {error}", file=sys.stderr)
        return 1
    print(
        f"clear requested for {', '.join(sorted(request.gpus))} in {data_dir}; the plugin "
        "applies it within seconds (its log says so)"
    )
    return 0
