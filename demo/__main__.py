"""The gpu-dra demo: a real local cluster, the driver installed with its Helm chart from the
locally built image (demo/install.py: the kubelet plugin as the DaemonSet's pod on a simulated
8-GPU node, the controller as the Deployment), the claims of demo/examples, what each pod
received and what the plugin did for it. Run through `demo/run` (as root).

The examples run in stages (demo/stages.py), each a ``helm upgrade --install`` with its
plugin flags: NVIDIA's example manifests on whole GPUs as NVIDIA's driver publishes them, then -
once those are deleted - dynamic MIG, MPS shares, per-claim MPS and time-slicing together, on
which the demo shows utilization per claim, busy and idle claims side by side
(demo/utilization.py); last, with the controller's idle policy on, an idle notebook warned and
its right-sizing advice (demo/idle.py), and then two teams sharing the node by quotas per tier,
one over its quota (demo/quotas.py). The last stage keeps running, with the cluster, so you can
look around;
`.venv/bin/python -m e2e.cluster down` removes it. `demo/run --real` runs the plugin as a host
process on a fake driver root (demo/real.py).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from demo.idle import show_idle_reclaim
from demo.install import (
    IDLE_RECLAIM,
    NAMESPACE,
    RELEASE,
    DemoRelease,
    apply_example,
    demo_driver,
    plugin_env,
    remove_release,
)
from demo.observe import (
    MPS_PID_KEY,
    Seen,
    containers_seen,
    mig_instances,
    mig_mode_on,
    mps_daemons,
    time_slices,
    wait_pods_running,
)
from demo.quotas import show_quotas
from demo.real import NAMESPACE as REAL_NAMESPACE
from demo.real import remove_real_stage, run_real_stage
from demo.stages import PROFILE, STAGES, Stage, namespace_of, title_of
from demo.utilization import show_utilization
from e2e.chart import CHART, release_installed
from e2e.cluster import Cluster, ClusterError
from e2e.cluster.paths import REPO_ROOT
from e2e.driver import MPS_DAEMON_NAMESPACE, PLUGIN, Driver
from e2e.kube import Kube, wait_for
from gpu_dra.driver.naming import GpuDeviceName, parse_device_name
from gpu_dra.kubelet_plugin.time_slicer import interval_name
from gpu_dra.kubelet_plugin.utilization.simulated_file import SIMULATED_UTILIZATION_FILE


def say(text: str = "") -> None:
    print(text, flush=True)


def table(rows: Sequence[Sequence[str]], indent: str = "  ") -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        say(indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def gpu_minor(device_name: str) -> int:
    """The (parent) GPU minor of a published device name: the demo lists GPUs in that order."""
    name = parse_device_name(device_name)
    return name.minor if isinstance(name, GpuDeviceName) else name.parent_minor


def published_summary(driver: Driver) -> list[str]:
    """One line per physical GPU: how the plugin offers it in this stage."""
    slices = driver.slices()
    devices = driver.devices()
    partitions: dict[str, int] = defaultdict(int)
    for device in devices.values():
        if device["attributes"]["type"]["string"] == "mig":
            partitions[device["attributes"]["parentUUID"]["string"]] += 1
    counter_sets = sum(len(s["spec"].get("sharedCounters") or []) for s in slices)
    lines = [
        f"{len(devices)} devices in {len(slices)} ResourceSlice(s), {counter_sets} counter set(s)"
    ]
    for name, device in sorted(devices.items(), key=lambda item: gpu_minor(item[0])):
        attributes = device["attributes"]
        if attributes["type"]["string"] != "gpu":
            continue
        offered = ["whole GPU"]
        if partitions.get(attributes["uuid"]["string"]):
            offered.append(
                f"{partitions[attributes['uuid']['string']]} MIG partitions sharing counter set "
                f"{name}-counter-set"
            )
        if device.get("allowMultipleAllocations"):
            capacity = device["capacity"]
            offered = [
                f"MPS shares (allowMultipleAllocations; memory {capacity['memory']['value']}, "
                f"compute {capacity['compute']['value']} %)"
            ]
        product = attributes["productName"]["string"]
        lines.append(f"  {name:<6} {product:<22} {' + '.join(offered)}")
    return lines


def received_rows(seen: Iterable[Seen]) -> list[list[str]]:
    """Table rows: pod, container, device, UUID, what it is; MPS clients get a second row."""
    rows = []
    for container in seen:
        for device, facts in sorted(container.devices.items()):
            what = facts.get("PRODUCT", "?")
            if "PROFILE" in facts:
                what = f"MIG {facts['PROFILE']} of {facts.get('PARENT_UUID', '?')}"
            rows.append(
                [container.where, container.container, device, facts.get("UUID", "?"), what]
            )
        mps = {k: v for k, v in container.env.items() if k.startswith("CUDA_MPS_")}
        if mps:
            caps = [f"pipe {mps.pop('CUDA_MPS_PIPE_DIRECTORY', '?')}"]
            caps.append(f"daemon PID {container.env.get(MPS_PID_KEY, '?')}")
            caps.extend(f"{k}={v}" for k, v in sorted(mps.items()))
            rows.append(["", "", "", "MPS:", ", ".join(caps)])
    return rows


def plugin_view(driver: Driver, namespace: str, seen: Sequence[Seen]) -> list[str]:
    """What the plugin did on the node for these containers: MIG instances it made, MPS daemons
    serving the namespace's claims with their caps, time slices it set."""
    uuids = {f["UUID"]: name for c in seen for name, f in c.devices.items() if "UUID" in f}
    lines = []
    made = sorted((i for i in mig_instances(driver) if i.uuid in uuids), key=lambda i: i.start)
    on = mig_mode_on(driver)
    for parent in sorted({i.parent_uuid for i in made}):
        mode = "on" if parent in on else "off"
        lines.append(f"{parent} (MIG mode {mode}): GPU + compute instances made at prepare:")
        lines.extend(
            f"  GPU instance profile {i.profile_id} at memory slice {i.start} -> {i.uuid} "
            f"({uuids[i.uuid]})"
            for i in made
            if i.parent_uuid == parent
        )
    pods = driver.mps_daemon_pods()
    for daemon in mps_daemons(driver).values():
        ours = {c: caps for c, caps in daemon.claims.items() if c.startswith(f"{namespace}/")}
        if not ours:
            continue
        pod = next(
            (f"{MPS_DAEMON_NAMESPACE}/{n}" for n in pods if n.endswith(daemon.daemon_id)), "?"
        )
        lines.append(
            f"MPS control daemon {daemon.daemon_id} (pod {pod}) serves "
            f"{len(daemon.claims)} claim(s):"
        )
        for claim, caps in sorted(ours.items()):
            limits = [f"{caps['threads']:.0f} % of SMs"] if "threads" in caps else []
            limits += [
                f"{int(value) // 2**20} MiB pinned on {key.split(':', 1)[1]}"
                for key, value in sorted(caps.items())
                if key.startswith("memory:")
            ]
            lines.append(f"  {claim}: {', '.join(limits)}")
    for uuid, value in sorted(time_slices(driver).items()):
        if uuid in uuids:
            lines.append(f"compute time slice of {uuid} ({uuids[uuid]}): {interval_name(value)}")
    return lines


