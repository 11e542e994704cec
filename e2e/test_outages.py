"""Outages around the plugin (issue 12, item 6) on a simulated hgx-h100 node with dynamic MIG and
MPS daemons run as pods: the apiserver down for `OUTAGE_S`, the kubelet restarted while a
prepare is under way, and a node reboot. Each test stops only what it restarts again, in a
``finally``. What each proves: docs/architecture.md, "Outages".

`OUTAGE_S` (default 60 s) comes from ``GPU_DRA_E2E_OUTAGE_S`` for quicker runs. The reboot is
simulated: the plugin is killed, the simulated GPUs are reset (MIG instances gone, pending MIG
mode current), the MPS daemon processes are killed, and the plugin starts again with another
boot ID (``GPU_DRA_TEST_BOOT_ID``, honoured on simulated nodes only); the pods of the earlier
boot are deleted as their node's end would end them, and their Deployments make new ones.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from e2e import grpc_health_check
from e2e import manifests as m
from e2e.cluster import Cluster
from e2e.driver import PLUGIN, Driver
from e2e.health import HEALTH_ARGS, XID_KEY, inject, wait_tainted, wait_untainted
from e2e.kube import Kube, wait_for
from e2e.mig import mig_instances, mig_modes, mig_request, reset_simulated_gpus
from e2e.mps import (
    MPS_CONFIG,
    assert_unprepared_without_daemon,
    daemon_pid,
    daemon_processes,
    daemons,
)
from e2e.workloads import (
    allocated_devices,
    claim_uid,
    delete_pods,
    gpus_seen,
    wait_running,
)
from gpu_dra.kubelet_plugin.checkpoint import read_boot_id
from gpu_dra.kubelet_plugin.fault_injection import TEST_BOOT_ID_ENV, TEST_PREPARE_DELAY_ENV
from gpu_dra.kubelet_plugin.mps import claim_daemon_id
from gpu_dra.kubelet_plugin.slices.metrics import WRITE_VERBS
from tests.doubles.mps_helpers import kill_processes_under

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left", "no_mig_left")]

SIMULATED_PROFILE = "hgx-h100"
DYNAMIC_MIG = True
HEALTH_PORT = 51519
PLUGIN_ARGS = (f"--healthcheck-port={HEALTH_PORT}", *HEALTH_ARGS)

OUTAGE_S = float(os.environ.get("GPU_DRA_E2E_OUTAGE_S", "60"))
"""How long the apiserver stays down (20 s or more: the finishing pod must end within it)."""
FINISH_AFTER_S = max(OUTAGE_S / 2, 10.0)
"""How long the finishing pod's container runs: it must outlive the start of the outage (its
pod's start is waited for) and end early in it."""
PREPARE_DELAY_S = 15
"""How long the plugin holds a prepare after PrepareStarted: the kubelet restarts meanwhile."""

APISERVER = "kube-apiserver"
KUBELET = "kubelet"
TAINT_OUTAGE_S = 15.0
"""The outage of the taint test: long enough for the publisher's retries to reach their cap."""
TAINT_AFTER_OUTAGE_BOUND_S = 8.0
"""The publisher's back-off cap (5 s) plus its debounce, the write and the test's polling
(measured 4.5 s; 9.0 s with the earlier 30 s cap)."""


def plugin_log(driver: Driver) -> str:
    return (driver.cluster.paths.logs / f"{PLUGIN}.log").read_text(errors="replace")


def health(service: str) -> str:
    """What the plugin's gRPC health service answers for `service` (as a kubelet probe asks)."""
    return grpc_health_check.check(f"127.0.0.1:{HEALTH_PORT}", service)


def slice_writes(driver: Driver) -> float:
    return sum(driver.metric("gpu_dra_resourceslice_writes_total", verb=v) for v in WRITE_VERBS)


def slice_generations(driver: Driver) -> dict[str, int]:
    """The node's ResourceSlices: name -> pool generation."""
    return {s["metadata"]["name"]: int(s["spec"]["pool"]["generation"]) for s in driver.slices()}


def claim_files(driver: Driver, uid: str) -> Path:
    return driver.state_dir / "claims" / uid


