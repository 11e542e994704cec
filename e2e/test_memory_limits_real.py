"""GPU memory caps enforced by the driver per container (issue 16, items 3 and 4), end to end.

The kubelet plugin in real mode on the fake DGX H100 driver root (`e2e.realnode`) whose NVML
mock reports the 615 driver (``REAL_DRIVER``: ``nvmlDeviceSet/GetMemoryLimits_v1`` per cgroup,
kept in the mock's state file), with NVIDIA's ``nvidia-cdi-hook`` v1.20.1. gpu-0 is offered as
capped shares, gpu-1 as MPS shares (``--mps-share-memory-limits=auto``). Two share pods per GPU:
runc runs the ``apply-cuda-memory-limits`` createRuntime hook of each container's CDI device,
the hook sets its share on the container's own cgroup through the mock (the hook reads the
mock's settings from the file beside the library, as it gets no others), and the test reads back
per container cgroup exactly its claim's limit (soft = hard = the share), the claim's
enforcement ``driver`` (its Event, and for MPS shares the gauge), and nothing left once the
pods are gone.

Needs a cgroup v2 host (``/sys/fs/cgroup`` cgroup2): the plugin offers the cap only there and
NVIDIA's hook refuses cgroup v1; elsewhere the module is skipped. The time-slice interval of a
capped share's GPU is set with ``--nvidia-smi=/bin/true``: the fake root's ``nvidia-smi`` knows
only ``-L`` and ``--version``, and time-slicing is tested on simulated nodes. See docs/shares.md,
"How it is tested".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.realnode import RealNode
from e2e.workloads import claim_uid, delete_pods, pids_of_pod, wait_event, wait_running
from gpu_dra.driver.shares import CAPPED
from gpu_dra.kubelet_plugin.mps.events import REASON_CAPPED_SHARE, REASON_SHARE_MEMORY

CGROUP_ROOT = Path("/sys/fs/cgroup")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (CGROUP_ROOT / "cgroup.controllers").is_file(),
        reason="needs a cgroup v2 host: NVIDIA's apply-cuda-memory-limits hook refuses cgroup v1",
    ),
    pytest.mark.usefixtures("no_mps_daemon_left"),
]

REAL_MACHINE = "dgxh100"
REAL_DRIVER = "615"
PLUGIN_ARGS = (
    "--capped-shares=0",
    "--mps-shares=1",
    "--mps-share-memory-limits=auto",
    "--mps-share-daemon-warm=off",
    "--nvidia-smi=/bin/true",
)
CAPPED_CLASS = "capped.gpu.nvidia.com"
MPS_CLASS = "mps.gpu.nvidia.com"
MIB = 1024 * 1024
DRIVER_CAP = "memory capped per container by the driver"
SHARES = {"a": ("10Gi", 10240, 25), "b": ("20Gi", 20480, 50)}
"""Pod and claim name suffix: (memory, MiB, compute percent)."""


@pytest.fixture
def real_namespace(namespace: str, driver: Driver) -> Iterator[str]:
    yield namespace
    wait_for("every claim to be unprepared", lambda: not driver.checkpoint_claims(), 120)


def container_cgroups(pod_uid: str) -> set[str]:
    """The cgroup v2 paths (under /sys/fs/cgroup) of the pod's processes but its pause
    container's: the workload container's own cgroup, where the hook set the limit."""
    found = set()
    for pid in pids_of_pod(pod_uid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            continue  # exited meanwhile
        if command.endswith(b"/pause"):
            continue
        for line in lines:
            if line.startswith("0::"):
                found.add(str(CGROUP_ROOT / line[3:].lstrip("/")))
    return found


def run_shares(
    driver: Driver, kube: Kube, namespace: str, image: str, prefix: str, device_class: str
) -> dict[str, tuple[str, int]]:
    """Two share claims of `device_class` and a pod each (the glibc image, pointed at the mock's
    state), running; returns per pod name its container cgroup and its share in MiB."""
    real = driver.real
    assert real is not None
    for suffix, (memory, _, compute) in SHARES.items():
        name = f"{prefix}-{suffix}"
        kube.create(m.share_claim(name, namespace, memory, compute, device_class=device_class))
        kube.create(real.pod(name, namespace, name, image, "sleep 3600 & wait"))
    found = {}
    for suffix, (_, mib, _) in SHARES.items():
        name = f"{prefix}-{suffix}"
        wait_running(kube, name, namespace)
        uid = kube.get("v1", "Pod", name, namespace)["metadata"]["uid"]
        (cgroup,) = container_cgroups(uid)
        found[name] = (cgroup, mib)
    return found


def assert_capped_by_the_driver(real: RealNode, gpu: str, pods: dict[str, tuple[str, int]]) -> None:
    """Each container's cgroup holds exactly its claim's share as soft and hard limit on `gpu`,
    and no other cgroup or GPU has a limit."""
    expected = {cgroup: (mib * MIB, mib * MIB) for cgroup, mib in pods.values()}
    assert real.memory_limits() == {gpu: expected}


def assert_nothing_left(
    driver: Driver, kube: Kube, namespace: str, pods: dict[str, tuple[str, int]]
) -> None:
    uids = [claim_uid(kube, name, namespace) for name in pods]
    delete_pods(kube, namespace, list(pods))
    for uid in uids:
        driver.wait_unprepared(uid)
    assert driver.real is not None
    assert driver.real.memory_limits() == {}
    assert not any(Path(cgroup).exists() for cgroup, _ in pods.values())


def test_capped_shares_get_their_limit_on_each_containers_cgroup(
    driver: Driver, kube: Kube, real_namespace: str, glibc_image: str
) -> None:
    namespace = real_namespace
    real = driver.real
    assert real is not None
    assert real.root.driver_version == "615.71.09"
    devices = driver.devices()
    assert devices["gpu-0"]["allowMultipleAllocations"] is True
    assert devices["gpu-0"]["attributes"][CAPPED] == {"bool": True}
    gpu = driver.uuid_of("gpu-0")

    pods = run_shares(driver, kube, namespace, glibc_image, "capped", CAPPED_CLASS)
    assert_capped_by_the_driver(real, gpu, pods)
    for name, (_, mib) in pods.items():
        message = wait_event(kube, namespace, name, REASON_CAPPED_SHARE, timeout=30)
        assert f"capped share of {gpu} ({mib} MiB" in message, message
        assert DRIVER_CAP in message, message
        state = driver.checkpoint_entry(claim_uid(kube, name, namespace))["state"]
        assert state["cappedShares"]["gpu-0"]["memoryBytes"] == mib * MIB
    assert_nothing_left(driver, kube, namespace, pods)


def test_mps_shares_get_their_limit_on_each_containers_cgroup(
    driver: Driver, kube: Kube, real_namespace: str, glibc_image: str
) -> None:
    namespace = real_namespace
    real = driver.real
    assert real is not None
    assert driver.devices()["gpu-1"]["allowMultipleAllocations"] is True
    gpu = driver.uuid_of("gpu-1")

    pods = run_shares(driver, kube, namespace, glibc_image, "mps", MPS_CLASS)
    assert_capped_by_the_driver(real, gpu, pods)
    for name, (_, mib) in pods.items():
        message = wait_event(kube, namespace, name, REASON_SHARE_MEMORY, timeout=30)
        assert f"MPS share of {gpu} ({mib} MiB" in message, message
        assert DRIVER_CAP in message, message
        uid = claim_uid(kube, name, namespace)
        assert (
            driver.checkpoint_entry(uid)["state"]["mpsShares"]["gpu-1"]["memoryEnforcement"]
            == "driver"
        )
        labels = {"claim": f"{namespace}/{name}", "gpu": gpu, "enforcement": "driver"}
        assert driver.metric("gpu_dra_mps_share_memory_enforcement", **labels) == 1
    assert_nothing_left(driver, kube, namespace, pods)
