"""The randomized driver: random claims of every tier on the simulated nodes, concurrent calls,
a random crash point per plugin start, restarts, the kubelet's retries, invariants after each.

Each cycle picks a node, kills its plugin (if the last cycle left one running) and starts a
new one with a random crash point armed (its 1st to 3rd hit; sometimes none), waits for its
recovery (a kill during recovery restarts it again), checks the invariants, then sends at once,
in calls of one or two claims: the kubelet's retries (prepare or unprepare of each claim it has
a call in flight for), sometimes a prepare of a claim already prepared or one prepare in two
concurrent calls, new claims, and unprepares of prepared ones. A failed prepare makes the
kubelet unprepare the claim. When every call is answered the invariants are checked again. At
the end every claim is unprepared and the node must hold nothing. A fixed seed gives the same
choices as long as each kill interrupts the same calls; which of two concurrent calls had
finished depends on timing, so two runs may part there (the checks never depend on it).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import tempfile
import time
import uuid as uuid_module
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_dra.driver.model import Gpu, MigDevice, MigPartition
from gpu_dra.driver.shares import shared_device_name
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.startup import discovery
from tests.crash_harness.invariants import Belief, check
from tests.crash_harness.nodes import KINDS, NODE_NAME, NodeKind
from tests.crash_harness.plugin import PluginDiedError, PluginProcess
from tests.doubles.mps_helpers import kill_processes_under
from tests.fakes.claim_reader import allocation_result, gpu_config, opaque_config, resource_claim

CALL_TIMEOUT_S = 120.0
"""How long the harness waits for an answer before it reports a hang (never hit when healthy;
generous so that a loaded machine is no failure)."""

SETTLE_S = 15.0
"""How long a broken invariant may take to mend before it is reported (an MPS daemon told to
quit exits just after answering)."""

MPS_CLASS_CONFIG: dict[str, Any] = {
    "source": "FromClass",
    "opaque": {"driver": "gpu.nvidia.com", "parameters": gpu_config(sharing={"strategy": "MPS"})},
}
MIG_MPS_CLASS_CONFIG: dict[str, Any] = {
    "source": "FromClass",
    "opaque": {
        "driver": "gpu.nvidia.com",
        "parameters": {**gpu_config(sharing={"strategy": "MPS"}), "kind": "MigDeviceConfig"},
    },
}
"""The class config of mps.mig.nvidia.com (MPS shares of static MIG devices)."""


@dataclasses.dataclass
class Claim:
    uid: str
    tier: str
    obj: dict[str, Any]
    tokens: frozenset[str]

    @property
    def ref(self) -> dict[str, str]:
        metadata = self.obj["metadata"]
        return {k: metadata[k] for k in ("namespace", "name", "uid")}


@dataclasses.dataclass
class Result:
    """What a run did and found."""

    cycles: int = 0
    restarts: int = 0
    kills: Counter[str] = dataclasses.field(default_factory=Counter)
    """Crash points hit, by name (a kill during recovery too)."""
    tiers: Counter[str] = dataclasses.field(default_factory=Counter)
    """Claims prepared successfully, by tier."""
    calls: int = 0
    refused: int = 0
    """Prepares that failed (the plugin's refusals of conflicting claims included)."""
    problems: list[str] = dataclasses.field(default_factory=list)
    """Broken invariants (leaks, double allocations, prepared claims without their parts)."""
    crashes: list[str] = dataclasses.field(default_factory=list)
    """Plugin processes that died other than at their crash point, or hung."""
    refusals: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"cycles={self.cycles} restarts={self.restarts} calls={self.calls} "
            f"kills={sum(self.kills.values())} kill_points_hit={len(self.kills)}/"
            f"{len(crash_points.POINTS)} prepared={dict(sorted(self.tiers.items()))} "
            f"refused={self.refused} leaks/violations={len(self.problems)} "
            f"crashes={len(self.crashes)} seconds={self.seconds:.1f}"
        )


