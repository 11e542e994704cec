"""Fixtures for tests against the real local cluster (e2e/cluster).

The session brings the cluster up unless it is already healthy, moves the test process into the
cluster's network namespace (the only place its addresses exist), removes the chart release a
`demo/run` leaves running (its plugin pod would serve the node beside the tests' plugins), and
tears the cluster down at the end if it started it (set GPU_DRA_E2E_KEEP=1 to keep it). When a
test fails, every component's log is copied to $GPU_DRA_CACHE/e2e-logs/<test> and the tails are
printed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.install import remove_leftover_release
from e2e.cluster import Cluster, netns
from e2e.driver import MPS_DAEMON_NAMESPACE, Driver
from e2e.health import recover_all, taints, wait_untainted
from e2e.kube import Kube, wait_for
from e2e.mig import mig_instances, mig_modes
from e2e.mps import DAEMON_ID_LABEL, daemon_ids
from e2e.realnode import RealNode

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
    remove_leftover_release(cluster, Kube(cluster.kubeconfig))
    yield cluster
    if started and os.environ.get("GPU_DRA_E2E_KEEP") != "1":
        cluster.down()


@pytest.fixture(scope="session")
def kube(cluster: Cluster) -> Kube:
    return Kube(cluster.kubeconfig)


@pytest.fixture(scope="module")
def driver(cluster: Cluster, kube: Kube, request: pytest.FixtureRequest) -> Iterator[Driver]:
    """gpu-dra on the node, simulating the module's SIMULATED_PROFILE (default hgx-h100) or, where
    the module sets REAL_MACHINE (an NVML mock server, e.g. ``dgxh100``), in real mode on a fake
    driver root of that machine (`e2e.realnode`; REAL_DRIVER, e.g. ``615``, the driver the mock
    reports), with
    ``--dynamic-mig`` where the module sets DYNAMIC_MIG and the module's PLUGIN_ARGS (default
    none) as further plugin flags. With dynamic MIG the simulated GPUs start without MIG and
    end so: later modules simulate the profile without it, and no MIG state may carry over."""
    machine = getattr(request.module, "REAL_MACHINE", None)
    real_driver = getattr(request.module, "REAL_DRIVER", None)
    real = None if machine is None else RealNode.create(cluster.paths, machine, driver=real_driver)
    running = Driver(
        cluster,
        kube,
        getattr(request.module, "SIMULATED_PROFILE", "hgx-h100"),
        dynamic_mig=getattr(request.module, "DYNAMIC_MIG", False),
        plugin_args=tuple(getattr(request.module, "PLUGIN_ARGS", ())),
        real=real,
    )
    if running.dynamic_mig:
        running.forget_simulated_mig()
    try:
        running.install()
        running.start_plugin()
        yield running
    finally:
        running.stop_plugin()
        # Warm MPS daemons outlive the plugin by design; the next module starts without them.
        running.remove_mps_daemons()
        if running.dynamic_mig:
            running.forget_simulated_mig()
        if real is not None:
            real.remove()


@pytest.fixture(scope="module")
def glibc_image(driver: Driver) -> str:
    """The glibc test image (real-mode pods), imported into containerd."""
    return driver.ensure_glibc_image()


@pytest.fixture(scope="session")
def deleted_namespaces(kube: Kube) -> Iterator[list[str]]:
    """The namespaces the tests deleted; at the end of the session, waited for until gone."""
    deleted: list[str] = []
    yield deleted
    for name in deleted:
        kube.wait_gone("v1", "Namespace", name, None, timeout=180)


@pytest.fixture
def namespace(
    kube: Kube, deleted_namespaces: list[str], request: pytest.FixtureRequest
) -> Iterator[str]:
    """A fresh namespace per test (with its default ServiceAccount), deleted afterwards: the
    test ends once its pods and ResourceClaims are gone (a pod leaves the API only after the
    kubelet unprepared its claims; a claim once deallocated). The namespace object itself takes
    the namespace controller ~5 s more (passes over every resource type) that no later test
    depends on: the session waits for every deleted namespace at its end."""
    name = f"e2e-{request.node.name[:40].lower().replace('_', '-')}-{uuid.uuid4().hex[:5]}"
    name = name.replace("[", "-").replace("]", "")
    kube.create_namespace(name)
    yield name
    kube.delete("v1", "Namespace", name)
    deleted_namespaces.append(name)
    kinds = (("v1", "Pod"), ("resource.k8s.io/v1", "ResourceClaim"))
    for api_version, kind in kinds:
        for item in kube.list(api_version, kind, namespace=name):
            kube.delete(api_version, kind, item["metadata"]["name"], name)

    def emptied() -> bool:
        return not any(kube.list(api_version, kind, namespace=name) for api_version, kind in kinds)

    wait_for(f"the pods and ResourceClaims of namespace {name} to be gone", emptied, 180)


@pytest.fixture
def healthy_node(driver: Driver) -> Iterator[None]:
    """The test starts and ends with no device tainted (every GPU recovered afterwards): the
    health modules' `pytest.mark.usefixtures`."""
    assert not taints(driver), "device taints left by an earlier test"
    yield
    recover_all(driver)
    wait_untainted(driver)


