"""The kubelet plugin's prepare side on a test node, shared by the prepare tests: the real
checkpoint, CDI store and claim files under a temporary directory, claims from an in-memory API
server, GPUs of a simulated machine profile, and the real `NodeClaimPreparer` built over them.

`Node` serves static inventories (whole GPUs, static MIG); `MpsNode` adds the real MPS daemon
manager running the ``nvidia-cuda-mps-control`` test double; `DynamicMigNode` simulates an
hgx-h100 whose MIG state survives restarts, with the MIG lifecycle and crash points. Subclasses
add preparer options through `preparer_options`; one place, `PluginOnNode.build_preparer`,
builds the preparer."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pynvml
import yaml

from gpu_dra.driver.discovery import discover_devices, discover_gpus
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.shares import MigShareSelection, ShareSelection
from gpu_dra.kubelet_plugin.cdi import CdiDevice, ClaimSpecStore, ContainerEdits
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint, LoadResult
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.kubeapi import ResourceClaim
from gpu_dra.kubelet_plugin.mig import MigLifecycle, SimulatedMigStateFile
from gpu_dra.kubelet_plugin.mig.claims import DynamicMig
from gpu_dra.kubelet_plugin.mps import (
    DaemonHandle,
    MpsDaemonManager,
    PlainDirectoryShm,
    claim_daemon_id,
)
from gpu_dra.kubelet_plugin.mps.process import start_time
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_instances import PluginInstance
from gpu_dra.kubelet_plugin.prepare import NodeClaimPreparer
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice, PrepareResult
from gpu_dra.kubelet_plugin.simulated_facts import SIMULATED_FACTS_DIR, SharedFactFiles
from gpu_dra.kubelet_plugin.tiers.assembly import node_tiers
from gpu_dra.kubelet_plugin.tiers.state import claims_using, handles_from_state
from tests.doubles import nvidia_cuda_mps_control as double
from tests.doubles.mps_helpers import DOUBLE_BINARY, double_env, processes_under
from tests.fakes.claim_reader import (
    InMemoryClaimReader,
    allocation_result,
    gpu_config,
    opaque_config,
    resource_claim,
)

DRIVER = "gpu.nvidia.com"
NODE = "node-a"

TIER_PARTS = frozenset(inspect.signature(node_tiers).parameters) - {
    "records",
    "inventory",
    "node_name",
    "cdi",
    "instance",
}
"""The `node_tiers` arguments `new_preparer` takes beside the preparer's."""


def new_preparer(
    *,
    checkpoint: Checkpoint,
    inventory: NodeInventory,
    cdi: ClaimSpecStore,
    claims_dir: Path,
    node_name: str = NODE,
    driver_name: str = DRIVER,
    instance: PluginInstance | None = None,
    **options: Any,
) -> NodeClaimPreparer:
    """A `NodeClaimPreparer` over ``checkpoint`` with the tiers `node_tiers` builds, as the
    plugin wires them: ``options`` naming a tier part (`TIER_PARTS`: ``mps``, ``dynamic_mig``,
    ...) go to `node_tiers`, the others to the preparer."""
    records = ClaimRecords(checkpoint, owner=None if instance is None else instance.token)
    parts = {name: options.pop(name) for name in list(options) if name in TIER_PARTS}
    tiers = node_tiers(records, inventory, node_name=node_name, cdi=cdi, instance=instance, **parts)
    return NodeClaimPreparer(
        driver_name=driver_name,
        node_name=node_name,
        inventory=inventory,
        records=records,
        cdi=cdi,
        claims_dir=claims_dir,
        tiers=tiers,
        instance=instance,
        **options,
    )


UID_A = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
UID_B = "5d2c9f71-3e8a-4b6d-8c1f-6a4e2b0d9c02"
UID_C = "9e4f2a10-6b3d-4c8e-a1f7-0d5b3c2e1f03"
DYNAMIC_MIG_PROFILE = "hgx-h100"
OFF = pynvml.NVML_DEVICE_MIG_DISABLE


def double_daemon_manager(root: Path) -> MpsDaemonManager:
    """The real MPS daemon manager under `root`, running the test double (plain-dir shm)."""
    return MpsDaemonManager(
        root, binary=DOUBLE_BINARY, base_env=double_env(), shm=PlainDirectoryShm()
    )


class Boot:
    """A node whose boot ID a test can change (a reboot)."""

    def __init__(self, boot_id: str = "boot-1") -> None:
        self.id = boot_id

    def __call__(self) -> str:
        return self.id


