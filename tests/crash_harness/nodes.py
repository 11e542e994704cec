"""The simulated nodes the harness runs on; together they have every tier.

``dynamic``: two H100s (dynamic MIG: whole GPUs, MIG partitions, MPS on those partitions,
time-slicing and per-claim MPS on the whole GPUs; the 3g.40gb partitions offered as MPS shares,
``--mps-shares-on-dynamic-mig``) and two L4s (whole, time-slicing, per-claim MPS; gpu-3 offered
as MPS shares). ``static``: the hgx-h100-mig profile, MIG devices made
before the plugin started (static MIG, with and without MPS; its three 3g.40gb devices offered as
MPS shares, ``--mps-shares-on-mig``) and gpu-7 whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings

NODE_NAME = "crash-node"
STATIC_SHARED_PROFILE = "3g.40gb"
"""The MIG profile whose static devices the ``static`` node offers as MPS shares."""
DYNAMIC_SHARED_PROFILE = "3g.40gb"
"""The MIG profile whose partitions the ``dynamic`` node offers as MPS shares."""

DYNAMIC_PROFILE = {
    "description": "crash harness: 2x H100 (dynamic MIG) and 2x L4 (one offered as MPS shares)",
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "gpus": [
        {"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0", "numaNode": 0,
         "pcieRoot": "pci0000:18"},
        {"model": "H100-SXM5-80GB", "busId": "00000000:43:00.0", "numaNode": 0,
         "pcieRoot": "pci0000:40"},
        {"model": "L4", "busId": "00000000:81:00.0", "numaNode": 0, "pcieRoot": "pci0000:80"},
        {"model": "L4", "busId": "00000000:C1:00.0", "numaNode": 0, "pcieRoot": "pci0000:c0"},
    ],
}  # fmt: skip


@dataclass(frozen=True)
class NodeKind:
    """One simulated node: its name in reports and the plugin flags it runs with."""

    name: str
    dynamic_mig: bool

    def profile(self, root: Path) -> str:
        if not self.dynamic_mig:
            return "hgx-h100-mig"
        path = root / "profile.json"
        if not path.exists():
            path.write_text(json.dumps(DYNAMIC_PROFILE))
        return str(path)

    def settings(self, root: Path) -> KubeletPluginSettings:
        """The plugin's settings on this node, under ``root`` (short: socket paths)."""
        args = [
            f"--node-name={NODE_NAME}",
            f"--simulate={self.profile(root)}",
            f"--kubelet-plugins-dir={root / 'plugins'}",
            f"--kubelet-registry-dir={root / 'registry'}",
            f"--data-dir={root / 'data'}",
            f"--cdi-root={root / 'cdi'}",
            "--metrics-port=0",
        ]
        if self.dynamic_mig:
            args += ["--dynamic-mig=true", "--mps-shares=3", "--mps-share-max-percent=50"]
            args += [f"--mps-shares-on-dynamic-mig={DYNAMIC_SHARED_PROFILE}"]
        else:
            args += [f"--mps-shares-on-mig={STATIC_SHARED_PROFILE}"]
        return KubeletPluginSettings.parse(args)


DYNAMIC = NodeKind("dynamic", dynamic_mig=True)
STATIC = NodeKind("static", dynamic_mig=False)
KINDS = (DYNAMIC, STATIC)
