"""Pod create -> Ready on the local e2e cluster: a pod with an MPS share vs one without a claim vs
one with a whole GPU, as ratios to the pod without a claim, measured in one run (issue 16 item 6:
a share <= 1.2x a pod without a claim, the first share after a plugin start included).

Runs gpu-dra on the cluster's simulated ``hgx-h100`` node as the e2e tests do (``e2e.driver``:
daemon pods of the MPS test double, ``--mps-shares=0``, the plugin's default
``--mps-share-daemon-warm=always``, plus ``--plugin-arg`` flags, e.g.
``--plugin-arg=--mps-share-daemon-warm=off`` for the cold-start baseline). Brings the cluster up
if it is not healthy, as the e2e session does (and leaves it up). Do not run it beside e2e tests:
there is one cluster per machine.

Per round, one pod at a time in a namespace of its own, each timed on this client from just
before the pod's create request until a GET shows its ``Ready`` condition ``True`` (polled every
``--poll`` s); the claim of a claim pod is created first, untimed, so the scheduler's allocation
is inside the time:

* ``no_claim``: a pod without a claim;
* ``whole_gpu``: a claim of ``gpu.nvidia.com`` for gpu-1's UUID (a GPU not offered as shares);
* ``share``: a claim of ``mps.gpu.nvidia.com`` (10Gi, 10 % compute) on gpu-0, the first share
  on the GPU (none runs): with warm daemons its daemon runs already;
* ``share_beside``: a second share while the first runs (joins a daemon in use);
* ``first_share_after_restart``: the plugin stopped and started again (its warm daemon runs on,
  the new plugin adopts it; registered and slices published), a share pod created at once;
* ``first_share_after_start``: the plugin stopped, every MPS daemon of the node removed, then
  started (a first start on the node: it warms the daemon before it registers), a share pod
  created at once.

With ``--partitions`` the plugin runs with ``--dynamic-mig --mps-shares-on-dynamic-mig=7g.80gb``
instead (no ``--mps-shares``) and the share kinds are of gpu-0's 7g.80gb partition (class
``mps.mig.nvidia.com``): ``partition_share``, the first share, whose prepare makes the MIG
device and starts its daemon (a partition's daemon cannot be warm), and
``partition_share_beside``, a second one joining both; no restart kinds. Their ratios are
reported without a target (the 1.2x goal is the GPU shares').

``--restarts`` of each restart kind, alternating. After each pod its claim's unprepare is
waited for, then ``--settle`` s (a warm daemon is started anew after the last share left).
Reported: each kind's median and max (s), each median over ``no_claim``'s (``ratio_*``, targets
<= 1.2), and ``share_cold_starts``: the shared daemons a share's prepare started itself (the
plugin log's ``mps shared daemon started``), 0 with warm daemons.

    python -m bench.pod_start [--rounds 5] [--restarts 3] [--settle 3] [--poll 0.02] [--json]
    python -m bench.pod_start --partitions [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from bench.report import Reporter, Target
from e2e import manifests as m
from e2e.cluster import Cluster, netns
from e2e.driver import PLUGIN, Driver
from e2e.kube import Kube
from gpu_dra.kubelet_plugin.mps.warm_policy import DEFAULT as DEFAULT_WARM
from gpu_dra.kubelet_plugin.mps.warm_policy import WarmPolicy

BENCH: Final = "pod_start"
PROFILE: Final = "hgx-h100"
SHARE_GPU: Final = "gpu-0"
WHOLE_GPU: Final = "gpu-1"
BASE_PLUGIN_ARGS: Final = (f"--mps-shares={SHARE_GPU[-1]}",)
PARTITION_PROFILE: Final = "7g.80gb"
PARTITION_PLUGIN_ARGS: Final = (f"--mps-shares-on-dynamic-mig={PARTITION_PROFILE}",)
"""With ``--dynamic-mig`` (`Driver.dynamic_mig`): each GPU's one 7g.80gb placement as shares."""
MPS_CLASS: Final = "mps.gpu.nvidia.com"
MIG_MPS_CLASS: Final = "mps.mig.nvidia.com"
GPU_CLASS: Final = "gpu.nvidia.com"
BASELINE: Final = "no_claim"
KINDS: Final = (
    "no_claim",
    "whole_gpu",
    "share",
    "share_beside",
    "partition_share",
    "partition_share_beside",
    "first_share_after_restart",
    "first_share_after_start",
)
UNJUDGED: Final = frozenset({"whole_gpu", "partition_share", "partition_share_beside"})
"""Kinds whose ratio is reported without the 1.2x target."""
RATIO_TARGET: Final = Target("<=", 1.2)
COLD_START: Final = "mps shared daemon started daemon_id="
"""The plugin's log line when a share's prepare started the shared daemon itself."""
READY_TIMEOUT_S: Final = 120.0