class RecordingSpecStore(ClaimSpecStore):
    """The real CDI store, recording writes; a set ``gate`` holds writes until it is opened, and
    with ``disk_full`` every write fails (after it is recorded)."""

    def __init__(self, cdi_root: Path, *, disk_full: bool = False) -> None:
        super().__init__(cdi_root, driver_name=DRIVER)
        self.writes: list[str] = []
        self.writing = threading.Event()
        self.gate: threading.Event | None = None
        self.disk_full = disk_full

    def write(
        self,
        claim_uid: str,
        devices: Sequence[CdiDevice],
        *,
        common_edits: ContainerEdits | None = None,
    ) -> Path:
        self.writes.append(claim_uid)
        if self.disk_full:
            raise OSError(28, "No space left on device")
        self.writing.set()
        if self.gate is not None and not self.gate.wait(timeout=10):
            raise TimeoutError("test gate never opened")
        return super().write(claim_uid, devices, common_edits=common_edits)


def as_shipped(inventory: NodeInventory, data_dir: Path) -> NodeInventory:
    """``inventory`` as the plugin builds it (`startup.discovery`): a simulated one keeps the
    fact files of its own devices in ``<data_dir>/simulated-facts``."""
    if not inventory.simulated or inventory.fact_files is not None:
        return inventory
    return dataclasses.replace(
        inventory, fact_files=SharedFactFiles(data_dir / SIMULATED_FACTS_DIR)
    )


class PluginOnNode:
    """What every test node has: the plugin's inventory, claims, checkpoint, CDI store and data
    dir, and the preparer built over them (`build_preparer`, at each restart)."""

    inventory: NodeInventory
    api: InMemoryClaimReader
    checkpoint: Checkpoint
    cdi: ClaimSpecStore
    data_dir: Path
    preparer: NodeClaimPreparer

    def preparer_options(self) -> dict[str, Any]:
        """Further `new_preparer` arguments (MPS, time slicing, ...); built at each restart."""
        return {}

    def build_preparer(self, **options: Any) -> NodeClaimPreparer:
        """The preparer of driver `DRIVER` on node `NODE`, claim files in ``<data_dir>/claims``,
        with `preparer_options` and `options`."""
        return new_preparer(
            inventory=self.inventory,
            claims=self.api,
            checkpoint=self.checkpoint,
            cdi=self.cdi,
            claims_dir=self.data_dir / "claims",
            **self.preparer_options(),
            **options,
        )

    def recover(self) -> None:
        asyncio.run(self.preparer.recover())

    def spec(self, claim_uid: str) -> dict[str, Any]:
        loaded: dict[str, Any] = yaml.safe_load(self.cdi.path_for(claim_uid).read_text())
        return loaded


class Node(PluginOnNode):
    """The plugin's state on one node, in ``root``; :meth:`restart` keeps the files."""

    def __init__(self, root: Path, inventory: NodeInventory) -> None:
        self.root = root
        self.api = InMemoryClaimReader()
        self.boot = Boot()
        self.data_dir = root / "data"
        self.inventory = as_shipped(inventory, self.data_dir)
        self.claims_dir = self.data_dir / "claims"
        self.cdi_root = root / "cdi"
        self.fail_cdi_writes = False
        self.restart()

    def restart(self) -> LoadResult:
        """A new plugin process: fresh checkpoint, CDI store and preparer over the same files."""
        self.checkpoint = Checkpoint(self.data_dir, boot_id=self.boot)
        loaded = self.checkpoint.load()
        self.cdi = RecordingSpecStore(self.cdi_root, disk_full=self.fail_cdi_writes)
        self.preparer = self.build_preparer()
        return loaded

    def add(self, claim: ResourceClaim) -> ClaimRef:
        self.api.add(claim)
        metadata = claim["metadata"]
        return ClaimRef(metadata["namespace"], metadata["uid"], metadata["name"])

    def add_gpus(self, claim_uid: str, name: str, *devices: str, **kwargs: Any) -> ClaimRef:
        """A claim allocated ``devices`` of this node for its request ``gpu``."""
        results = [allocation_result(device, **kwargs) for device in devices]
        return self.add(resource_claim(claim_uid, name, results=results))

    def prepare(self, *claims: ClaimRef) -> dict[str, PrepareResult]:
        return dict(asyncio.run(self.preparer.prepare(claims)))

    def unprepare(self, *claims: ClaimRef) -> dict[str, str | None]:
        return dict(asyncio.run(self.preparer.unprepare(claims)))

    def spec_files(self) -> list[str]:
        return sorted(p.name for p in self.cdi_root.iterdir()) if self.cdi_root.exists() else []

    def claim_dirs(self) -> list[str]:
        return sorted(p.name for p in self.claims_dir.iterdir()) if self.claims_dir.exists() else []

    def uuid_of(self, device: str) -> str:
        gpu = self.inventory.by_name(device)
        assert gpu is not None
        return gpu.uuid

    def assert_nothing_left(self, claim_uid: str) -> None:
        assert not self.cdi.path_for(claim_uid).exists(), "CDI spec left behind"
        assert not (self.claims_dir / claim_uid).exists(), "claim files left behind"
        assert self.checkpoint.get(claim_uid) is None, "checkpoint entry left behind"


