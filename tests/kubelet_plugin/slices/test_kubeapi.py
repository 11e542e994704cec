"""The ResourceSlice adapter's pure parts: field selectors, watch events."""

from __future__ import annotations

import json

from gpu_dra.kube.watch import parse_raw_watch_event
from gpu_dra.kubelet_plugin.slices.kubeapi import SliceSelector, slice_event


def test_node_pool_selector_filters_by_driver_and_node() -> None:
    selector = SliceSelector(driver="gpu.example.com", node_name="node-a")

    assert selector.field_selector == "spec.driver=gpu.example.com,spec.nodeName=node-a"


def test_cluster_selector_filters_by_driver_only() -> None:
    assert SliceSelector(driver="gpu.example.com").field_selector == "spec.driver=gpu.example.com"


def test_watch_event_carries_the_slice_and_its_version() -> None:
    line = json.dumps(
        {"type": "DELETED", "object": {"metadata": {"name": "s1", "resourceVersion": "42"}}}
    )

    event = slice_event(*parse_raw_watch_event(line, "ResourceSlices"))

    assert (event.type, event.name, event.resource_version) == ("DELETED", "s1", "42")
