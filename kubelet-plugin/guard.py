"""Start-up guard: the plugin does not take a node whose GPUs something else already hands out.

Checked before recovery touches anything (`check_node`): NVIDIA's device plugin (the Node's
allocatable `nvidia.com/gpu`, `nvidia.com/gpu.*` or `nvidia.com/mig-*` above 0, or a socket
`nvidia-*.sock` in the kubelet's device-plugins directory that accepts connections), pods of the
node still holding GPUs the device plugin handed out, another process serving this driver's DRA
or registration socket (except the sockets of another running gpu-dra instance of this data
dir: a rolling update), and ResourceSlices of this driver for this node that gpu-dra did not
publish. Each finding names the step that moves the node to gpu-dra. A refusal is logged and
recorded as a Warning Event on the Node; the plugin then waits and checks again
(`gpu_dra.kubelet_plugin.startup.node_guard`). `--allow-nvidia-device-plugin` turns the device
plugin findings into warnings; the others cannot be overridden. See docs/deployment.md,
"Start-up guard", and docs/migration.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, cast

from kubernetes import client as k8s

from gpu_dra.kube import errors
from gpu_dra.kube.client import decoded_object, list_objects, translated_errors
from gpu_dra.kubelet_plugin.slices.kubeapi import RESOURCE_SLICES, ResourceSlice, SliceSelector
from gpu_dra.kubelet_plugin.slices.plan import spec_hash_annotation

log = logging.getLogger(__name__)

DEVICE_PLUGIN_REASON = "NvidiaDevicePluginPresent"
DEVICE_PLUGIN_PODS_REASON = "NvidiaDevicePluginPodsRunning"
DRA_DRIVER_REASON = "GpuDraDriverConflict"
GPU_OPERATOR_DEVICE_PLUGIN_LABEL = "nvidia.com/gpu.deploy.device-plugin"
"""The GPU Operator's per-node switch for its device plugin DaemonSet ("false": off)."""
MIGRATION_DOC = "docs/migration.md"
COMPONENT = "gpu-dra-kubelet-plugin"
EVENT_MESSAGE_LIMIT = 1024
SOCKET_PROBE_TIMEOUT_S = 1.0
DEVICE_PLUGIN_SOCKET_GLOB = "nvidia-*.sock"
"""NVIDIA's device plugin serves resource `nvidia.com/<name>` on `nvidia-<name>.sock`."""


@dataclass(frozen=True)
class Finding:
    reason: str
    """The Event reason: `DEVICE_PLUGIN_REASON`, `DEVICE_PLUGIN_PODS_REASON` or
    `DRA_DRIVER_REASON`."""
    message: str

    @property
    def overridable(self) -> bool:
        """Whether `--allow-nvidia-device-plugin` lets the plugin start anyway."""
        return self.reason in (DEVICE_PLUGIN_REASON, DEVICE_PLUGIN_PODS_REASON)


class GuardApi(Protocol):
    """What the guard reads and writes (blocking; failures are `errors.ApiError`)."""

    def read_node(self, name: str) -> dict[str, Any]: ...

    def list_node_slices(self, driver: str, node_name: str) -> list[ResourceSlice]: ...

    def list_node_pods(self, node_name: str) -> list[dict[str, Any]]: ...

    def create_event(self, namespace: str, event: dict[str, Any]) -> None: ...


def device_plugin_resources(node: Mapping[str, Any]) -> dict[str, str]:
    """The Node's allocatable NVIDIA device-plugin resources above 0 (name -> quantity)."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return {
        name: str(quantity)
        for name, quantity in sorted(allocatable.items())
        if _is_nvidia_device_plugin_resource(name) and _positive(str(quantity))
    }


def _is_nvidia_device_plugin_resource(name: str) -> bool:
    return name == "nvidia.com/gpu" or name.startswith(("nvidia.com/gpu.", "nvidia.com/mig-"))


def device_plugin_pods(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """The pods (`namespace/name (resource=quantity, ...)`) that are not finished and hold
    NVIDIA device-plugin resources the device plugin handed out: they request one, and the
    scheduler did not give it to them through DRA (`status.extendedResourceClaimStatus`, a
    DeviceClass's `extendedResourceName`)."""
    found = []
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed") or status.get(
            "extendedResourceClaimStatus"
        ):
            continue
        spec = pod.get("spec") or {}
        held: dict[str, str] = {}
        for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
            resources = container.get("resources") or {}
            for kind in ("limits", "requests"):
                for name, quantity in (resources.get(kind) or {}).items():
                    if _is_nvidia_device_plugin_resource(name) and _positive(str(quantity)):
                        held.setdefault(name, str(quantity))
        if held:
            metadata = pod.get("metadata") or {}
            listed = ", ".join(f"{name}={quantity}" for name, quantity in sorted(held.items()))
            found.append(f"{metadata.get('namespace', '?')}/{metadata.get('name', '?')} ({listed})")
    return sorted(found)


