"""The dynamic MIG flags: `--dynamic-mig`, the MIG profiles it publishes, NVIDIA's
`--feature-gates` (``DynamicMIG=true`` is `--dynamic-mig`) and the ResourceSlice layout of the
shared counters. See docs/config.md#gpu-dra-kubelet-plugin.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from gpu_dra.driver.mig_policy import DEFAULT_POLICY_TEXT, MigPolicyError, parse_policy
from gpu_dra.driver.slices import SliceLayout
from gpu_dra.kubelet_plugin.settings.values import parse_bool, parse_feature_gates


def add_dynamic_mig_options(option: Callable[..., None], environ: Mapping[str, str]) -> None:
    """`--dynamic-mig`, `--dynamic-mig-profiles`, `--feature-gates` and `--slice-layout`."""
    option(
        "--dynamic-mig",
        "publish MIG-capable GPUs as partitionable devices: every placement of every MIG "
        "profile --dynamic-mig-profiles offers, MIG slices made on demand (true/false; a bare "
        "flag means true)",
        "false",
        nargs="?",
        const="true",
    )
    option(
        "--dynamic-mig-profiles",
        "MIG profiles dynamic MIG publishes: [<model>=]<profile>,... entries separated by ';'; "
        "a profile is a name (1g.10gb, 1g.10gb+me), a shape (1g, 3g, 1g+me: the shape's "
        "smallest profile) or all",
        DEFAULT_POLICY_TEXT,
    )
    option(
        "--feature-gates",
        "NVIDIA's feature gates, Name=true|false,...: DynamicMIG=true is --dynamic-mig; "
        "also read from FEATURE_GATES",
        environ.get("FEATURE_GATES"),
    )
    option(
        "--slice-layout",
        "where shared counters go: auto (from the apiserver version), split (Kubernetes "
        "1.35+: own slices) or combined (1.34: with their devices)",
        "auto",
    )


def dynamic_mig_settings(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> dict[str, Any]:
    """`--dynamic-mig`, `--dynamic-mig-profiles`, `--feature-gates` and `--slice-layout` (None =
    auto), or a usage error."""
    try:
        dynamic_mig = parse_bool(args.dynamic_mig or "", "--dynamic-mig")
        feature_gates = parse_feature_gates(args.feature_gates or "")
    except ValueError as error:
        parser.error(str(error))
    try:
        mig_policy = parse_policy(args.dynamic_mig_profiles or DEFAULT_POLICY_TEXT)
    except MigPolicyError as error:
        parser.error(f"--dynamic-mig-profiles: {error}")
    layout_name = (args.slice_layout or "auto").strip().lower()
    layouts = {layout.value: layout for layout in SliceLayout}
    if layout_name != "auto" and layout_name not in layouts:
        parser.error(f"--slice-layout must be auto, split or combined, got {args.slice_layout!r}")
    return {
        "dynamic_mig": dynamic_mig,
        "dynamic_mig_profiles": mig_policy,
        "feature_gates": feature_gates,
        "slice_layout": layouts.get(layout_name),
    }