@pytest.fixture
def other_namespace(kube: Kube, namespace: str) -> Iterator[str]:
    """A second namespace for the test, beside `namespace` (MPS shares come from any
    namespace); deleted afterwards, waiting until it is gone."""
    name = f"{namespace[:55]}-b"
    kube.create_namespace(name)
    yield name
    kube.delete("v1", "Namespace", name)
    kube.wait_gone("v1", "Namespace", name, None, timeout=180)


@pytest.fixture
def no_mps_daemon_left(driver: Driver, kube: Kube) -> Iterator[None]:
    """The test starts and ends with no MPS daemons or daemon pods but the warm ones: the shared
    daemon of each GPU the plugin offers as shares, recorded by no claim, one process and one pod
    each, unless ``--mps-share-daemon-warm=off`` (docs/mps.md, "Warm daemons"). Any other - a
    claim's daemon, a share daemon its last share left behind - is removed and fails the test,
    so that no double process outlives the run. For MPS modules:
    ``pytest.mark.usefixtures("no_mps_daemon_left")``."""
    found = unexpected_mps_daemons(driver)
    assert not found, f"MPS daemons left by an earlier test: {found}"
    yield
    # A stopped daemon's process may take a moment to exit; a fresh warm one to start.
    with contextlib.suppress(TimeoutError):
        wait_for("only warm MPS daemons", lambda: not unexpected_mps_daemons(driver), 15)
    found = unexpected_mps_daemons(driver)
    warm = driver.warm_daemon_ids()
    for name, pod in driver.mps_daemon_pods().items():
        if pod["metadata"].get("labels", {}).get(DAEMON_ID_LABEL) not in warm:
            kube.delete("v1", "Pod", name, MPS_DAEMON_NAMESPACE)
    for pid, daemon_id in daemon_ids(driver).items():
        if daemon_id not in warm or found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not found, f"MPS daemons left behind: {found}"


def unexpected_mps_daemons(driver: Driver) -> list[str]:
    """What of the node's MPS daemons is not a warm daemon (`no_mps_daemon_left`)."""
    warm = driver.warm_daemon_ids()
    found = [f"claims record daemon {i}" for i in sorted(driver.recorded_daemon_ids())]
    for name, pod in sorted(driver.mps_daemon_pods().items()):
        daemon_id = pod["metadata"].get("labels", {}).get(DAEMON_ID_LABEL)
        if daemon_id not in warm:
            found.append(f"pod {name}")
    per_id: dict[str, list[int]] = {}
    for pid, daemon_id in daemon_ids(driver).items():
        per_id.setdefault(daemon_id, []).append(pid)
    for daemon_id, pids in sorted(per_id.items()):
        if daemon_id not in warm or len(pids) > 1:
            found.append(f"daemon {daemon_id} pids {sorted(pids)}")
    return found


@pytest.fixture
def no_mig_left(driver: Driver) -> Iterator[None]:
    """The test starts without MIG instances and ends, once every claim is unprepared, without
    instances and with MIG mode off on every GPU (dynamic MIG modules)."""
    assert mig_instances(driver) == {}, "MIG instances left by an earlier test"
    yield
    wait_for("every claim to be unprepared", lambda: not driver.checkpoint_claims(), 120)
    assert mig_instances(driver) == {}, "MIG instances left behind"
    assert all(mode == [0, 0] for mode in mig_modes(driver).values()), mig_modes(driver)


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``runs_last`` (e2e/test_migration.py) after all others, in their order."""
    items.sort(key=lambda item: item.get_closest_marker("runs_last") is not None)