def devices_of(entry: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(device name, CDI device IDs) of a checkpoint entry or a NodePrepareResources answer."""
    return [(d["deviceName"], list(d["cdiDeviceIDs"])) for d in entry["devices"]]


def mps_claim_spec() -> m.Obj:
    config = m.gpu_config(m.mps_sharing(**MPS_CONFIG), requests=["mps-gpu"])
    return m.claim_spec([m.request("mps-gpu")], [config])


def test_the_node_serves_through_an_apiserver_outage_and_converges_after_it(
    driver: Driver, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    """Pods with a whole GPU and with a per-claim MPS daemon run, and a third pod's container
    ends on its own, while the apiserver is down for OUTAGE_S: the plugin (same process) keeps
    answering the kubelet and its health probes, the kubelet unprepares the finished pod's claim
    through it, the MPS daemon is left alone. When the apiserver is back the slices are as the
    plugin left them (no write), new claims are prepared, deleted slices are published anew
    (the watch works again), and every claim is unprepared when its pods go, leaving no
    checkpoint entry, CDI spec, claim files or MPS daemon."""
    kube.create(m.claim("steady", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("steady", namespace, claim="steady"))
    kube.create(m.claim("mps", namespace, mps_claim_spec()))
    kube.create(m.gpu_pod("mps", namespace, claim="mps", command=m.SHOW_MPS))
    kube.create(m.claim("finisher", namespace, m.claim_spec([m.request()])))
    for name in ("steady", "mps"):
        wait_running(kube, name, namespace)
    uids = {name: claim_uid(kube, name, namespace) for name in ("steady", "mps", "finisher")}
    (mps_device,) = allocated_devices(kube, "mps", namespace)
    daemon_id = claim_daemon_id(uids["mps"], [driver.uuid_of(mps_device)])
    (daemon_pod,) = driver.mps_daemon_pods().values()
    daemon = daemon_pid(driver, daemon_id)
    seen = gpus_seen(kube, "steady", namespace)
    published = set(driver.devices())
    generations = slice_generations(driver)
    writes = slice_writes(driver)
    steady = driver.checkpoint_entry(uids["steady"])
    plugin_pid = cluster.pid(PLUGIN)
    assert plugin_pid is not None
    # Started last, so that it still runs when the apiserver stops.
    finishing = f"env | grep ^GPU_DRA_ | sort; sleep {FINISH_AFTER_S:g}"
    kube.create(m.gpu_pod("finisher", namespace, claim="finisher", command=finishing))
    wait_running(kube, "finisher", namespace)

    # Killed: after a SIGTERM it was still running 20 s later (the clients stay connected).
    cluster.stop_component(APISERVER, timeout=0)
    back_at = time.monotonic() + OUTAGE_S
    try:
        assert uids["finisher"] in driver.checkpoint_claims(), "finished before the outage"
        # The finished pod's claim is unprepared without the apiserver: the kubelet works from
        # its own state, the plugin from its checkpoint.
        wait_for(
            "the kubelet to unprepare the finished pod's claim during the outage",
            lambda: uids["finisher"] not in driver.checkpoint_claims(),
            back_at - time.monotonic(),
        )
        assert uids["finisher"] not in driver.cdi_spec_claims()
        assert not claim_files(driver, uids["finisher"]).exists()
        # A prepare of a prepared claim is answered from the checkpoint (no claim read).
        answer = driver.node_prepare(namespace, uids["steady"], "steady")
        assert answer["error"] == ""
        assert devices_of(answer) == devices_of(steady)
        # The same process serves, healthy, the whole outage; the MPS daemon keeps running.
        assert (health("liveness"), health("readiness")) == ("SERVING", "SERVING")
        while (left := back_at - time.monotonic()) > 0:
            assert cluster.pid(PLUGIN) == plugin_pid, "the plugin restarted during the outage"
            assert daemon_processes(driver) == [daemon]
            time.sleep(min(left, 5.0))
        assert cluster.pid(PLUGIN) == plugin_pid, "the plugin restarted during the outage"
        assert (health("liveness"), health("readiness")) == ("SERVING", "SERVING")
    finally:
        cluster.start_component(APISERVER)
        cluster.wait_apiserver_ready()
    cluster.wait_node_ready()

    # The slices are as the plugin left them: the outage made it write nothing.
    assert slice_generations(driver) == generations
    assert set(driver.devices()) == published
    # The pods that ran through the outage still run, on their devices, with their daemon.
    wait_running(kube, "steady", namespace)
    wait_running(kube, "mps", namespace)
    assert gpus_seen(kube, "steady", namespace) == seen
    (after,) = driver.mps_daemon_pods().values()
    assert after["metadata"]["uid"] == daemon_pod["metadata"]["uid"]
    assert daemon_processes(driver) == [daemon]
    assert cluster.pid(PLUGIN) == plugin_pid
    # The finished pod's status reaches the API.
    wait_for(
        "the finished pod to be Succeeded",
        lambda: kube.get("v1", "Pod", "finisher", namespace)["status"].get("phase") == "Succeeded",
        90,
    )
    # New claims are prepared.
    kube.create(m.claim("after", namespace, m.claim_spec([m.request()])))
    kube.create(m.gpu_pod("after", namespace, claim="after"))
    wait_running(kube, "after", namespace, timeout=120)
    uids["after"] = claim_uid(kube, "after", namespace)
    assert slice_writes(driver) == writes
    assert slice_generations(driver) == generations
    # The plugin's slice watch works again: slices deleted (as a starting kubelet deletes them)
    # are published anew, with the same devices.
    for name in generations:
        kube.delete("resource.k8s.io/v1", "ResourceSlice", name)
    wait_for(
        "the deleted slices to be published anew",
        lambda: (
            not set(slice_generations(driver)) & set(generations)
            and set(driver.devices()) == published
        ),
        90,
    )

    # Every claim is unprepared when its pods go: nothing is left of any of them.
    delete_pods(kube, namespace, ["steady", "mps", "finisher", "after"])
    assert_unprepared_without_daemon(driver, uids["mps"], daemon_id)
    for uid in uids.values():
        driver.wait_unprepared(uid)
        assert uid not in driver.cdi_spec_claims()
        assert not claim_files(driver, uid).exists()


def test_a_taint_set_during_an_apiserver_outage_is_published_soon_after_it(
    driver: Driver, cluster: Cluster
) -> None:
    """An XID 48 the plugin sees while the apiserver is down reaches the slices within the
    publisher's back-off cap (5 s) of the apiserver answering again (issue 25: it took up to
    30 s). The measurement is printed (docs/architecture.md, Outages)."""
    uuid = driver.uuid_of("gpu-2")
    cluster.stop_component(APISERVER, timeout=0)
    try:
        inject(driver, {"gpu": uuid, "event": "xid", "xid": 48})  # taken from the data dir
        time.sleep(TAINT_OUTAGE_S)
    finally:
        cluster.start_component(APISERVER)
        cluster.wait_apiserver_ready()
    back = time.monotonic()
    wait_tainted(driver, {"gpu-2"}, XID_KEY, timeout=60)
    elapsed = time.monotonic() - back
    print(f"\nXID 48 taint published {elapsed:.1f} s after the apiserver answered again")
    assert elapsed < TAINT_AFTER_OUTAGE_BOUND_S
    cluster.wait_node_ready()
    inject(driver, {"gpu": uuid, "event": "recovered"})
    wait_untainted(driver)


def test_a_kubelet_restarted_during_a_prepare_gets_the_claim_prepared_once(
    driver: Driver, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    """The kubelet stops while the plugin prepares a dynamic MIG slice (held PREPARE_DELAY_S
    after PrepareStarted by ``GPU_DRA_TEST_PREPARE_DELAY_S``) and starts again: the prepare the
    kubelet walked away from finishes behind it, the restarted kubelet's retry finds the claim
    prepared (one prepare, one MIG device), the pod runs, and its deletion leaves nothing."""
    driver.stop_plugin()
    driver.start_plugin(env={TEST_PREPARE_DELAY_ENV: str(PREPARE_DELAY_S)})
    try:
        plugin_pid = cluster.pid(PLUGIN)
        offset = len(plugin_log(driver))
        kube.create(m.claim("slice", namespace, m.claim_spec([mig_request("mig", "1g.10gb")])))
        kube.create(m.gpu_pod("pod", namespace, claim="slice"))
        uid = claim_uid(kube, "slice", namespace)
        wait_for(
            "the prepare to record PrepareStarted",
            lambda: driver.checkpoint_phase(uid) == "PrepareStarted",
            60,
        )

        cluster.stop_component(KUBELET)
        try:
            # The kubelet is gone and the prepare goes on (the delay holds it).
            assert driver.checkpoint_phase(uid) == "PrepareStarted"
        finally:
            cluster.start_component(KUBELET)
            cluster.wait_node_ready()

        wait_running(kube, "pod", namespace, timeout=120)
        assert cluster.pid(PLUGIN) == plugin_pid
        # Prepared once: one hold at PrepareStarted (the retry did not prepare anew), one MIG
        # device, the one the checkpoint records; one CDI spec.
        held = [
            line
            for line in plugin_log(driver)[offset:].splitlines()
            if "holding the prepare" in line and f"claim_uid={uid}" in line
        ]
        assert len(held) == 1, held
        entry = driver.checkpoint_entry(uid)
        assert entry["phase"] == "PrepareCompleted"
        (made,) = entry["state"]["dynamicMig"]
        (gpu_instances,) = mig_instances(driver).values()
        assert [ci["uuid"] for gi in gpu_instances for ci in gi["computeInstances"]] == [
            made["uuid"]
        ]
        assert driver.checkpoint_claims() == {uid}
        assert uid in driver.cdi_spec_claims()

        delete_pods(kube, namespace, ["pod"])
        driver.wait_unprepared(uid)
        assert uid not in driver.cdi_spec_claims()
        assert not claim_files(driver, uid).exists()
        assert mig_instances(driver) == {}
    finally:
        driver.stop_plugin()
        driver.start_plugin()  # without the delay


def running_pod(kube: Kube, namespace: str, app: str, besides: set[str]) -> str:
    """The name of the one Running pod of Deployment `app` that is not in `besides`; waits."""
    found: list[str] = []

    def one_running() -> bool:
        pods = kube.list("v1", "Pod", namespace=namespace, label_selector=f"app={app}")
        found[:] = [
            p["metadata"]["name"]
            for p in pods
            if p["metadata"]["name"] not in besides
            and not p["metadata"].get("deletionTimestamp")
            and p["status"].get("phase") == "Running"
        ]
        return len(found) == 1

    wait_for(f"a running pod of {app}", one_running, 120)
    return found[0]


def pod_claim_uid(kube: Kube, pod: str, namespace: str) -> tuple[str, str]:
    """(name, UID) of the claim the pod's template made for it."""
    (status,) = kube.get("v1", "Pod", pod, namespace)["status"]["resourceClaimStatuses"]
    name = str(status["resourceClaimName"])
    return name, claim_uid(kube, name, namespace)