class NodeRun:
    """One simulated node under the harness: its files, the kubelet's view, the plugin."""

    def __init__(self, kind: NodeKind, root: Path, result: Result) -> None:
        self.kind = kind
        self.root = root
        self.result = result
        root.mkdir()
        settings = kind.settings(root)
        nvml, pci, _ = discovery.node_nvml_and_state(settings)
        self.inventory: NodeInventory = discovery.node_inventory(
            settings, discovery.discover(settings, nvml, pci)
        )
        shutil.rmtree(root / "data", ignore_errors=True)  # discovery wrote nothing that stays
        self.offers = _offers(kind, self.inventory)
        self.beliefs: dict[str, Belief] = {}
        self.claims: dict[str, Claim] = {}
        self.plugin: PluginProcess | None = None
        self.log = root / "plugin.log"
        self.cycle_no = 0
        self.reachable: set[str] = set()

    # ---- one cycle ---------------------------------------------------------------------------
    def cycle(self, rng: random.Random, cycle_no: int) -> None:
        self.cycle_no = cycle_no
        prepares, unprepares = self.plan(rng)
        wanted = _points_of(prepares, unprepares, recovering=self.in_flight())
        if not self.start(rng, wanted=wanted):
            return
        self.check(after_restart=True)
        self.run_calls(self.calls(rng, prepares, unprepares))

    def in_flight(self) -> bool:
        return any(b is not Belief.PREPARED for b in self.beliefs.values())

    def start(
        self, rng: random.Random, *, armed: bool = True, wanted: frozenset[str] = frozenset()
    ) -> bool:
        """Restart the plugin and wait for its recovery; False when it could not start."""
        if self.plugin is not None:
            self.plugin.kill()
            self.plugin = None
        for attempt in range(4):
            point = None
            nth = 1
            if armed and attempt < 3 and rng.random() < 0.9:
                point = self.pick_point(rng, wanted)
                nth = rng.choice((1, 1, 1, 2, 3))
            self.result.restarts += 1
            plugin = PluginProcess(self.kind, self.root, point, nth, self.log)
            try:
                self.receive(plugin)
            except PluginDiedError:
                if not self.died(plugin):
                    return False
                continue
            except TimeoutError as error:
                plugin.kill()
                self.crash(f"start-up hung: {error}")
                return False
            self.plugin = plugin
            return True
        self.crash("the plugin never finished its recovery")
        return False

    def pick_point(self, rng: random.Random, wanted: frozenset[str]) -> str:
        """Mostly a point the cycle's calls pass (``wanted``) that this node's plugins have
        been seen to reach, the less killed the likelier; sometimes any."""
        reachable = sorted(self.reachable & wanted) or sorted(wanted)
        if reachable and rng.random() < 0.85:
            weights = [1.0 / (1 + self.result.kills[p]) for p in reachable]
            return rng.choices(reachable, weights)[0]
        return rng.choice(sorted(crash_points.POINTS))

    def receive(self, plugin: PluginProcess) -> dict[str, Any]:
        """The plugin's next reply (or ready), noting the crash points it reports reached."""
        while True:
            message = plugin.receive(CALL_TIMEOUT_S)
            if "reached" not in message:
                return message
            self.reachable.add(message["reached"])

    def died(self, plugin: PluginProcess) -> bool:
        """Account for a dead plugin; False (and a crash) unless its crash point killed it."""
        if plugin.killed_at_point() and plugin.point is not None:
            self.result.kills[plugin.point] += 1
            return True
        self.crash(f"the plugin died with exit status {plugin.status}")
        return False

    def crash(self, what: str) -> None:
        tail = self.log.read_text()[-3000:] if self.log.exists() else ""
        self.result.crashes.append(f"{self.kind.name} cycle {self.cycle_no}: {what}\n{tail}")

    def check(self, *, after_restart: bool) -> None:
        deadline = time.monotonic() + SETTLE_S
        while True:
            problems = check(
                self.kind, self.root, self.inventory, self.beliefs, after_restart=after_restart
            )
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        when = "after restart" if after_restart else "when idle"
        self.result.problems += [
            f"{self.kind.name} cycle {self.cycle_no} {when}: {p}" for p in problems
        ]

    # ---- the kubelet -------------------------------------------------------------------------
    def plan(self, rng: random.Random) -> tuple[list[Claim], list[Claim]]:
        """The claims this cycle prepares and unprepares."""
        prepares: list[Claim] = []
        unprepares: list[Claim] = []
        for uid, belief in sorted(self.beliefs.items()):
            claim = self.claims[uid]
            if belief is Belief.PREPARING:
                prepares.append(claim)
            elif belief is Belief.UNPREPARING or rng.random() < 0.3:
                unprepares.append(claim)
            elif rng.random() < 0.1:
                prepares.append(claim)  # the kubelet asks again (say, after its restart)
        for _ in range(rng.randint(1, 3)):
            claim = self.new_claim(rng)
            if claim is not None:
                prepares.append(claim)
        return prepares, unprepares

    def calls(
        self, rng: random.Random, prepares: list[Claim], unprepares: list[Claim]
    ) -> list[dict[str, Any]]:
        """The calls (one or two claims each) of a plan; the kubelet has them in flight."""
        for claim in prepares:
            self.beliefs[claim.uid] = Belief.PREPARING
        for claim in unprepares:
            self.beliefs[claim.uid] = Belief.UNPREPARING
        ops = [("prepare", c) for c in prepares] + [("unprepare", c) for c in unprepares]
        # Two pods sharing a claim sync at once: the same claim in two concurrent calls.
        ops += [("prepare", c) for c in prepares if rng.random() < 0.1]
        rng.shuffle(ops)
        calls = []
        while ops:
            op, first = ops.pop()
            batch = [first]
            if ops and ops[-1][0] == op and ops[-1][1] is not first and rng.random() < 0.5:
                batch.append(ops.pop()[1])
            payload = [c.obj for c in batch] if op == "prepare" else [c.ref for c in batch]
            calls.append({"id": len(calls), "op": op, "claims": payload})
        return calls

    def run_calls(self, calls: list[dict[str, Any]]) -> None:
        assert self.plugin is not None
        for call in calls:
            self.plugin.send(call)
        self.result.calls += len(calls)
        waiting = {call["id"] for call in calls}
        while waiting:
            try:
                reply = self.receive(self.plugin)
            except PluginDiedError:
                self.died(self.plugin)
                self.plugin = None
                return  # the calls not answered stay in flight: retried after the restart
            except TimeoutError as error:
                self.plugin.kill()
                self.plugin = None
                self.crash(f"calls hung: {error}")
                return
            waiting.discard(reply["id"])
            op = calls[reply["id"]]["op"]
            for uid, error in reply["results"].items():
                self.answered(op, uid, error)
        self.check(after_restart=False)

    def answered(self, op: str, uid: str, error: str | None) -> None:
        claim = self.claims[uid]
        if op == "prepare":
            if error is None:
                if self.beliefs[uid] is Belief.PREPARING:
                    self.beliefs[uid] = Belief.PREPARED
                    self.result.tiers[claim.tier] += 1
                return
            self.result.refused += 1
            self.result.refusals.append(f"{claim.tier}: {error}")
            self.beliefs[uid] = Belief.UNPREPARING  # the pod fails; its claim is unprepared
        elif error is None:
            del self.beliefs[uid]
            del self.claims[uid]
        # a failed unprepare stays UNPREPARING: retried

    def drain(self, rng: random.Random) -> None:
        """Unprepare every claim (retrying, no crash point), then the node must hold nothing."""
        for _ in range(5):
            if not self.beliefs:
                break
            if not self.start(rng, armed=False):
                return
            for uid in self.beliefs:
                self.beliefs[uid] = Belief.UNPREPARING
            refs = [self.claims[uid].ref for uid in sorted(self.beliefs)]
            self.run_calls([{"id": 0, "op": "unprepare", "claims": refs}])
        if self.beliefs:
            self.result.problems.append(f"{self.kind.name}: claims never unprepared: "
                                        f"{sorted(self.beliefs)}")  # fmt: skip
        if self.start(rng, armed=False):
            self.check(after_restart=True)
        if self.plugin is not None:
            self.plugin.kill()
            self.plugin = None

    # ---- the scheduler -----------------------------------------------------------------------
    def new_claim(self, rng: random.Random) -> Claim | None:
        tier, make = rng.choice(self.offers)
        return self.new_claim_of(tier, make, rng, race=rng.random() < 0.03)

    def cdi_path(self, uid: str) -> Path:
        return ClaimSpecStore(self.root / "cdi").path_for(uid)

    def new_claim_of(
        self, tier: str, make: Maker, rng: random.Random, *, race: bool = False
    ) -> Claim | None:
        """A claim of ``tier`` on devices no other claim holds (any devices in a ``race``,
        which the plugin must refuse if they are taken)."""
        taken: set[str] = set()
        for claim in self.claims.values():
            taken |= claim.tokens
        made = make(rng, frozenset() if race else frozenset(taken))
        if made is None:
            return None
        results, configs, tokens = made
        uid = str(uuid_module.UUID(int=rng.getrandbits(128), version=4))
        obj = resource_claim(
            uid, f"claim-{uid[:8]}", rng.choice(("default", "team-a")), results=results,
            class_configs=[c for c in configs if c.get("source") == "FromClass"],
            claim_configs=[c for c in configs if c.get("source") != "FromClass"],
        )  # fmt: skip
        for source in obj["status"]["allocation"]["devices"].get("config", []):
            if source.get("source") == "FromClass":
                source.pop("requests", None)
        claim = Claim(uid, tier, obj, tokens)
        self.claims[uid] = claim
        return claim


