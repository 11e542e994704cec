"""The demo's stages as demo/run runs them: gpu-dra installed with its Helm chart from the
locally built image (the kubelet plugin as the DaemonSet's pod, no host process; the controller
as the Deployment), upgraded to each stage's plugin flags; each stage's examples together on the
demo's simulated node; each container sees exactly the devices allocated to its claims (MIG
devices as the plugin made them, MPS caps and time slices as the claims ask); on the last stage
the utilization per claim: the busy claims' numbers and the idle claims in ``gpu-dra inventory
--utilization`` / ``--idle`` as the demo prints them, and ``gpu-dra rightsize``'s advice for the
busy and idle shares; on the last stage, the idle notebook warned by the chart's controller
(condition, Events, the plugin's fresh claim status, ``gpu-dra inventory --idle``) and the
1g.10gb MIG slice ``gpu-dra rightsize`` advises for it, then two teams by the recipe's quotas,
one refused over its quota and one refused a class its quota does not name; and deleting the
examples leaks nothing.
(tests/test_demo.py checks the stages and their chart values without a cluster.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from demo.idle import ADVICE, BURST_GPU, CONTEXT_MEMORY, NOTEBOOK, show_idle_reclaim
from demo.idle import IDLE_FOR as NOTEBOOK_IDLE_FOR
from demo.install import DemoRelease, apply_example, remove_release
from demo.observe import (
    MPS_PID_KEY,
    MpsDaemon,
    Result,
    Seen,
    claim_results,
    container_claims,
    containers_seen,
    mig_instances,
    mig_mode_on,
    mps_daemons,
    time_slices,
    wait_pods_running,
)
from demo.quotas import (
    BYPASS_CLAIM,
    BYPASS_CLASS,
    REFUSED_CLAIM,
    TRAINING_CLAIMS,
    reset_teams,
    show_quotas,
)
from demo.stages import MPS_SHARE_GPU, STAGES, Stage, namespace_of
from demo.utilization import (
    BUSY_GPU,
    BUSY_GPU_CLAIM,
    BUSY_SHARE_CLAIM,
    BUSY_SHARE_MEMORY,
    BUSY_SHARE_SM,
    IDLE_CLAIMS,
    IDLE_FOR,
    IDLE_NAMESPACE,
    show_utilization,
)
from e2e.chart import CONTROLLER_SELECTOR, pods, ready
from e2e.cluster import Cluster
from e2e.driver import PLUGIN, Driver
from e2e.kube import Kube, wait_for
from e2e.quotas import QUOTA
from gpu_dra.driver.cluster.idle_policy import parse_time
from gpu_dra.driver.config.limits import render_pinned_limit
from gpu_dra.driver.config.quantity import quantity_value
from gpu_dra.driver.naming import MigDeviceName, gpu_device_name, parse_device_name
from gpu_dra.kubelet_plugin.time_slicer import TIME_SLICE_VALUES
from gpu_dra.kubelet_plugin.utilization.simulated_file import SIMULATED_UTILIZATION_FILE

pytestmark = pytest.mark.e2e

CUDA_MPS_PIPE = "/tmp/nvidia-mps"

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def release(cluster: Cluster, kube: Kube) -> Iterator[DemoRelease]:
    """gpu-dra as demo/run installs it: the chart's release from the locally built image (each
    test upgrades it to its stage's flags); uninstalled at the end, with what it left."""
    if cluster.pid(PLUGIN):  # no host-process plugin may serve the node beside the chart's
        cluster.stop_component(PLUGIN)
    installed = DemoRelease.prepare(cluster, kube)
    yield installed
    remove_release(installed.driver)


