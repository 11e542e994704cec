"""Taking the node at start-up: the guard against another owner of its GPUs and this process's
registration as a plugin instance of the data dir (`register_instance`, which removes the
sockets nobody serves). While NVIDIA's device plugin or another DRA driver serves the node, or
the guard cannot check, `take_node` waits: it reports why (log, an Event on the Node when the
reason changes and every `EVENT_REPEAT_S`, health readiness NOT_SERVING with liveness SERVING)
and checks again every `--guard-recheck-interval`, so that a node moves to gpu-dra by itself
once the other owner is gone (docs/migration.md). `guard_node` is one check that raises. See
docs/deployment.md#start-up-guard and docs/architecture.md, "Start-up of the kubelet plugin".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from kubernetes.client import ApiClient

from gpu_dra.kube.client import new_api_client
from gpu_dra.kube.errors import ApiError
from gpu_dra.kubelet_plugin.guard import (
    GuardApi,
    KubernetesGuardApi,
    NodeCheck,
    NodeConflictError,
    check_node,
    guard,
    refusal_message,
    refusals,
    report_refusal,
)
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry, PluginInstance
from gpu_dra.kubelet_plugin.plugin_sockets import (
    MAX_SOCKET_PATH_BYTES,
    remove_stale_sockets,
    socket_paths,
)
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup import StartupError

log = logging.getLogger(__name__)

EVENT_REPEAT_S = 600.0
"""While the reason stays the same, how often its Event is recorded again (the apiserver drops
Events after an hour by default)."""


class NodeWaitReport(Protocol):
    """Where the wait shows besides the log: the health service (`PluginHealth`)."""

    def waiting_for_node(self, reason: str) -> None: ...

    def node_taken(self) -> None: ...


def _node_check(settings: KubeletPluginSettings) -> NodeCheck:
    live = InstanceRegistry(settings.state_dir).live()
    return NodeCheck(
        node_name=settings.node_name,
        driver_name=settings.driver_name,
        plugins_dir=settings.kubelet_plugins_dir,
        registry_dir=settings.kubelet_registry_dir,
        device_plugins_dir=settings.device_plugins_dir,
        gpu_dra_sockets=frozenset(Path(path) for info in live for path in info.sockets),
    )


async def take_node(
    settings: KubeletPluginSettings,
    api: GuardApi,
    report: NodeWaitReport,
    *,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Return once nothing else serves the node's GPUs; until then report why and check again
    every `settings.guard_recheck_interval_s` (a check that cannot be made waits too)."""
    reported: str | None = None
    reported_at = 0.0
    while True:
        try:
            node, findings = await asyncio.to_thread(check_node, api, _node_check(settings))
        except ApiError as error:
            reason = f"cannot check whether something else hands out this node's GPUs: {error}"
            if reason != reported:
                log.error("not serving node %s yet: %s", settings.node_name, reason)
                reported = reason
        else:
            refusing = refusals(
                findings,
                allow_device_plugin=settings.allow_nvidia_device_plugin,
                node_name=settings.node_name,
            )
            if not refusing:
                if reported is not None:
                    log.info("node %s is free of other GPU owners: starting", settings.node_name)
                report.node_taken()
                return
            reason = refusal_message(refusing)
            now = clock()
            if reason != reported or now - reported_at >= EVENT_REPEAT_S:
                await asyncio.to_thread(
                    report_refusal, api, node, refusing, event_namespace=settings.event_namespace
                )
                reported, reported_at = reason, now
        report.waiting_for_node(reason)
        log.debug(
            "node %s: checking again in %.0f s",
            settings.node_name,
            settings.guard_recheck_interval_s,
        )
        await sleep(settings.guard_recheck_interval_s)


def guard_node(settings: KubeletPluginSettings, api: GuardApi) -> None:
    """Refuse (`StartupError`, after an Event on the Node) a node whose GPUs NVIDIA's device
    plugin or another DRA driver of this name already serves (another running gpu-dra instance
    of this data dir is a rolling update, not a conflict); a check that cannot be made refuses
    too."""
    check = _node_check(settings)
    try:
        guard(
            api,
            check,
            event_namespace=settings.event_namespace,
            allow_device_plugin=settings.allow_nvidia_device_plugin,
        )
    except NodeConflictError as error:
        raise StartupError(f"this node's GPUs are already handed out: {error}") from error
    except ApiError as error:
        raise StartupError(
            f"cannot check whether something else hands out this node's GPUs: {error}"
        ) from error


async def guarded_api_client(settings: KubeletPluginSettings, report: NodeWaitReport) -> ApiClient:
    """The API client, once `take_node` has the node for this plugin."""
    api_client = new_api_client(settings.kubeconfig)
    await take_node(settings, KubernetesGuardApi(api_client), report)
    return api_client


def register_instance(settings: KubeletPluginSettings) -> PluginInstance:
    """This process as a plugin instance of the data dir, after forgetting dead instances and
    removing their sockets (and any other socket of this driver nobody serves)."""
    registry = InstanceRegistry(settings.state_dir)
    dead = registry.remove_dead()
    instance_id = settings.instance_id or None
    sockets = socket_paths(
        settings.driver_name,
        settings.kubelet_plugins_dir,
        settings.kubelet_registry_dir,
        instance_id,
    )
    for path in sockets:
        if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise StartupError(
                f"socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes: use a "
                "shorter --kubelet-plugins-dir (or --instance-id)"
            )
    instance = registry.register(settings.instance_id, sockets)
    live = {Path(path) for info in registry.live() for path in info.sockets}
    candidates = {Path(path) for info in dead for path in info.sockets}
    socket_dir = settings.kubelet_plugins_dir.absolute() / settings.driver_name
    registry_dir = settings.kubelet_registry_dir.absolute()
    with contextlib.suppress(OSError):
        candidates.update(socket_dir.glob("dra*.sock"))
    with contextlib.suppress(OSError):
        candidates.update(registry_dir.glob(f"{settings.driver_name}-*reg.sock"))
    remove_stale_sockets(candidates, keep=live)
    return instance
