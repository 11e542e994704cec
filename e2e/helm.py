"""``helm``, built from the pinned Go module like every test-bed tool.

`build` builds ``helm`` from ``e2e/toolchain/helm`` (Go module ``helm.sh/helm/v4`` at `VERSION`,
cached under ``<cache>/tools/helm-<hash>``) and returns the directory holding it; `binary` is
the program itself. The chart in ``deployments/helm/gpu-dra`` is linted and rendered with it
(tests/test_helm_chart.py) and installed with it in e2e; see docs/deployment.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from e2e.cluster.paths import ClusterPaths
from e2e.cluster.toolchain import ToolBuild, build_tool

VERSION: Final = "v4.3.1"
"""The Helm release pinned in ``e2e/toolchain/helm/go.mod``."""

MODULE: Final = "helm.sh/helm/v4"
HELM: Final = "helm"

TOOL: Final = ToolBuild(
    name="helm",
    outputs=((HELM, f"{MODULE}/cmd/{HELM}"),),
    # What Helm's Makefile sets for a release build, so that `helm version` names the release.
    ldflags=f"-s -w -X {MODULE}/internal/version.version={VERSION}",
)


def build(paths: ClusterPaths) -> Path:
    """The directory holding ``helm`` (built now unless cached)."""
    return build_tool(paths, TOOL)


def binary(paths: ClusterPaths) -> Path:
    """The ``helm`` program (built now unless cached)."""
    return build(paths) / HELM
