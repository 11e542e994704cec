"""sliceplan.plan_pool on hand-made live slices: what an update keeps and what it drops."""

from __future__ import annotations

from typing import Any, cast

from gpu_dra.driver.slices import DeviceOrder, build_pool
from gpu_dra.kubelet_plugin.slices.kubeapi import ResourceSlice
from gpu_dra.kubelet_plugin.slices.plan import (
    node_owner,
    plan_pool,
    spec_hash,
    spec_hash_annotation,
)

DRIVER = "gpu.example.com"
NODE = "node-a"


def test_update_keeps_labels_and_other_owners_but_not_server_managed_fields() -> None:
    desired = build_pool(DRIVER, NODE, NODE, [{"name": "gpu-0"}], order=DeviceOrder.GIVEN)
    other_owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u"}
    live = cast(
        "ResourceSlice",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "name": "s1",
                "uid": "uid-s1",
                "resourceVersion": "7",
                "labels": {"team": "infra"},
                "managedFields": [{"manager": "gpu-dra"}],
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "ownerReferences": [other_owner],
            },
            "spec": {**desired.slices[0], "devices": []},
        },
    )

    plan = plan_pool(desired, [live], last_generation=0).owned_by(node_owner(NODE, "uid-n"))

    (update,) = plan.updates
    metadata = cast("dict[str, Any]", update["metadata"])
    assert metadata["name"] == "s1"
    assert metadata["resourceVersion"] == "7"
    assert metadata["labels"] == {"team": "infra"}
    assert metadata["annotations"] == {spec_hash_annotation(DRIVER): spec_hash(desired.slices[0])}
    assert metadata["ownerReferences"] == [other_owner, node_owner(NODE, "uid-n")]
    assert "managedFields" not in metadata
    assert "creationTimestamp" not in metadata
    assert update["spec"]["pool"]["generation"] == 1


def test_content_hash_ignores_generation_and_slice_count() -> None:
    desired = build_pool(DRIVER, NODE, NODE, [{"name": "gpu-0"}], order=DeviceOrder.GIVEN)
    spec = desired.slices[0]
    restamped = {**spec, "pool": {**spec["pool"], "generation": 9, "resourceSliceCount": 3}}

    assert spec_hash(cast("Any", restamped)) == spec_hash(spec)