class MpsNode(Node):
    """`Node` whose preparer has a real MPS daemon manager running the test double."""

    def __init__(self, root: Path, inventory: NodeInventory, mps_root: Path) -> None:
        self.mps_root = mps_root
        super().__init__(root, inventory)

    def preparer_options(self) -> dict[str, Any]:
        self.mps = double_daemon_manager(self.mps_root)
        return {**super().preparer_options(), "mps": self.mps}

    def add_mps(
        self,
        claim_uid: str,
        *devices: str,
        mps_config: dict[str, Any] | None = None,
        name: str = "claim-a",
    ) -> ClaimRef:
        """A claim for ``devices`` (request ``gpu``) with one MPS config for all of them."""
        sharing: dict[str, Any] = {"strategy": "MPS"}
        if mps_config is not None:
            sharing["mpsConfig"] = mps_config
        config = opaque_config(gpu_config(sharing=sharing), requests=["gpu"])
        results = [allocation_result(device) for device in devices]
        return self.add(resource_claim(claim_uid, name, results=results, claim_configs=[config]))

    def handles(self, claim_uid: str) -> list[DaemonHandle]:
        entry = self.checkpoint.get(claim_uid)
        assert entry is not None
        return handles_from_state(entry.state)

    def daemon_dirs(self) -> list[str]:
        base = self.mps_root / "mps"
        return sorted(p.name for p in base.iterdir()) if base.exists() else []

    def running(self) -> list[int]:
        return processes_under(self.mps_root)


def shares_inventory() -> NodeInventory:
    """The whole GPUs of the simulated hgx-h100 node, gpu-0 and gpu-1 offered as MPS shares."""
    host = SimulatedHost.load("hgx-h100", NODE)
    gpus = tuple(discover_gpus(host.nvml, host.pci))
    return NodeInventory(gpus, simulated=True, mps_shares=ShareSelection.parse("0,1").select(gpus))


MPS_CLASS_CONFIG: dict[str, Any] = {
    "source": "FromClass",
    "opaque": {"driver": "gpu.nvidia.com", "parameters": gpu_config(sharing={"strategy": "MPS"})},
}


class SharesNode(MpsNode):
    """`MpsNode` with gpu-0 and gpu-1 offered as MPS shares (`shares_inventory`)."""

    max_percent = 100

    def __init__(self, root: Path, mps_root: Path) -> None:
        super().__init__(root, shares_inventory(), mps_root)

    def preparer_options(self) -> dict[str, Any]:
        return {**super().preparer_options(), "mps_share_max_percent": self.max_percent}

    def add_share(
        self,
        uid: str,
        memory: str,
        compute: str,
        *,
        device: str = "gpu-0",
        name: str = "share",
        namespace: str = "default",
        configs: tuple[dict[str, Any], ...] = (MPS_CLASS_CONFIG,),
        claim_configs: tuple[dict[str, Any], ...] = (),
    ) -> ClaimRef:
        """A claim of the mps.gpu.nvidia.com class holding a share of ``device``."""
        result = allocation_result(
            device,
            request="share",
            share_id=f"{uid[:8]}-0000-4000-8000-000000000000",
            consumed_capacity={"memory": memory, "compute": compute},
        )
        claim = resource_claim(
            uid,
            name,
            namespace,
            results=[result],
            class_configs=list(configs),
            claim_configs=list(claim_configs),
        )
        return self.add(claim)

    def shared_handles(self) -> dict[str, DaemonHandle]:
        """``{claim uid: handle of its shared daemon}``."""
        found = {}
        for uid in self.checkpoint.all():
            for handle in self.handles(uid):
                if handle.daemon_id.startswith("shared-"):
                    found[uid] = handle
        return found

    def users(self, daemon_id: str) -> list[str]:
        states = {uid: entry.state for uid, entry in self.checkpoint.all().items()}
        return claims_using(states, daemon_id)


