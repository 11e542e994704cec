"""The plugin's gRPC health service, probed as the kubelet's `grpc:` probes do: a real
grpc.health.v1 client over TCP against a real `PluginServer` on Unix sockets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2 as reg
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2_grpc as reg_grpc
from gpu_dra.kubelet_plugin.health import HealthServer, PluginHealth
from gpu_dra.kubelet_plugin.plugin_sockets import PluginServer
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from tests.fakes.claim_preparer import InMemoryClaimPreparer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def sock_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gpu-dra-", dir="/tmp") as root:
        yield Path(root)


@contextlib.asynccontextmanager
async def health_service(health: PluginHealth) -> AsyncIterator[health_pb2_grpc.HealthStub]:
    server = HealthServer(health, 0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield health_pb2_grpc.HealthStub(channel)
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def plugin_sockets(sock_root: Path) -> AsyncIterator[PluginServer]:
    server = PluginServer(
        driver_name="gpu.nvidia.com",
        preparer=InMemoryClaimPreparer(),
        plugins_dir=sock_root / "plugins",
        registry_dir=sock_root / "plugins_registry",
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1)


async def status(stub: health_pb2_grpc.HealthStub, service: str) -> int:
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


async def register(server: PluginServer, ok: bool) -> None:
    async with grpc.aio.insecure_channel(f"unix:{server.registration_socket}") as channel:
        with contextlib.suppress(grpc.aio.AioRpcError):  # a failure report is answered so
            await reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=ok, error="" if ok else "mismatch"),
                timeout=5,
            )


def test_nothing_is_serving_before_recovery_and_the_sockets() -> None:
    async def scenario() -> None:
        health = PluginHealth()
        async with health_service(health) as stub:
            for service in ("", "liveness", "readiness"):
                assert await status(stub, service) == NOT_SERVING
            health.mark_recovered()
            assert await status(stub, "liveness") == NOT_SERVING  # sockets not served yet

    asyncio.run(scenario())


def test_liveness_needs_answering_sockets_and_readiness_a_registration(sock_root: Path) -> None:
    async def scenario() -> None:
        health = PluginHealth()
        async with health_service(health) as stub, plugin_sockets(sock_root) as server:
            health.attach(server)
            assert await status(stub, "liveness") == NOT_SERVING  # recovery not finished
            health.mark_recovered()

            assert await status(stub, "") == SERVING
            assert await status(stub, "liveness") == SERVING
            assert await status(stub, "readiness") == NOT_SERVING  # no registration yet
            await register(server, ok=True)
            assert await status(stub, "readiness") == SERVING
            await register(server, ok=False)
            assert await status(stub, "readiness") == NOT_SERVING
            assert await status(stub, "liveness") == SERVING  # a restart would not help

            listed = await stub.List(health_pb2.HealthListRequest(), timeout=5)
            assert {name: s.status for name, s in listed.statuses.items()} == {
                "": SERVING,
                "liveness": SERVING,
                "readiness": NOT_SERVING,
            }

    asyncio.run(scenario())


def test_a_removed_dra_socket_is_not_serving_and_named(
    sock_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        health = PluginHealth()
        async with health_service(health) as stub, plugin_sockets(sock_root) as server:
            health.attach(server)
            health.mark_recovered()
            assert await status(stub, "liveness") == SERVING
            server.dra_socket.unlink()  # the kubelet could no longer connect either

            with caplog.at_level(logging.WARNING, logger="gpu_dra.kubelet_plugin.health"):
                assert await status(stub, "liveness") == NOT_SERVING
                assert await status(stub, "liveness") == NOT_SERVING

        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1  # logged when the status changes, not at every probe
        assert f"DRA socket {server.dra_socket}: UNAVAILABLE" in warnings[0]

    asyncio.run(scenario())


def test_a_socket_that_does_not_answer_fails_within_the_probe_deadline(sock_root: Path) -> None:
    """A listener that accepts but never speaks gRPC (a hung server) must not hang the probe."""

    class Silent:
        def __init__(self, path: Path) -> None:
            self.dra_socket = path
            self.registration_socket = path
            self.registered = asyncio.Event()

    async def scenario() -> None:
        path = sock_root / "silent.sock"
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(path))
            listener.listen()
            health = PluginHealth(self_call_timeout_s=0.5)
            health.attach(Silent(path))
            health.mark_recovered()
            started = asyncio.get_running_loop().time()
            verdict = await health.check("liveness")
            elapsed = asyncio.get_running_loop().time() - started

        assert not verdict.serving
        assert verdict.reason == f"registration socket {path}: no answer in time"
        assert elapsed < 3

    asyncio.run(scenario())


def test_shutdown_is_not_serving(sock_root: Path) -> None:
    async def scenario() -> None:
        health = PluginHealth()
        async with health_service(health) as stub, plugin_sockets(sock_root) as server:
            health.attach(server)
            health.mark_recovered()
            assert await status(stub, "liveness") == SERVING
            await health.stopping()
            assert await status(stub, "liveness") == NOT_SERVING

    asyncio.run(scenario())


def test_an_unknown_service_is_not_found() -> None:
    async def scenario() -> None:
        async with health_service(PluginHealth()) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await status(stub, "gpu")
            assert error.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())


def test_the_port_is_nvidias_flag_and_off_by_default() -> None:
    def parse(*argv: str, **env: str) -> KubeletPluginSettings:
        return KubeletPluginSettings.parse(list(argv), {"NODE_NAME": "n", **env})

    assert parse().healthcheck_port == -1
    assert parse(HEALTHCHECK_PORT="51516").healthcheck_port == 51516  # NVIDIA's variable
    assert parse(GPU_DRA_HEALTHCHECK_PORT="7", HEALTHCHECK_PORT="8").healthcheck_port == 7
    assert parse("--healthcheck-port", "0").healthcheck_port == 0
    assert parse("--healthcheck-port", "-5").healthcheck_port == -1
    with pytest.raises(SystemExit):
        parse("--healthcheck-port", "70000")
    with pytest.raises(SystemExit):
        parse("--healthcheck-port", "http")
