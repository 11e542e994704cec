"""Real mode end to end: the kubelet plugin without ``--simulate`` on a fake driver root of a
DGX H100 (8 GPUs) whose ``libnvidia-ml.so.1`` is the NVML mock library built from NVIDIA's
go-nvml mock servers (`e2e.realnode`). Pods of a glibc image get the driver's userspace through
the CDI spec (libraries, ``nvidia-smi``, device nodes, NVIDIA's ``nvidia-cdi-hook`` hooks run by
runc), and the ``nvidia-smi -L`` each container runs lists exactly its claim's GPUs; a per-claim
MPS container also reaches its claim's control daemon (the nvidia-cuda-mps-control TEST DOUBLE
as a pod, as in the simulated MPS tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e import manifests as m
from e2e.cluster import Cluster
from e2e.driver import CDI_ROOT, Driver
from e2e.kube import Kube, wait_for
from e2e.mps import MPS_CONFIG, PIPE, daemon_pid, daemons
from e2e.realnode import SHOW_DRIVER, finished_log, gpu_lines, section, uuids
from e2e.workloads import allocated_devices, claim_uid, delete_pods, wait_running

pytestmark = pytest.mark.e2e

REAL_MACHINE = "dgxh100"


@pytest.fixture
def real_namespace(namespace: str, driver: Driver) -> Iterator[str]:
    yield namespace
    wait_for("every claim to be unprepared", lambda: not driver.checkpoint_claims(), 120)


def test_real_mode_publishes_what_gpu_dra_devices_finds_through_the_mock(driver: Driver) -> None:
    assert driver.real is not None
    devices = driver.devices()
    assert sorted(devices) == [f"gpu-{i}" for i in range(8)]
    products = {d["attributes"]["productName"]["string"] for d in devices.values()}
    assert products == {"NVIDIA H100 80GB HBM3"}
    version = driver.real.root.driver_version
    assert {d["attributes"]["driverVersion"]["version"] for d in devices.values()} == {version}


@pytest.mark.parametrize("count", [1, 2])
def test_containers_get_the_driver_userspace_and_nvidia_smi_lists_only_their_gpus(
    driver: Driver, kube: Kube, cluster: Cluster, real_namespace: str, glibc_image: str,
    count: int,
) -> None:  # fmt: skip
    namespace = real_namespace
    kube.create(m.claim("gpus", namespace, m.claim_spec([m.request(count=count)])))
    kube.create(driver.real.pod("cuda", namespace, "gpus", glibc_image))
    wait_running(kube, "cuda", namespace)
    log = finished_log(kube, "cuda", namespace)

    allocated = allocated_devices(kube, "gpus", namespace)
    published = driver.devices()
    expected = sorted(published[d]["attributes"]["uuid"]["string"] for d in allocated)
    smi = section(log, "smi")
    assert "smi-exit=0" in smi, log
    assert len(gpu_lines(smi)) == count, smi
    assert sorted(uuids(smi)) == expected
    assert all("NVIDIA H100 80GB HBM3" in line for line in gpu_lines(smi))

    ldcache = section(log, "ldcache")  # update-ldcache hook: the libraries are in the cache
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1"):
        assert f"{soname} (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/{soname}" in ldcache, log
    nodes = set(section(log, "dev").split())
    minors = {f"nvidia{d.removeprefix('gpu-')}" for d in allocated}
    assert {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"} | minors <= nodes, nodes
    others = {f"nvidia{i}" for i in range(8)} - minors
    assert not nodes & others, f"device nodes of other GPUs in the container: {nodes & others}"

    uid = claim_uid(kube, "gpus", namespace)
    assert uid in driver.cdi_spec_claims()
    delete_pods(kube, namespace, ["cuda"])
    driver.wait_unprepared(uid)
    assert uid not in driver.cdi_spec_claims()
    assert not list(CDI_ROOT.glob(f"*{uid}*"))


@pytest.mark.usefixtures("no_mps_daemon_left")
def test_an_mps_container_gets_the_driver_and_reaches_its_claims_daemon(
    driver: Driver, kube: Kube, real_namespace: str, glibc_image: str
) -> None:
    namespace = real_namespace
    config = m.gpu_config(m.mps_sharing(**MPS_CONFIG))
    kube.create(m.claim("mps", namespace, m.claim_spec([m.request()], [config])))
    command = SHOW_DRIVER.replace(
        "echo '--- end'",
        "echo '--- mps'; env | grep ^CUDA_MPS_ | sort; "
        f"cat {PIPE}/nvidia-cuda-mps-control.pid; echo; echo '--- end'",
    )
    kube.create(driver.real.pod("cuda", namespace, "mps", glibc_image, command))
    wait_running(kube, "cuda", namespace)
    log = finished_log(kube, "cuda", namespace)

    smi = section(log, "smi")
    (device,) = allocated_devices(kube, "mps", namespace)
    assert uuids(smi) == [driver.devices()[device]["attributes"]["uuid"]["string"]], log
    mps = section(log, "mps")
    assert f"CUDA_MPS_PIPE_DIRECTORY={PIPE}" in mps
    (daemon_id,) = [p.name for p in driver.mps_dir.iterdir()]
    assert mps.split()[-1] == str(daemon_pid(driver, daemon_id)), log  # the daemon's own file

    uid = claim_uid(kube, "mps", namespace)
    delete_pods(kube, namespace, ["cuda"])
    driver.wait_unprepared(uid)
    wait_for("the daemon to be gone", lambda: not daemons(driver), 60)
