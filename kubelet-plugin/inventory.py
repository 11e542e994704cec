"""This node's devices: what gets published, and what a container receives for each.

Real GPUs get their device nodes (`/dev/nvidia<minor>` plus the control nodes). Simulated GPUs
have no device nodes, so they get what a container can prove instead: per-device environment
variables and a read-only file with the device's facts, mounted from the plugin's data dir. Both
kinds also carry the per-device environment, so workloads and tests can see which GPU they got.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpu_dra.driver import attributes, slices
from gpu_dra.driver.model import Gpu
from gpu_dra.driver.naming import gpu_device_name
from gpu_dra.driver.resourceapi import Device
from gpu_dra.kubelet_plugin.cdi import ContainerEdits, DeviceNode, Mount

# Control nodes every CUDA process needs next to its /dev/nvidia<minor>.
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
# Where simulated devices' fact files appear inside containers.
CONTAINER_DEVICE_DIR = "/run/gpu-dra/devices"


def device_env_prefix(device_name: str) -> str:
    """`gpu-3` -> `GPU_DRA_GPU_3`: per-device variables never collide in one container."""
    return "GPU_DRA_" + device_name.upper().replace("-", "_")


@dataclass(frozen=True)
class NodeInventory:
    """The GPUs of this node, by device name, and how they are handed to containers."""

    gpus: tuple[Gpu, ...]
    simulated: bool
    driver_root: Path = Path("/")

    def __post_init__(self) -> None:
        names = [gpu_device_name(gpu.minor) for gpu in self.gpus]
        if len(set(names)) != len(names):
            raise ValueError(f"two GPUs share a minor number: {sorted(names)}")

    def by_name(self, device_name: str) -> Gpu | None:
        for gpu in self.gpus:
            if gpu_device_name(gpu.minor) == device_name:
                return gpu
        return None

    def published_devices(self) -> list[Device]:
        """Devices in PCI bus order (the order NVIDIA's driver publishes them in)."""
        return [attributes.gpu_device(gpu) for gpu in sorted(self.gpus, key=lambda g: g.pci_bus_id)]

    def desired_pool(self, driver: str, node_name: str) -> slices.DesiredPool:
        return slices.build_pool(
            driver,
            node_name,
            node_name,
            self.published_devices(),
            order=slices.DeviceOrder.GIVEN,
        )

    def container_edits(self, gpu: Gpu, claim_dir: Path) -> ContainerEdits:
        """Edits for one whole GPU; simulated ones write their fact file under `claim_dir`."""
        name = gpu_device_name(gpu.minor)
        prefix = device_env_prefix(name)
        env = {f"{prefix}_UUID": gpu.uuid, f"{prefix}_PRODUCT": gpu.product_name}
        if self.simulated:
            facts = claim_dir / f"{name}.json"
            facts.write_text(json.dumps(_facts(gpu), indent=2, sort_keys=True) + "\n")
            facts.chmod(0o644)
            return ContainerEdits(
                env={**env, f"{prefix}_SIMULATED": "true"},
                mounts=(
                    Mount(
                        host_path=str(facts),
                        container_path=f"{CONTAINER_DEVICE_DIR}/{name}.json",
                        options=("ro", "nosuid", "nodev", "bind"),
                    ),
                ),
            )
        nodes = [f"/dev/nvidia{gpu.minor}", *CONTROL_DEVICE_NODES]
        return ContainerEdits(
            env=env,
            device_nodes=tuple(
                DeviceNode(path=node, host_path=self._host_path(node), permissions="rw")
                for node in nodes
            ),
        )

    def _host_path(self, node: str) -> str | None:
        if self.driver_root == Path("/"):
            return None
        return str(self.driver_root / node.lstrip("/"))


def _facts(gpu: Gpu) -> dict[str, object]:
    return {
        "name": gpu_device_name(gpu.minor),
        "uuid": gpu.uuid,
        "productName": gpu.product_name,
        "pciBusID": gpu.pci_bus_id,
        "memoryBytes": gpu.memory_bytes,
        "minor": gpu.minor,
    }
