"""A rolling update of the plugin on one node, with real plugin processes: each serves its own
sockets (named by its instance id), a second one starts beside the first (the guard accepts a
running gpu-dra instance of the data dir), the first stops and removes only its own sockets, and
the sockets of an instance killed with SIGKILL are removed by the next one to start. The
apiserver is a stub that answers what start-up needs. An instance id too long for a socket path
stops the plugin with a message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2 as reg
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2_grpc as reg_grpc
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry
from gpu_dra.kubelet_plugin.plugin_sockets import served, socket_paths
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup import StartupError
from gpu_dra.kubelet_plugin.startup.node_guard import register_instance

NODE = "gpu-node-1"
DRIVER = "gpu.nvidia.com"
POD_A = "00000000-0000-4000-8000-0000000000a1"
POD_B = "00000000-0000-4000-8000-0000000000b2"
POD_C = "00000000-0000-4000-8000-0000000000c3"


class StubApiserver(BaseHTTPRequestHandler):
    """The Node, empty lists, watches that end at once, and creates echoed back."""

    version = 1

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
            return self._reply(
                200, {"kind": "Node", "metadata": {"name": NODE, "uid": "node-uid"}, "status": {}}
            )
        if "watch=true" in self.path:
            time.sleep(0.5)
            return self._reply(200, {})
        return self._reply(200, {"metadata": {"resourceVersion": "1"}, "items": []})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StubApiserver.version += 1
        metadata = body.setdefault("metadata", {})
        metadata.setdefault("name", metadata.get("generateName", "x") + str(self.version))
        metadata["resourceVersion"] = str(self.version)
        self._reply(201, body)


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Iterator[Path]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubApiserver)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    path = tmp_path / "kubeconfig"
    path.write_text(
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
        yield path
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def node_root() -> Iterator[Path]:
    """A short directory (Unix socket paths are limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="gpu-dra-", dir="/tmp") as root:
        yield Path(root)


class Plugin:
    """One `gpu-dra-kubelet-plugin` process of the node."""

    def __init__(self, root: Path, kubeconfig: Path, pod_uid: str) -> None:
        self.dra, self.registration = socket_paths(
            DRIVER, root / "plugins", root / "plugins_registry", pod_uid
        )
        self.log = root / f"{pod_uid}.log"
        env = {**os.environ, "POD_UID": pod_uid}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpu_dra.kubelet_plugin",
                 f"--node-name={NODE}", f"--kubeconfig={kubeconfig}", "--simulate=t4",
                 "--metrics-port=0", f"--kubelet-plugins-dir={root / 'plugins'}",
                 f"--kubelet-registry-dir={root / 'plugins_registry'}",
                 f"--data-dir={root / 'data'}", f"--cdi-root={root / 'cdi'}",
                 f"--kubelet-device-plugins-dir={root / 'device-plugins'}"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def wait_serving(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not (served(self.dra) and served(self.registration)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"plugin did not serve; its log:\n{self.log.read_text()}")
            time.sleep(0.1)

    def wait_logged(self, text: str, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log.read_text():
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not logged; the log:\n{self.log.read_text()}")
            time.sleep(0.1)

    def endpoint(self) -> str:
        with grpc.insecure_channel(f"unix:{self.registration}") as channel:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=5)
        return str(info.endpoint)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def test_a_new_instance_serves_beside_the_old_one_which_then_stops_cleanly(
    node_root: Path, kubeconfig: Path
) -> None:
    old = Plugin(node_root, kubeconfig, POD_A)
    new: Plugin | None = None
    try:
        old.wait_serving()
        assert old.dra.name == f"dra-{POD_A}.sock"
        assert old.registration.name == f"{DRIVER}-{POD_A}-reg.sock"

        new = Plugin(node_root, kubeconfig, POD_B)
        new.wait_serving()

        assert old.endpoint() == str(old.dra)
        assert new.endpoint() == str(new.dra)
        registry = InstanceRegistry(node_root / "data")
        assert [i.instance_id for i in registry.live()] == [POD_A, POD_B]
        assert all(i.ready for i in registry.live())
        # The newest ready instance publishes the slices; the old one stops writing them.
        old.wait_logged("publishing this node's ResourceSlices")
        new.wait_logged("publishing this node's ResourceSlices")
        old.wait_logged("a newer plugin instance publishes the ResourceSlices; stopping")

        assert old.stop() == 0
        assert not old.dra.exists()
        assert not old.registration.exists()
        assert served(new.dra)
        assert served(new.registration)
        assert [i.instance_id for i in registry.live()] == [POD_B]
    finally:
        for plugin in (old, new):
            if plugin is not None and plugin.process.poll() is None:
                plugin.kill()


def test_the_sockets_of_a_killed_instance_are_removed_by_the_next_one(
    node_root: Path, kubeconfig: Path
) -> None:
    killed = Plugin(node_root, kubeconfig, POD_B)
    try:
        killed.wait_serving()
    finally:
        killed.kill()
    assert killed.dra.exists()  # SIGKILL: nothing cleaned up
    assert killed.registration.exists()

    successor = Plugin(node_root, kubeconfig, POD_C)
    try:
        successor.wait_serving()
        assert not killed.dra.exists()
        assert not killed.registration.exists()
        registry = InstanceRegistry(node_root / "data")
        assert [i.instance_id for i in registry.instances()] == [POD_C]
        assert successor.stop() == 0
    finally:
        if successor.process.poll() is None:
            successor.kill()


def test_an_instance_id_too_long_for_a_unix_socket_stops_the_plugin_clearly(
    node_root: Path,
) -> None:
    settings = KubeletPluginSettings(
        node_name=NODE,
        kubelet_plugins_dir=node_root / "plugins",
        kubelet_registry_dir=node_root / "plugins_registry",
        data_dir=node_root / "data",
        instance_id="x" * 100,
    )

    with pytest.raises(StartupError, match="is longer than 107 bytes"):
        register_instance(settings)

    assert InstanceRegistry(settings.state_dir).instances() == []