def device_plugin_step(node: Mapping[str, Any]) -> str:
    """What moves `node` off NVIDIA's device plugin, from the GPU Operator's label on it."""
    name = (node.get("metadata") or {}).get("name", "<node>")
    switch = ((node.get("metadata") or {}).get("labels") or {}).get(
        GPU_OPERATOR_DEVICE_PLUGIN_LABEL
    )
    if switch == "false":
        step = (
            f"the GPU Operator's device plugin is switched off here "
            f"({GPU_OPERATOR_DEVICE_PLUGIN_LABEL}=false): wait for the Operator to remove its "
            "pod; if a device plugin stays, it is another one (NVIDIA's Helm chart or a "
            "manifest): keep its DaemonSet off this node"
        )
    elif switch is not None:
        step = (
            "switch the GPU Operator's device plugin off on this node: kubectl label node "
            f"{name} {GPU_OPERATOR_DEVICE_PLUGIN_LABEL}=false --overwrite"
        )
    else:
        step = (
            "keep NVIDIA's device plugin DaemonSet off this node (its Helm chart's affinity, "
            f"e.g. {GPU_OPERATOR_DEVICE_PLUGIN_LABEL} NotIn [false], then kubectl label node "
            f"{name} {GPU_OPERATOR_DEVICE_PLUGIN_LABEL}=false)"
        )
    return (
        f"to move this node to gpu-dra, {step}; gpu-dra starts here by itself once the device "
        f"plugin is gone ({MIGRATION_DOC}). To keep the device plugin on this node instead, "
        "keep gpu-dra off it (chart value kubeletPlugin.migrationNodeLabel)"
    )


def _positive(quantity: str) -> bool:
    text = quantity.strip()
    try:
        return float(text) > 0
    except ValueError:
        return text not in ("", "0")  # a suffixed quantity (1k) is more than 0


def answering_sockets(paths: Sequence[Path]) -> list[Path]:
    """Those of `paths` that are Unix sockets with a listener (a stale file refuses)."""
    found = []
    for path in paths:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(SOCKET_PROBE_TIMEOUT_S)
            try:
                probe.connect(str(path))
            except OSError:
                continue
            found.append(path)
    return found


def device_plugin_sockets(directory: Path) -> list[Path]:
    """NVIDIA device-plugin sockets in the kubelet's device-plugins directory that answer."""
    try:
        candidates = sorted(directory.glob(DEVICE_PLUGIN_SOCKET_GLOB))
    except OSError:
        return []
    return answering_sockets(candidates)


def driver_sockets(plugins_dir: Path, registry_dir: Path, driver_name: str) -> list[Path]:
    """Sockets of `driver_name` that another process already serves: the DRA socket (also the
    per-instance `dra-<id>.sock` of rolling updates) and the registration socket
    (`<driver>-reg.sock`, `<driver>-<id>-reg.sock`)."""
    socket_dir = plugins_dir / driver_name
    candidates: list[Path] = []
    with contextlib.suppress(OSError):
        candidates += sorted(socket_dir.glob("dra*.sock"))
    with contextlib.suppress(OSError):
        candidates += sorted(registry_dir.glob(f"{driver_name}-*reg.sock"))
    return answering_sockets(candidates)


def foreign_slices(slices: Sequence[ResourceSlice], driver: str, node_name: str) -> list[str]:
    """Names (and pools) of the node's slices of `driver` that gpu-dra did not publish: ours are
    in the pool named after the node and carry the publisher's `<driver>/spec-hash`."""
    annotation = spec_hash_annotation(driver)
    found = []
    for item in slices:
        raw = cast("dict[str, Any]", item)  # as the apiserver sent it: fields may be missing
        metadata = raw.get("metadata") or {}
        pool = ((raw.get("spec") or {}).get("pool") or {}).get("name", "")
        if annotation not in (metadata.get("annotations") or {}) or pool != node_name:
            found.append(f"{metadata.get('name', '?')} (pool {pool or '?'})")
    return found


