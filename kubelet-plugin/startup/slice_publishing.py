"""Publishing of the node's ResourceSlices at start-up: the layout the apiserver takes
(`slice_layout`) and the publishing turn of the newest ready instance (`publisher_turn`). See
docs/architecture.md, "Start-up of the kubelet plugin".
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Final

from kubernetes.client import ApiClient
from prometheus_client import CollectorRegistry

from gpu_dra.driver import slices
from gpu_dra.driver.health import TaintEffect, rfc3339
from gpu_dra.driver.naming import gpu_device_name
from gpu_dra.driver.resourceapi import DeviceTaint
from gpu_dra.kube.client import read_server_version
from gpu_dra.kube.errors import ApiError
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_instances import PluginInstance
from gpu_dra.kubelet_plugin.prepare import NodeClaimPreparer
from gpu_dra.kubelet_plugin.publishing import NodeTaints, PublisherTurn
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
    taints: NodeTaints | None = None,
) -> tuple[PublisherTurn, slices.SliceLayout]:
    """Publishing of the node's pool (in the layout the apiserver takes, read only when there
    are counter sets), while this instance is the newest ready one; the layout. ``taints``: the
    devices' taints (`node_taints`), published from the first slice on, so that a tainted GPU
    is never published untainted while the health monitor starts; each change republishes."""
    slice_metrics = SliceMetrics(registry)
    layout = slices.SliceLayout.SPLIT
    if inventory.counter_sets():
        layout = await asyncio.to_thread(
            slice_layout, settings, functools.partial(read_server_version, api_client)
        )
    first = None if taints is None else taints.merged()
    pool = inventory.desired_pool(settings.driver_name, settings.node_name, layout, first)

    def new_publisher() -> SlicePublisher:
        return SlicePublisher(
            KubernetesSliceApi(api_client),
            driver=settings.driver_name,
            node_name=settings.node_name,
            metrics=slice_metrics,
        )

    turn = PublisherTurn(new_publisher, instance.newest_ready)
    turn.set_desired(pool)
    if taints is not None:
        taints.publish_with(
            lambda merged: turn.set_desired(
                inventory.desired_pool(settings.driver_name, settings.node_name, layout, merged)
            )
        )
    return turn, layout


HEALTH: Final = "health"
"""`NodeTaints` source of the health monitor's taints."""


def node_taints(
    settings: KubeletPluginSettings,
    inventory: NodeInventory,
    health: Mapping[str, Sequence[DeviceTaint]],
    unswept: Mapping[str, str],
) -> NodeTaints:
    """The devices' taints at start: ``health``'s (the health record's) and those of the GPUs
    whose MIG sweep failed (`mig_leftover_taints`)."""
    leftovers = mig_leftover_taints(inventory, unswept, settings.driver_name, datetime.now(UTC))
    return NodeTaints({HEALTH: health, MIG_LEFTOVERS: leftovers})


MIG_LEFTOVERS: Final = "mig-leftovers"
"""Taint key (``<driver>/mig-leftovers``) and `NodeTaints` source of the GPUs whose MIG sweep
failed."""
SWEEP_RETRY_S: Final = 30.0
"""Between two sweeps of the GPUs whose start-up sweep failed."""


def mig_leftover_taints(
    inventory: NodeInventory, unswept: Mapping[str, str], driver: str, since: datetime
) -> dict[str, list[DeviceTaint]]:
    """The whole-GPU device of each GPU in ``unswept`` (UUID -> why), tainted ``NoSchedule``:
    it may hold MIG instances no claim owns (and MIG mode on), so the scheduler must not hand
    it out whole until a sweep succeeds."""
    names = {gpu.uuid: gpu_device_name(gpu.minor) for gpu in inventory.gpus}

    def taint() -> DeviceTaint:
        return {
            "key": f"{driver}/{MIG_LEFTOVERS}",
            "effect": TaintEffect.NO_SCHEDULE.value,
            "timeAdded": rfc3339(since),
        }

    return {names[uuid]: [taint()] for uuid in sorted(unswept) if uuid in names}


async def sweep_until_clean(
    preparer: NodeClaimPreparer,
    taints: NodeTaints,
    inventory: NodeInventory,
    driver: str,
    unswept: Mapping[str, str],
    *,
    interval_s: float = SWEEP_RETRY_S,
) -> None:
    """While GPUs are ``unswept`` (their MIG sweep failed), every ``interval_s`` sweep them
    again and untaint those swept; returns once none is left (at once when none is)."""
    since = datetime.now(UTC)
    left = dict(unswept)
    while left:
        await asyncio.sleep(interval_s)
        try:
            left = await preparer.retry_mig_sweeps()
        except Exception:  # a bug or a lock time-out: the GPUs stay tainted, try again
            log.exception("sweeping the GPUs with MIG leftovers again failed")
            continue
        taints.set(MIG_LEFTOVERS, mig_leftover_taints(inventory, left, driver, since))
        if not left:
            log.info("every GPU is swept of leftover MIG instances")