@pytest.mark.parametrize("stage", STAGES, ids=[f"stage-{i}" for i in range(1, len(STAGES) + 1)])
def test_stage_examples_run_side_by_side_and_each_container_sees_its_claims_allocation(
    stage: Stage, release: DemoRelease, cluster: Cluster, kube: Kube
) -> None:
    """As demo/run does: the chart release with the stage's flags, all its examples at once;
    then each container's devices against its claims' allocation, each example's own checks,
    the utilization per claim where the stage shows it, and after deleting them nothing left on
    the node."""
    release.ensure(stage)
    driver = release.driver
    assert_plugin_runs_as_the_charts_pod(release, cluster, kube)
    namespaces = {example.name: namespace_of(example) for example in stage.example_dirs()}
    for example in stage.example_dirs():
        apply_example(cluster, example)
    try:
        for example, namespace in namespaces.items():
            pods_running = {
                name: kube.get("v1", "Pod", name, namespace)
                for name in wait_pods_running(kube, namespace, timeout=120)
            }
            seen = [
                c for pod in pods_running.values() for c in containers_seen(kube, namespace, pod)
            ]
            results = claim_results(kube, namespace)
            for container in seen:
                claims = container_claims(pods_running[container.pod], container.container)
                allocated = {r.device for claim in claims for r in results[claim]}
                assert set(container.devices) == allocated, (container, claims, results)
                for device, facts in container.devices.items():
                    assert_device_is_what_was_published(driver, device, facts)
            CHECKS.get(example, lambda *_: None)(driver, kube, namespace, seen, results)
        if stage.shows_utilization:
            check_utilization(driver)
        if stage.idle_reclaim:
            check_idle_reclaim(driver)
        if stage.shows_quotas:
            check_quotas(driver)
    finally:
        if stage.shows_quotas:
            reset_teams(driver)
        for namespace in namespaces.values():
            kube.delete("v1", "Namespace", namespace)
        for namespace in namespaces.values():
            kube.wait_gone("v1", "Namespace", namespace, None, timeout=180)
        (driver.state_dir / SIMULATED_UTILIZATION_FILE).unlink(missing_ok=True)
    wait_for("every claim to be unprepared", lambda: not driver.checkpoint_claims(), 60)
    assert driver.cdi_spec_claims() == set()
    assert mig_instances(driver) == []
    assert mig_mode_on(driver) == []
    # Left: the warm daemon of the GPU offered as shares (docs/mps.md, "Warm daemons").
    warm = {f"mps-control-daemon-{daemon_id}" for daemon_id in driver.warm_daemon_ids()}
    wait_for(
        "MPS daemon pods but the warm ones to go",
        lambda: set(driver.mps_daemon_pods()) <= warm,
        60,
    )
    assert time_slices(driver) == {}


