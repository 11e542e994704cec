"""NVIDIA device plugin resource names served through DRA (issue 27), on static MIG: unmodified
device-plugin-style pods (``resources.limits: {nvidia.com/mig-1g.10gb: 1}``, no claim) on the
simulated ``hgx-h100-mig`` node, whose 1g.10gb slices exist. The class serving the name is the one
the chart renders for ``deviceClasses.migProfiles`` (the e2e controller applies the repository's
catalog, which has no generated classes), and a ResourceQuota on that class counts such pods
(their claims, which the scheduler makes).
The dynamic MIG case: e2e/test_mig_dynamic.py; ``nvidia.com/gpu.shared``:
e2e/test_mps_shares.py; ``nvidia.com/gpu``: e2e/test_whole_gpu.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e import manifests as m
from e2e.chart import chart_class
from e2e.cluster import Cluster
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.workloads import (
    delete_pods,
    extended_resource_claim,
    wait_refused_by_quota,
    wait_running,
)

pytestmark = pytest.mark.e2e

SIMULATED_PROFILE = "hgx-h100-mig"
MIG_1G = "mig-1g.10gb.gpu.nvidia.com"
RESOURCE = "nvidia.com/mig-1g.10gb"


@pytest.fixture
def mig_1g_class(cluster: Cluster, kube: Kube) -> Iterator[str]:
    with chart_class(cluster, kube, MIG_1G, "deviceClasses.migProfiles={1g.10gb}"):
        yield MIG_1G


def uuid_printed(kube: Kube, pod: str, namespace: str, uuid: str) -> None:
    wait_for(f"{uuid} in {pod}'s log", lambda: uuid in kube.pod_log(pod, namespace), 30)


def allocated_slice(driver: Driver, kube: Kube, pod: str, namespace: str) -> str:
    """The one device the scheduler allocated for the pod's extended resource, checked to be
    requested through the class that serves the name."""
    claim = extended_resource_claim(kube, pod, namespace)
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == MIG_1G, request
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return str(result["device"])


def test_a_mig_1g_10gb_pod_gets_a_static_slice_of_that_profile(
    driver: Driver, kube: Kube, namespace: str, mig_1g_class: str
) -> None:
    kube.create(m.device_plugin_pod("legacy-mig", namespace, {RESOURCE: "1"}))
    wait_running(kube, "legacy-mig", namespace)

    device = allocated_slice(driver, kube, "legacy-mig", namespace)
    published = driver.devices()[device]
    assert published["attributes"]["type"] == {"string": "mig"}
    assert published["attributes"]["profile"] == {"string": "1g.10gb"}
    uuid = driver.uuid_of(device)
    assert uuid.startswith("MIG-")
    uuid_printed(kube, "legacy-mig", namespace, uuid)


def test_a_quota_on_the_class_refuses_the_second_device_plugin_style_pod(
    driver: Driver, kube: Kube, namespace: str, mig_1g_class: str
) -> None:
    quota = m.class_quota(mig_1g_class)
    kube.create(m.resource_quota("mig-1g", namespace, {quota: "1"}))
    wait_for(
        "the quota to be counted",
        lambda: "hard" in kube.get("v1", "ResourceQuota", "mig-1g", namespace).get("status", {}),
        30,
    )
    kube.create(m.device_plugin_pod("first", namespace, {RESOURCE: "1"}))
    wait_running(kube, "first", namespace)
    used = kube.get("v1", "ResourceQuota", "mig-1g", namespace)["status"]["used"]
    assert used[quota] == "1", used

    # Seven more 1g.10gb slices are free: only the quota stands in the way. The pod is admitted;
    # the claim the scheduler makes for it at binding is what the quota refuses.
    kube.create(m.device_plugin_pod("second", namespace, {RESOURCE: "1"}))
    wait_refused_by_quota(kube, namespace, "second", quota)
    # Once the first pod (and its claim) is gone, the second one gets its slice.
    delete_pods(kube, namespace, ["first"])
    wait_running(kube, "second", namespace, timeout=120)
    allocated_slice(driver, kube, "second", namespace)
