"""`h100`: an H100 SXM5 80GB as discovery describes it, for tests of the pure core.

The model's facts (product name, brand, architecture, compute capability, PCI device id, memory,
MIG capability) come from the simulator's model table (`GpuModel.gpu`, which `gpu-dra lint` uses
too); the node-specific ones default to GPU 4 of a node: minor 4, NUMA node 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gpu_dra.driver.model import Gpu
from gpu_dra.driver.nvml.simulated_profiles import builtin_models

H100_MODEL = "H100-SXM5-80GB"


def h100(**changes: Any) -> Gpu:
    """The H100 at minor 4 (``gpu-4``), with `changes` replacing any field."""
    gpu = builtin_models()[H100_MODEL].gpu(
        minor=4,
        uuid="GPU-a75cda02-62ce-2c30-9150-555ef08935e2",
        driver_version="580.65.06",
        cuda_driver_version=13000,
        pci_bus_id="0000:65:00.0",
    )
    return dataclasses.replace(gpu, **{"pcie_root": "pci0000:64", "numa_node": 1, **changes})
