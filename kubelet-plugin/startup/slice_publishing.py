"""Publishing of the node's ResourceSlices at start-up: the layout the apiserver takes
(`slice_layout`) and the publishing turn of the newest ready instance (`publisher_turn`). See
docs/architecture.md, "Start-up of the kubelet plugin".
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence

from kubernetes.client import ApiClient
from prometheus_client import CollectorRegistry

from gpu_dra.driver import slices
from gpu_dra.driver.resourceapi import DeviceTaint
from gpu_dra.kube.client import read_server_version
from gpu_dra.kube.errors import ApiError
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_instances import PluginInstance
from gpu_dra.kubelet_plugin.publishing import PublisherTurn
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.slices.kubeapi import KubernetesSliceApi
from gpu_dra.kubelet_plugin.slices.metrics import SliceMetrics
from gpu_dra.kubelet_plugin.slices.publisher import SlicePublisher

log = logging.getLogger("gpu_dra.kubelet_plugin")


def slice_layout(
    settings: KubeletPluginSettings, server_version: Callable[[], tuple[str, str]]
) -> slices.SliceLayout:
    """`--slice-layout`, or the layout the apiserver's version accepts (1.34 combined, 1.35+
    split; `server_version` gives ``/version``'s major and minor); split when the version cannot
    be read (logged, naming the flag)."""
    if settings.slice_layout is not None:
        return settings.slice_layout
    try:
        major, minor = server_version()
        layout = slices.layout_for_kubernetes(major, minor)
    except (ApiError, ValueError) as error:
        log.warning("%s; publishing the split layout (set --slice-layout to choose)", error)
        return slices.SliceLayout.SPLIT
    log.info("apiserver version %s.%s: %s slice layout", major, minor, layout.value)
    return layout


async def publisher_turn(
    settings: KubeletPluginSettings,
    api_client: ApiClient,
    inventory: NodeInventory,
    registry: CollectorRegistry,
    instance: PluginInstance,
    *,
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
) -> tuple[PublisherTurn, slices.SliceLayout]:
    """Publishing of the node's pool (in the layout the apiserver takes, read only when there
    are counter sets), while this instance is the newest ready one; the layout. ``taints``: the
    devices' taints from the start (the health record's), so that a tainted GPU is never
    published untainted while the health monitor starts."""
    slice_metrics = SliceMetrics(registry)
    layout = slices.SliceLayout.SPLIT
    if inventory.counter_sets():
        layout = await asyncio.to_thread(
            slice_layout, settings, functools.partial(read_server_version, api_client)
        )
    pool = inventory.desired_pool(settings.driver_name, settings.node_name, layout, taints)

    def new_publisher() -> SlicePublisher:
        return SlicePublisher(
            KubernetesSliceApi(api_client),
            driver=settings.driver_name,
            node_name=settings.node_name,
            metrics=slice_metrics,
        )

    turn = PublisherTurn(new_publisher, instance.newest_ready)
    turn.set_desired(pool)
    return turn, layout
