"""The MPS memory watchdog: caps of shares that the driver does not enforce, checked from NVML.

Where the driver does not cap a share's memory per container (`memory_limits.Enforcement`
``mps-client``: older drivers, cgroup v1, MIG), every ``--mps-memory-watchdog-interval`` seconds
NVML's per-process memory on those shares' GPUs is read and mapped process -> cgroup -> pod ->
claim (`utilization.sampler`, `utilization.claims`). A claim whose processes together use more
than its share is handled by ``--mps-memory-watchdog``: ``report`` (Warning Events on its pods and
claim, metrics), ``kill`` (and SIGKILL to its newest process) or ``evict`` (and its pods through
the Eviction API). Only the publishing instance posts Events and acts; another logs and counts.
A process in no claim's pod is reported, never killed; what cannot be read (NVML, /proc, pods,
API) is reported with its cause, never taken as under the cap. See docs/shares.md.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.kube import errors
from gpu_dra.kube.events import InvolvedObject
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry
from gpu_dra.kubelet_plugin.kubeapi import EvictionApi
from gpu_dra.kubelet_plugin.memory_limits import Enforcement, MemoryLimitSupport
from gpu_dra.kubelet_plugin.mps.events import claim_object, pod_object
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice, claim_devices, pods_from_claim
from gpu_dra.kubelet_plugin.utilization.sampler import ProcessReading, Sample, UtilizationSampler
from gpu_dra.kubelet_plugin.utilization.simulated_file import (
    SIMULATED_UTILIZATION_FILE,
    SimulatedUtilizationFile,
)

log = logging.getLogger(__name__)

REASON_EXCEEDED: Final = "MpsShareMemoryExceeded"
REASON_KILLED: Final = "MpsShareProcessKilled"
REASON_EVICTED: Final = "MpsSharePodEvicted"
REASON_UNCHECKED: Final = "MpsShareMemoryUnchecked"
REPEAT_S: Final = 600.0
"""An overrun or a cause of not checking that lasts gets its Event again at most this often."""
ACTION_GRACE_S: Final = 30.0
"""After a kill or an eviction, the claim is left alone while the killed process (evicted pod)
is still listed by NVML, for at most this long; then the action is taken again."""
MIB: Final = 2**20


class Policy(StrEnum):
    OFF = "off"
    REPORT = "report"
    KILL = "kill"
    EVICT = "evict"


POLICIES: Final = tuple(policy.value for policy in Policy)


class EventPoster(Protocol):
    def post(
        self, targets: Sequence[InvolvedObject], reason: str, message: str, *, warning: bool
    ) -> None: ...


@dataclass(frozen=True)
class Overrun:
    """A claim's processes on a share's GPU together use more than the share."""

    device: ClaimDevice
    used_bytes: int
    processes: tuple[ProcessReading, ...]


@dataclass(frozen=True)
class Unchecked:
    """A share whose use could not be known this round, and why."""

    device: ClaimDevice
    cause: str


@dataclass(frozen=True)
class Check:
    overruns: tuple[Overrun, ...] = ()
    unchecked: tuple[Unchecked, ...] = ()
    unmapped: tuple[tuple[str, ProcessReading], ...] = ()
    """(GPU UUID, process) of processes in no watched claim's pod: reported, never acted on."""


def watched(devices: Sequence[ClaimDevice]) -> list[ClaimDevice]:
    """The MPS shares whose memory the driver does not cap (unknown counts as not capped)."""
    return [
        device
        for device in devices
        if device.tier == "mps-share" and device.share_memory_enforcement != Enforcement.DRIVER
    ]