def assert_plugin_runs_as_the_charts_pod(
    release: DemoRelease, cluster: Cluster, kube: Kube
) -> None:
    """The node's one plugin is the DaemonSet's pod of the locally built image (no host
    process), and the controller runs as the Deployment's pod."""
    plugin = release.plugin_pod()
    assert ready(plugin)
    assert plugin["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
    assert plugin["spec"]["containers"][0]["image"] == release.image
    assert cluster.pid(PLUGIN) is None
    controllers = pods(kube, CONTROLLER_SELECTOR, plugin["metadata"]["namespace"])
    assert any(map(ready, controllers)), controllers
    assert release.driver.metrics_url.startswith(f"http://{plugin['status']['podIP']}:")


def claim_lines(text: str, section: str) -> dict[str, list[str]]:
    """The table lines of one ``==> <section>`` block of the demo's output, by their first
    column (``<namespace>/<claim>``)."""
    header = f"==> {section}\n"
    assert text.count(header) == 1, text
    block = text.split(header, 1)[1].split("\n==> ", 1)[0]
    lines: dict[str, list[str]] = {}
    for line in block.splitlines():
        first = line.split(" ", 1)[0]
        if "/" in first:
            lines.setdefault(first, []).append(line)
    return lines


def check_utilization(driver: Driver) -> None:
    """The demo's utilization step on the running examples: the busy claims' numbers in
    ``gpu-dra inventory --utilization``, the idle ones (and not the busy ones) in ``--idle``."""
    printed: list[str] = []
    shown = show_utilization(driver, printed.append)
    busy_gpu, busy_share = "/".join(BUSY_GPU_CLAIM), "/".join(BUSY_SHARE_CLAIM)
    assert shown.busy == {busy_gpu: BUSY_GPU["gpu"], busy_share: BUSY_SHARE_SM}
    idle = {"/".join(claim) for claim in IDLE_CLAIMS}
    assert idle <= shown.idle
    assert any(claim.startswith(f"{IDLE_NAMESPACE}/") for claim in shown.idle), shown.idle
    assert not {busy_gpu, busy_share} & shown.idle
    limit = requested_capacity(driver.kube, *BUSY_SHARE_CLAIM)["memory"]
    assert_utilization_printed("\n".join(printed), quantity_value(limit))
    assert_rightsize_advice(shown.advice, "\n".join(printed))


def check_idle_reclaim(driver: Driver) -> None:
    """The demo's idle-reclaim step: the notebook's claim status as the plugin wrote it (Idle,
    from a fresh sample), the policy's warning as condition, Events and inventory column, the
    pod not evicted within its grace period, and the advice: a 1g.10gb MIG slice for its peak
    (6 GiB, 10 %) on the whole H100 it holds."""
    printed: list[str] = []
    shown = show_idle_reclaim(driver, printed.append)
    text = "\n".join(printed)
    namespace, name = NOTEBOOK

    (entry,) = shown.status
    (active,) = [c for c in entry["conditions"] if c["type"] == "Active"]
    assert (active["status"], active["reason"]) == ("False", "Idle"), entry
    sampled = parse_time(entry["data"]["sampledAt"])
    assert sampled is not None, entry
    # The plugin rewrites it every 5 s (claimStatus.minInterval): within the policy's bound.
    assert shown.status_read_at - sampled < 3 * (5 + 1 + 2), (shown.status_read_at, entry)
    assert "idleSince" in entry["data"], entry

    condition = shown.condition
    assert (condition["status"], condition["reason"]) == ("True", "Idle"), condition
    assert f"claim {name} has been idle since" in condition["message"], condition
    assert f"pod {name} is evicted at" in condition["message"], condition
    assert ("Warning", "Pod", name, "GpuClaimIdle") in shown.events, shown.events
    assert ("Warning", "ResourceClaim", name, "GpuClaimIdle") in shown.events, shown.events
    assert not [e for e in shown.events if e[3] == "GpuClaimIdleEvicted"], shown.events
    assert shown.pod_phase == "Running"
    policy = shown.idle["policy"]
    assert (policy["mode"], policy["reason"]) == ("enabled", "Idle"), policy

    advice = shown.advice
    assert advice["peak"]["memoryUsedBytes"] == CONTEXT_MEMORY, advice
    assert advice["peak"]["gpuUtilizationPercent"] == BURST_GPU, advice
    recommended = advice["recommended"]
    assert (recommended["kind"], recommended["profile"]) == ("mig", "1g.10gb"), advice
    assert recommended["offered"] is True, advice

    # What the viewer sees.
    assert f"{entry['pool']}/{shown.device}: Active=False (Idle), idleSince " in text
    assert f"True, reason Idle, since {condition['lastTransitionTime']}" in text
    events = text.split("reason=GpuClaimIdle\n", 1)[1]
    assert f"pod/{name}" in events, events
    assert f"resourceclaim/{name}" in events, events
    idle_table = claim_lines(text, f"gpu-dra inventory --idle --idle-for {NOTEBOOK_IDLE_FOR}")
    (line,) = idle_table[f"{namespace}/{name}"]
    assert "warned " in line, line
    assert ", evicts at " in line, line
    assert f"{namespace}/{name} (" in text
    assert ADVICE in text


def assert_rightsize_advice(advice: dict[str, dict[str, Any]], text: str) -> None:
    """``gpu-dra rightsize`` on the shares' namespace: the busy share's peaks (its pod's process:
    12 GiB, 35 %) and, with 10 % headroom, a 14Gi / 40 % share where it holds 40Gi / 40 %; the
    idle shares called unused; the sentence and the template printed."""
    busy_share = "/".join(BUSY_SHARE_CLAIM)
    large = advice[busy_share]
    assert large["peak"]["memoryUsedBytes"] == BUSY_SHARE_MEMORY, large
    assert large["peak"]["gpuUtilizationPercent"] == BUSY_SHARE_SM, large
    recommended = large["recommended"]
    assert (recommended["kind"], recommended["offered"]) == ("mps-share", True), large
    assert (recommended["memoryBytes"], recommended["computePercent"]) == (14 * 2**30, 40), large
    for claim in ("/".join(claim) for claim in IDLE_CLAIMS):
        assert advice[claim]["unused"] is True, advice[claim]
    assert f"{busy_share} (" in text
    assert "a 14Gi / 40 % MPS share" in text
    assert "name: large-rightsized" in text


def assert_utilization_printed(text: str, share_limit_bytes: int) -> None:
    """What the demo printed: the busy claims' utilization and memory in the ``--utilization``
    table, the idle shares at 0 %; the idle claims, and not the busy ones, in ``--idle``."""
    busy_gpu, busy_share = "/".join(BUSY_GPU_CLAIM), "/".join(BUSY_SHARE_CLAIM)
    idle = {"/".join(claim) for claim in IDLE_CLAIMS}
    table = claim_lines(text, "gpu-dra inventory --utilization")
    (gpu_line,) = table[busy_gpu]
    assert f" {BUSY_GPU['gpu']}% " in gpu_line, gpu_line
    assert f" {BUSY_GPU['memoryUsedBytes'] / 2**30:.1f}/" in gpu_line, gpu_line
    (share_line,) = table[busy_share]
    share_memory = f"{BUSY_SHARE_MEMORY / 2**30:.1f}/{share_limit_bytes / 2**30:.1f} GiB"
    assert f" {BUSY_SHARE_SM}% " in share_line, share_line
    assert share_memory in share_line, share_line
    assert " mps-share " in share_line, share_line
    for claim in idle:
        (line,) = table[claim]
        assert " 0% " in line, line

    idle_table = claim_lines(text, f"gpu-dra inventory --idle --idle-for {IDLE_FOR}")
    assert idle <= set(idle_table), text
    assert any(claim.startswith(f"{IDLE_NAMESPACE}/") for claim in idle_table), text
    assert not {busy_gpu, busy_share} & set(idle_table), text


def assert_device_is_what_was_published(driver: Driver, device: str, facts: dict[str, str]) -> None:
    """A whole GPU: its published UUID and product. A dynamic MIG partition: its published
    parent and profile, and the UUID of the MIG device the plugin made at its placement."""
    published = driver.devices()[device]["attributes"]
    assert facts["PRODUCT"] == published["productName"]["string"]
    if published["type"]["string"] == "gpu":
        assert facts["UUID"] == published["uuid"]["string"]
        return
    name = parse_device_name(device)
    assert isinstance(name, MigDeviceName)
    parent = published["parentUUID"]["string"]
    assert facts["PARENT_UUID"] == parent
    assert facts["PROFILE"] == published["profile"]["string"]
    made = [
        i.uuid
        for i in mig_instances(driver)
        if (i.parent_uuid, i.profile_id, i.start)
        == (parent, name.gi_profile_id, name.placement_start)
    ]
    assert made == [facts["UUID"]], (device, made)


def check_dynamic_mig(
    driver: Driver, kube: Kube, namespace: str, seen: list[Seen], results: dict[str, list[Result]]
) -> None:
    """Four 1g slices on one parent, one 3g slice; the simulated GPUs hold exactly them."""
    published = driver.devices()
    four = [published[r.device]["attributes"] for r in results["four-1g"]]
    assert len({r.device for r in results["four-1g"]}) == 4
    assert len({a["parentUUID"]["string"] for a in four}) == 1  # matchAttribute parentUUID
    assert {a["profile"]["string"] for a in four} == {"1g.10gb"}
    (three,) = results["one-3g"]
    assert published[three.device]["attributes"]["profile"]["string"].startswith("3g.")
    seen_uuids = {f["UUID"] for c in seen for f in c.devices.values()}
    assert len(seen_uuids) == 5
    assert {i.uuid for i in mig_instances(driver)} == seen_uuids
    assert mig_mode_on(driver) == sorted({i.parent_uuid for i in mig_instances(driver)})


def check_mps_shares(
    driver: Driver, kube: Kube, namespace: str, seen: list[Seen], results: dict[str, list[Result]]
) -> None:
    """Each share lands on the offered GPU with its amounts; each container gets its claim's
    caps from the one daemon of that GPU."""
    shared = gpu_device_name(MPS_SHARE_GPU)
    uuid = driver.uuid_of(shared)
    assert driver.devices()[shared]["allowMultipleAllocations"] is True
    (daemon,) = daemons_of(driver, namespace)
    assert set(daemon.claims) == {f"{namespace}/{claim}" for claim in results}
    assert [p for p in driver.mps_daemon_pods() if p.endswith(daemon.daemon_id)]
    for container in seen:
        (claim,) = container_claims(kube.get("v1", "Pod", container.pod, namespace), "ctr")
        asked = requested_capacity(kube, namespace, claim)
        (result,) = results[claim]
        assert result.device == shared
        assert result.share_id
        assert dict(result.consumed) == asked
        memory = render_pinned_limit(asked["memory"])
        assert container.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuid}={memory}"
        assert container.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == asked["compute"]
        assert container.env["CUDA_MPS_PIPE_DIRECTORY"] == CUDA_MPS_PIPE
        caps = daemon.claims[f"{namespace}/{claim}"]
        assert caps == {
            "threads": float(asked["compute"]),
            f"memory:{uuid}": float(quantity_value(asked["memory"])),
        }
    assert len({c.env[MPS_PID_KEY] for c in seen}) == 1  # one daemon for all shares