@dataclass(frozen=True)
class NodeCheck:
    node_name: str
    driver_name: str
    plugins_dir: Path
    registry_dir: Path
    device_plugins_dir: Path
    gpu_dra_sockets: frozenset[Path] = frozenset()
    """Sockets of gpu-dra instances that run on this node
    (`plugin_instances.InstanceRegistry.live`): the old instance of a rolling update, not a
    conflict."""


def check_node(api: GuardApi, check: NodeCheck) -> tuple[dict[str, Any], list[Finding]]:
    """The Node and what already serves its GPUs. API failures raise `errors.ApiError`: a check
    that could not be made is not a pass."""
    node = api.read_node(check.node_name)
    findings = []
    resources = device_plugin_resources(node)
    sockets = device_plugin_sockets(check.device_plugins_dir)
    if resources or sockets:
        found = []
        if resources:
            listed = ", ".join(f"{name}={quantity}" for name, quantity in resources.items())
            found.append(f"node {check.node_name} has allocatable {listed}")
        if sockets:
            found.append(
                f"NVIDIA device plugin socket(s) {', '.join(map(str, sockets))} accept connections"
            )
        findings.append(
            Finding(
                DEVICE_PLUGIN_REASON,
                f"{' and '.join(found)}: NVIDIA's device plugin (or the GPU Operator's) serves "
                f"this node's GPUs; {device_plugin_step(node)}",
            )
        )
    else:
        holding = device_plugin_pods(api.list_node_pods(check.node_name))
        if holding:
            findings.append(
                Finding(
                    DEVICE_PLUGIN_PODS_REASON,
                    f"pod(s) {', '.join(holding)} still use GPUs NVIDIA's device plugin handed "
                    "out, and gpu-dra cannot tell which: it starts serving this node once they "
                    "have ended (they keep running; delete them to have them rescheduled "
                    f"sooner, {MIGRATION_DOC})",
                )
            )
    answering = driver_sockets(check.plugins_dir, check.registry_dir, check.driver_name)
    served = [path for path in answering if path not in check.gpu_dra_sockets]
    for path in answering:
        if path in check.gpu_dra_sockets:
            log.info("another gpu-dra instance serves %s (a rolling update): starting beside it",
                     path)  # fmt: skip
    if served:
        findings.append(
            Finding(
                DRA_DRIVER_REASON,
                f"another process serves the {check.driver_name} socket(s) "
                f"{', '.join(map(str, served))}: a DRA driver of that name (NVIDIA's, or a "
                "second gpu-dra plugin) already runs on this node; to move this node to "
                "gpu-dra, keep NVIDIA's DRA driver kubelet plugin off it (its Helm chart's "
                f"kubeletPlugin.affinity, {MIGRATION_DOC}) and gpu-dra starts here by itself",
            )
        )
    foreign = foreign_slices(
        api.list_node_slices(check.driver_name, check.node_name),
        check.driver_name,
        check.node_name,
    )
    if foreign:
        findings.append(
            Finding(
                DRA_DRIVER_REASON,
                f"ResourceSlices of driver {check.driver_name} for node {check.node_name} that "
                f"gpu-dra did not publish: {', '.join(foreign)}; another DRA driver publishes "
                "these GPUs (once its kubelet plugin is off this node the kubelet removes "
                "them; or kubectl delete resourceslice them), and gpu-dra starts by itself",
            )
        )
    return node, findings


def node_event(
    node: Mapping[str, Any], namespace: str, finding: Finding, now: datetime
) -> dict[str, Any]:
    """A Warning Event about `node` (as `kubectl describe node` lists them)."""
    metadata = node.get("metadata") or {}
    return node_warning(
        str(metadata.get("name", "")),
        namespace,
        finding.reason,
        f"gpu-dra kubelet plugin waits for this node: {finding.message}",
        now,
        uid=str(metadata.get("uid", "")),
    )


def node_warning(
    name: str, namespace: str, reason: str, message: str, now: datetime, *, uid: str = ""
) -> dict[str, Any]:
    """A Warning Event about Node `name` (``uid`` when known), its message cut to the API's
    limit."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if len(message) > EVENT_MESSAGE_LIMIT:
        message = message[: EVENT_MESSAGE_LIMIT - 1] + "…"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{name}.gpu-dra-", "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid},
        "reason": reason,
        "message": message,
        "type": "Warning",
        "source": {"component": COMPONENT, "host": name},
        "reportingComponent": COMPONENT,
        "reportingInstance": name,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class NodeConflictError(Exception):
    """The node's GPUs are already handed out by something else; the message says what."""


