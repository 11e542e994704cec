"""A node's ResourceSlices as the kubelet plugin writes them, per publishing shape, and their size.

`node_slices` renders the slices of one simulated node with the plugin's own code (simulated
discovery, `NodeInventory.desired_pool`, the publisher's `plan_pool` and Node owner) for a shape:
``whole`` (whole GPUs), ``mps-shares`` (every GPU offered as MPS shares), ``dynamic-mig-all``
(``--dynamic-mig --dynamic-mig-profiles=all``) or ``dynamic-mig`` (with a policy, default
``--dynamic-mig-profiles``'s). A scheduler benchmark can create these objects for N fake nodes.
`stored_bytes` is their size as compact JSON with the metadata the apiserver adds (name, uid,
resourceVersion, creationTimestamp, generation, one managedFields entry), which is how the
apiserver serves them to every watcher. See docs/performance.md, "ResourceSlice bytes".

    python -m bench.slice_bytes [--machine hgx-h100] [--dynamic-mig-profiles POLICY] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpu_dra.driver import shares
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.mig_policy import DEFAULT, EVERYTHING, MigPolicy, parse_policy
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.slices import SliceLayout
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.slices.kubeapi import ResourceSlice
from gpu_dra.kubelet_plugin.slices.plan import node_owner, plan_pool

SHAPES: Final = ("whole", "mps-shares", "dynamic-mig-all", "dynamic-mig")
MACHINE: Final = "hgx-h100"
_NODE_UID: Final = "6c0f9a8e-1d2b-4e3f-9a5b-7c8d9e0f1a2b"


def node_slices(
    node_name: str,
    shape: str,
    *,
    machine: str = MACHINE,
    policy: MigPolicy = DEFAULT,
    node_uid: str = _NODE_UID,
    driver: str = DEFAULT_DRIVER_NAME,
    layout: SliceLayout = SliceLayout.SPLIT,
) -> list[ResourceSlice]:
    """The ResourceSlices the plugin creates for `node_name` on a simulated `machine` in
    `shape` (one of `SHAPES`; `policy` is used by ``dynamic-mig`` only), owned by the Node."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    host = SimulatedHost.load(machine, node_name)
    dynamic_mig = shape.startswith("dynamic-mig")
    found = discover_devices(host.nvml, host.pci, mig_profiles=dynamic_mig)
    inventory = NodeInventory.from_discovery(
        found,
        simulated=True,
        dynamic_mig=dynamic_mig,
        mig_policy=EVERYTHING if shape == "dynamic-mig-all" else policy,
        mps_shares=shares.ShareSelection(every_gpu=shape == "mps-shares"),
    )
    desired = inventory.desired_pool(driver, node_name, layout)
    plan = plan_pool(desired, [], last_generation=0).owned_by(node_owner(node_name, node_uid))
    return list(plan.creates)


def stored(body: ResourceSlice, index: int) -> dict[str, Any]:
    """`body` with the metadata the apiserver adds when it creates it (typical values)."""
    metadata: dict[str, Any] = dict(body["metadata"])
    prefix = metadata.pop("generateName", "")
    metadata.update(
        name=f"{prefix}{index:05d}"[: len(prefix) + 5],
        uid="0f0e5a3c-2b1d-4c5e-8f7a-9b0c1d2e3f40",
        resourceVersion="1234567",
        generation=1,
        creationTimestamp="2026-11-26T00:00:00Z",
        managedFields=[
            {
                "manager": "gpu-dra-kubelet-plugin",
                "operation": "Update",
                "apiVersion": "resource.k8s.io/v1",
                "time": "2026-11-26T00:00:00Z",
                "fieldsType": "FieldsV1",
                "fieldsV1": _fields_v1(body),
            }
        ],
    )
    return {**body, "metadata": metadata}


def _fields_v1(body: ResourceSlice) -> dict[str, Any]:
    """What a create records as owned: every field written, lists being atomic."""
    meta = {f"f:{key}": {} for key in body["metadata"] if key != "generateName"}
    spec = {f"f:{key}": {} for key in body["spec"]}
    spec["f:pool"] = {f"f:{key}": {} for key in body["spec"]["pool"]}
    return {"f:metadata": meta, "f:spec": spec}


def stored_bytes(slices: Sequence[ResourceSlice]) -> int:
    """Compact JSON bytes of `slices` as the apiserver stores and serves them."""
    return sum(
        len(json.dumps(stored(body, index), separators=(",", ":")).encode())
        for index, body in enumerate(slices)
    )


@dataclass(frozen=True)
class ShapeSize:
    shape: str
    slices: int
    devices: int
    counter_sets: int
    consumed_counters: int
    bytes: int

    def to_json(self) -> dict[str, object]:
        return {
            "shape": self.shape,
            "slices": self.slices,
            "devices": self.devices,
            "counterSets": self.counter_sets,
            "consumedCounters": self.consumed_counters,
            "bytes": self.bytes,
        }


def measure(shape: str, *, machine: str = MACHINE, policy: MigPolicy = DEFAULT) -> ShapeSize:
    slices = node_slices("bench-node-000", shape, machine=machine, policy=policy)
    devices = [device for body in slices for device in body["spec"].get("devices", [])]
    return ShapeSize(
        shape=shape,
        slices=len(slices),
        devices=len(devices),
        counter_sets=sum(len(body["spec"].get("sharedCounters", [])) for body in slices),
        consumed_counters=sum(
            len(entry["counters"]) for d in devices for entry in d.get("consumesCounters", [])
        ),
        bytes=stored_bytes(slices),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slice_bytes", description=__doc__)
    parser.add_argument("--machine", default=MACHINE, help="simulated machine profile")
    parser.add_argument(
        "--dynamic-mig-profiles",
        default=str(DEFAULT),
        help="the policy of the dynamic-mig shape (default: the plugin's default)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per shape")
    args = parser.parse_args(argv)
    policy = parse_policy(args.dynamic_mig_profiles)
    sizes = [measure(shape, machine=args.machine, policy=policy) for shape in SHAPES]
    if args.json:
        for size in sizes:
            print(json.dumps(size.to_json()))
        return 0
    print(
        f"{'shape':<16} {'slices':>6} {'devices':>7} {'counters':>8} {'bytes':>8} {'B/device':>8}"
    )
    for size in sizes:
        per_device = size.bytes // max(size.devices, 1)
        print(
            f"{size.shape:<16} {size.slices:>6} {size.devices:>7} {size.consumed_counters:>8} "
            f"{size.bytes:>8} {per_device:>8}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