def check_per_claim_mps(
    driver: Driver, kube: Kube, namespace: str, seen: list[Seen], results: dict[str, list[Result]]
) -> None:
    """Both pods are clients of the claim's one daemon, which has the claim's defaults."""
    (claim,) = results
    (result,) = results[claim]
    uuid = driver.uuid_of(result.device)
    mps = claim_config(kube, namespace, claim)["sharing"]["mpsConfig"]
    assert len(seen) == 2
    assert len({c.env[MPS_PID_KEY] for c in seen}) == 1
    assert all(c.env["CUDA_MPS_PIPE_DIRECTORY"] == CUDA_MPS_PIPE for c in seen)
    (daemon,) = daemons_of(driver, namespace)
    limit = quantity_value(mps["defaultPinnedDeviceMemoryLimit"])
    assert daemon.claims == {
        f"{namespace}/{claim}": {
            "threads": float(mps["defaultActiveThreadPercentage"]),
            f"memory:{uuid}": float(limit),
        }
    }
    assert [p for p in driver.mps_daemon_pods() if p.endswith(daemon.daemon_id)]


def check_time_slicing(
    driver: Driver, kube: Kube, namespace: str, seen: list[Seen], results: dict[str, list[Result]]
) -> None:
    """Both containers share one GPU whose time slice is the claim's interval."""
    ((claim, (result,)),) = results.items()
    uuid = driver.uuid_of(result.device)
    assert {f["UUID"] for c in seen for f in c.devices.values()} == {uuid}
    interval = claim_config(kube, namespace, claim)["sharing"]["timeSlicingConfig"]["interval"]
    assert time_slices(driver)[uuid] == TIME_SLICE_VALUES[interval]


