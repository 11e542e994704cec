"""What must hold on a node after every restart of the plugin (and whenever no call is under
way), read from the node's real state: the checkpoint file, the CDI dir, the claim files, the
MPS daemon dirs and processes, the simulated MIG state file and the time-slice record.

- nothing leaked: every checkpoint entry, CDI spec, claim dir, MPS dir and daemon process, MIG
  instance (and MIG mode left on) and non-default time slice belongs to a claim the kubelet
  believes prepared or has a call in flight for; no temporary file (``.tmp``) is left;
- no device prepared for two claims (MPS shares excepted);
- every claim the kubelet believes prepared has its `PrepareCompleted` entry, CDI spec, claim
  files, live MPS daemons, MIG devices and time slices.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pynvml

from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore
from gpu_dra.kubelet_plugin.checkpoint import CHECKPOINT_FILE
from gpu_dra.kubelet_plugin.mig import SIMULATED_STATE_FILE, MigLifecycle, SimulatedMigStateFile
from gpu_dra.kubelet_plugin.mps.process import start_time
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.simulated_facts import SIMULATED_FACTS_DIR
from gpu_dra.kubelet_plugin.tiers.state import (
    handles_from_state,
    intents_from_state,
    time_slices_from_state,
)
from gpu_dra.kubelet_plugin.time_slicer import DEFAULT_INTERVAL, RECORD_FILE
from tests.crash_harness.nodes import NODE_NAME, NodeKind
from tests.doubles.mps_helpers import processes_under


class Belief(enum.Enum):
    """What the kubelet believes of a claim on the node."""

    PREPARED = "prepared"  # its prepare succeeded
    PREPARING = "preparing"  # a prepare is in flight (or to be retried)
    UNPREPARING = "unpreparing"  # an unprepare is in flight (or to be retried)


def check(
    kind: NodeKind,
    root: Path,
    inventory: NodeInventory,
    beliefs: Mapping[str, Belief],
    *,
    after_restart: bool,
) -> list[str]:
    """The broken invariants (empty: all hold). ``after_restart``: recovery has just run, so no
    record may be unfinished; otherwise (idle) an unprepare that failed may be."""
    data = root / "data"
    problems: list[str] = []
    entries = _checkpoint(data)
    cdi = ClaimSpecStore(root / "cdi")
    completed = {u for u, e in entries.items() if e["phase"] == "PrepareCompleted"}

    for uid, entry in entries.items():
        belief = beliefs.get(uid)
        if belief is None:
            problems.append(f"checkpoint entry {uid} ({entry['phase']}) of a claim the kubelet "
                            "does not have")  # fmt: skip
        phase = entry["phase"]
        if phase == "PrepareStarted" or (phase == "UnprepareStarted" and after_restart):
            when = "recovery" if after_restart else "every call answered"
            problems.append(f"checkpoint entry {uid} is {phase} after {when}")
        if phase == "UnprepareStarted" and belief is not Belief.UNPREPARING:
            problems.append(f"checkpoint entry {uid} is UnprepareStarted, kubelet: {belief}")
    for uid, belief in beliefs.items():
        if belief is Belief.PREPARED and uid not in completed:
            problems.append(f"claim {uid} the kubelet believes prepared has no PrepareCompleted "
                            f"entry ({entries.get(uid, {}).get('phase')})")  # fmt: skip

    # What the kubelet knows nothing of is leaked, whatever records it.
    entries = {uid: entry for uid, entry in entries.items() if uid in beliefs}
    completed &= set(entries)
    # CDI specs and their temporaries; claim files
    for path in sorted((root / "cdi").iterdir()) if (root / "cdi").exists() else []:
        uid = _spec_uid(cdi, path)
        if uid is None:
            problems.append(f"leaked file in the CDI dir: {path.name}")
        elif uid not in entries:
            problems.append(f"leaked CDI spec of claim {uid}")
    claims_dir = data / "claims"
    for path in sorted(claims_dir.iterdir()) if claims_dir.exists() else []:
        if path.name not in entries:
            problems.append(f"leaked claim files {path.name}")
    plugin_files = (claims_dir, data / SIMULATED_FACTS_DIR)
    for uid in completed:
        if not cdi.path_for(uid).exists():
            problems.append(f"prepared claim {uid} has no CDI spec")
        for host_path in map(Path, cdi.mounted_host_paths(uid)):
            if any(host_path.is_relative_to(d) for d in plugin_files) and not host_path.exists():
                problems.append(f"prepared claim {uid} mounts {host_path}, which is gone")
    for path in data.rglob("*.tmp") if data.exists() else []:
        problems.append(f"leaked temporary file {path.relative_to(root)}")

    problems += _mps(data, entries, completed)
    problems += _devices(entries, beliefs)
    problems += _time_slices(data, entries, completed)
    if kind.dynamic_mig:
        problems += _mig(kind, data, inventory, entries, completed)
    return problems


def _checkpoint(data: Path) -> dict[str, dict[str, Any]]:
    try:
        document = json.loads((data / CHECKPOINT_FILE).read_text())
    except FileNotFoundError:
        return {}
    claims: dict[str, dict[str, Any]] = document.get("claims", {})
    return claims


def _spec_uid(cdi: ClaimSpecStore, path: Path) -> str | None:
    prefix = f"{cdi.path_for('00000000-0000-0000-0000-000000000000').name.split('_')[0]}_"
    if path.name.startswith(prefix) and path.name.endswith(".yaml"):
        return path.name[len(prefix) : -len(".yaml")]
    return None


def _mps(data: Path, entries: Mapping[str, Any], completed: set[str]) -> list[str]:
    problems = []
    recorded: dict[str, list[str]] = {}
    for uid, entry in entries.items():
        for handle in handles_from_state(entry.get("state", {})):
            recorded.setdefault(handle.daemon_id, []).append(uid)
            alive = start_time(handle.pid) == handle.pid_start_time
            if uid in completed and not alive:
                problems.append(f"prepared claim {uid}: MPS daemon {handle.daemon_id} "
                                f"(pid {handle.pid}) is not running")  # fmt: skip
    mps_dir = data / "mps"
    for path in sorted(mps_dir.iterdir()) if mps_dir.exists() else []:
        if path.name not in recorded:
            problems.append(f"leaked MPS daemon dir {path.name}")
    for pid in processes_under(data):
        daemon = _daemon_of(pid, mps_dir)
        if daemon not in recorded:
            problems.append(f"leaked MPS process {pid} (daemon {daemon})")
    return problems


def _daemon_of(pid: int, mps_dir: Path) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"CUDA_MPS_PIPE_DIRECTORY="):
            pipe = Path(os.fsdecode(item.split(b"=", 1)[1]))
            if pipe.parent.parent == mps_dir:
                return pipe.parent.name
    return None


def _devices(entries: Mapping[str, Any], beliefs: Mapping[str, Belief]) -> list[str]:
    """A device (not a share) in two entries; a whole GPU and a MIG device of it in two."""
    problems = []
    holders: dict[str, str] = {}
    for uid, entry in sorted(entries.items()):
        for device in entry.get("devices", []):
            if device.get("shareID"):
                continue
            name = device["deviceName"]
            other = holders.setdefault(name, uid)
            if other != uid:
                problems.append(f"device {name} is prepared for claims {other} and {uid}")
    for name, uid in holders.items():
        if "-mig-" in name:
            parent = name.split("-mig-")[0]
            if parent in holders and holders[parent] != uid:
                problems.append(f"MIG device {name} of claim {uid} and its GPU {parent} of "
                                f"claim {holders[parent]} are both prepared")  # fmt: skip
    del beliefs
    return problems


def _time_slices(data: Path, entries: Mapping[str, Any], completed: set[str]) -> list[str]:
    try:
        intervals: dict[str, int] = json.loads((data / RECORD_FILE).read_text())["intervals"]
    except FileNotFoundError:
        intervals = {}
    problems = []
    recorded: dict[str, int] = {}
    for uid, entry in entries.items():
        for uuid, interval in time_slices_from_state(entry.get("state", {})).items():
            recorded[uuid] = interval
            if uid in completed and intervals.get(uuid, DEFAULT_INTERVAL) != interval:
                problems.append(f"prepared claim {uid}: GPU {uuid} time slice is "
                                f"{intervals.get(uuid)}, recorded {interval}")  # fmt: skip
    for uuid, interval in intervals.items():
        if interval != DEFAULT_INTERVAL and uuid not in recorded:
            problems.append(f"leaked time slice {interval} on GPU {uuid}")
    return problems


def _mig(
    kind: NodeKind,
    data: Path,
    inventory: NodeInventory,
    entries: Mapping[str, Any],
    completed: set[str],
) -> list[str]:
    state = SimulatedMigStateFile(data / SIMULATED_STATE_FILE, kind.profile(data.parent))
    host = SimulatedHost.load(kind.profile(data.parent), NODE_NAME, saved_mig=state.load())
    mig = MigLifecycle(host.nvml, crash_point=lambda point: None)
    recorded: dict[tuple[str, int, int], str] = {}
    for uid, entry in entries.items():
        for intent in intents_from_state(entry.get("state", {})):
            recorded[intent.key] = uid
    problems = []
    existing = set()
    for gpu in inventory.partitionable_gpus():
        instances = mig.instances(gpu)
        for instance in instances:
            key = (gpu.uuid, instance.gi_profile_id, instance.placement_start)
            existing.add(key)
            if key not in recorded:
                problems.append(f"leaked MIG instance {key}")
        if not instances and _mig_mode(host, gpu.uuid) == pynvml.NVML_DEVICE_MIG_ENABLE:
            problems.append(f"MIG mode left on, without instances, on {gpu.uuid}")
    for key, uid in recorded.items():
        if uid in completed and key not in existing:
            problems.append(f"prepared claim {uid}: MIG instance {key} is gone")
    return problems


def _mig_mode(host: SimulatedHost, uuid: str) -> int:
    nvml = host.nvml
    nvml.init()
    try:
        current, _ = nvml.device_get_mig_mode(nvml.device_get_handle_by_uuid(uuid))
        return int(current)
    finally:
        nvml.shutdown()
