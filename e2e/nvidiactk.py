"""NVIDIA's ``nvidia-ctk`` and ``nvidia-cdi-hook``, built from the pinned container toolkit.

`build` builds both from ``e2e/toolchain/nvidia-container-toolkit`` (Go module
``github.com/NVIDIA/nvidia-container-toolkit`` at `VERSION`, cached like every test-bed tool)
and returns the directory holding them. ``nvidia-ctk cdi generate`` is the independent oracle
for gpu-dra's CDI specs; see docs/real-nodes.md, "NVIDIA's nvidia-ctk as an oracle".
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from e2e.cluster.paths import ClusterPaths
from e2e.cluster.toolchain import ToolBuild, build_tool

VERSION: Final = "v1.20.1"
"""The toolkit release pinned in ``e2e/toolchain/nvidia-container-toolkit/go.mod``."""

MODULE: Final = "github.com/NVIDIA/nvidia-container-toolkit"
NVIDIA_CTK: Final = "nvidia-ctk"
NVIDIA_CDI_HOOK: Final = "nvidia-cdi-hook"

TOOL: Final = ToolBuild(
    name="nvidia-container-toolkit",
    outputs=(
        (NVIDIA_CTK, f"{MODULE}/cmd/{NVIDIA_CTK}"),
        (NVIDIA_CDI_HOOK, f"{MODULE}/cmd/{NVIDIA_CDI_HOOK}"),
    ),
    # go-nvml (NVML through dlopen) has no build without cgo.
    cgo=True,
    # What NVIDIA's Makefile sets, so that `--version` names the release.
    ldflags=f"-s -w -X {MODULE}/internal/info.version={VERSION.removeprefix('v')}",
)


def build(paths: ClusterPaths) -> Path:
    """The directory holding ``nvidia-ctk`` and ``nvidia-cdi-hook`` (built now unless cached)."""
    # go-nvml's cgo wrappers call functions nvml.h marks deprecated: one warning each.
    return build_tool(paths, TOOL, env={"CGO_CFLAGS": "-O2 -g -Wno-deprecated-declarations"})
