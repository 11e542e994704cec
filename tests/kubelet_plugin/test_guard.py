"""The start-up guard: what counts as NVIDIA's device plugin, its pods or another DRA driver on the
node, the step each refusal names, the refusal (log line, Event on the Node) and its override,
the wait until the node is free (Events once per reason, health: alive but not ready); last, the
whole plugin waiting on a node of a stub apiserver and starting once the device plugin is
gone."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, cast

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_dra.kube import errors
from gpu_dra.kubelet_plugin.guard import (
    DEVICE_PLUGIN_PODS_REASON,
    DEVICE_PLUGIN_REASON,
    DRA_DRIVER_REASON,
    NodeCheck,
    NodeConflictError,
    device_plugin_pods,
    device_plugin_resources,
    device_plugin_sockets,
    driver_sockets,
    foreign_slices,
    guard,
)
from gpu_dra.kubelet_plugin.health import LIVENESS, READINESS, PluginHealth, Verdict
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry
from gpu_dra.kubelet_plugin.plugin_sockets import socket_paths
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.slices.kubeapi import ResourceSlice
from gpu_dra.kubelet_plugin.startup import StartupError
from gpu_dra.kubelet_plugin.startup.node_guard import guard_node, take_node

NODE = "gpu-node-1"
DRIVER = "gpu.nvidia.com"
NODE_UID = "6c0f7a8e-1d2b-4c3d-9e4f-5a6b7c8d9e0f"


def node(
    allocatable: dict[str, str] | None = None, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "uid": NODE_UID, "labels": labels or {}},
        "status": {"allocatable": {"cpu": "8", "memory": "32Gi", **(allocatable or {})}},
    }


def pod(
    name: str,
    limits: dict[str, str] | None = None,
    *,
    phase: str = "Running",
    via_dra: bool = False,
    init: bool = False,
) -> dict[str, Any]:
    container = {"name": "c", "resources": {"limits": limits or {}}}
    status: dict[str, Any] = {"phase": phase}
    if via_dra:  # what the scheduler sets for an extended resource a DeviceClass backs
        status["extendedResourceClaimStatus"] = {
            "resourceClaimName": f"{name}-extended-resources-abcde",
            "requestMappings": [
                {"containerName": "c", "resourceName": "nvidia.com/gpu", "requestName": "r0"}
            ],
        }
    return {
        "metadata": {"namespace": "team-a", "name": name},
        "spec": {
            "nodeName": NODE,
            "initContainers" if init else "containers": [container],
            **({"containers": [{"name": "main"}]} if init else {}),
        },
        "status": status,
    }


def slice_of(name: str, pool: str = NODE, ours: bool = True) -> ResourceSlice:
    annotations = {f"{DRIVER}/spec-hash": "abc"} if ours else {}
    return cast(
        "ResourceSlice",
        {
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": pool}},
        },
    )


@pytest.fixture
def sock_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gpu-dra-", dir="/tmp") as root:
        yield Path(root)


@pytest.fixture
def listeners() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def listen(stack: ExitStack, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    server = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    server.bind(str(path))
    server.listen()


def stale(path: Path) -> None:
    """A socket file whose process is gone: it refuses connections."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))


class FakeGuardApi:
    def __init__(
        self,
        node: dict[str, Any],
        slices: list[ResourceSlice] | None = None,
        fail_read: errors.ApiError | None = None,
        fail_event: errors.ApiError | None = None,
        pods: list[dict[str, Any]] | None = None,
    ) -> None:
        self.node = node
        self.pods = pods or []
        self.slices = slices or []
        self.fail_read = fail_read
        self.fail_event = fail_event
        self.events: list[tuple[str, dict[str, Any]]] = []

    def read_node(self, name: str) -> dict[str, Any]:
        if self.fail_read is not None:
            raise self.fail_read
        assert name == NODE
        return self.node

    def list_node_slices(self, driver: str, node_name: str) -> list[ResourceSlice]:
        assert (driver, node_name) == (DRIVER, NODE)
        return self.slices

    def list_node_pods(self, node_name: str) -> list[dict[str, Any]]:
        assert node_name == NODE
        return self.pods

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        if self.fail_event is not None:
            raise self.fail_event
        self.events.append((namespace, event))


def check(root: Path) -> NodeCheck:
    return NodeCheck(
        node_name=NODE,
        driver_name=DRIVER,
        plugins_dir=root / "plugins",
        registry_dir=root / "plugins_registry",
        device_plugins_dir=root / "device-plugins",
    )