def daemons_of(driver: Driver, namespace: str) -> list[MpsDaemon]:
    """The MPS daemons serving claims of the namespace (other examples run beside it)."""
    return [
        d
        for d in mps_daemons(driver).values()
        if any(claim.startswith(f"{namespace}/") for claim in d.claims)
    ]


def requested_capacity(kube: Kube, namespace: str, claim: str) -> dict[str, str]:
    spec = kube.get("resource.k8s.io/v1", "ResourceClaim", claim, namespace)["spec"]
    (request,) = spec["devices"]["requests"]
    return dict(request["exactly"]["capacity"]["requests"])


def claim_config(kube: Kube, namespace: str, claim: str) -> Obj:
    """The opaque GpuConfig parameters of a claim with one config entry."""
    spec = kube.get("resource.k8s.io/v1", "ResourceClaim", claim, namespace)["spec"]
    (config,) = spec["devices"]["config"]
    return dict(config["opaque"]["parameters"])


Check = Callable[[Driver, Kube, str, list[Seen], dict[str, list[Result]]], None]
CHECKS: dict[str, Check] = {
    "06-dynamic-mig": check_dynamic_mig,
    "07-mps-shares": check_mps_shares,
    "08-per-claim-mps": check_per_claim_mps,
    "09-time-slicing": check_time_slicing,
}


def check_quotas(driver: Driver) -> None:
    """The demo's two teams (demo/quotas.py): what it printed is what the apiserver said, the
    refused claims do not exist, and each quota counts what the team holds."""
    printed: list[str] = []
    refusals = show_quotas(driver, printed.append)
    output = "\n".join(printed)
    over, bypass = refusals
    whole = "gpu.nvidia.com.deviceclass.resource.k8s.io/devices"
    assert (over.namespace, over.claim) == REFUSED_CLAIM
    assert f"exceeded quota: {QUOTA}, requested: {whole}=1" in over.message, over.message
    assert f"limited: {whole}={TRAINING_CLAIMS}" in over.message, over.message
    assert (bypass.namespace, bypass.claim) == BYPASS_CLAIM
    assert "gpu-dra tier quota: namespace research may use only the DeviceClasses" in (
        bypass.message
    )
    assert f"this ResourceClaim uses {BYPASS_CLASS}." in bypass.message
    assert over.message in output
    assert bypass.message in output
    assert "GPU_DRA_" in output  # trainer-0's log: the GPU it got
    kube = driver.kube
    for namespace, name in (REFUSED_CLAIM, BYPASS_CLAIM):
        assert not kube.exists("resource.k8s.io/v1", "ResourceClaim", name, namespace)
    used = kube.get("v1", "ResourceQuota", QUOTA, "training")["status"]["used"]
    assert used[whole] == str(TRAINING_CLAIMS)
    research = kube.get("v1", "ResourceQuota", QUOTA, "research")["status"]["used"]
    assert research["mig-1g.gpu.nvidia.com.deviceclass.resource.k8s.io/devices"] == "1"
