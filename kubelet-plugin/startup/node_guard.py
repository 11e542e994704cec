"""Taking the node at start-up: the guard against another owner of its GPUs (`guard_node`,
`StartupError` after an Event on the Node) and this process's registration as a plugin instance
of the data dir (`register_instance`, which removes the sockets nobody serves). See
docs/deployment.md#start-up-guard and docs/architecture.md, "Start-up of the kubelet plugin".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from kubernetes.client import ApiClient

from gpu_dra.kube.client import new_api_client
from gpu_dra.kube.errors import ApiError
from gpu_dra.kubelet_plugin.guard import (
    GuardApi,
    KubernetesGuardApi,
    NodeCheck,
    NodeConflictError,
    guard,
)
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry, PluginInstance
from gpu_dra.kubelet_plugin.plugin_sockets import (
    MAX_SOCKET_PATH_BYTES,
    remove_stale_sockets,
    socket_paths,
)
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup import StartupError


def guard_node(settings: KubeletPluginSettings, api: GuardApi) -> None:
    """Refuse (`StartupError`, after an Event on the Node) a node whose GPUs NVIDIA's device
    plugin or another DRA driver of this name already serves (another running gpu-dra instance
    of this data dir is a rolling update, not a conflict); a check that cannot be made refuses
    too."""
    live = InstanceRegistry(settings.state_dir).live()
    check = NodeCheck(
        node_name=settings.node_name,
        driver_name=settings.driver_name,
        plugins_dir=settings.kubelet_plugins_dir,
        registry_dir=settings.kubelet_registry_dir,
        device_plugins_dir=settings.device_plugins_dir,
        gpu_dra_sockets=frozenset(Path(path) for info in live for path in info.sockets),
    )
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


async def guarded_api_client(settings: KubeletPluginSettings) -> ApiClient:
    """The API client, once `guard_node` let the plugin start on this node."""
    api_client = new_api_client(settings.kubeconfig)
    await asyncio.to_thread(guard_node, settings, KubernetesGuardApi(api_client))
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