# ---- detection ---------------------------------------------------------------------------------
def test_the_device_plugins_resources_are_those_above_zero() -> None:
    found = device_plugin_resources(
        node(
            {
                "nvidia.com/gpu": "8",
                "nvidia.com/gpu.shared": "16",
                "nvidia.com/mig-1g.10gb": "7",
                "nvidia.com/mig-3g.40gb": "0",
                "nvidia.com/gpu-feature": "1",
                "example.com/dongle": "4",
            }
        )
    )

    assert found == {
        "nvidia.com/gpu": "8",
        "nvidia.com/gpu.shared": "16",
        "nvidia.com/mig-1g.10gb": "7",
    }
    assert device_plugin_resources(node({"nvidia.com/gpu": "0"})) == {}
    assert device_plugin_resources({"metadata": {"name": NODE}}) == {}


def test_only_device_plugin_sockets_that_answer_count(
    sock_root: Path, listeners: ExitStack
) -> None:
    plugins = sock_root / "device-plugins"
    listen(listeners, plugins / "nvidia-gpu.sock")
    listen(listeners, plugins / "kubelet.sock")  # the kubelet's own, not a device plugin
    stale(plugins / "nvidia-mig-1g.10gb.sock")  # left behind by a device plugin that is gone
    (plugins / "nvidia-file.sock").write_text("not a socket")

    assert device_plugin_sockets(plugins) == [plugins / "nvidia-gpu.sock"]
    assert device_plugin_sockets(sock_root / "missing") == []


def test_the_drivers_sockets_served_by_another_process_are_found(
    sock_root: Path, listeners: ExitStack
) -> None:
    dra = sock_root / "plugins" / DRIVER / "dra.sock"
    rolling = sock_root / "plugins" / DRIVER / "dra-6f1c.sock"
    registration = sock_root / "plugins_registry" / f"{DRIVER}-reg.sock"
    listen(listeners, dra)
    listen(listeners, registration)
    stale(rolling)
    listen(listeners, sock_root / "plugins_registry" / "other.example.com-reg.sock")

    assert driver_sockets(sock_root / "plugins", sock_root / "plugins_registry", DRIVER) == [
        dra,
        registration,
    ]


def test_slices_not_published_by_gpu_dra_are_foreign() -> None:
    slices = [
        slice_of("gpu-node-1-gpu.nvidia.com-ours"),
        slice_of("gpu-node-1-gpu.nvidia.com-nvidia", ours=False),  # NVIDIA's plugin: same pool
        slice_of("shared-pool-x", pool="shared"),
    ]

    assert foreign_slices(slices, DRIVER, NODE) == [
        "gpu-node-1-gpu.nvidia.com-nvidia (pool gpu-node-1)",
        "shared-pool-x (pool shared)",
    ]


# ---- refusal -----------------------------------------------------------------------------------
def test_a_device_plugin_node_is_refused_with_an_event_on_the_node(
    sock_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeGuardApi(node({"nvidia.com/gpu": "8"}))
    moment = datetime(2026, 5, 6, 7, 8, 9, tzinfo=UTC)

    with (
        caplog.at_level(logging.ERROR, logger="gpu_dra.kubelet_plugin.guard"),
        pytest.raises(NodeConflictError) as refused,
    ):
        guard(
            api, check(sock_root), event_namespace="gpu-dra", allow_device_plugin=False, now=moment
        )

    assert "allocatable nvidia.com/gpu=8" in str(refused.value)
    assert "--allow-nvidia-device-plugin" in str(refused.value)
    ((logged,),) = [[r.getMessage() for r in caplog.records]]
    assert logged.startswith(
        f"not serving node {NODE}: node {NODE} has allocatable nvidia.com/gpu=8: NVIDIA's "
        "device plugin (or the GPU Operator's) serves this node's GPUs; to move this node to "
        "gpu-dra, keep NVIDIA's device plugin DaemonSet off this node"
    )
    ((namespace, event),) = api.events
    assert namespace == "gpu-dra"
    assert event["metadata"] == {"generateName": f"{NODE}.gpu-dra-", "namespace": "gpu-dra"}
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": NODE,
        "uid": NODE_UID,
    }
    assert (event["type"], event["reason"]) == ("Warning", DEVICE_PLUGIN_REASON)
    assert event["message"].startswith("gpu-dra kubelet plugin waits for this node: node")
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2026-05-06T07:08:09Z"


