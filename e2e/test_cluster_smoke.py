"""The test bed itself works: a real node, real pods, real DRA allocation, real CEL validation."""

from __future__ import annotations

import pytest
from kubernetes.dynamic.exceptions import UnprocessibleEntityError

from e2e import manifests as m
from e2e.cluster import Cluster, versions
from e2e.kube import Kube, wait_for

pytestmark = pytest.mark.e2e

SMOKE_DRIVER = "smoke.e2e.gpu-dra.dev"


def test_node_is_ready_with_the_pinned_kubelet(cluster: Cluster, kube: Kube) -> None:
    node = kube.get("v1", "Node", versions.NODE_NAME)
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
    assert ready == "True"
    assert node["status"]["nodeInfo"]["kubeletVersion"] == versions.KUBERNETES_VERSION
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.")
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == versions.NODE_IP


def test_busybox_pod_runs_and_its_log_is_read_back(kube: Kube, namespace: str) -> None:
    command = "echo hello from $(hostname); cat /etc/passwd"
    kube.create(m.pod("hello", namespace, [m.container("main", command)]))

    def succeeded() -> bool:
        phase = kube.get("v1", "Pod", "hello", namespace)["status"].get("phase")
        assert phase != "Failed", kube.events_for(namespace, "hello")
        return bool(phase == "Succeeded")

    wait_for("pod hello to succeed", succeeded, timeout=120)
    log = kube.pod_log("hello", namespace)
    assert "hello from hello" in log
    assert "root:x:0:0" in log
    pod = kube.get("v1", "Pod", "hello", namespace)
    assert pod["status"]["podIP"].startswith(versions.POD_CIDR.rsplit(".", 2)[0])


def test_claim_is_allocated_from_a_slice_by_the_real_scheduler(kube: Kube, namespace: str) -> None:
    slice_name = f"smoke-{namespace}"
    class_name = f"smoke-{namespace}"
    kube.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": slice_name},
            "spec": {
                "driver": SMOKE_DRIVER,
                "nodeName": versions.NODE_NAME,
                "pool": {"name": slice_name, "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {
                        "name": "dev-0",
                        "attributes": {"model": {"string": "small"}},
                        "capacity": {"memory": {"value": "1Gi"}},
                    },
                    {
                        "name": "dev-1",
                        "attributes": {"model": {"string": "large"}},
                        "capacity": {"memory": {"value": "80Gi"}},
                    },
                ],
            },
        }
    )
    try:
        kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": class_name},
                "spec": {
                    "selectors": [
                        {
                            "cel": {
                                "expression": f'device.driver == "{SMOKE_DRIVER}" && '
                                f"device.capacity['{SMOKE_DRIVER}'].memory"
                                ".compareTo(quantity('40Gi')) >= 0"
                            }
                        }
                    ]
                },
            }
        )
        kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "big", "namespace": namespace},
                "spec": {
                    "devices": {
                        "requests": [{"name": "dev", "exactly": {"deviceClassName": class_name}}]
                    }
                },
            }
        )
        kube.create(
            m.pod(
                "consumer",
                namespace,
                [m.container("main", "true", claims=[{"name": "dev"}])],
                [{"name": "dev", "resourceClaimName": "big"}],
            )
        )
        wait_for(
            "pod to be bound",
            lambda: bool(kube.get("v1", "Pod", "consumer", namespace)["spec"].get("nodeName")),
            timeout=60,
        )
        claim = kube.get("resource.k8s.io/v1", "ResourceClaim", "big", namespace)
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["driver"], r["pool"], r["device"]) for r in results] == [
            (SMOKE_DRIVER, slice_name, "dev-1")
        ]
        assert [r["name"] for r in claim["status"]["reservedFor"]] == ["consumer"]
    finally:
        kube.delete("v1", "Pod", "consumer", namespace, grace_period_seconds=0)
        kube.wait_gone("v1", "Pod", "consumer", namespace)
        kube.delete("resource.k8s.io/v1", "DeviceClass", class_name)
        kube.delete("resource.k8s.io/v1", "ResourceSlice", slice_name)


def test_invalid_cel_is_rejected_by_the_apiserver_with_its_message(kube: Kube) -> None:
    with pytest.raises(UnprocessibleEntityError) as error:
        kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": "smoke-invalid-cel"},
                "spec": {"selectors": [{"cel": {"expression": "device.driver == "}}]},
            }
        )
    body = str(error.value.body)
    assert "spec.selectors[0].cel.expression" in body
    assert "compilation failed" in body
    assert "Syntax error" in body
