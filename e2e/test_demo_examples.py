"""Every demo example runs on the demo's simulated node, and cleaning it up leaks nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo.__main__ import EXAMPLES, PROFILE, namespace_of, received, wait_pods_running
from e2e.cluster import Cluster
from e2e.driver import Driver
from e2e.kube import Kube

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = str(PROFILE)
EXAMPLE_DIRS = sorted(p for p in EXAMPLES.iterdir() if p.is_dir())


@pytest.mark.parametrize("example", EXAMPLE_DIRS, ids=[p.name for p in EXAMPLE_DIRS])
def test_demo_example_runs_and_every_container_sees_a_published_gpu(
    example: Path, driver: Driver, cluster: Cluster, kube: Kube
) -> None:
    namespace = namespace_of(example)
    published = {d["attributes"]["uuid"]["string"] for d in driver.devices().values()}
    cluster.kubectl("apply", "-f", str(example / "example.yaml"))
    try:
        for pod_name in wait_pods_running(kube, namespace, timeout=120):
            pod = kube.get("v1", "Pod", pod_name, namespace)
            rows = received(kube, namespace, pod)
            containers = {c["name"] for c in pod["spec"]["containers"]}
            assert {container for container, _, _ in rows} == containers
            assert all(what.split()[0] in published for _, _, what in rows), rows
    finally:
        kube.delete("v1", "Namespace", namespace)
        kube.wait_gone("v1", "Namespace", namespace, None, timeout=180)
    assert driver.checkpoint_claims() == set()
    assert driver.cdi_spec_claims() == set()