Obj = dict[str, Any]


# ---- pure part (tests/test_bench_pod_start.py) ----------------------------------------------


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's ``Ready`` condition is ``True``; a pod that ended is an error."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    if phase in ("Failed", "Succeeded"):
        name = (pod.get("metadata") or {}).get("name", "?")
        raise RuntimeError(f"pod {name} ended ({phase}) before it was Ready: {status}")
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def ratios(samples: Mapping[str, Sequence[float]], baseline: str = BASELINE) -> dict[str, float]:
    """Median of each kind over the median of ``baseline`` (kinds without samples left out)."""
    if not samples.get(baseline):
        raise ValueError(f"no {baseline} samples: nothing to compare with")
    base = statistics.median(samples[baseline])
    if base <= 0:
        raise ValueError(f"{baseline} median is {base}: not a time")
    return {
        kind: statistics.median(values) / base
        for kind, values in samples.items()
        if kind != baseline and values
    }


def warm(plugin_args: Sequence[str]) -> bool:
    """Whether the plugin runs with warm shared daemons (the last ``--mps-share-daemon-warm``
    of ``plugin_args``, else the plugin's default)."""
    prefix = "--mps-share-daemon-warm="
    given = [arg.removeprefix(prefix) for arg in plugin_args if arg.startswith(prefix)]
    return (WarmPolicy.parse(given[-1]) if given else DEFAULT_WARM).warm


def cold_starts(log: str) -> int:
    """How many shared daemons the prepares in ``log`` (a part of the plugin's log) started."""
    return log.count(COLD_START)


def report(
    reporter: Reporter,
    samples: Mapping[str, Sequence[float]],
    *,
    share_cold_starts: int | None = None,
    warm_daemons: bool = True,
) -> None:
    """Median and max per kind (s), then the ratios, share's the primary metric, then the
    shares' cold starts (judged == 0 with warm daemons)."""
    for kind in KINDS:
        values = samples.get(kind) or []
        if not values:
            continue
        reporter.metric(f"{kind}_median", statistics.median(values), "s")
        reporter.metric(f"{kind}_max", max(values), "s")
    for kind, ratio in ratios(samples).items():
        target = None if kind in UNJUDGED else RATIO_TARGET
        primary = kind == ("share" if "share" in samples else "partition_share")
        reporter.metric(f"ratio_{kind}", ratio, "x", target=target, primary=primary)
    if share_cold_starts is not None:
        target = Target("==", 0) if warm_daemons else None
        reporter.metric("share_cold_starts", share_cold_starts, "starts", target=target)


def share_request(memory: str = "10Gi", compute: int = 10) -> Obj:
    return {
        "name": "gpu",
        "exactly": {
            "deviceClassName": MPS_CLASS,
            "capacity": {"requests": {"memory": memory, "compute": str(compute)}},
        },
    }


def partition_share_request(parent_uuid: str, memory: str = "10Gi", compute: int = 10) -> Obj:
    """A share of the `PARTITION_PROFILE` partition of the GPU of ``parent_uuid``."""
    selectors = [
        f"device.attributes['gpu.nvidia.com'].profile == '{PARTITION_PROFILE}'",
        f"device.attributes['gpu.nvidia.com'].parentUUID == '{parent_uuid}'",
    ]
    return {
        "name": "gpu",
        "exactly": {
            "deviceClassName": MIG_MPS_CLASS,
            "selectors": [{"cel": {"expression": s}} for s in selectors],
            "capacity": {"requests": {"memory": memory, "compute": str(compute)}},
        },
    }