def check(sample: Sample) -> Check:
    """The overruns, shares not checkable, and unmapped processes of one sample of `watched`
    devices (pure)."""
    overruns: list[Overrun] = []
    unchecked: list[Unchecked] = []
    mapped: dict[str, set[str]] = {}
    for device in sample.devices:
        if device.uuid is None or device.share_memory_bytes is None:
            unchecked.append(Unchecked(device, "the share's GPU or size was not recorded"))
            continue
        reading = sample.readings.get(device.uuid)
        if reading is None or reading.processes is None:
            causes = [
                f"{e.call}: {e.reason} {e.detail}".strip()
                for e in sample.errors
                if e.device in (device.uuid, "") and e.call != "cgroup"
            ]
            cause = "; ".join(causes) or "no process list"
            unchecked.append(Unchecked(device, f"NVML processes of {device.uuid}: {cause}"))
            continue
        if not device.pods:
            unchecked.append(
                Unchecked(device, "the claim's pods are not known (claim cache not serving)")
            )
            continue
        pods = {pod.uid for pod in device.pods}
        mapped.setdefault(device.uuid, set()).update(pods)
        mine = tuple(p for p in reading.processes if p.pod_uid in pods)
        unknown = sorted(p.pid for p in mine if p.used_memory_bytes is None)
        if unknown:
            unchecked.append(
                Unchecked(device, f"NVML reports no memory use of process(es) {unknown}")
            )
            continue
        used = sum(p.used_memory_bytes or 0 for p in mine)
        if used > device.share_memory_bytes:
            overruns.append(Overrun(device, used, mine))
    unmapped = [
        (uuid, process)
        for uuid, reading in sorted(sample.readings.items())
        for process in reading.processes or ()
        if process.pod_uid is None or process.pod_uid not in mapped.get(uuid, set())
    ]
    return Check(tuple(overruns), tuple(unchecked), tuple(unmapped))


HOST_PROC: Final = Path("/proc")


def _not_this_hosts_process(pid: int, signum: int) -> None:
    """The kill of a watchdog reading another ``/proc`` (tests): its PIDs are not this host's."""
    raise PermissionError(f"process {pid} is from another /proc: not signalled")


def start_time(pid: int, proc_root: Path = Path("/proc")) -> int:
    """The process's start time (clock ticks after boot, ``/proc/<pid>/stat`` field 22);
    `OSError` or `ValueError` when it cannot be read."""
    text = (proc_root / str(pid) / "stat").read_text(encoding="utf-8")
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19])