_PREPARE = (
    crash_points.PREPARE_AFTER_STARTED, crash_points.PREPARE_AFTER_CLAIM_FILES,
    crash_points.CDI_BEFORE_RENAME, crash_points.PREPARE_AFTER_CDI_SPEC,
    crash_points.PREPARE_AFTER_COMPLETED, crash_points.CHECKPOINT_BEFORE_RENAME,
)  # fmt: skip
_UNPREPARE = (
    crash_points.UNPREPARE_AFTER_STARTED, crash_points.UNPREPARE_AFTER_CDI_REMOVED,
    crash_points.UNPREPARE_AFTER_CLAIM_FILES_REMOVED,
    crash_points.UNPREPARE_BEFORE_RECORD_REMOVED, crash_points.CHECKPOINT_BEFORE_RENAME,
)  # fmt: skip
_MPS_START = (
    crash_points.MPS_AFTER_LAUNCH, crash_points.MPS_RECORD_BEFORE_RENAME,
    crash_points.MPS_AFTER_DAEMON_START,
)  # fmt: skip
_MPS_SHARE_JOIN = (
    crash_points.MPS_AFTER_LAUNCH, crash_points.MPS_RECORD_BEFORE_RENAME,
    crash_points.MPS_SHARE_AFTER_JOIN,
)  # fmt: skip
_START = (crash_points.INSTANCE_BEFORE_LOCK_RENAME, crash_points.INSTANCE_INFO_BEFORE_RENAME)
"""Every start registers its plugin instance."""
_TIER_POINTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # tier: (points its prepare passes, points its unprepare passes)
    "whole": ((), ()),
    "two-devices": ((), ()),
    "static-mig": ((), ()),
    "time-slicing": ((crash_points.TIMESLICE_AFTER_SET,), (crash_points.TIMESLICE_AFTER_RESET,)),
    "mps": (_MPS_START, (crash_points.MPS_AFTER_DAEMON_STOP,)),
    "mps-on-static-mig": (_MPS_START, (crash_points.MPS_AFTER_DAEMON_STOP,)),
    "mps-share": (_MPS_SHARE_JOIN, (crash_points.MPS_SHARE_AFTER_LEAVE,)),
    "mps-share-static-mig": (_MPS_SHARE_JOIN, (crash_points.MPS_SHARE_AFTER_LEAVE,)),
    "dynamic-mig": (
        (
            crash_points.MIG_AFTER_MODE_ON,
            crash_points.CRASH_AFTER_GPU_INSTANCE,
            crash_points.MIG_AFTER_COMPUTE_INSTANCE,
            crash_points.MIG_AFTER_RECORD,
        ),
        (
            crash_points.MIG_AFTER_COMPUTE_INSTANCE_DESTROYED,
            crash_points.MIG_AFTER_GPU_INSTANCE_DESTROYED,
        ),
    ),
}
_TIER_POINTS["mps-on-dynamic-mig"] = (
    (*_TIER_POINTS["dynamic-mig"][0], crash_points.MPS_AFTER_LAUNCH,
     crash_points.MPS_RECORD_BEFORE_RENAME, crash_points.MPS_MIG_AFTER_DAEMON_START),
    (*_TIER_POINTS["dynamic-mig"][1], crash_points.MPS_AFTER_DAEMON_STOP),
)  # fmt: skip
_TIER_POINTS["mps-share-dynamic-mig"] = (
    (*_TIER_POINTS["dynamic-mig"][0], *_TIER_POINTS["mps-share"][0]),
    (*_TIER_POINTS["dynamic-mig"][1], *_TIER_POINTS["mps-share"][1]),
)


