"""The kubelet plugin's node selection (docs/migration.md): which nodes its DaemonSet's pods may be
scheduled to, judged as the scheduler judges a pod's nodeSelector and required node affinity,
for nodes labelled by node-feature-discovery alone, by the GPU Operator, and while a cluster
moves node by node (`kubeletPlugin.migrationNodeLabel`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helmchart import Rendered, template

BASE: dict[str, Any] = {"gpuResourcesEnabledOverride": True}

NFD_3D: dict[str, str] = {"feature.node.kubernetes.io/pci-0302_10de.present": "true"}
"""Stock node-feature-discovery on a node with a data-centre GPU (PCI class 0302)."""
NFD_VGA: dict[str, str] = {"feature.node.kubernetes.io/pci-0300_10de.present": "true"}
"""Stock node-feature-discovery on a node whose GPU is VGA class (0300)."""
GPU_OPERATOR: dict[str, str] = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.deploy.device-plugin": "true",
}
"""A GPU Operator node with its device plugin on."""
CPU_ONLY: dict[str, str] = {
    "feature.node.kubernetes.io/pci-0300_1af4.present": "true",  # a virtio VGA adapter
    "kubernetes.io/hostname": "cpu-1",
}


def _matches(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator = expression["key"], expression["operator"]
    values = expression.get("values") or []
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise AssertionError(f"operator {operator} not judged here")


def schedules_on(rendered: Rendered, labels: dict[str, str]) -> bool:
    """Whether the plugin's pod fits a node with `labels`: every nodeSelector entry, and one
    term of the required node affinity with all its expressions (the scheduler's rule)."""
    spec = rendered.pod_spec("DaemonSet")
    selector = spec.get("nodeSelector") or {}
    if any(labels.get(key) != value for key, value in selector.items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms")
    if terms is None:
        return True
    return any(
        all(_matches(e, labels) for e in term.get("matchExpressions") or []) for term in terms
    )


@pytest.fixture(scope="module")
def defaults(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return Rendered.of(BASE, tmp_path_factory.mktemp("defaults"))


@pytest.mark.parametrize(
    "labels",
    [NFD_3D, NFD_VGA, {"feature.node.kubernetes.io/pci-10de.present": "true"}, GPU_OPERATOR],
    ids=["nfd-3d-controller", "nfd-vga", "nfd-vendor-only", "gpu-operator"],
)
def test_every_gpu_node_runs_the_plugin_however_it_was_labelled(
    defaults: Rendered, labels: dict[str, str]
) -> None:
    assert schedules_on(defaults, labels)


def test_a_node_without_an_nvidia_gpu_does_not(defaults: Rendered) -> None:
    assert not schedules_on(defaults, CPU_ONLY)
    assert not schedules_on(defaults, {"feature.node.kubernetes.io/pci-0302_1002.present": "true"})


def test_the_gpu_operators_device_plugin_switch_moves_one_node_at_a_time(tmp_path: Path) -> None:
    rendered = Rendered.of(
        {
            **BASE,
            "kubeletPlugin": {"migrationNodeLabel": "nvidia.com/gpu.deploy.device-plugin=false"},
        },
        tmp_path,
    )
    switched_off = {**GPU_OPERATOR, "nvidia.com/gpu.deploy.device-plugin": "false"}

    assert not schedules_on(rendered, GPU_OPERATOR)  # the device plugin still serves it
    assert schedules_on(rendered, switched_off)
    assert not schedules_on(rendered, {**CPU_ONLY, "nvidia.com/gpu.deploy.device-plugin": "false"})


def test_an_opt_in_label_of_ones_own_works_with_nfd_labels_alone(tmp_path: Path) -> None:
    rendered = Rendered.of(
        {**BASE, "kubeletPlugin": {"migrationNodeLabel": "nvidia.com/gpu-dra=true"}}, tmp_path
    )

    assert not schedules_on(rendered, NFD_3D)
    assert schedules_on(rendered, {**NFD_3D, "nvidia.com/gpu-dra": "true"})
    assert not schedules_on(rendered, {**NFD_3D, "nvidia.com/gpu-dra": "false"})


def test_the_migration_label_adds_to_a_node_selector_of_ones_own(tmp_path: Path) -> None:
    rendered = Rendered.of(
        {
            **BASE,
            "kubeletPlugin": {
                "migrationNodeLabel": "nvidia.com/gpu-dra=true",
                "nodeSelector": {"pool": "training"},
            },
        },
        tmp_path,
    )
    migrated = {**NFD_3D, "nvidia.com/gpu-dra": "true"}

    assert schedules_on(rendered, {**migrated, "pool": "training"})
    assert not schedules_on(rendered, migrated)
    assert not schedules_on(rendered, {**NFD_3D, "pool": "training"})


def test_a_migration_label_that_contradicts_the_node_selector_is_refused(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                **BASE,
                "kubeletPlugin": {
                    "migrationNodeLabel": "nvidia.com/gpu-dra=true",
                    "nodeSelector": {"nvidia.com/gpu-dra": "false"},
                },
            }
        )
    )

    result = template(values)

    assert result.returncode != 0
    assert "kubeletPlugin.migrationNodeLabel nvidia.com/gpu-dra=true contradicts" in result.stderr


@pytest.mark.parametrize(
    "label", ["nvidia.com/gpu-dra", "=true", "nvidia.com/gpu-dra=true false", "Bad_Domain/x=1"]
)
def test_a_migration_label_that_is_not_key_equals_value_is_refused(label: str) -> None:
    result = template(
        None, "gpuResourcesEnabledOverride=true", f"kubeletPlugin.migrationNodeLabel={label}"
    )

    assert result.returncode != 0
    assert "'/kubeletPlugin/migrationNodeLabel'" in result.stderr