def refusals(
    findings: Sequence[Finding], *, allow_device_plugin: bool, node_name: str
) -> list[Finding]:
    """The findings that keep the plugin off the node; device-plugin findings with
    `allow_device_plugin` are logged as warnings instead, once nothing else refuses."""
    refusing = [f for f in findings if not (allow_device_plugin and f.overridable)]
    for finding in [] if refusing else findings:
        if finding not in refusing:
            log.warning(
                "starting anyway on node %s (--allow-nvidia-device-plugin): %s; gpu-dra and the "
                "device plugin may hand the same GPU to two pods",
                node_name,
                finding.message,
            )
    return refusing


def report_refusal(
    api: GuardApi,
    node: Mapping[str, Any],
    refusing: Sequence[Finding],
    *,
    event_namespace: str,
    now: datetime | None = None,
) -> None:
    """Log each refusing finding and record it as a Warning Event on the Node (an Event that
    cannot be recorded is logged, the refusal stands)."""
    name = (node.get("metadata") or {}).get("name", "")
    for finding in refusing:
        log.error("not serving node %s: %s", name, finding.message)
        event = node_event(node, event_namespace, finding, now or datetime.now(UTC))
        try:
            api.create_event(event_namespace, event)
        except errors.ApiError as error:
            log.warning("could not record the refusal as an Event on the Node: %s", error)


def refusal_message(refusing: Sequence[Finding]) -> str:
    hint = (
        " (set --allow-nvidia-device-plugin to start next to the device plugin anyway)"
        if all(f.overridable for f in refusing)
        else ""
    )
    return "; ".join(f.message for f in refusing) + hint


def guard(
    api: GuardApi,
    check: NodeCheck,
    *,
    event_namespace: str,
    allow_device_plugin: bool,
    now: datetime | None = None,
) -> None:
    """Raise `NodeConflictError` (after logging it and recording an Event on the Node) when the
    node's GPUs are served by something else; device-plugin findings only warn with
    `allow_device_plugin`."""
    node, findings = check_node(api, check)
    refusing = refusals(
        findings, allow_device_plugin=allow_device_plugin, node_name=check.node_name
    )
    if not refusing:
        return
    report_refusal(api, node, refusing, event_namespace=event_namespace, now=now)
    raise NodeConflictError(refusal_message(refusing))


class KubernetesGuardApi:
    """`GuardApi` on the `kubernetes` client."""

    def __init__(self, api_client: k8s.ApiClient, *, request_timeout_s: float = 10.0) -> None:
        # Any: raw dictionaries in and out (_preload_content=False), not the typed models.
        self._core: Any = k8s.CoreV1Api(api_client)
        self._objects = k8s.CustomObjectsApi(api_client)
        self._timeout = request_timeout_s

    def read_node(self, name: str) -> dict[str, Any]:
        with translated_errors(f"read Node {name}"):
            response = self._core.read_node(
                name, _preload_content=False, _request_timeout=self._timeout
            )
        return cast("dict[str, Any]", json.loads(response.data))

    def list_node_slices(self, driver: str, node_name: str) -> list[ResourceSlice]:
        listing = list_objects(
            self._objects,
            RESOURCE_SLICES,
            what="ResourceSlices",
            field_selector=SliceSelector(driver=driver, node_name=node_name).field_selector,
            request_timeout_s=self._timeout,
        )
        return cast("list[ResourceSlice]", list(listing.items))

    def list_node_pods(self, node_name: str) -> list[dict[str, Any]]:
        action = f"list Pods of node {node_name}"
        pods: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            with translated_errors(action):
                response = self._core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={node_name}",
                    limit=500,
                    _continue=token,
                    _preload_content=False,
                    _request_timeout=self._timeout,
                )
            page = decoded_object(response.data, action)
            items = page.get("items") or []
            if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
                raise errors.ApiError(f"{action}: items is not a list of objects")
            pods += items
            token = (page.get("metadata") or {}).get("continue") or None
            if token is None:
                return pods

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        with translated_errors(f"create Event in {namespace}"):
            self._core.create_namespaced_event(
                namespace, event, _preload_content=False, _request_timeout=self._timeout
            )