class WatchdogMetrics:
    def __init__(self, registry: CollectorRegistry, node: str) -> None:
        self.node = node
        self.overruns = Counter(
            "gpu_dra_mps_memory_watchdog_overruns",
            "Times an MPS share's processes together went over its memory (the driver not "
            "capping it), by claim and what was done: reported, killed, evicted, or observed "
            "(a plugin instance that does not publish).",
            ["node", "namespace", "claim", "action"],
            registry=registry,
        )
        self.actions = Counter(
            "gpu_dra_mps_memory_watchdog_actions",
            "Kills and evictions of the memory watchdog, by result (done or failed).",
            ["node", "action", "result"],
            registry=registry,
        )
        self.unchecked = Counter(
            "gpu_dra_mps_memory_watchdog_unchecked",
            "Checks of an MPS share that could not be made (NVML error, pods not known, no "
            "per-process memory), by GPU; never taken as under the cap.",
            ["node", "gpu"],
            registry=registry,
        )
        self.unmapped = Gauge(
            "gpu_dra_mps_memory_watchdog_unmapped_processes",
            "Processes on a watched GPU that are in no watched claim's pod in the newest check "
            "(the MPS server's among them): reported, never killed.",
            ["node", "gpu"],
            registry=registry,
        )
        self.duration = Histogram(
            "gpu_dra_mps_memory_watchdog_check_duration_seconds",
            "Time one check of the watched GPUs takes (NVML, /proc, actions).",
            ["node"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        self.duration.labels(node=node)


class MemoryWatchdog:
    """Checks in a thread every `interval_s` (see the module doc)."""

    def __init__(
        self,
        sampler: UtilizationSampler,
        devices: Callable[[], list[ClaimDevice]],
        *,
        policy: Policy,
        interval_s: float,
        is_turn: Callable[[], bool],
        events: EventPoster | None,
        evictions: EvictionApi | None,
        metrics: WatchdogMetrics,
        proc_root: Path = Path("/proc"),
        kill: Callable[[int, int], None] = os.kill,
        before_check: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`devices`: every claim device now (`watched` picks the shares); `is_turn`: whether
        this instance publishes; `before_check`: the simulated utilization file."""
        self._sampler = sampler
        self._devices = devices
        self.policy = policy
        self.interval_s = interval_s
        self._is_turn = is_turn
        self._events = events
        self._evictions = evictions
        self._metrics = metrics
        self._proc = proc_root
        self._kill = kill
        self._before = before_check
        self._clock = clock
        self._over: dict[tuple[str, str], tuple[float, bool]] = {}
        """Overruns going on: when last reported, and whether as the publishing instance (one
        that starts publishing reports again)."""
        self._unchecked: dict[tuple[str, str], tuple[str, float, bool]] = {}
        self._acted: dict[tuple[str, str], tuple[frozenset[int | str], float]] = {}
        self._unmapped_seen: set[tuple[str, int]] = set()
        self._failures: dict[tuple[str, str], str] = {}
        """The last failed action's cause per claim device: posted again only when it changes."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> Check:
        """One round: read, compare, report and act; blocking."""
        started = time.perf_counter()
        if self._before is not None:
            self._before()
        devices = watched(self._devices())
        if not devices:  # nothing to watch: forget what was (claims unprepared)
            self._over.clear()
            self._acted.clear()
            self._failures.clear()
            self._unchecked.clear()
            return Check()
        found = check(self._sampler.sample(devices))
        try:
            turn = self._is_turn()
        except OSError as error:  # the instance registry cannot be read: report, do not act
            log.warning("MPS memory watchdog: whether this instance publishes is not known "
                        "(%s): reporting only", error)  # fmt: skip
            turn = False
        self._report_unmapped(found, devices)
        self._report_unchecked(found.unchecked, turn)
        for overrun in found.overruns:
            self._handle(overrun, turn)
        over = {o.device.key for o in found.overruns}
        for key in set(self._over) - over:
            del self._over[key]
        for key in set(self._acted) - over:
            del self._acted[key]
        for key in set(self._failures) - over:
            del self._failures[key]
        self._metrics.duration.labels(node=self._metrics.node).observe(
            time.perf_counter() - started
        )
        return found

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mps-memory-watchdog", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return
        self._sampler.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:  # a bug must not end the watchdog for good
                log.exception("MPS memory watchdog check failed")
            self._stop.wait(self.interval_s)

    # -- reporting -------------------------------------------------------------------------

    def _post(
        self, targets: Sequence[InvolvedObject], reason: str, message: str, turn: bool
    ) -> None:
        if turn and self._events is not None:
            self._events.post(targets, reason, message, warning=True)

    def _report_unmapped(self, found: Check, devices: Sequence[ClaimDevice]) -> None:
        seen = set()
        counts = {uuid: 0 for uuid in {d.uuid for d in devices if d.uuid}}
        for uuid, process in found.unmapped:
            counts[uuid] = counts.get(uuid, 0) + 1
            seen.add((uuid, process.pid))
            if (uuid, process.pid) not in self._unmapped_seen:
                log.warning(
                    "MPS memory watchdog: process %d on %s uses %s bytes and is in no watched "
                    "claim's pod (pod %s): reported, not acted on",
                    process.pid, uuid, process.used_memory_bytes, process.pod_uid or "unknown",
                )  # fmt: skip
        self._unmapped_seen = seen
        for uuid, count in counts.items():
            self._metrics.unmapped.labels(node=self._metrics.node, gpu=uuid).set(count)

    def _report_unchecked(self, unchecked: Sequence[Unchecked], turn: bool) -> None:
        now = self._clock()
        current = set()
        for item in unchecked:
            device = item.device
            current.add(device.key)
            self._metrics.unchecked.labels(node=self._metrics.node, gpu=device.uuid or "").inc()
            last = self._unchecked.get(device.key)
            repeat = last is not None and (last[0], last[2]) == (item.cause, turn)
            if repeat and last is not None and now - last[1] < REPEAT_S:
                continue
            self._unchecked[device.key] = (item.cause, now, turn)
            claim = device.claim
            message = (
                f"the memory of MPS share {device.device} of claim {claim.namespace}/"
                f"{claim.name} cannot be checked ({item.cause}); the driver does not cap it, so "
                "an overrun would go unnoticed until this is fixed"
            )
            log.warning("MPS memory watchdog: %s", message)
            self._post([claim_object(claim)], REASON_UNCHECKED, message, turn)
        for key in set(self._unchecked) - current:
            log.info("MPS memory watchdog: claim device %s can be checked again", key)
            del self._unchecked[key]

    def _handle(self, overrun: Overrun, turn: bool) -> None:
        device = overrun.device
        claim = device.claim
        limit = device.share_memory_bytes or 0
        pids = sorted(p.pid for p in overrun.processes)
        message = (
            f"the processes {pids} of claim {claim.namespace}/{claim.name} use "
            f"{overrun.used_bytes // MIB} MiB of {device.uuid}, more than its MPS share of "
            f"{limit // MIB} MiB (the driver does not cap it; --mps-memory-watchdog="
            f"{self.policy.value})"
        )
        now = self._clock()
        last = self._over.get(device.key)
        if last is None or last[1] != turn or now - last[0] >= REPEAT_S:
            self._over[device.key] = (now, turn)
            action = "observed" if not turn else _ACTION_WORD[self.policy]
            self._metrics.overruns.labels(
                node=self._metrics.node, namespace=claim.namespace, claim=claim.name,
                action=action,
            ).inc()  # fmt: skip
            log.warning("MPS memory watchdog: %s%s", message,
                        "" if turn else " (not the publishing instance: not acted on)")  # fmt: skip
            self._post(self._targets(device), REASON_EXCEEDED, message, turn)
        if not turn or self.policy is Policy.REPORT:
            return
        acted = self._acted.get(device.key)
        if acted is not None and now - acted[1] < ACTION_GRACE_S:
            listed: set[int | str] = {p.pid for p in overrun.processes}
            listed |= {p.pod_uid for p in overrun.processes if p.pod_uid}
            if acted[0] & listed:
                return  # the last action has not taken effect yet
        if self.policy is Policy.KILL:
            self._kill_newest(overrun, message, now)
        else:
            self._evict(overrun, message, now)

    def _targets(self, device: ClaimDevice) -> list[InvolvedObject]:
        namespace = device.claim.namespace
        pods = [pod_object(namespace, pod.name, pod.uid) for pod in device.pods]
        return [*pods, claim_object(device.claim)]

    def _kill_newest(self, overrun: Overrun, message: str, now: float) -> None:
        device = overrun.device
        started: list[tuple[int, int]] = []
        for process in overrun.processes:
            try:
                started.append((start_time(process.pid, self._proc), process.pid))
            except (OSError, ValueError, IndexError) as error:
                self._failed("kill", device, f"start time of process {process.pid}: {error}")
                return
        if not started:
            return
        _, pid = max(started)
        try:
            self._kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone already: NVML will stop listing it
        except OSError as error:
            self._failed("kill", device, f"SIGKILL to process {pid}: {error}")
            return
        self._acted[device.key] = (frozenset({pid}), now)
        self._metrics.actions.labels(node=self._metrics.node, action="kill", result="done").inc()
        text = f"{message}; killed its newest process {pid}"
        log.warning("MPS memory watchdog: %s", text)
        self._post(self._targets(device), REASON_KILLED, text, True)

    def _evict(self, overrun: Overrun, message: str, now: float) -> None:
        device = overrun.device
        if self._evictions is None:
            self._failed("evict", device, "no Eviction API client")
            return
        using = {p.pod_uid for p in overrun.processes}
        pods = [pod for pod in device.pods if pod.uid in using]
        evicted: set[int | str] = set()
        for pod in pods:
            try:
                self._evictions.evict_pod(device.claim.namespace, pod.name, uid=pod.uid)
            except errors.ApiError as error:
                self._failed("evict", device, f"eviction of pod {pod.name}: {error}")
                continue
            evicted.add(pod.uid)
            self._metrics.actions.labels(
                node=self._metrics.node, action="evict", result="done"
            ).inc()
            text = f"{message}; evicted pod {device.claim.namespace}/{pod.name}"
            log.warning("MPS memory watchdog: %s", text)
            self._post(self._targets(device), REASON_EVICTED, text, True)
        if evicted:
            self._acted[device.key] = (frozenset(evicted), now)

    def _failed(self, action: str, device: ClaimDevice, cause: str) -> None:
        self._metrics.actions.labels(node=self._metrics.node, action=action, result="failed").inc()
        claim = device.claim
        text = (
            f"MPS share {device.device} of claim {claim.namespace}/{claim.name} is over its "
            f"memory, and the watchdog's {action} failed: {cause}"
        )
        log.error("MPS memory watchdog: %s", text)
        if self._failures.get(device.key) != cause:
            self._failures[device.key] = cause
            self._post([claim_object(claim)], REASON_EXCEEDED, text, True)


_ACTION_WORD: Final = {
    Policy.OFF: "observed",
    Policy.REPORT: "reported",
    Policy.KILL: "killed",
    Policy.EVICT: "evicted",
}


def unenforced_devices(inventory: NodeInventory, support: MemoryLimitSupport) -> list[str]:
    """What the watchdog would watch, as its start-up log names it: the UUIDs of the GPUs and
    static MIG devices offered as MPS shares whose memory the driver does not cap, then, per
    profile of the dynamic MIG partitions offered, their MIG devices (made while shares hold
    them; the driver caps no MIG device)."""
    unenforced = [
        device.uuid
        for device in inventory.shared_devices
        if support.enforcement(device.uuid) is not Enforcement.DRIVER
    ]
    profiles = sorted({p.profile_name for p in inventory.partition_shares})
    return unenforced + [f"the MIG devices made from {name} partitions" for name in profiles]


def start_memory_watchdog(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    support: MemoryLimitSupport,
    *,
    entries: Callable[[], Mapping[str, CheckpointEntry]],
    claims: Callable[[str, str], Mapping[str, object] | None],
    registry: CollectorRegistry,
    is_turn: Callable[[], bool],
    events: EventPoster | None,
    evictions: EvictionApi | None,
    proc_root: Path = HOST_PROC,
) -> MemoryWatchdog | None:
    """Start the watchdog thread; None (logged) when ``--mps-memory-watchdog=off`` or when
    the driver caps every GPU offered as MPS shares and no static MIG device or dynamic MIG
    partition is offered (MIG shares are never capped by the driver: always watched)."""
    policy = Policy(settings.mps_memory_watchdog)
    unenforced = unenforced_devices(inventory, support)
    if policy is Policy.OFF or not unenforced:
        why = "turned off" if policy is Policy.OFF else "the driver caps every share's memory"
        log.info("MPS memory watchdog not started: %s", why)
        return None

    def devices() -> list[ClaimDevice]:
        return claim_devices(
            entries(), inventory, lambda ns, name: pods_from_claim(claims(ns, name))
        )

    simulated = (
        SimulatedUtilizationFile(settings.state_dir / SIMULATED_UTILIZATION_FILE, nvml)
        if isinstance(nvml, SimulatedNvml)
        else None
    )
    watchdog = MemoryWatchdog(
        UtilizationSampler(nvml, proc_root=proc_root, process_utilization=False),
        devices,
        policy=policy,
        interval_s=settings.mps_memory_watchdog_interval_s,
        is_turn=is_turn,
        events=events,
        evictions=evictions,
        metrics=WatchdogMetrics(registry, settings.node_name),
        proc_root=proc_root,
        before_check=None if simulated is None else simulated.apply,
        kill=os.kill if proc_root == HOST_PROC else _not_this_hosts_process,
    )
    log.info("MPS memory watchdog: %s every %gs on the shares of %s", policy.value,
             watchdog.interval_s, ", ".join(unenforced))  # fmt: skip
    watchdog.start()
    return watchdog
