"""The controller's /healthz and /readyz: the heartbeat and readiness conditions, served over HTTP
beside /metrics."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from gpu_dra.controller.health import ControllerHealth, serve_http

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
    Counter("gpu_dra_example", "An example.", registry=registry).inc()
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
    health.set("catalog", True)
    assert get(f"{url}/readyz") == (200, "[+]event-loop ok\n[+]catalog ok\n")
    status, metrics = get(f"{url}/metrics")
    assert status == 200
    assert "gpu_dra_example_total 1.0" in metrics