def mig_shares_inventory(offered: str = "1g.10gb") -> NodeInventory:
    """The static MIG devices of the simulated hgx-h100-mig node, those ``offered``
    (``--mps-shares-on-mig``) as MPS shares."""
    host = SimulatedHost.load("hgx-h100-mig", NODE)
    found = discover_devices(host.nvml, host.pci)
    return NodeInventory.from_discovery(
        found, simulated=True, mps_shares_on_mig=MigShareSelection.parse(offered)
    )


MIG_MPS_CLASS_CONFIG: dict[str, Any] = {
    "source": "FromClass",
    "opaque": {
        "driver": "gpu.nvidia.com",
        "parameters": {**gpu_config(sharing={"strategy": "MPS"}), "kind": "MigDeviceConfig"},
    },
}


class MigSharesNode(SharesNode):
    """`SharesNode` on the simulated hgx-h100-mig: its 1g.10gb MIG devices offered as MPS
    shares (`mig_shares_inventory`); shares default to the class config of mps.mig.nvidia.com."""

    def __init__(self, root: Path, mps_root: Path) -> None:
        MpsNode.__init__(self, root, mig_shares_inventory(), mps_root)

    def add_share(
        self,
        uid: str,
        memory: str,
        compute: str,
        *,
        device: str = "gpu-0",
        name: str = "share",
        namespace: str = "default",
        configs: tuple[dict[str, Any], ...] = (MIG_MPS_CLASS_CONFIG,),
        claim_configs: tuple[dict[str, Any], ...] = (),
    ) -> ClaimRef:
        return super().add_share(
            uid,
            memory,
            compute,
            device=device,
            name=name,
            namespace=namespace,
            configs=configs,
            claim_configs=claim_configs,
        )


class Crash(BaseException):
    """Raised at a crash point, after the node's files were frozen (`DynamicMigNode.crashed`)."""


class DynamicMigNode(PluginOnNode):
    """The plugin with dynamic MIG on one simulated hgx-h100; `restart` is a new process over
    the same files, simulated GPUs included (their MIG state comes back from the state file)."""

    inventory_options: Mapping[str, Any] = {}
    """Further `NodeInventory.from_discovery` arguments (partitions offered as shares)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.api = InMemoryClaimReader()
        self.data_dir = root / "data"
        self.data_dir.mkdir()
        self.cdi_root = root / "cdi"
        self.cdi_root.mkdir()
        self.restart()

    def restart(self, *, crash_at: str | None = None, dynamic: bool = True) -> None:
        state = SimulatedMigStateFile(self.data_dir / "simulated-nvml.json", DYNAMIC_MIG_PROFILE)
        self.host = SimulatedHost.load(
            DYNAMIC_MIG_PROFILE, NODE, saved_mig=state.load(), on_mig_change=state.save
        )
        found = discover_devices(self.host.nvml, self.host.pci, mig_profiles=True)
        self.inventory = NodeInventory.from_discovery(
            found,
            simulated=True,
            dynamic_mig=True,
            fact_files=SharedFactFiles(self.data_dir / SIMULATED_FACTS_DIR),
            **self.inventory_options,
        )
        self.checkpoint = Checkpoint(self.data_dir, boot_id=lambda: "boot-1")
        self.checkpoint.load()
        self.cdi = ClaimSpecStore(self.cdi_root, driver_name=DRIVER)

        def crash(point: str) -> None:
            if point == crash_at:
                # The process dies here: what is on disk now is all the next one finds. The
                # exception unwinds (and cleans up) in this process; `crashed` puts back the
                # files as they were at this moment.
                shutil.copytree(self.data_dir, self.root / "at-crash" / "data")
                shutil.copytree(self.cdi_root, self.root / "at-crash" / "cdi")
                raise Crash(point)

        self.crash = crash
        """The crash point of this process (`crash_points.arm` it to crash beyond MIG calls)."""
        self.lifecycle = MigLifecycle(self.host.nvml, crash_point=crash)
        dynamic_mig = DynamicMig(self.lifecycle, self.inventory.partitionable_gpus())
        self.preparer = self.build_preparer(dynamic_mig=dynamic_mig if dynamic else None)

    def crashed(self) -> None:
        """A new plugin process after the crash: the files as the crash point froze them."""
        for name, path in (("data", self.data_dir), ("cdi", self.cdi_root)):
            shutil.rmtree(path)
            shutil.copytree(self.root / "at-crash" / name, path)
        shutil.rmtree(self.root / "at-crash")
        self.restart()

    def add(self, uid: str, *devices: str, name: str = "claim-a", **kwargs: Any) -> ClaimRef:
        results = [allocation_result(device, request=f"r{i}") for i, device in enumerate(devices)]
        self.api.add(resource_claim(uid, name, results=results, **kwargs))
        return ClaimRef("default", uid, name)

    def prepare(self, claim: ClaimRef) -> PrepareResult:
        return asyncio.run(self.preparer.prepare([claim]))[claim.uid]

    def unprepare(self, claim: ClaimRef) -> str | None:
        return asyncio.run(self.preparer.unprepare([claim]))[claim.uid]

    def gpu(self, minor: int) -> Any:
        return next(g for g in self.inventory.gpus if g.minor == minor)

    def layout(self, minor: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(GI profile ID, placement start, CI ids) of every GPU instance, read through NVML."""
        return [
            (i.gi_profile_id, i.placement_start, i.ci_ids)
            for i in self.lifecycle.instances(self.gpu(minor))
        ]

    def mig_mode(self, minor: int) -> list[int]:
        nvml = self.host.nvml
        nvml.init()
        try:
            return nvml.device_get_mig_mode(nvml.device_get_handle_by_uuid(self.gpu(minor).uuid))
        finally:
            nvml.shutdown()

    def all_instances(self) -> dict[str, list[Any]]:
        snapshot = self.host.nvml.mig_snapshot()["gpus"]
        assert isinstance(snapshot, dict)
        return {uuid: s["gpuInstances"] for uuid, s in snapshot.items() if s["gpuInstances"]}

    def assert_nothing_left(self, uid: str) -> None:
        assert not self.cdi.path_for(uid).exists(), "CDI spec left behind"
        assert not (self.data_dir / "claims" / uid).exists(), "claim files left behind"
        assert self.checkpoint.get(uid) is None, "checkpoint entry left behind"
        assert self.all_instances() == {}, "MIG instances left behind"
        assert all(m == [OFF, OFF] for m in (self.mig_mode(g.minor) for g in self.inventory.gpus))