def test_the_override_starts_next_to_the_device_plugin_with_a_warning(
    sock_root: Path, listeners: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    listen(listeners, sock_root / "device-plugins" / "nvidia-gpu.sock")
    api = FakeGuardApi(node({"nvidia.com/gpu": "8"}))

    with caplog.at_level(logging.WARNING, logger="gpu_dra.kubelet_plugin.guard"):
        guard(api, check(sock_root), event_namespace="gpu-dra", allow_device_plugin=True)

    assert api.events == []
    ((warning,),) = [[r.getMessage() for r in caplog.records]]
    assert warning.startswith(f"starting anyway on node {NODE} (--allow-nvidia-device-plugin)")
    assert "nvidia.com/gpu=8 and NVIDIA device plugin socket(s)" in warning


def test_another_dra_driver_is_refused_even_with_the_override(
    sock_root: Path, listeners: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    listen(listeners, sock_root / "plugins" / DRIVER / "dra.sock")
    api = FakeGuardApi(node({"nvidia.com/gpu": "1"}), slices=[slice_of("nvidia-slice", ours=False)])

    with pytest.raises(NodeConflictError) as refused:
        guard(api, check(sock_root), event_namespace="gpu-dra", allow_device_plugin=True)

    # Not starting: no "starting anyway" for the device plugin it was told to start beside.
    assert not any("starting anyway" in r.getMessage() for r in caplog.records)

    assert "another process serves the gpu.nvidia.com socket(s)" in str(refused.value)
    assert "nvidia-slice (pool gpu-node-1)" in str(refused.value)
    assert "--allow-nvidia-device-plugin" not in str(refused.value)
    assert [e["reason"] for _, e in api.events] == [DRA_DRIVER_REASON, DRA_DRIVER_REASON]


def test_a_clean_node_and_our_own_slices_pass(sock_root: Path) -> None:
    stale(sock_root / "plugins" / DRIVER / "dra.sock")  # our last run's, it crashed
    api = FakeGuardApi(node({"nvidia.com/gpu": "0"}), slices=[slice_of("ours")])

    guard(api, check(sock_root), event_namespace="gpu-dra", allow_device_plugin=False)

    assert api.events == []


def test_the_sockets_of_a_running_gpu_dra_instance_are_a_rolling_update_not_a_conflict(
    sock_root: Path, listeners: ExitStack
) -> None:
    settings = KubeletPluginSettings(
        node_name=NODE,
        kubelet_plugins_dir=sock_root / "plugins",
        kubelet_registry_dir=sock_root / "plugins_registry",
        data_dir=sock_root / "data",
    )
    old_pod = "4f1c2b9e-0000-4000-8000-00000000000a"
    sockets = socket_paths(
        DRIVER, settings.kubelet_plugins_dir, settings.kubelet_registry_dir, old_pod
    )
    old = InstanceRegistry(settings.state_dir).register(old_pod, sockets)
    for path in sockets:
        listen(listeners, path)
    api = FakeGuardApi(node(), slices=[slice_of("ours")])

    guard_node(settings, api)  # the old pod of a rolling update: accepted

    # NVIDIA's DRA driver (or a gpu-dra that is not registered in this data dir) is not.
    listen(listeners, sock_root / "plugins" / DRIVER / "dra-nvidia.sock")
    with pytest.raises(StartupError, match=r"dra-nvidia\.sock: a DRA driver of that name"):
        guard_node(settings, api)
    # Nor are the old instance's sockets once it is gone and something else serves them.
    old.close()
    with pytest.raises(StartupError, match=f"dra-{old_pod}"):
        guard_node(settings, api)
    assert [e["reason"] for _, e in api.events] == [DRA_DRIVER_REASON, DRA_DRIVER_REASON]


def test_an_event_that_cannot_be_recorded_still_refuses(
    sock_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = FakeGuardApi(
        node({"nvidia.com/gpu": "1"}), fail_event=errors.ForbiddenError("403 Forbidden")
    )

    with pytest.raises(NodeConflictError):
        guard(api, check(sock_root), event_namespace="gpu-dra", allow_device_plugin=False)

    assert any("could not record the refusal" in r.getMessage() for r in caplog.records)


def test_a_check_that_cannot_be_made_stops_the_plugin(sock_root: Path) -> None:
    settings = KubeletPluginSettings(
        node_name=NODE,
        kubelet_plugins_dir=sock_root / "plugins",
        kubelet_registry_dir=sock_root / "plugins_registry",
    )
    unreachable = FakeGuardApi(node(), fail_read=errors.ApiError("read Node: connection refused"))
    refused = FakeGuardApi(node({"nvidia.com/gpu": "2"}))

    with pytest.raises(StartupError, match="cannot check whether something else hands out"):
        guard_node(settings, unreachable)
    with pytest.raises(StartupError, match="this node's GPUs are already handed out: node"):
        guard_node(settings, refused)
    assert settings.device_plugins_dir == sock_root / "device-plugins"


# ---- the step each refusal names ----------------------------------------------------------------
def test_pods_holding_device_plugin_gpus_are_those_not_given_them_through_dra() -> None:
    pods = [
        pod("trainer", {"nvidia.com/gpu": "2", "cpu": "4"}),
        pod("mig-user", {"nvidia.com/mig-1g.10gb": "1"}, phase="Pending"),
        pod("init-probe", {"nvidia.com/gpu": "1"}, init=True),
        pod("done", {"nvidia.com/gpu": "1"}, phase="Succeeded"),
        pod("crashed", {"nvidia.com/gpu": "1"}, phase="Failed"),
        pod("via-dra", {"nvidia.com/gpu": "1"}, via_dra=True),  # gpu-dra's own
        pod("zero", {"nvidia.com/gpu": "0"}),
        pod("web", {"cpu": "1"}),
    ]

    assert device_plugin_pods(pods) == [
        "team-a/init-probe (nvidia.com/gpu=1)",
        "team-a/mig-user (nvidia.com/mig-1g.10gb=1)",
        "team-a/trainer (nvidia.com/gpu=2)",
    ]


@pytest.mark.parametrize(
    ("labels", "step"),
    [
        (
            {"nvidia.com/gpu.deploy.device-plugin": "true"},
            f"switch the GPU Operator's device plugin off on this node: kubectl label node {NODE} "
            "nvidia.com/gpu.deploy.device-plugin=false --overwrite",
        ),
        (
            {"nvidia.com/gpu.deploy.device-plugin": "false"},
            "wait for the Operator to remove its pod; if a device plugin stays, it is another one",
        ),
        (
            {},
            "keep NVIDIA's device plugin DaemonSet off this node (its Helm chart's affinity, e.g. "
            "nvidia.com/gpu.deploy.device-plugin NotIn [false], then kubectl label node "
            f"{NODE} nvidia.com/gpu.deploy.device-plugin=false)",
        ),
    ],
    ids=["gpu-operator", "gpu-operator-switched-off", "standalone"],
)
def test_a_device_plugin_refusal_names_the_step_that_moves_the_node(
    sock_root: Path, labels: dict[str, str], step: str
) -> None:
    api = FakeGuardApi(node({"nvidia.com/gpu": "8"}, labels))

    with pytest.raises(NodeConflictError) as refused:
        guard(api, check(sock_root), event_namespace="default", allow_device_plugin=False)

    assert step in str(refused.value)
    assert "gpu-dra starts here by itself once the device plugin is gone" in str(refused.value)
    assert "kubeletPlugin.migrationNodeLabel" in str(refused.value)
    assert step in api.events[0][1]["message"]


def test_pods_of_the_device_plugin_keep_the_node_until_they_end(sock_root: Path) -> None:
    api = FakeGuardApi(
        node({"nvidia.com/gpu": "0"}), pods=[pod("trainer", {"nvidia.com/gpu": "1"})]
    )

    with pytest.raises(NodeConflictError) as refused:
        guard(api, check(sock_root), event_namespace="default", allow_device_plugin=False)

    assert "pod(s) team-a/trainer (nvidia.com/gpu=1) still use GPUs" in str(refused.value)
    assert [e["reason"] for _, e in api.events] == [DEVICE_PLUGIN_PODS_REASON]
    api.pods = [pod("trainer", {"nvidia.com/gpu": "1"}, phase="Succeeded")]
    guard(api, check(sock_root), event_namespace="default", allow_device_plugin=False)


def test_a_dra_driver_refusal_names_the_step(sock_root: Path, listeners: ExitStack) -> None:
    listen(listeners, sock_root / "plugins" / DRIVER / "dra.sock")
    api = FakeGuardApi(node())

    with pytest.raises(NodeConflictError) as refused:
        guard(api, check(sock_root), event_namespace="default", allow_device_plugin=False)

    assert (
        "keep NVIDIA's DRA driver kubelet plugin off it (its Helm chart's kubeletPlugin.affinity"
        in str(refused.value)
    )


# ---- waiting for the node ------------------------------------------------------------------------
class Report:
    def __init__(self) -> None:
        self.waits: list[str] = []
        self.taken = 0

    def waiting_for_node(self, reason: str) -> None:
        self.waits.append(reason)

    def node_taken(self) -> None:
        self.taken += 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.on_sleep: Callable[[int], None] = lambda _: None

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.on_sleep(len(self.sleeps))


def wait_settings(root: Path) -> KubeletPluginSettings:
    return KubeletPluginSettings(
        node_name=NODE,
        kubelet_plugins_dir=root / "plugins",
        kubelet_registry_dir=root / "plugins_registry",
        data_dir=root / "data",
        guard_recheck_interval_s=60.0,
    )


def test_the_plugin_waits_reporting_each_reason_once_and_takes_the_node_when_free(
    sock_root: Path,
) -> None:
    api = FakeGuardApi(node({"nvidia.com/gpu": "8"}))
    report, clock = Report(), Clock()

    def world(sleeps: int) -> None:
        if sleeps == 3:  # the device plugin is gone, its pod runs on
            api.node = node({"nvidia.com/gpu": "0"})
            api.pods = [pod("trainer", {"nvidia.com/gpu": "1"})]
        if sleeps == 5:
            api.pods = []

    clock.on_sleep = world
    asyncio.run(take_node(wait_settings(sock_root), api, report, sleep=clock.sleep, clock=clock))

    assert clock.sleeps == [60.0] * 5
    assert [e["reason"] for _, e in api.events] == [DEVICE_PLUGIN_REASON, DEVICE_PLUGIN_PODS_REASON]
    assert len(report.waits) == 5
    assert "allocatable nvidia.com/gpu=8" in report.waits[0]
    assert "team-a/trainer" in report.waits[4]
    assert report.taken == 1


def test_a_reason_that_stays_is_recorded_again_every_ten_minutes(sock_root: Path) -> None:
    api = FakeGuardApi(node({"nvidia.com/gpu": "8"}))
    report, clock = Report(), Clock()

    def world(sleeps: int) -> None:
        if sleeps == 25:
            api.node = node()

    clock.on_sleep = world
    asyncio.run(take_node(wait_settings(sock_root), api, report, sleep=clock.sleep, clock=clock))

    # Checks at 0, 60, ..., 1440 s: Events at 0, 600 and 1200 s.
    assert len(api.events) == 3
    assert report.taken == 1


def test_a_check_that_cannot_be_made_waits_too(sock_root: Path) -> None:
    api = FakeGuardApi(node(), fail_read=errors.ApiError("read Node: connection refused"))
    report, clock = Report(), Clock()

    def world(sleeps: int) -> None:
        if sleeps == 2:
            api.fail_read = None

    clock.on_sleep = world
    asyncio.run(take_node(wait_settings(sock_root), api, report, sleep=clock.sleep, clock=clock))

    assert (
        report.waits
        == [
            "cannot check whether something else hands out this node's GPUs: read Node: "
            "connection refused"
        ]
        * 2
    )
    assert api.events == []
    assert report.taken == 1


def test_waiting_for_the_node_is_alive_but_not_ready() -> None:
    health = PluginHealth()

    async def verdicts() -> tuple[Verdict, Verdict]:
        return await health.check(LIVENESS), await health.check(READINESS)

    assert asyncio.run(verdicts())[0].serving is False  # starting: not yet alive
    health.waiting_for_node("node gpu-node-1 has allocatable nvidia.com/gpu=8: ...")
    liveness, readiness = asyncio.run(verdicts())
    assert liveness.serving
    assert not readiness.serving
    assert (
        readiness.reason
        == "waiting for the node: node gpu-node-1 has allocatable nvidia.com/gpu=8: ..."
    )
    # Taken after a wait: start-up (recovery, sockets) still runs, within the startup probe's
    # 10 minutes the wait used up.
    health.node_taken()
    liveness, readiness = asyncio.run(verdicts())
    assert liveness.serving
    assert readiness.reason == "start-up recovery has not finished"


# ---- the whole plugin against a stub apiserver -------------------------------------------------
class StubApiserver(BaseHTTPRequestHandler):
    node: ClassVar[dict[str, Any]] = {}
    pods: ClassVar[list[dict[str, Any]]] = []
    events: ClassVar[list[tuple[str, dict[str, Any]]]] = []
    node_reads: ClassVar[int] = 0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, code: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.startswith(f"/api/v1/nodes/{NODE}"):
            type(self).node_reads += 1
            return self._reply(200, self.node)
        if self.path.startswith("/api/v1/pods?"):
            assert "fieldSelector=spec.nodeName%3Dgpu-node-1" in self.path, self.path
            return self._reply(200, {"metadata": {"resourceVersion": "1"}, "items": self.pods})
        if self.path.startswith("/apis/resource.k8s.io/v1/resourceslices"):
            return self._reply(200, {"metadata": {"resourceVersion": "1"}, "items": []})
        return self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.events.append((self.path, body))
        self._reply(201, body)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def health_of(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(answer.status)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_plugin_waits_on_a_device_plugin_node_and_starts_once_it_is_gone(
    sock_root: Path, tmp_path: Path
) -> None:
    StubApiserver.node = node(
        {"nvidia.com/gpu": "4"}, {"nvidia.com/gpu.deploy.device-plugin": "true"}
    )
    StubApiserver.pods = [pod("trainer", {"nvidia.com/gpu": "1"})]
    StubApiserver.events = []
    StubApiserver.node_reads = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubApiserver)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}
                ],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    port = free_port()
    log_path = tmp_path / "plugin.log"
    with log_path.open("w") as log_file:
        plugin = subprocess.Popen(
            [
                sys.executable, "-m", "gpu_dra.kubelet_plugin",
                f"--node-name={NODE}", f"--kubeconfig={kubeconfig}", "--simulate=t4",
                "--metrics-port=0", f"--healthcheck-port={port}",
                f"--kubelet-plugins-dir={sock_root / 'plugins'}",
                f"--kubelet-registry-dir={sock_root / 'plugins_registry'}",
                f"--data-dir={sock_root / 'data'}", f"--cdi-root={sock_root / 'cdi'}",
                "--event-namespace=gpu-dra", "--guard-recheck-interval=0.1",
            ],
            stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    try:
        # The device plugin serves the node: the plugin waits, alive but not ready, one Event.
        wait_until(lambda: StubApiserver.node_reads >= 5, "five checks of the node")
        assert plugin.poll() is None, log_path.read_text()
        assert health_of(port, "liveness") == health_pb2.HealthCheckResponse.SERVING
        assert health_of(port, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
        ((path, event),) = StubApiserver.events
        assert path == "/api/v1/namespaces/gpu-dra/events"
        assert event["reason"] == DEVICE_PLUGIN_REASON
        assert event["involvedObject"]["uid"] == NODE_UID
        assert (
            f"kubectl label node {NODE} nvidia.com/gpu.deploy.device-plugin=false --overwrite"
            in event["message"]
        )
        # Nothing written before the node is free: no checkpoint, no instance.
        assert not (sock_root / "data" / "gpu-dra-checkpoint.json").exists()
        assert not (sock_root / "data" / "instances").exists()

        # The Operator took its device plugin away (the kubelet zeroes the allocatable); the
        # pod it served runs on: the plugin still waits, saying so.
        StubApiserver.node = node(
            {"nvidia.com/gpu": "0"}, {"nvidia.com/gpu.deploy.device-plugin": "false"}
        )
        wait_until(lambda: len(StubApiserver.events) == 2, "the Event about the pod")
        assert StubApiserver.events[1][1]["reason"] == DEVICE_PLUGIN_PODS_REASON
        assert "team-a/trainer (nvidia.com/gpu=1)" in StubApiserver.events[1][1]["message"]
        assert not (sock_root / "data" / "instances").exists()

        # The pod finished: the plugin takes the node.
        StubApiserver.pods = [pod("trainer", {"nvidia.com/gpu": "1"}, phase="Succeeded")]
        wait_until((sock_root / "data" / "instances").exists, "the plugin to start")
        assert "is free of other GPU owners: starting" in log_path.read_text()
        assert len(StubApiserver.events) == 2
    finally:
        plugin.kill()
        plugin.wait(timeout=30)
        server.shutdown()
        server.server_close()
        thread.join()
