"""The DRA device health service as the kubelet uses it: registration advertises it, and a real
grpc.aio client on the DRA Unix socket reads NodeWatchResources (v1 and v1alpha1): every
device at once, a new list on every change, repeats only while the monitor is alive."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.health import DeviceHealth, HealthPolicy, Problem, Severity
from gpu_dra.driver.nvml.interface import NVML_EVENT_TYPE_XID_CRITICAL_ERROR
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2 as reg
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2_grpc as reg_grpc
from gpu_dra.kubelet_plugin.device_health.monitor import HealthMonitor
from gpu_dra.kubelet_plugin.device_health.monitor_inputs import MonitorTiming
from gpu_dra.kubelet_plugin.device_health.service import DeviceHealthService
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_sockets import PluginServer
from tests.fakes.claim_preparer import InMemoryClaimPreparer

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
XID = NVML_EVENT_TYPE_XID_CRITICAL_ERROR


def api(version: str) -> tuple[Any, Any]:
    base = f"gpu_dra.kubelet_plugin._generated.dra_health.{version}"
    return importlib.import_module(f"{base}.api_pb2"), importlib.import_module(
        f"{base}.api_pb2_grpc"
    )


@pytest.fixture
def sock_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gpu-dra-", dir="/tmp") as root:
        yield Path(root)


@dataclass
class FakeSource:
    """A `HealthSource` whose snapshot, version and liveness the test sets."""

    devices: dict[str, DeviceHealth] = field(default_factory=dict)
    version: int = 0
    alive: bool = True
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def snapshot(self) -> Mapping[str, DeviceHealth]:
        return dict(self.devices)

    def set(self, name: str, health: DeviceHealth) -> None:
        self.devices[name] = health
        self.version += 1
        self.changed.set()

    async def wait_changed(self, version: int, timeout_s: float) -> None:
        self.changed.clear()
        if self.version != version:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout_s)

    def alive_within(self, seconds: float) -> bool:
        return self.alive


@contextlib.asynccontextmanager
async def serving(sock_root: Path, service: DeviceHealthService) -> AsyncIterator[PluginServer]:
    server = PluginServer(
        driver_name=DRIVER,
        preparer=InMemoryClaimPreparer(),
        plugins_dir=sock_root / "plugins",
        registry_dir=sock_root / "registry",
        extra_services=[service],
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1)


def devices(response: Any) -> dict[str, tuple[int, str, str, int]]:
    return {
        d.device.device_name: (
            d.health,
            d.message,
            d.device.pool_name,
            d.health_check_timeout_seconds,
        )
        for d in response.devices
    }


def test_registration_advertises_the_health_service_after_the_dra_versions(sock_root: Path) -> None:
    async def scenario() -> None:
        service = DeviceHealthService(FakeSource(), pool=NODE)
        async with (
            serving(sock_root, service) as server,
            grpc.aio.insecure_channel(f"unix:{server.registration_socket}") as channel,
        ):
            info = await reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest())
        assert list(info.supported_versions) == [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        ]

    asyncio.run(scenario())


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_the_stream_sends_every_device_then_each_change(sock_root: Path, version: str) -> None:
    messages, stubs = api(version)
    source = FakeSource({"gpu-0": DeviceHealth(), "gpu-1": DeviceHealth()})
    problem = Problem("xid", "79", Severity.LOST, "critical XID 79", datetime.now(UTC))

    async def scenario() -> None:
        service = DeviceHealthService(source, pool=NODE, resend_interval_s=30, timeout_s=45)
        async with (
            serving(sock_root, service) as server,
            grpc.aio.insecure_channel(f"unix:{server.dra_socket}") as channel,
        ):
            stream = stubs.DRAResourceHealthStub(channel).NodeWatchResources(
                messages.NodeWatchResourcesRequest()
            )
            first = await asyncio.wait_for(stream.read(), 5)
            assert devices(first) == {
                "gpu-0": (messages.HEALTHY, "", NODE, 45),
                "gpu-1": (messages.HEALTHY, "", NODE, 45),
            }
            assert all(d.last_updated_time > 0 for d in first.devices)
            source.set("gpu-1", DeviceHealth((problem,)))
            second = await asyncio.wait_for(stream.read(), 5)
            assert devices(second)["gpu-1"] == (messages.UNHEALTHY, "critical XID 79", NODE, 45)
            assert devices(second)["gpu-0"][0] == messages.HEALTHY
            stream.cancel()

    asyncio.run(scenario())


def test_the_list_is_repeated_while_the_monitor_is_alive_and_not_after(sock_root: Path) -> None:
    messages, stubs = api("v1")
    source = FakeSource({"gpu-0": DeviceHealth()})
    received: list[Any] = []

    async def read_all(stream: Any) -> None:
        async for response in stream:
            received.append(response)

    async def scenario() -> None:
        service = DeviceHealthService(source, pool=NODE, resend_interval_s=0.05, timeout_s=30)
        async with (
            serving(sock_root, service) as server,
            grpc.aio.insecure_channel(f"unix:{server.dra_socket}") as channel,
        ):
            stream = stubs.DRAResourceHealthStub(channel).NodeWatchResources(
                messages.NodeWatchResourcesRequest()
            )
            reader = asyncio.create_task(read_all(stream))
            await asyncio.sleep(0.5)
            assert len(received) >= 4  # the first list and repeats every 0.05 s
            source.alive = False
            await asyncio.sleep(0.1)  # one repeat may have been under way
            silent_from = len(received)
            await asyncio.sleep(0.5)
            assert len(received) == silent_from
            source.alive = True
            await asyncio.sleep(0.3)
            assert len(received) > silent_from
            stream.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    asyncio.run(scenario())


def test_an_injected_xid_reaches_the_kubelets_stream(sock_root: Path) -> None:
    """The whole path on a simulated node: NVML event -> monitor -> NodeWatchResources."""
    host = SimulatedHost.load("hgx-h100", NODE)
    inventory = NodeInventory.from_discovery(discover_devices(host.nvml, host.pci), simulated=True)
    messages, stubs = api("v1")

    async def scenario() -> None:
        monitor = HealthMonitor(
            host.nvml,
            inventory.gpus,
            inventory.health_scopes(),
            policy=HealthPolicy(),
            timing=MonitorTiming(wait_timeout_ms=50),
        )
        task = asyncio.create_task(monitor.run())
        await monitor.started()
        try:
            service = DeviceHealthService(monitor, pool=NODE, resend_interval_s=30)
            async with (
                serving(sock_root, service) as server,
                grpc.aio.insecure_channel(f"unix:{server.dra_socket}") as channel,
            ):
                stream = stubs.DRAResourceHealthStub(channel).NodeWatchResources(
                    messages.NodeWatchResourcesRequest()
                )
                first = await asyncio.wait_for(stream.read(), 5)
                assert len(first.devices) == 8
                host.nvml.inject_event(3, XID, 48)
                second = await asyncio.wait_for(stream.read(), 5)
                unhealthy = {
                    d.device.device_name: d.message
                    for d in second.devices
                    if d.health == messages.UNHEALTHY
                }
                assert unhealthy == {
                    "gpu-3": "critical XID 48 (double-bit ECC error) reported by NVML"
                }
                stream.cancel()
        finally:
            monitor.stop()
            await task

    asyncio.run(scenario())
