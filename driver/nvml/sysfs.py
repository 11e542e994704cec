"""`PciTopology` read from Linux sysfs (``/sys/bus/pci/devices/<bus id>``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from gpu_dra.driver.nvml.interface import PciTopology

_ROOT_COMPONENT: Final = re.compile(r"^pci[0-9a-f]{4,}:[0-9a-f]{2}$")


class SysfsPciTopology:
    """PCIe root from the device symlink's ``pci<domain>:<bus>`` component, NUMA from ``numa_node``.

    ``/sys/bus/pci/devices/0000:65:00.0 -> ../../../devices/pci0000:64/0000:64:00.0/0000:65:00.0``
    gives ``pci0000:64``. Unreadable entries give None (the attribute is then left out).
    """

    def __init__(self, sysfs_root: Path = Path("/sys")) -> None:
        self.sysfs_root = sysfs_root

    def pcie_root(self, pci_bus_id: str) -> str | None:
        try:
            target = os.readlink(self._device(pci_bus_id))
        except OSError:
            return None
        for component in Path(target).parts:
            if _ROOT_COMPONENT.match(component):
                return component
        return None

    def numa_node(self, pci_bus_id: str) -> int | None:
        try:
            text = (self._device(pci_bus_id) / "numa_node").read_text(encoding="ascii")
            node = int(text.strip())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None

    def _device(self, pci_bus_id: str) -> Path:
        return self.sysfs_root / "bus" / "pci" / "devices" / pci_bus_id


if TYPE_CHECKING:
    _conforms_to_pci: type[PciTopology] = SysfsPciTopology
