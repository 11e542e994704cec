"""Dynamic MIG end to end (issue 4) on a simulated hgx-h100 node with --dynamic-mig: the
scheduler picks placements from the partitionable devices, the plugin makes the MIG devices at
prepare and destroys them at unprepare. The simulated GPUs keep their MIG state in the plugin's
``simulated-nvml.json``, which these tests read as the "hardware". A device-plugin-style pod
asking for ``nvidia.com/mig-1g.10gb`` gets a partition made for it (issue 27)."""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml

from e2e import manifests as m
from e2e.chart import chart_class
from e2e.cluster import Cluster
from e2e.driver import CDI_ROOT, PLUGIN, Driver
from e2e.kube import Kube, wait_for
from e2e.mig import mig_instances, mig_modes, mig_request
from e2e.workloads import (
    allocated_devices,
    claim_uid,
    delete_pods,
    extended_resource_claim,
    wait_event,
    wait_running,
)
from gpu_dra.kubelet_plugin.fault_injection import TEST_NVML_FAULTS_ENV
from gpu_dra.kubelet_plugin.mig import (
    CRASH_AFTER_GPU_INSTANCE,
    SIMULATED_STATE_FILE,
    TEST_CRASH_ENV,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mig_left")]

SIMULATED_PROFILE = "hgx-h100"
DYNAMIC_MIG = True
# gpu-test4 on an H100: 1g.10gb x2, 2g.20gb, 3g.40gb, all on one GPU (8 memory slices).
FOUR_PROFILES = {
    "mig-1g-a": "1g.10gb",
    "mig-1g-b": "1g.10gb",
    "mig-2g": "2g.20gb",
    "mig-3g": "3g.40gb",
}
LEFTOVERS_KEY = "gpu.nvidia.com/mig-leftovers"
CLAIM = ("resource.k8s.io/v1", "ResourceClaim")
_ENV_UUID = re.compile(r"^GPU_DRA_(GPU_\d+_MIG_\w+?)_UUID=(MIG-[0-9a-f-]+)$", re.M)


def whole_gpus(driver: Driver) -> dict[str, str]:
    """{UUID: device name} of the published whole GPUs (partitions have no UUID)."""
    return {
        d["attributes"]["uuid"]["string"]: name
        for name, d in driver.devices().items()
        if d["attributes"]["type"]["string"] == "gpu"
    }


def whole_gpu_name(driver: Driver, uuid: str) -> str:
    return whole_gpus(driver)[uuid]


def uuid_request(name: str, uuid: str) -> m.Obj:
    return m.request(name, selectors=[f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"])


def mig_uuids_seen(kube: Kube, pod: str, namespace: str, count: int) -> dict[str, str]:
    """{device env name: MIG UUID} the container printed; waits for `count` of them."""
    seen: dict[str, str] = {}

    def printed() -> bool:
        seen.clear()
        seen.update(_ENV_UUID.findall(kube.pod_log(pod, namespace)))
        return len(seen) >= count

    wait_for(f"{count} MIG UUIDs in {pod}'s log", printed, 30)
    return seen


def wait_unschedulable(kube: Kube, pod: str, namespace: str) -> None:
    wait_event(kube, namespace, pod, "FailedScheduling", 90)
    assert kube.get("v1", "Pod", pod, namespace)["status"]["phase"] == "Pending"


def delete_pod_and_claim(kube: Kube, pod: str, claim: str, namespace: str) -> None:
    delete_pods(kube, namespace, [pod])
    kube.delete("resource.k8s.io/v1", "ResourceClaim", claim, namespace)
    kube.wait_gone("resource.k8s.io/v1", "ResourceClaim", claim, namespace)


def test_four_mig_requests_on_one_gpu_are_made_and_each_container_sees_them(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    spec = m.claim_spec([mig_request(name, p) for name, p in FOUR_PROFILES.items()])
    spec["devices"]["constraints"] = [{"matchAttribute": "gpu.nvidia.com/parentUUID"}]
    kube.create(m.claim("slices", namespace, spec))
    kube.create(m.gpu_pod("pod", namespace, claim="slices"))
    wait_running(kube, "pod", namespace, timeout=120)

    names = allocated_devices(kube, "slices", namespace)
    published = driver.devices()
    parents = {published[n]["attributes"]["parentUUID"]["string"] for n in names}
    assert len(parents) == 1, names
    (parent,) = parents
    assert sorted(published[n]["attributes"]["profile"]["string"] for n in names) == sorted(
        FOUR_PROFILES.values()
    )

    # The simulated GPU now holds one GPU instance (with its compute instance) per device, at
    # the placement the device name gives.
    held = mig_instances(driver)
    assert list(held) == [parent]
    placements = sorted((gi["profileId"], gi["start"]) for gi in held[parent])
    assert placements == sorted((int(n.split("-")[-2]), int(n.split("-")[-1])) for n in names)
    made_uuids = {ci["uuid"] for gi in held[parent] for ci in gi["computeInstances"]}
    assert len(made_uuids) == 4

    # The container got each MIG device's UUID, as the claim's CDI spec says.
    uid = claim_uid(kube, "slices", namespace)
    seen = mig_uuids_seen(kube, "pod", namespace, 4)
    assert set(seen.values()) == made_uuids
    cdi = yaml.safe_load((CDI_ROOT / f"k8s.gpu.nvidia.com-claim_{uid}.yaml").read_text())
    in_spec = {
        value
        for device in cdi["devices"]
        for key, value in (item.split("=", 1) for item in device["containerEdits"]["env"])
        if key.endswith("_UUID") and not key.endswith("_PARENT_UUID")
    }
    assert in_spec == made_uuids
    entry = driver.checkpoint_entry(uid)
    assert entry["phase"] == "PrepareCompleted"
    assert {i["uuid"] for i in entry["state"]["dynamicMig"]} == made_uuids

    delete_pod_and_claim(kube, "pod", "slices", namespace)


def test_whole_gpus_and_mig_slices_exclude_each_other_until_unprepared(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    first, second = sorted(whole_gpus(driver))[:2]

    # A MIG slice on the first GPU, the second GPU whole.
    kube.create(
        m.claim(
            "slice",
            namespace,
            m.claim_spec(
                [
                    mig_request(
                        "mig",
                        "1g.10gb",
                        f"device.attributes['gpu.nvidia.com'].parentUUID == '{first}'",
                    )
                ]
            ),
        )
    )
    kube.create(m.gpu_pod("slice-pod", namespace, claim="slice"))
    kube.create(m.claim("whole", namespace, m.claim_spec([uuid_request("gpu", second)])))
    kube.create(m.gpu_pod("whole-pod", namespace, claim="whole"))
    wait_running(kube, "slice-pod", namespace, timeout=120)
    wait_running(kube, "whole-pod", namespace, timeout=120)
    assert list(mig_instances(driver)) == [first]

    # The first GPU cannot be had whole while its slice lives, nor a slice of the second one.
    kube.create(m.claim("whole-first", namespace, m.claim_spec([uuid_request("gpu", first)])))
    kube.create(m.gpu_pod("whole-first-pod", namespace, claim="whole-first"))
    parent_is_second = f"device.attributes['gpu.nvidia.com'].parentUUID == '{second}'"
    kube.create(
        m.claim(
            "slice-second",
            namespace,
            m.claim_spec([mig_request("mig", "1g.10gb", parent_is_second)]),
        )
    )
    kube.create(m.gpu_pod("slice-second-pod", namespace, claim="slice-second"))
    wait_unschedulable(kube, "whole-first-pod", namespace)
    wait_unschedulable(kube, "slice-second-pod", namespace)

    # Deleting the slice's pod and claim destroys the MIG device and turns MIG off: the first GPU
    # is whole again, and the waiting pod gets it.
    slice_uid = claim_uid(kube, "slice", namespace)
    delete_pod_and_claim(kube, "slice-pod", "slice", namespace)
    driver.wait_unprepared(slice_uid)
    assert mig_instances(driver) == {}
    assert mig_modes(driver)[first] == [0, 0]
    wait_running(kube, "whole-first-pod", namespace, timeout=180)
    assert allocated_devices(kube, "whole-first", namespace) == [whole_gpu_name(driver, first)]
    # Likewise the second GPU: once its whole-GPU pod goes, the slice is made on it.
    delete_pod_and_claim(kube, "whole-pod", "whole", namespace)
    wait_running(kube, "slice-second-pod", namespace, timeout=180)
    assert list(mig_instances(driver)) == [second]

    delete_pod_and_claim(kube, "whole-first-pod", "whole-first", namespace)
    delete_pod_and_claim(kube, "slice-second-pod", "slice-second", namespace)


def test_a_device_plugin_style_mig_pod_gets_a_slice_made_for_it(
    cluster: Cluster, driver: Driver, kube: Kube, namespace: str
) -> None:
    """``nvidia.com/mig-1g.10gb: 1`` (the device plugin's mixed MIG strategy), no claim: served
    by the class the chart renders for deviceClasses.migProfiles, on a dynamic MIG partition of
    that profile, made at prepare and destroyed with the pod."""
    name = "mig-1g.10gb.gpu.nvidia.com"
    with chart_class(cluster, kube, name, "deviceClasses.migProfiles={1g.10gb}"):
        kube.create(m.device_plugin_pod("legacy-mig", namespace, {"nvidia.com/mig-1g.10gb": "1"}))
        wait_running(kube, "legacy-mig", namespace, timeout=120)

        claim = extended_resource_claim(kube, "legacy-mig", namespace)
        (request,) = claim["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == name, request
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        published = driver.devices()[result["device"]]
        assert published["attributes"]["profile"] == {"string": "1g.10gb"}
        assert "consumesCounters" in published  # a partition, made on demand
        held = mig_instances(driver)
        (instances,) = held.values()
        (made,) = [ci["uuid"] for gi in instances for ci in gi["computeInstances"]]
        assert list(mig_uuids_seen(kube, "legacy-mig", namespace, 1).values()) == [made]

        uid = claim["metadata"]["uid"]
        delete_pods(kube, namespace, ["legacy-mig"])
        driver.wait_unprepared(uid)
        assert mig_instances(driver) == {}


def test_plugin_crash_between_gpu_and_compute_instance_leaves_nothing_behind(
    driver: Driver, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    driver.stop_plugin()
    driver.start_plugin(env={TEST_CRASH_ENV: CRASH_AFTER_GPU_INSTANCE})
    kube.create(m.claim("slice", namespace, m.claim_spec([mig_request("mig", "3g.40gb")])))
    kube.create(m.gpu_pod("pod", namespace, claim="slice"))
    uid = ""

    def crashed() -> bool:
        return cluster.pid(PLUGIN) is None

    try:
        wait_for("the plugin to kill itself at the crash point", crashed, 120)
        uid = claim_uid(kube, "slice", namespace)
        # What the dead plugin left: its intent, and a GPU instance without compute instance.
        entry = driver.checkpoint_entry(uid)
        assert entry["phase"] == "PrepareStarted"
        (intent,) = entry["state"]["dynamicMig"]
        assert set(intent) == {"device", "parentUUID", "giProfileID", "placementStart"}
        left = mig_instances(driver)
        assert list(left) == [intent["parentUUID"]]
        assert [
            (gi["profileId"], gi["start"], gi["computeInstances"])
            for gi in left[intent["parentUUID"]]
        ] == [(9, intent["placementStart"], [])]
    finally:
        driver.stop_plugin()  # reaps the killed process (or stops one that did not crash)
        driver.start_plugin()  # without the crash setting

    log = (cluster.paths.logs / f"{PLUGIN}.log").read_text()
    assert f"rolling back an interrupted prepare claim_uid={uid}" in log
    # The kubelet retries the prepare, which now succeeds: the claim's one MIG device exists,
    # nothing else does. On its own the kubelet retries a failed pod sync at its next resync
    # (60 to 90 s); a pod update makes it sync at once.
    cluster.kubectl("annotate", "pod", "pod", f"--namespace={namespace}", "gpu-dra.e2e/retry=1")
    wait_running(kube, "pod", namespace, timeout=300)
    (device,) = allocated_devices(kube, "slice", namespace)
    held = mig_instances(driver)
    assert [len(gis) for gis in held.values()] == [1]
    (gi,) = next(iter(held.values()))
    assert (gi["profileId"], gi["start"], len(gi["computeInstances"])) == (
        9,
        int(device.split("-")[-1]),
        1,
    )
    assert driver.checkpoint_claims() == {uid}
    assert driver.cdi_spec_claims() == {uid}

    delete_pod_and_claim(kube, "pod", "slice", namespace)
    wait_for("the claim to be unprepared", lambda: not driver.checkpoint_claims(), 60)
    assert driver.cdi_spec_claims() == set()


def test_a_gpu_whose_start_up_sweep_failed_is_not_allocated_whole_until_it_is_swept(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    """Issue 25: a leftover MIG instance the start-up sweep cannot remove (NVML fails on that
    GPU) keeps the GPU's whole device tainted ``mig-leftovers``: a claim for it stays
    unallocated. Once a sweep works (here the next start, without the fault) the leftover goes,
    the taint goes, and the claim gets the GPU."""
    uuid, name = sorted(whole_gpus(driver).items())[-1]
    index = int(name.removeprefix("gpu-"))  # the simulated GPUs' NVML index is their minor
    driver.stop_plugin()
    path = driver.state_dir / SIMULATED_STATE_FILE
    saved = (
        json.loads(path.read_text())
        if path.exists()
        else {"version": 1, "profile": SIMULATED_PROFILE, "gpus": {}}
    )
    # MIG mode on and a GPU instance without compute instance, as a crashed prepare leaves them.
    saved["gpus"][uuid] = {
        "current": 1, "pending": 1, "computeInstancesCreated": 0,
        "gpuInstances": [{"id": 7, "profileId": 19, "start": 0, "computeInstances": []}],
    }  # fmt: skip
    path.write_text(json.dumps(saved))
    fault = f"device_get_gpu_instance_profile_info@{index}=NVML_ERROR_UNKNOWN"
    driver.start_plugin(env={TEST_NVML_FAULTS_ENV: fault})
    try:
        wait_for(
            f"{name} tainted mig-leftovers",
            lambda: LEFTOVERS_KEY in {t["key"] for t in driver.devices()[name].get("taints", [])},
            60,
        )
        kube.create(m.claim("whole", namespace, m.claim_spec([uuid_request("gpu", uuid)])))
        kube.create(m.gpu_pod("pod", namespace, claim="whole"))
        time.sleep(15)  # the scheduler tries (and retries) meanwhile
        assert "allocation" not in (kube.get(*CLAIM, "whole", namespace).get("status") or {})
        assert [gi["start"] for gi in mig_instances(driver)[uuid]] == [0]  # still there
    finally:
        driver.stop_plugin()
        driver.start_plugin()  # without the fault: the start-up sweep removes the leftover
    wait_for(f"{name} untainted", lambda: "taints" not in driver.devices()[name], 60)
    wait_running(kube, "pod", namespace, timeout=180)
    assert allocated_devices(kube, "whole", namespace) == [name]
    assert uuid not in mig_instances(driver)
    delete_pod_and_claim(kube, "pod", "whole", namespace)