def hgx_h100_inventory() -> NodeInventory:
    """The whole GPUs of the simulated hgx-h100 node."""
    host = SimulatedHost.load("hgx-h100", NODE)
    return NodeInventory(tuple(discover_gpus(host.nvml, host.pci)), simulated=True)


def ok(result: PrepareResult) -> tuple[PreparedDevice, ...]:
    assert result.error is None, result.error
    return result.devices


def failed(result: PrepareResult) -> str:
    assert result.error is not None, f"prepared {result.devices}"
    return result.error


def device_env(spec_device: dict[str, Any]) -> dict[str, str]:
    """The environment a CDI device sets, as a dict."""
    pairs = (item.split("=", 1) for item in spec_device["containerEdits"]["env"])
    return {key: value for key, value in pairs}


def env_of(spec: dict[str, Any]) -> dict[str, dict[str, str]]:
    """``{CDI device name: its environment}`` of a claim's CDI spec."""
    return {d["name"]: device_env(d) for d in spec["devices"]}


def device_var(device: str, suffix: str) -> str:
    """The name of a device's ``GPU_DRA_<DEVICE>_<suffix>`` variable."""
    return "GPU_DRA_" + device.upper().replace("-", "_") + "_" + suffix


def mounts(spec_device: dict[str, Any]) -> dict[str, tuple[str, list[str]]]:
    """``{containerPath: (hostPath, options)}`` of a CDI device's mounts."""
    return {
        m["containerPath"]: (m["hostPath"], m["options"])
        for m in spec_device["containerEdits"].get("mounts", [])
    }


def assert_one_daemon_per_mig_device(
    claim_uid: str,
    handles: Mapping[tuple[str, ...], DaemonHandle],
    threads: float,
    limits: Mapping[str, str],
) -> None:
    """`handles` (by their devices) are one daemon per MIG UUID of `limits`, named for the claim
    and that UUID, serving it alone with default `threads` % and its pinned limit."""
    assert set(handles) == {(uuid,) for uuid in limits}
    for uuid, limit in limits.items():
        handle = handles[(uuid,)]
        assert handle.daemon_id == claim_daemon_id(claim_uid, [uuid])
        state = double.read_state(handle.paths.pipe)
        assert state["visibleDevices"] == [uuid]
        assert state["defaults"] == {
            "activeThreadPercentage": threads,
            "pinnedMemLimits": {uuid: limit},
        }


def wait_dead(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while start_time(pid) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
