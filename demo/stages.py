"""The demo's examples and the kubelet plugin flags each group of them runs under.

The tiers a node offers are choices of its plugin, not of a claim: ``--dynamic-mig`` publishes
the H100s as MIG partitions, ``--mps-shares=4`` offers the first A100 as MPS shares, the other
GPUs stay whole. NVIDIA's example manifests (01-05) run first on the plugin as NVIDIA's driver
publishes (no flags); they hold 7 of the 8 GPUs, so they are deleted before the examples of the
other tiers (06-09), which run together on one plugin with both flags; on them the demo then
shows utilization per claim, a busy and an idle claim side by side. The last stage (10) turns on
the controller's idle policy with short intervals: an idle notebook is warned and `gpu-dra
rightsize` says what it needed (demo/idle.py); then, after everything else, two teams share the
node by quotas (demo/quotas.py); it keeps running. Each stage upgrades the chart
release to its flags and values (demo/install.py), applies its examples and reports; each deletes
the examples of the stage before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from e2e.cluster import versions
from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.resourceapi import Device
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings

DEMO = Path(__file__).resolve().parent
EXAMPLES = DEMO / "examples"
PROFILE = DEMO / "node.yaml"
MPS_SHARE_GPU = 4
"""The GPU the last stage offers as MPS shares: index 4, the first A100 80GB of node.yaml."""


@dataclass(frozen=True)
class Stage:
    title: str
    examples: tuple[str, ...]
    """Example directory names, in order."""
    dynamic_mig: bool = False
    plugin_args: tuple[str, ...] = ()
    """Further plugin flags (``--dynamic-mig`` is `dynamic_mig`)."""
    shows_utilization: bool = False
    """After its examples the demo makes some of their claims busy and prints the utilization
    per claim (demo/utilization.py)."""
    idle_reclaim: bool = False
    """The controller's idle policy on and the plugin's claim status quick (demo/install.py);
    after its examples the demo shows an idle claim warned and its right-sizing advice
    (demo/idle.py)."""
    shows_quotas: bool = False
    """Last, two teams share the node by the recipe's quotas, one over its quota
    (demo/quotas.py)."""

    @property
    def plugin_flags(self) -> tuple[str, ...]:
        """Every plugin flag of the stage, ``--dynamic-mig`` included."""
        return (*(("--dynamic-mig",) if self.dynamic_mig else ()), *self.plugin_args)

    @property
    def flags(self) -> str:
        """The stage's plugin flags as a command line would show them."""
        return " ".join(self.plugin_flags) or "(default flags: NVIDIA's publishing)"

    def example_dirs(self) -> list[Path]:
        return [EXAMPLES / name for name in self.examples]


STAGES: tuple[Stage, ...] = (
    Stage(
        "whole GPUs, published as NVIDIA's driver does",
        (
            "01-select-with-cel",
            "02-one-gpu-per-pod",
            "03-two-containers-one-claim",
            "04-one-claim-two-pods",
            "05-device-plugin-style",
        ),
    ),
    Stage(
        "every tier at once: MIG slices of an H100, MPS shares of an A100, per-claim MPS, "
        "time-slicing",
        ("06-dynamic-mig", "07-mps-shares", "08-per-claim-mps", "09-time-slicing"),
        dynamic_mig=True,
        plugin_args=(f"--mps-shares={MPS_SHARE_GPU}",),
        shows_utilization=True,
    ),
    Stage(
        "getting idle GPUs back: the idle policy warns an idle notebook, rightsize says what it "
        "needed",
        ("10-idle-notebook",),
        dynamic_mig=True,
        plugin_args=(f"--mps-shares={MPS_SHARE_GPU}",),
        idle_reclaim=True,
        shows_quotas=True,
    ),
)


def example_dirs() -> list[Path]:
    """Every example directory under demo/examples, sorted by name."""
    return sorted(p for p in EXAMPLES.iterdir() if p.is_dir())


def stage_of(example: Path) -> Stage:
    """The stage an example runs in; a ValueError names an example no stage lists."""
    for stage in STAGES:
        if example.name in stage.examples:
            return stage
    raise ValueError(f"{example.name} is in no stage of demo/stages.py: add it to STAGES")


def title_of(example: Path) -> str:
    return (example / "README.md").read_text().splitlines()[0].lstrip("# ")


def namespace_of(example: Path) -> str:
    for document in yaml.safe_load_all((example / "example.yaml").read_text()):
        if document and document.get("kind") == "Namespace":
            return str(document["metadata"]["name"])
    raise ValueError(f"{example} has no Namespace")


def published_devices(stage: Stage) -> list[Device]:
    """What the kubelet plugin publishes on the demo node with the stage's flags (its own
    settings, discovery and inventory code)."""
    settings = KubeletPluginSettings.parse(
        [f"--node-name={versions.NODE_NAME}", f"--simulate={PROFILE}", *stage.plugin_flags],
        env={},
    )
    host = SimulatedHost.load(str(PROFILE), versions.NODE_NAME)
    dynamic_mig = settings.dynamic_mig_enabled
    found = discover_devices(host.nvml, host.pci, mig_profiles=dynamic_mig)
    inventory = NodeInventory.from_discovery(
        found,
        simulated=True,
        dynamic_mig=dynamic_mig,
        mig_policy=settings.dynamic_mig_profiles,
        mps_shares=settings.mps_shares,
    )
    return inventory.published_devices()