def run_example(driver: Driver, example: Path) -> None:
    cluster, kube = driver.cluster, driver.kube
    say(f"\n==> example {example.name}: {title_of(example)}")
    apply_example(cluster, example)
    namespace = namespace_of(example)
    seen: list[Seen] = []
    for pod_name in wait_pods_running(kube, namespace):
        seen.extend(containers_seen(kube, namespace, kube.get("v1", "Pod", pod_name, namespace)))
    say("what each container received (its own environment):")
    table([["POD", "CONTAINER", "DEVICE", "UUID", "WHAT"], *received_rows(seen)])
    view = plugin_view(driver, namespace, seen)
    if view:
        say("what the plugin did on the node:")
        for line in view:
            say(f"  {line}")


def clean_up(driver: Driver, stage: Stage) -> None:
    """Delete the stage's examples and wait until the plugin has unprepared every claim."""
    kube = driver.kube
    namespaces = [namespace_of(e) for e in stage.example_dirs()]
    say(f"\n==> deleting {', '.join(namespaces)}")
    for namespace in namespaces:
        kube.delete("v1", "Namespace", namespace)
    for namespace in namespaces:
        kube.wait_gone("v1", "Namespace", namespace, None, timeout=180)
    wait_for("every claim to be unprepared", lambda: not driver.checkpoint_claims(), 120)
    # Every simulated GPU idle again: the next stage's claims start from nothing.
    (driver.state_dir / SIMULATED_UTILIZATION_FILE).unlink(missing_ok=True)
    say(
        f"left on the node: {len(driver.checkpoint_claims())} prepared claims, "
        f"{len(driver.cdi_spec_claims())} CDI specs, {len(mig_instances(driver))} MIG "
        f"instances ({len(mig_mode_on(driver))} GPUs in MIG mode), "
        f"{len(driver.mps_daemon_pods())} MPS daemon pods, "
        f"{len(time_slices(driver))} GPUs with a time slice set"
    )