def _points_of(
    prepares: list[Claim], unprepares: list[Claim], *, recovering: bool
) -> frozenset[str]:
    """The crash points a cycle's start, its calls (and recovery, with claims in flight)
    pass."""
    points: set[str] = set(_START)
    for claim in prepares:
        points.update(_PREPARE, _TIER_POINTS[claim.tier][0])
    for claim in unprepares:
        points.update(_UNPREPARE, _TIER_POINTS[claim.tier][1])
    if recovering:
        points.add(crash_points.RECOVERY_AFTER_UNDO)
    return frozenset(points)


Made = tuple[list[dict[str, Any]], list[dict[str, Any]], frozenset[str]]
Maker = Callable[[random.Random, frozenset[str]], Made | None]
Offer = tuple[str, Maker]


def _tokens(device: Gpu | MigDevice | MigPartition, name: str) -> frozenset[str]:
    """What a device takes: a whole GPU its name and every memory slice, a MIG partition its
    slices, a static MIG device its name."""
    if isinstance(device, MigPartition):
        minor = device.parent.minor
        start, size = device.placement_start, device.placement_size
        return frozenset(f"gpu-{minor}/slice-{i}" for i in range(start, start + size))
    if isinstance(device, Gpu):
        return frozenset({name, *(f"{name}/slice-{i}" for i in range(8))})
    return frozenset({name})