def test_after_a_node_reboot_the_old_boot_is_discarded_and_new_pods_get_fresh_prepares(
    driver: Driver, cluster: Cluster, kube: Kube, namespace: str
) -> None:
    """A Deployment's pod holds a dynamic MIG slice, another's a per-claim MPS daemon. The node
    reboots (simulated, see the module doc): the plugin of the new boot discards the checkpoint
    of the old one and removes what it recorded (the dead daemon's pod and directories, CDI
    specs, claim files; MIG mode off on GPUs without instances); the old pods' unprepares
    succeed; the Deployments' new pods get fresh claims, prepared anew, and nothing of the old
    boot remains."""
    kube.create(m.claim_template("slice", namespace, m.claim_spec([mig_request("mig", "1g.10gb")])))
    kube.create(m.claim_template("mps", namespace, mps_claim_spec()))
    kube.create(m.deployment("mig", namespace, template="slice"))
    kube.create(m.deployment("mps", namespace, template="mps", command=m.SHOW_MPS))
    new_boot = str(uuid.uuid4())
    try:
        old_pods = {app: running_pod(kube, namespace, app, set()) for app in ("mig", "mps")}
        old = {app: pod_claim_uid(kube, pod, namespace) for app, pod in old_pods.items()}
        old_uids = {uid for _, uid in old.values()}
        assert driver.checkpoint_claims() == old_uids
        assert driver.checkpoint_boot_id() == read_boot_id()
        (old_mig,) = driver.checkpoint_entry(old["mig"][1])["state"]["dynamicMig"]
        (mps_device,) = allocated_devices(kube, old["mps"][0], namespace)
        old_daemon_id = claim_daemon_id(old["mps"][1], [driver.uuid_of(mps_device)])
        (old_daemon_pod,) = driver.mps_daemon_pods().values()
        assert daemons(driver) == [daemon_pid(driver, old_daemon_id)]

        # The node goes down: the plugin dies, MIG devices and MPS daemons with the boot.
        driver.kill_plugin()
        reset_simulated_gpus(driver)
        kill_processes_under(driver.data_dir / "mps", grace_s=0)
        wait_for("the MPS daemon to be gone", lambda: not daemons(driver), 10)
        offset = len(plugin_log(driver))
        driver.start_plugin(env={TEST_BOOT_ID_ENV: new_boot})

        # The plugin of the new boot discarded the old checkpoint and what it recorded.
        assert (
            f"node rebooted: discarded checkpoint of boot {read_boot_id()} with 2 claim(s)"
            in plugin_log(driver)[offset:]
        )
        assert driver.checkpoint_boot_id() == new_boot
        assert driver.checkpoint_claims() == set()
        assert driver.mps_daemon_pods() == {}
        assert not (driver.mps_dir / old_daemon_id).exists()
        for uid in old_uids:
            assert uid not in driver.cdi_spec_claims()
            assert not claim_files(driver, uid).exists()
        assert mig_instances(driver) == {}
        assert all(mode == [0, 0] for mode in mig_modes(driver).values()), mig_modes(driver)

        # The old pods end with the old boot (their unprepares find nothing to do); their
        # Deployments make new ones, whose new claims are prepared anew.
        delete_pods(kube, namespace, old_pods.values())
        new_pods = {
            app: running_pod(kube, namespace, app, set(old_pods.values())) for app in old_pods
        }
        new = {app: pod_claim_uid(kube, pod, namespace) for app, pod in new_pods.items()}
        new_uids = {uid for _, uid in new.values()}
        assert not new_uids & old_uids
        assert driver.checkpoint_claims() == new_uids
        assert {driver.checkpoint_phase(uid) for uid in new_uids} == {"PrepareCompleted"}
        for uid in new_uids:
            assert uid in driver.cdi_spec_claims()
        (new_mig,) = driver.checkpoint_entry(new["mig"][1])["state"]["dynamicMig"]
        (gpu_instances,) = mig_instances(driver).values()
        made = [ci["uuid"] for gi in gpu_instances for ci in gi["computeInstances"]]
        assert made == [new_mig["uuid"]]
        assert new_mig["uuid"] != old_mig["uuid"]
        (mps_device,) = allocated_devices(kube, new["mps"][0], namespace)
        new_daemon_id = claim_daemon_id(new["mps"][1], [driver.uuid_of(mps_device)])
        (new_daemon_pod,) = driver.mps_daemon_pods().values()
        assert new_daemon_pod["metadata"]["uid"] != old_daemon_pod["metadata"]["uid"]
        assert daemons(driver) == [daemon_pid(driver, new_daemon_id)]

        # The new boot's claims are unprepared as usual when their pods go.
        for app in ("mig", "mps"):
            kube.delete("apps/v1", "Deployment", app, namespace)
        wait_for(
            "the Deployments' pods to be gone",
            lambda: (
                not kube.list("v1", "Pod", namespace=namespace, label_selector="app in (mig,mps)")
            ),
            120,
        )
        assert_unprepared_without_daemon(driver, new["mps"][1], new_daemon_id)
        driver.wait_unprepared(new["mig"][1])
        assert mig_instances(driver) == {}
    finally:
        for app in ("mig", "mps"):
            kube.delete("apps/v1", "Deployment", app, namespace)
        # The kernel's boot ID again: to the plugin another reboot, which drops (and cleans up
        # after) whatever a failure above left prepared.
        driver.stop_plugin()
        driver.start_plugin()
