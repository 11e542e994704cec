"""Fixtures of the controller tests: the in-memory apiserver and a private metrics registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.kubelet_plugin.slices.metrics import SliceMetrics
from tests.fakes.slice_api import InMemorySliceApi


@pytest.fixture
def slice_api() -> InMemorySliceApi:
    """An empty apiserver that knows the Nodes node-a and node-b (uid: `uid-<name>`)."""
    return InMemorySliceApi(nodes={"node-a": "uid-node-a", "node-b": "uid-node-b"})


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> SliceMetrics:
    return SliceMetrics(registry)