def _offers(kind: NodeKind, inventory: NodeInventory) -> list[Offer]:
    names = [d["name"] for d in inventory.published_devices()]
    shared = {f"gpu-{g.minor}" for g in inventory.mps_shares}
    shared_mig = sorted(shared_device_name(m) for m in inventory.mig_mps_shares)
    whole = [n for n in names if "-mig-" not in n and n not in shared]
    mig = [n for n in names if "-mig-" in n and n not in shared_mig]
    tokens = {n: _tokens(inventory.by_name(n), n) for n in names}  # type: ignore[arg-type]

    def pick(candidates: list[str]) -> Callable[[random.Random, frozenset[str]], str | None]:
        def choose(rng: random.Random, taken: frozenset[str]) -> str | None:
            free = [n for n in candidates if not tokens[n] & taken]
            return rng.choice(free) if free else None

        return choose

    def plain(candidates: list[str], sharing: dict[str, Any] | None, mig_kind: bool) -> Any:
        choose = pick(candidates)

        def make(rng: random.Random, taken: frozenset[str]) -> Made | None:
            device = choose(rng, taken)
            if device is None:
                return None
            configs = []
            if sharing is not None:
                sharing_now = dict(sharing)
                if sharing_now["strategy"] == "TimeSlicing":
                    interval = rng.choice(("Short", "Medium", "Long"))
                    sharing_now["timeSlicingConfig"] = {"interval": interval}
                kind_name = "MigDeviceConfig" if mig_kind else "GpuConfig"
                params = {**gpu_config(sharing=sharing_now), "kind": kind_name}
                configs.append(opaque_config(params, requests=["gpu"]))
            result = allocation_result(device, pool=NODE_NAME)
            return [result], configs, tokens[device]

        return make

    def two(rng: random.Random, taken: frozenset[str]) -> Made | None:
        first = pick(whole + mig)(rng, taken)
        if first is None:
            return None
        second = pick(whole + mig)(rng, taken | tokens[first])
        if second is None:
            return None
        results = [
            allocation_result(first, pool=NODE_NAME, request="gpu"),
            allocation_result(second, pool=NODE_NAME, request="other"),
        ]
        return results, [], tokens[first] | tokens[second]

    def shares_of(devices: list[str], config: dict[str, Any], *, partitions: bool = False) -> Maker:
        """Shares of one of ``devices``; of a partition, they take its memory slices (and a
        marker that lets the next share of that partition in) while any share holds it."""

        def share(rng: random.Random, taken: frozenset[str]) -> Made | None:
            device = rng.choice(devices)
            used = sum(1 for t in taken if t.startswith(f"{device}/share-"))
            if used >= 4:
                return None
            marker = f"{device}/held-by-shares"
            holds = frozenset({marker, *tokens[device]}) if partitions else frozenset()
            if partitions and tokens[device] & taken and marker not in taken:
                return None  # an overlapping placement or its GPU is held
            share_id = str(uuid_module.UUID(int=rng.getrandbits(128), version=4))
            result = allocation_result(
                device, pool=NODE_NAME, request="share", share_id=share_id,
                consumed_capacity={"memory": "2Gi", "compute": "10"},
            )  # fmt: skip
            return [result], [config], frozenset({f"{device}/share-{share_id}", *holds})

        return share

    mps = {"strategy": "MPS"}
    offers: list[Offer] = [
        ("whole", plain(whole, None, False)),
        ("time-slicing", plain(whole, {"strategy": "TimeSlicing"}, False)),
        ("mps", plain(whole, mps, False)),
        ("two-devices", two),
    ]
    mig_name = "dynamic-mig" if kind.dynamic_mig else "static-mig"
    offers += [(mig_name, plain(mig, None, True)), (f"mps-on-{mig_name}", plain(mig, mps, True))]
    if shared:
        share = shares_of(sorted(shared)[:1], MPS_CLASS_CONFIG)
        offers += [("mps-share", share), ("mps-share", share)]
    if shared_mig:
        mig_share = shares_of(shared_mig, MIG_MPS_CLASS_CONFIG)
        offers += [("mps-share-static-mig", mig_share), ("mps-share-static-mig", mig_share)]
    # Offered partitions stay in ``mig`` too: a claim of all of one holds its device alone.
    shared_partitions = sorted(shared_device_name(p) for p in inventory.partition_shares)
    if shared_partitions:
        partition_share = shares_of(shared_partitions, MIG_MPS_CLASS_CONFIG, partitions=True)
        offers += [("mps-share-dynamic-mig", partition_share)] * 3
    return offers


def run(cycles: int, seed: int, *, workdir: Path | None = None) -> Result:
    """``cycles`` cycles (fixed ``seed``) on the two simulated nodes, then the drain."""
    rng = random.Random(seed)
    result = Result()
    root = Path(tempfile.mkdtemp(prefix="gdc-", dir=workdir or "/tmp"))
    started = time.monotonic()
    nodes = [NodeRun(kind, root / kind.name[:3], result) for kind in KINDS]
    try:
        for cycle_no in range(cycles):
            rng.choice(nodes).cycle(rng, cycle_no)
            result.cycles += 1
        for node in nodes:
            node.drain(rng)
    finally:
        for node in nodes:
            if node.plugin is not None:
                node.plugin.kill()
        leftovers = kill_processes_under(root)
        if leftovers:
            result.problems.append(f"MPS processes left at the end: {leftovers}")
        result.seconds = time.monotonic() - started
        if not result.problems and not result.crashes:
            shutil.rmtree(root, ignore_errors=True)
        else:
            result.problems.append(f"node files kept in {root}")
    return result