def delete_leftovers(driver: Driver) -> None:
    """A demo run before this one left its last stage running: delete its examples (with the
    plugin that prepared them) so that every stage starts on an empty node."""
    present = {n["metadata"]["name"] for n in driver.kube.list("v1", "Namespace")}
    left = [s for s in STAGES if any(namespace_of(e) in present for e in s.example_dirs())]
    for stage in left:
        clean_up(driver, stage)
    remove_real_stage(driver)  # `demo/run --real` ran last: its pods, claims and plugin


def chart_settings(stage: Stage) -> str:
    """How the stage's plugin flags are given to the chart (demo/install.py, stage_values)."""
    settings = ["featureGates.DynamicMIG=true"] if stage.dynamic_mig else []
    settings += [f"{e['name']}={e['value']}" for e in plugin_env(stage.plugin_args)]
    if stage.idle_reclaim:
        settings += [f"{key}={value}" for key, value in flat_values(IDLE_RECLAIM)]
    return ", ".join(settings) or "none"


def flat_values(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested chart values as ``--set`` keys: ``controller.idleReclaim.enabled``."""
    flat: list[tuple[str, Any]] = []
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat += flat_values(value, f"{prefix}{key}.")
        else:
            flat.append((f"{prefix}{key}", value))
    return flat


def install_stage(release: DemoRelease, number: int, stage: Stage) -> None:
    """Upgrade (or install) the release to the stage's flags and say where the plugin runs."""
    cluster = release.cluster
    chart = CHART.relative_to(REPO_ROOT)
    say(f"==> helm upgrade --install {RELEASE} {chart} --namespace {NAMESPACE}")
    say(f"  kubelet plugin: --simulate={PROFILE.name} {stage.flags}")
    say(
        f"  the stage's values: {chart_settings(stage)} (besides the node's: the local image, "
        "simulate, the MPS test double, a utilization sample every second)"
    )
    release.ensure(stage)
    pod = release.plugin_pod()
    say(
        f"==> the kubelet plugin runs as pod {NAMESPACE}/{pod['metadata']['name']} of the "
        f"chart's DaemonSet, image {pod['spec']['containers'][0]['image']}"
    )
    if number == 1:
        say(f"==> kubectl get pods --namespace {NAMESPACE} -o wide")
        say(cluster.kubectl("get", "pods", "--namespace", NAMESPACE, "-o", "wide"))
        say("==> kubectl get deviceclasses  (applied by the chart's controller)")
        say(cluster.kubectl("get", "deviceclasses"))


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["-h"], ["--help"]):
        say(f"usage: demo/run [--real]\n\n{__doc__}")
        return 0
    if args not in ([], ["--real"]):
        say("usage: demo/run [--real]")
        return 2
    cluster = Cluster()
    say("==> bringing up the local Kubernetes cluster (e2e/cluster)")
    try:
        cluster.up()
    except ClusterError as error:
        say(f"error: {error}")
        return 1
    kube = Kube(cluster.kubeconfig)
    if args == ["--real"]:
        return real_main(cluster, kube)
    say(
        "==> the driver image, built from the Dockerfile with buildah (cached by e2e/setup-host), "
        "into the node's containerd"
    )
    release = DemoRelease.prepare(cluster, kube)
    driver = release.driver
    say(f"  {release.image}")
    if cluster.pid(PLUGIN):  # a host process: `demo/run --real`, or an interrupted e2e run
        delete_leftovers(driver)
        driver.stop_plugin()
    if release.installed():  # an earlier demo run's release, with its last stage's examples
        delete_leftovers(driver)

    for number, stage in enumerate(STAGES, 1):
        say(f"\n======== stage {number}/{len(STAGES)}: {stage.title}")
        install_stage(release, number, stage)
        if number == 1:
            say("==> kubectl get resourceslices")
            say(cluster.kubectl("get", "resourceslices", "-o", "wide"))
            slice_name = driver.slices()[0]["metadata"]["name"]
            say(f"==> kubectl describe resourceslice {slice_name}")
            say(cluster.kubectl("describe", "resourceslice", slice_name))
        say("==> published:")
        for line in published_summary(driver):
            say(f"  {line}")
        for example in stage.example_dirs():
            run_example(driver, example)
        if stage.shows_utilization:
            say("\n======== utilization per claim: busy and idle claims side by side")
            show_utilization(driver, say)
        if stage.idle_reclaim:
            say("\n======== an idle notebook: warned by the idle policy, and what it needed")
            show_idle_reclaim(driver, say)
        if stage.shows_quotas:
            say("\n======== two teams by rule: quotas per tier (docs/quotas.md)")
            show_quotas(driver, say)
        if number < len(STAGES):
            clean_up(driver, stage)

    say("==> kubectl get resourceclaims -A")
    say(cluster.kubectl("get", "resourceclaims", "-A"))
    say(
        "The cluster keeps running with the last stage's pods (as root, from the repo root):\n"
        "  look around:  .venv/bin/python -m e2e.cluster kubectl get pods -A\n"
        f"  gpu-dra:      .venv/bin/python -m e2e.cluster kubectl get all -n {NAMESPACE}\n"
        "  remove it:    .venv/bin/python -m e2e.cluster down"
    )
    return 0


def real_main(cluster: Cluster, kube: Kube) -> int:
    """`demo/run --real`: the real-mode stage alone (demo/real.py), its plugin a host process."""
    if release_installed(cluster, RELEASE, NAMESPACE):  # the chart release of a demo run
        say(f"==> removing the demo's examples and helm release {NAMESPACE}/{RELEASE}")
        remove_release(demo_driver(cluster, kube))
    if cluster.pid(PLUGIN):  # from an earlier demo run, flags unknown
        delete_leftovers(Driver(cluster, kube, str(PROFILE)))
        cluster.stop_component(PLUGIN)  # remove_real_stage stops only a real-mode one
    say("\n======== real mode: no --simulate, a fake driver root with the NVML mock library")
    run_real_stage(cluster, kube, say)
    say(
        f"\nThe pods keep running in namespace {REAL_NAMESPACE} (as root, from the repo root):\n"
        "  look around:  .venv/bin/python -m e2e.cluster kubectl get pods -A\n"
        "  remove it:    .venv/bin/python -m e2e.cluster down"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
