"""The kubelet plugin's CDI specs for every device of a real-mode node, in a process of its own.

``python -m tests.e2e_tools.plugin_cdi_probe <driver root> <work dir> <nvidia-cdi-hook path>
[--any-node]``,
with the NVML mock library's ``GPU_DRA_NVML_MOCK_*`` variables in the environment (pynvml keeps
one loaded library per process, hence the subprocess). It composes the plugin as its
``__main__`` does in real mode (`discover`, `node_inventory`, `common_edits` over `RealNvml` of
the driver root), builds the real `NodeClaimPreparer` over it (claims from an in-memory API
server, the MPS test double, the recorded time slicer) and prepares one claim at a time: each
published device alone, then MPS and TimeSlicing claims on a whole GPU and on a MIG device. It
prints one JSON list, one entry per claim: ``label``, ``device`` (the DRA device name),
``uuid``, ``sharing`` (null, ``MPS`` or ``TimeSlicing``) and ``spec`` (the claim's CDI spec as
written). Every claim is unprepared before the next; nothing may be left.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from gpu_dra.driver.model import Gpu, MigDevice
from gpu_dra.driver.nvml.real import RealNvml
from gpu_dra.driver.nvml.sysfs import SysfsPciTopology
from gpu_dra.kubelet_plugin.cdi import ContainerEdits
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup.discovery import discover, node_inventory
from gpu_dra.kubelet_plugin.startup.userspace import common_edits
from gpu_dra.kubelet_plugin.time_slicer import RecordedTimeSlicer
from tests.doubles.mps_helpers import kill_processes_under, scratch_root
from tests.fakes.claim_reader import allocation_result, gpu_config, opaque_config, resource_claim
from tests.kubelet_plugin.nodes import NODE, MpsNode, ok

MIG_CONFIG_API_VERSION = "resource.nvidia.com/v1beta1"


class RealModeNode(MpsNode):
    """The plugin's prepare side in real mode: `common` gives the claims' common edits."""

    def __init__(
        self,
        root: Path,
        inventory: NodeInventory,
        mps_root: Path,
        common: Any,
    ) -> None:
        self.common = common
        super().__init__(root, inventory, mps_root)

    def preparer_options(self) -> dict[str, Any]:
        slicer = RecordedTimeSlicer(self.root / "time-slicing.json")
        return {**super().preparer_options(), "common_edits": self.common, "time_slicer": slicer}


def sharing_config(device: Gpu | MigDevice, sharing: dict[str, Any]) -> dict[str, Any]:
    """An opaque config for request ``gpu``: a GpuConfig, or a MigDeviceConfig for MIG."""
    if isinstance(device, MigDevice):
        parameters = {
            "apiVersion": MIG_CONFIG_API_VERSION,
            "kind": "MigDeviceConfig",
            "sharing": sharing,
        }
    else:
        parameters = gpu_config(sharing=sharing)
    return opaque_config(parameters, requests=["gpu"])


def main(argv: list[str]) -> int:
    root, work, hook_path = Path(argv[0]), Path(argv[1]), argv[2]
    # a real node (tests/real_gpu) may have one GPU and no MIG device: claims for what it has
    any_node = "--any-node" in argv[3:]
    settings = KubeletPluginSettings(
        node_name=NODE,
        driver_root=root,
        nvidia_cdi_hook_path=hook_path,
        data_dir=work / "data",
        # it also runs on lent real GPUs (tests/real_gpu): compute modes stay as they are
        mps_exclusive_compute_mode="none",
    )
    nvml = RealNvml(settings.driver_root)
    devices = discover(settings, nvml, SysfsPciTopology())
    inventory = node_inventory(settings, devices)
    common = asyncio.run(common_edits(settings, nvml))
    assert common is not None, "real mode has common edits"

    def current() -> ContainerEdits:
        return common.current()

    mps_root = scratch_root()
    try:
        node = RealModeNode(work / "node", inventory, mps_root, current)
        published: list[tuple[str, Gpu | MigDevice]] = []
        for entry in inventory.published_devices():
            found = inventory.by_name(entry["name"])
            assert isinstance(found, Gpu | MigDevice), entry["name"]
            published.append((entry["name"], found))
        whole = [(n, d) for n, d in published if isinstance(d, Gpu)]
        mig = [(n, d) for n, d in published if isinstance(d, MigDevice)]
        mig_names = {n for n, _ in mig}
        claims: list[tuple[str, str, Gpu | MigDevice, str | None]] = [
            (f"plain {name}", name, device, None) for name, device in published
        ]
        interval = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
        for kind, pool in (("whole GPU", whole), ("MIG device", mig)):
            if len(pool) < 2 and not any_node:
                raise SystemExit(f"the node needs two published {kind}s, has {len(pool)}")
            if pool:
                claims.append((f"MPS on a {kind}", *pool[0], "MPS"))
                claims.append((f"TimeSlicing on a {kind}", *pool[-1], "TimeSlicing"))
        results = []
        for label, name, device, sharing in claims:
            uid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpu-dra-cdi-probe/{label}"))
            configs = []
            if sharing == "MPS":
                configs.append(sharing_config(device, {"strategy": "MPS"}))
            elif sharing == "TimeSlicing":
                # A MigDeviceConfig takes no interval (NVIDIA's API): accepted, changes nothing.
                plain = {"strategy": "TimeSlicing"}
                configs.append(sharing_config(device, plain if name in mig_names else interval))
            claim = node.add(
                resource_claim(
                    uid, "claim", results=[allocation_result(name)], claim_configs=configs
                )
            )
            ok(node.prepare(claim)[uid])
            spec = node.spec(uid)
            assert node.unprepare(claim)[uid] is None
            node.assert_nothing_left(uid)
            results.append(
                {
                    "label": label,
                    "device": name,
                    "uuid": device.uuid,
                    "sharing": sharing,
                    "spec": spec,
                }
            )
        left = kill_processes_under(mps_root)
        assert not left, f"MPS processes left running: {left}"
    finally:
        kill_processes_under(mps_root)
        shutil.rmtree(mps_root, ignore_errors=True)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
