"""The start-up guard: what counts as NVIDIA's device plugin or another DRA driver on the node,
the refusal (log line, Event on the Node, exit status 1) and its override; last, the whole
plugin refusing a node of a stub apiserver."""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest
import yaml

from gpu_dra.kube import errors
from gpu_dra.kubelet_plugin.__main__ import main
from gpu_dra.kubelet_plugin.guard import (
    DEVICE_PLUGIN_REASON,
    DRA_DRIVER_REASON,
    NodeCheck,
    NodeConflictError,
    device_plugin_resources,
    device_plugin_sockets,
    driver_sockets,
    foreign_slices,
    guard,
)
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry
from gpu_dra.kubelet_plugin.plugin_sockets import socket_paths
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.slices.kubeapi import ResourceSlice
from gpu_dra.kubelet_plugin.startup import StartupError
from gpu_dra.kubelet_plugin.startup.node_guard import guard_node

NODE = "gpu-node-1"
DRIVER = "gpu.nvidia.com"
NODE_UID = "6c0f7a8e-1d2b-4c3d-9e4f-5a6b7c8d9e0f"


def node(allocatable: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "uid": NODE_UID},
        "status": {"allocatable": {"cpu": "8", "memory": "32Gi", **(allocatable or {})}},
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
    ) -> None:
        self.node = node
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
    assert [r.getMessage() for r in caplog.records] == [
        f"refusing to start on node {NODE}: node {NODE} has allocatable nvidia.com/gpu=8: a "
        "device plugin (NVIDIA's, or the GPU Operator's) serves its GPUs"
    ]
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
    assert event["message"].startswith("gpu-dra kubelet plugin refuses to start: node")
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2026-05-06T07:08:09Z"


def test_the_override_starts_next_to_the_device_plugin_with_a_warning(
    sock_root: Path, listeners: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    listen(listeners, sock_root / "device-plugins" / "nvidia-gpu.sock")
    api = FakeGuardApi(node({"nvidia.com/gpu": "8"}))

    with caplog.at_level(logging.WARNING, logger="gpu_dra.kubelet_plugin.guard"):
        guard(api, check(sock_root), event_namespace="gpu-dra", allow_device_plugin=True)

    assert api.events == []
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert all(w.startswith("starting anyway (--allow-nvidia-device-plugin)") for w in warnings)


def test_another_dra_driver_is_refused_even_with_the_override(
    sock_root: Path, listeners: ExitStack
) -> None:
    listen(listeners, sock_root / "plugins" / DRIVER / "dra.sock")
    api = FakeGuardApi(node(), slices=[slice_of("nvidia-slice", ours=False)])

    with pytest.raises(NodeConflictError) as refused:
        guard(api, check(sock_root), event_namespace="gpu-dra", allow_device_plugin=True)

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


# ---- the whole plugin against a stub apiserver -------------------------------------------------
class StubApiserver(BaseHTTPRequestHandler):
    node: ClassVar[dict[str, Any]] = {}
    events: ClassVar[list[tuple[str, dict[str, Any]]]] = []

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
            return self._reply(200, self.node)
        if self.path.startswith("/apis/resource.k8s.io/v1/resourceslices"):
            return self._reply(200, {"metadata": {"resourceVersion": "1"}, "items": []})
        return self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.events.append((self.path, body))
        self._reply(201, body)


def test_the_plugin_exits_1_on_a_device_plugin_node(
    sock_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    StubApiserver.node = node({"nvidia.com/gpu": "4"})
    StubApiserver.events = []
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
    try:
        with caplog.at_level(logging.ERROR):
            status = main(
                [
                    f"--node-name={NODE}",
                    f"--kubeconfig={kubeconfig}",
                    "--simulate=t4",
                    "--metrics-port=0",
                    f"--kubelet-plugins-dir={sock_root / 'plugins'}",
                    f"--kubelet-registry-dir={sock_root / 'plugins_registry'}",
                    f"--data-dir={sock_root / 'data'}",
                    f"--cdi-root={sock_root / 'cdi'}",
                    "--event-namespace=gpu-dra",
                ]
            )
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

    assert status == 1
    assert any(
        r.getMessage().startswith("cannot start: this node's GPUs are already handed out")
        for r in caplog.records
    )
    ((path, event),) = StubApiserver.events
    assert path == "/api/v1/namespaces/gpu-dra/events"
    assert event["involvedObject"]["uid"] == NODE_UID
    # Refused before the checkpoint was read or written, or the instance registered.
    assert not (sock_root / "data" / "gpu-dra-checkpoint.json").exists()
    assert not (sock_root / "data" / "instances").exists()
