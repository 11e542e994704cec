"""Fixtures for tests against the real local cluster (e2e/cluster).

The session brings the cluster up unless it is already healthy, moves the test process into the
cluster's network namespace (the only place its addresses exist), and tears the cluster down at
the end if it started it (set GPU_DRA_E2E_KEEP=1 to keep it). When a test fails, every
component's log is copied to $GPU_DRA_CACHE/e2e-logs/<test> and the tails are printed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.cluster import Cluster, netns
from e2e.driver import Driver
from e2e.kube import Kube

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster()
    started = False
    if not cluster.healthy():
        cluster.up()
        started = True
    if not netns.current_is():
        netns.enter()
    yield cluster
    if started and os.environ.get("GPU_DRA_E2E_KEEP") != "1":
        cluster.down()


@pytest.fixture(scope="session")
def kube(cluster: Cluster) -> Kube:
    return Kube(cluster.kubeconfig)


@pytest.fixture(scope="module")
def driver(cluster: Cluster, kube: Kube, request: pytest.FixtureRequest) -> Iterator[Driver]:
    """gpu-dra on the node, simulating the module's SIMULATED_PROFILE (default hgx-h100), with
    the module's PLUGIN_ARGS (default none) as further plugin flags."""
    running = Driver(
        cluster,
        kube,
        getattr(request.module, "SIMULATED_PROFILE", "hgx-h100"),
        plugin_args=tuple(getattr(request.module, "PLUGIN_ARGS", ())),
    )
    running.install()
    running.start_plugin()
    yield running
    running.stop_plugin()


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted (and waited for) afterwards."""
    name = f"e2e-{request.node.name[:40].lower().replace('_', '-')}-{uuid.uuid4().hex[:5]}"
    name = name.replace("[", "-").replace("]", "")
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    kube.delete("v1", "Namespace", name)
    kube.wait_gone("v1", "Namespace", name, None, timeout=180)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and "cluster" in getattr(item, "fixturenames", ()):
        cluster = Cluster()
        cache = Path(os.environ.get("GPU_DRA_CACHE", Path.home() / ".cache" / "gpu-dra"))
        destination = cluster.collect_logs(cache / "e2e-logs" / item.name)
        tails = "\n".join(
            f"--- {log.stem} (last lines) ---\n{cluster.log_tail(log.stem, 15)}"
            for log in sorted(destination.glob("*.log"))
        )
        report.sections.append(("component logs", f"copied to {destination}\n{tails}"))
