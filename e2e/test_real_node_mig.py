"""Dynamic MIG in real mode: the plugin makes MIG devices through NVML (the NVML mock library
from NVIDIA's go-nvml mock servers, `e2e.realnode`) at prepare; the container's ``nvidia-smi -L``
lists its parent GPU and exactly its claim's MIG device, whose capability nodes the CDI spec
gives by major/minor; unprepare destroys the instances and turns MIG mode off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from e2e import manifests as m
from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from e2e.mig import mig_request
from e2e.realnode import SHOW_DRIVER, finished_log, gpu_lines, section, uuids
from e2e.workloads import allocated_devices, claim_uid, delete_pods, wait_running

pytestmark = pytest.mark.e2e

REAL_MACHINE = "dgxh100"
DYNAMIC_MIG = True


@pytest.fixture
def no_real_mig_left(driver: Driver) -> Iterator[None]:
    assert driver.real is not None
    assert driver.real.mig_instances() == [], "MIG instances left by an earlier test"
    yield
    wait_for("every claim to be unprepared", lambda: not driver.checkpoint_claims(), 120)
    assert driver.real.mig_instances() == [], "MIG instances left behind"
    assert set(driver.real.mig_modes().values()) <= {0}, driver.real.mig_modes()


@pytest.mark.usefixtures("no_real_mig_left")
def test_a_mig_slice_is_made_and_its_container_sees_only_it(
    driver: Driver, kube: Kube, namespace: str, glibc_image: str
) -> None:
    assert driver.real is not None
    kube.create(m.claim("slice", namespace, m.claim_spec([mig_request("mig", "1g.10gb")])))
    kube.create(driver.real.pod("cuda", namespace, "slice", glibc_image, SHOW_DRIVER))
    wait_running(kube, "cuda", namespace)
    log = finished_log(kube, "cuda", namespace)

    (device,) = allocated_devices(kube, "slice", namespace)
    parent = driver.devices()[device]["attributes"]["parentUUID"]["string"]
    made = driver.real.mig_instances()
    assert [gi["gpuUUID"] for gi in made] == [parent]
    (mig_uuid,) = [ci["uuid"] for ci in made[0]["computeInstances"]]
    smi = section(log, "smi")
    assert "smi-exit=0" in smi, log
    assert len(gpu_lines(smi)) == 1, smi
    assert uuids(smi) == [parent], smi
    assert uuids(smi, "MIG-") == [mig_uuid], smi
    assert "MIG 1g.10gb" in smi
    assert driver.real.mig_modes()[parent] == 1

    uid = claim_uid(kube, "slice", namespace)
    delete_pods(kube, namespace, ["cuda"])
    driver.wait_unprepared(uid)