def whole_request(uuid: str) -> Obj:
    """A request of ``gpu.nvidia.com`` for the GPU of ``uuid``."""
    return {
        "name": "gpu",
        "exactly": {
            "deviceClassName": GPU_CLASS,
            "selectors": [
                {"cel": {"expression": f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"}}
            ],
        },
    }


# ---- the cluster part (the lead runs it) ------------------------------------------------------


class Bench:
    """The plugin on the cluster and the pods of one run."""

    def __init__(
        self,
        plugin_args: Sequence[str],
        *,
        poll_s: float,
        settle_s: float,
        partitions: bool = False,
    ) -> None:
        self.cluster = Cluster()
        if not self.cluster.healthy():
            self.cluster.up()
        if not netns.current_is():
            netns.enter()
        self.kube = Kube(self.cluster.kubeconfig)
        base = PARTITION_PLUGIN_ARGS if partitions else BASE_PLUGIN_ARGS
        self.driver = Driver(
            self.cluster,
            self.kube,
            PROFILE,
            dynamic_mig=partitions,
            plugin_args=(*base, *plugin_args),
        )
        self.poll_s = poll_s
        self.settle_s = settle_s
        self.namespace = f"bench-pod-start-{uuid.uuid4().hex[:6]}"
        self.cold_starts = 0
        """Shared daemons the timed share pods' prepares started (`cold_starts`)."""

    def __enter__(self) -> Bench:
        if self.driver.dynamic_mig:
            self.driver.forget_simulated_mig()  # as the e2e modules: no MIG state carried over
        self.driver.install()
        self.driver.start_plugin()
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}}
        self.kube.create(ns)
        return self

    def __exit__(self, *_: object) -> None:
        self.kube.delete("v1", "Namespace", self.namespace)
        self.kube.wait_gone("v1", "Namespace", self.namespace, None, timeout=180)
        self.driver.stop_plugin()
        self.driver.remove_mps_daemons()
        if self.driver.dynamic_mig:
            self.driver.forget_simulated_mig()

    def timed_pod(self, name: str, request: Obj | None) -> tuple[float, str | None]:
        """Seconds from the pod's create to Ready, and its claim's UID (None without)."""
        claim_uid = None
        if request is not None:
            claim = m.claim(name, self.namespace, m.claim_spec([request]))
            claim_uid = self.kube.create(claim)["metadata"]["uid"]
            pod = m.gpu_pod(name, self.namespace, claim=name)
        else:
            pod = m.pod(name, self.namespace, [m.container()])
        started = time.monotonic()
        self.kube.create(pod)
        deadline = started + READY_TIMEOUT_S
        while not is_ready(self.kube.get("v1", "Pod", name, self.namespace)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod {name} not Ready after {READY_TIMEOUT_S:.0f}s")
            time.sleep(self.poll_s)
        return time.monotonic() - started, claim_uid

    def remove(self, name: str, claim_uid: str | None) -> None:
        self.kube.delete("v1", "Pod", name, self.namespace)
        self.kube.wait_gone("v1", "Pod", name, self.namespace, timeout=120)
        if claim_uid is not None:
            self.kube.delete("resource.k8s.io/v1", "ResourceClaim", name, self.namespace)
            self.driver.wait_unprepared(claim_uid, timeout=120)
        time.sleep(self.settle_s)

    def plugin_log_size(self) -> int:
        log = self.cluster.paths.logs / f"{PLUGIN}.log"
        return log.stat().st_size if log.exists() else 0

    def count_cold_starts(self, offset: int) -> None:
        """Add the shared daemon starts the plugin logged after ``offset`` (bytes)."""
        with (self.cluster.paths.logs / f"{PLUGIN}.log").open("rb") as log:
            log.seek(offset)
            self.cold_starts += cold_starts(log.read().decode(errors="replace"))

    def one(self, name: str, request: Obj | None) -> float:
        seconds, uid = self.timed_pod(name, request)
        self.remove(name, uid)
        return seconds

    def shares(self, index: int, request: Obj | None = None) -> tuple[float, float]:
        """The first share on the GPU (of ``request``, default `share_request`), then one
        beside it."""
        offset = self.plugin_log_size()
        request = request or share_request()
        first_s, first_uid = self.timed_pod(f"share-{index}", request)
        beside_s, beside_uid = self.timed_pod(f"beside-{index}", request)
        self.count_cold_starts(offset)
        self.remove(f"beside-{index}", beside_uid)
        self.remove(f"share-{index}", first_uid)
        return first_s, beside_s

    def after_restart(self, index: int, *, fresh: bool) -> float:
        """A share pod right after the plugin was stopped and started; ``fresh``: every MPS
        daemon of the node removed between the two (a first start on the node)."""
        self.driver.stop_plugin()
        if fresh:
            self.driver.remove_mps_daemons()
        self.driver.start_plugin()
        offset = self.plugin_log_size()
        seconds, uid = self.timed_pod(f"{'start' if fresh else 'restart'}-{index}", share_request())
        self.count_cold_starts(offset)
        self.remove(f"{'start' if fresh else 'restart'}-{index}", uid)
        return seconds


def measure(
    bench: Bench, *, rounds: int, restarts: int, progress: Callable[[str], None]
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    whole = whole_request(bench.driver.uuid_of(WHOLE_GPU))
    partition = None
    share = "share"
    if bench.driver.dynamic_mig:
        partition = partition_share_request(bench.driver.uuid_of(SHARE_GPU))
        share = "partition_share"
    bench.one("warmup", None)  # images, the namespace's service account
    for index in range(rounds):
        samples["no_claim"].append(bench.one(f"plain-{index}", None))
        samples["whole_gpu"].append(bench.one(f"whole-{index}", whole))
        first, beside = bench.shares(index, partition)
        samples[share].append(first)
        samples[f"{share}_beside"].append(beside)
        progress(f"round {index + 1}/{rounds}")
    if partition is not None:
        return samples  # restarts: the GPU shares' warm daemons
    for index in range(restarts):
        samples["first_share_after_restart"].append(bench.after_restart(index, fresh=False))
        samples["first_share_after_start"].append(bench.after_restart(index, fresh=True))
        progress(f"restart {index + 1}/{restarts}")
    return samples


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pod_start", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after each pod")
    parser.add_argument("--poll", type=float, default=0.02, help="seconds between pod GETs")
    parser.add_argument("--plugin-arg", action="append", default=[], help="further plugin flag")
    parser.add_argument("--json", action="store_true", help="JSON lines")
    parser.add_argument(
        "--partitions",
        action="store_true",
        help="shares of a dynamic MIG partition instead of a GPU's (no restart kinds)",
    )
    args = parser.parse_args(argv)
    reporter = Reporter(BENCH, json_lines=args.json)
    base = ("--dynamic-mig", *PARTITION_PLUGIN_ARGS) if args.partitions else BASE_PLUGIN_ARGS
    plugin_args = (*base, *args.plugin_arg)
    reporter.run(
        profile=PROFILE,
        rounds=args.rounds,
        restarts=args.restarts,
        settle_s=args.settle,
        poll_s=args.poll,
        plugin_args=" ".join(plugin_args),
    )
    bench_args = {"poll_s": args.poll, "settle_s": args.settle, "partitions": args.partitions}
    with Bench(args.plugin_arg, **bench_args) as bench:
        samples = measure(
            bench,
            rounds=args.rounds,
            restarts=args.restarts,
            progress=lambda what: print(what, file=sys.stderr, flush=True),
        )
    warm_daemons = warm(plugin_args) and not args.partitions  # a partition's cannot be warm
    report(reporter, samples, share_cold_starts=bench.cold_starts, warm_daemons=warm_daemons)
    return 1 if reporter.failed else 0


if __name__ == "__main__":
    sys.exit(main())
