"""The controller's /healthz and /readyz: the heartbeat and readiness conditions, served over HTTP
beside /metrics, and what the run loop reports with and without leader election."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.controller import errors
from gpu_dra.controller.__main__ import APISERVER_CHECK, CATALOG_CHECK, EXIT_OK, run
from gpu_dra.controller.health import ControllerHealth, serve_http
from gpu_dra.controller.leader import ElectionConfig, LeaderElector
from gpu_dra.controller.metrics import CatalogMetrics, LeaderMetrics
from gpu_dra.controller.settings import ControllerSettings
from tests.controller.asyncwait import until
from tests.fakes.deviceclass_api import RecordingDeviceClassApi
from tests.fakes.lease_api import LeaseClient, LeaseStore

CLASS = (
    "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: gpu.example.com\n"
    "spec: {}\n"
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_liveness_fails_once_the_loop_has_not_beaten_for_the_stall_time() -> None:
    clock = Clock()
    health = ControllerHealth(stall_after_s=30, clock=clock)

    clock.now += 29
    assert health.live() == (True, ["[+]event-loop ok"])
    clock.now += 2
    assert health.live() == (False, ["[-]event-loop: no heartbeat for 31s"])
    health.beat()
    assert health.live()[0]


def test_readiness_needs_every_reported_condition_and_at_least_one() -> None:
    health = ControllerHealth()

    assert health.ready() == (False, ["[+]event-loop ok", "[-]starting: nothing reported yet"])
    health.set("apiserver", True)
    assert health.ready() == (True, ["[+]event-loop ok", "[+]apiserver ok"])
    health.set("catalog", False, "DeviceClass a: 422 Invalid")
    assert health.ready() == (
        False,
        ["[+]event-loop ok", "[+]apiserver ok", "[-]catalog: DeviceClass a: 422 Invalid"],
    )
    health.forget("catalog")
    assert health.ready()[0]


@pytest.fixture
def served() -> Iterator[tuple[str, ControllerHealth, CollectorRegistry]]:
    registry = CollectorRegistry()
    LeaderMetrics(registry).set_leading(True)
    health = ControllerHealth()
    server = serve_http(0, registry, health, addr="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", health, registry
    finally:
        server.shutdown()
        server.server_close()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read().decode()


def test_healthz_readyz_and_metrics_share_the_port(
    served: tuple[str, ControllerHealth, CollectorRegistry],
) -> None:
    url, health, _ = served

    assert get(f"{url}/healthz") == (200, "[+]event-loop ok\n")
    assert get(f"{url}/readyz")[0] == 503
    health.set(CATALOG_CHECK, True)
    assert get(f"{url}/readyz") == (200, "[+]event-loop ok\n[+]catalog ok\n")
    status, metrics = get(f"{url}/metrics")
    assert status == 200
    assert "gpu_dra_controller_leader 1.0" in metrics


def test_without_election_readiness_follows_the_catalog_apply(tmp_path: Path) -> None:
    (tmp_path / "gpu.yaml").write_text(CLASS)
    api = RecordingDeviceClassApi(refuse={"gpu.example.com": errors.InvalidError("422 bad")})
    settings = ControllerSettings(deviceclasses_dir=tmp_path, metrics_port=0, retry_interval_s=0.05)
    health = ControllerHealth()

    async def scenario() -> int:
        stop = asyncio.Event()
        task = asyncio.create_task(
            run(settings, api, CatalogMetrics(CollectorRegistry()), stop=stop, health=health)
        )
        failed = "[-]catalog: DeviceClass gpu.example.com: 422 bad"
        await until("the failure", lambda: health.ready()[1][-1] == failed)
        api.refuse.clear()
        await until("readiness", lambda: health.ready()[0])
        stop.set()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(scenario()) == EXIT_OK


@dataclass
class Replica:
    name: str
    health: ControllerHealth
    api: RecordingDeviceClassApi
    stop: asyncio.Event
    task: asyncio.Task[int]


def test_only_the_leader_applies_and_both_replicas_are_ready(tmp_path: Path) -> None:
    """Two controllers on one Lease: one applies the catalog; when it stops, the other does."""
    (tmp_path / "gpu.yaml").write_text(CLASS)
    store = LeaseStore()
    settings = ControllerSettings(deviceclasses_dir=tmp_path, metrics_port=0)

    def start(name: str) -> Replica:
        health = ControllerHealth()
        elector = LeaderElector(
            LeaseClient(store),
            ElectionConfig("lease", "ns", name, 1.0, 0.6, 0.1),
            on_api=lambda ok, reason: health.set(APISERVER_CHECK, ok, reason),
        )
        api, stop = RecordingDeviceClassApi(), asyncio.Event()
        metrics = CatalogMetrics(CollectorRegistry())
        task = asyncio.create_task(
            run(settings, api, metrics, stop=stop, health=health, elector=elector)
        )
        return Replica(name, health, api, stop, task)

    async def scenario() -> None:
        replicas = [start("pod-a"), start("pod-b")]
        await until("both ready", lambda: all(r.health.ready()[0] for r in replicas))
        await asyncio.sleep(0.5)

        (leader,) = [r for r in replicas if r.api.applied]
        (standby,) = [r for r in replicas if not r.api.applied]
        assert store.record is not None
        assert store.record.holder == leader.name
        assert "[+]catalog ok" in leader.health.ready()[1]
        assert standby.health.ready() == (True, ["[+]event-loop ok", "[+]apiserver ok"])

        leader.stop.set()
        assert await asyncio.wait_for(leader.task, 5) == EXIT_OK
        await until("the standby to apply", lambda: standby.api.applied, limit_s=3)
        assert store.record.holder == standby.name
        standby.stop.set()
        assert await asyncio.wait_for(standby.task, 5) == EXIT_OK

    asyncio.run(scenario())
