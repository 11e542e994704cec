"""Two plugin instances on one node, as during a rolling update (`maxSurge: 1`): one data dir
(checkpoint, claim files, simulated MIG state), one CDI root, one simulated hgx-h100 with dynamic
MIG, one API server. Each instance is registered (`InstanceRegistry`) and has its own checkpoint
object, simulator and preparer, so their locks are separate files exactly as in two processes.

The new instance's start-up recovery waits for the old one's prepare under way and leaves the
unfinished prepares and unprepares of a running instance alone; a dead instance's are rolled
back or finished; conflicting claims prepared on the two instances at once never both succeed;
one claim sent to both is prepared once, also when the first call was answered at its deadline
and its work went on behind the reply."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpu_dra.driver.discovery import discover_devices
from gpu_dra.driver.model import MigPartition
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint, ClaimPhase
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords, started
from gpu_dra.kubelet_plugin.dra_service import ClaimCallHandler
from gpu_dra.kubelet_plugin.mig import MigLifecycle, SimulatedMigStateFile
from gpu_dra.kubelet_plugin.mig.claims import DynamicMig
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.node_locks import NodeLocks
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry, PluginInstance
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PrepareResult
from gpu_dra.kubelet_plugin.tiers.state import DYNAMIC_MIG_STATE_KEY, intents_to_state
from tests.fakes.claim_reader import InMemoryClaimReader, allocation_result, resource_claim
from tests.kubelet_plugin.nodes import (
    DYNAMIC_MIG_PROFILE,
    NODE,
    UID_A,
    UID_B,
    UID_C,
    RecordingSpecStore,
    failed,
    new_preparer,
    ok,
)

MIG = "gpu-1-mig-3g40gb-9-0"
POD_OLD = "00000000-0000-4000-8000-0000000000a1"
POD_NEW = "00000000-0000-4000-8000-0000000000b2"


class Shared:
    """What both instances see: the data dir, the CDI root and the API server's claims."""

    def __init__(self, root: Path) -> None:
        self.data_dir = root / "data"
        self.cdi_root = root / "cdi"
        self.data_dir.mkdir()
        self.cdi_root.mkdir()
        self.api = InMemoryClaimReader()
        self.registry = InstanceRegistry(self.data_dir)

    def add(self, uid: str, *devices: str, name: str = "claim-a") -> ClaimRef:
        results = [allocation_result(d, request=f"r{i}") for i, d in enumerate(devices)]
        self.api.add(resource_claim(uid, name, results=results))
        return ClaimRef("default", uid, name)

    def checkpoint(self) -> Checkpoint:
        checkpoint = Checkpoint(self.data_dir, boot_id=lambda: "boot-1")
        checkpoint.load()
        return checkpoint

    def mig_instances(self) -> dict[str, list[Any]]:
        """The GPU instances the simulated hardware holds, by GPU UUID (from the state file,
        which both instances write)."""
        saved = SimulatedMigStateFile(
            self.data_dir / "simulated-nvml.json", DYNAMIC_MIG_PROFILE
        ).load()
        gpus = {} if saved is None else saved["gpus"]
        assert isinstance(gpus, dict)
        return {uuid: s["gpuInstances"] for uuid, s in gpus.items() if s["gpuInstances"]}


class Instance:
    """One plugin process on the shared node: registered, with its own simulator (its MIG
    state from the shared file), checkpoint object, CDI store and preparer."""

    def __init__(self, shared: Shared, pod_uid: str) -> None:
        self.shared = shared
        self.instance: PluginInstance = shared.registry.register(pod_uid)
        state = SimulatedMigStateFile(shared.data_dir / "simulated-nvml.json", DYNAMIC_MIG_PROFILE)
        self.host = SimulatedHost.load(
            DYNAMIC_MIG_PROFILE, NODE, saved_mig=state.load(), on_mig_change=state.save
        )
        state.attach(self.host.nvml)
        found = discover_devices(self.host.nvml, self.host.pci, mig_profiles=True)
        self.inventory = NodeInventory.from_discovery(found, simulated=True, dynamic_mig=True)
        self.checkpoint = shared.checkpoint()
        self.cdi = RecordingSpecStore(shared.cdi_root)
        lifecycle = MigLifecycle(
            self.host.nvml, locks=NodeLocks(shared.data_dir), refresh=state.refresh
        )
        self.dynamic_mig = DynamicMig(lifecycle, self.inventory.partitionable_gpus())
        self.preparer = new_preparer(
            inventory=self.inventory,
            claims=shared.api,
            checkpoint=self.checkpoint,
            cdi=self.cdi,
            claims_dir=shared.data_dir / "claims",
            dynamic_mig=self.dynamic_mig,
            instance=self.instance,
            recovery_wait_s=10,
        )

    async def prepare(self, claim: ClaimRef) -> PrepareResult:
        return (await self.preparer.prepare([claim]))[claim.uid]

    async def unprepare(self, claim: ClaimRef) -> str | None:
        return (await self.preparer.unprepare([claim]))[claim.uid]

    def die(self) -> None:
        """The process is gone: its instance lock with it."""
        self.instance.close()


@pytest.fixture
def shared(tmp_path: Path) -> Shared:
    return Shared(tmp_path)


async def wait_until_writing(instance: Instance) -> None:
    assert await asyncio.to_thread(instance.cdi.writing.wait, 10), "the CDI write never started"


def test_recovery_of_a_new_instance_waits_for_the_old_ones_prepare_and_keeps_its_mig_device(
    shared: Shared,
) -> None:
    old = Instance(shared, POD_OLD)
    claim = shared.add(UID_A, MIG)
    old.cdi.gate = threading.Event()  # the old instance's prepare stops at its CDI write

    async def scenario() -> PrepareResult:
        preparing = asyncio.create_task(old.prepare(claim))
        await wait_until_writing(old)
        # Halfway: PrepareStarted with the MIG device made; the new instance starts now.
        entry = old.checkpoint.get(UID_A)
        assert entry is not None
        assert entry.phase is ClaimPhase.PREPARE_STARTED
        assert entry.owner == old.instance.token
        new = Instance(shared, POD_NEW)
        recovering = asyncio.create_task(new.preparer.recover())
        await asyncio.sleep(0.3)
        assert not recovering.done(), "recovery ran beside a prepare under way"
        assert old.cdi.gate is not None
        old.cdi.gate.set()
        result = await preparing
        await asyncio.wait_for(recovering, 10)
        return result

    result = asyncio.run(scenario())

    assert [d.device_name for d in ok(result)] == [MIG]
    entry = shared.checkpoint().get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_COMPLETED
    assert old.cdi.path_for(UID_A).exists()
    (instances,) = shared.mig_instances().values()
    assert [(gi["profileId"], gi["start"]) for gi in instances] == [(9, 0)]


def test_a_running_instances_interrupted_prepare_is_left_to_it_and_a_dead_ones_rolled_back(
    shared: Shared,
) -> None:
    old = Instance(shared, POD_OLD)
    claim = ClaimRef("default", UID_A, "claim-a")
    # The old instance left a prepare PrepareStarted with its MIG device made (a rollback that
    # failed, which it retries at the claim's next prepare or unprepare).
    partition = old.inventory.by_name(MIG)
    assert isinstance(partition, MigPartition)
    intents = old.dynamic_mig.plan({MIG: partition})
    records = ClaimRecords(old.checkpoint, owner=old.instance.token)
    records.update(UID_A, started(claim, {DYNAMIC_MIG_STATE_KEY: intents_to_state(intents)}))
    made, _ = old.dynamic_mig.create(intents)
    records.update(UID_A, started(claim, {DYNAMIC_MIG_STATE_KEY: intents_to_state(made)}))

    new = Instance(shared, POD_NEW)
    asyncio.run(new.preparer.recover())

    entry = shared.checkpoint().get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.PREPARE_STARTED
    assert len(shared.mig_instances()) == 1, "the running instance's MIG device was destroyed"

    old.die()
    newest = Instance(shared, "00000000-0000-4000-8000-0000000000c3")
    asyncio.run(newest.preparer.recover())

    assert shared.checkpoint().get(UID_A) is None
    assert shared.mig_instances() == {}


def test_an_entry_written_before_instance_tokens_counts_as_a_dead_instances(
    shared: Shared,
) -> None:
    claim = ClaimRef("default", UID_A, "claim-a")
    ClaimRecords(shared.checkpoint()).update(UID_A, started(claim, {}))

    asyncio.run(Instance(shared, POD_NEW).preparer.recover())

    assert shared.checkpoint().get(UID_A) is None


def test_conflicting_claims_prepared_on_both_instances_at_once_never_both_succeed(
    shared: Shared,
) -> None:
    old, new = Instance(shared, POD_OLD), Instance(shared, POD_NEW)
    first = shared.add(UID_A, "gpu-0", name="first")
    second = shared.add(UID_B, "gpu-0", name="second")
    old.cdi.gate = threading.Event()

    async def scenario() -> tuple[PrepareResult, PrepareResult]:
        on_old = asyncio.create_task(old.prepare(first))
        await wait_until_writing(old)
        # The old instance recorded PrepareStarted (no devices yet) and writes the CDI spec.
        on_new = asyncio.create_task(new.prepare(second))
        await asyncio.sleep(0.3)
        assert not on_new.done(), "the device lock did not hold the second prepare"
        assert old.cdi.gate is not None
        old.cdi.gate.set()
        return await on_old, await asyncio.wait_for(on_new, 10)

    won, lost = asyncio.run(scenario())

    assert [d.device_name for d in ok(won)] == ["gpu-0"]
    assert f"already prepared for claim default/first ({UID_A})" in failed(lost)
    assert list(shared.checkpoint().all()) == [UID_A]
    assert not new.cdi.path_for(UID_B).exists()


def test_conflicting_mig_and_whole_gpu_claims_on_both_instances_never_both_succeed(
    shared: Shared,
) -> None:
    old, new = Instance(shared, POD_OLD), Instance(shared, POD_NEW)
    mig = shared.add(UID_A, MIG, name="mig")
    whole = shared.add(UID_B, "gpu-1", name="whole")

    async def scenario() -> list[PrepareResult]:
        return list(await asyncio.gather(old.prepare(mig), new.prepare(whole)))

    results = asyncio.run(scenario())

    assert sum(r.ok for r in results) == 1, results
    (winner,) = shared.checkpoint().all()
    if winner == UID_A:
        assert "cannot be handed out whole" in failed(results[1])
        assert len(shared.mig_instances()) == 1
    else:
        assert "prepared whole" in failed(results[0])
        assert shared.mig_instances() == {}


def test_one_claim_sent_to_both_instances_is_prepared_once(shared: Shared) -> None:
    old, new = Instance(shared, POD_OLD), Instance(shared, POD_NEW)
    claim = shared.add(UID_A, MIG)
    old.cdi.gate = threading.Event()

    async def scenario() -> tuple[PrepareResult, PrepareResult]:
        on_old = asyncio.create_task(old.prepare(claim))
        await wait_until_writing(old)
        # The kubelet gave up on the old instance and asks the new one (newest registered).
        on_new = asyncio.create_task(new.prepare(claim))
        await asyncio.sleep(0.3)
        assert not on_new.done()
        assert old.cdi.gate is not None
        old.cdi.gate.set()
        return await on_old, await asyncio.wait_for(on_new, 10)

    first, second = asyncio.run(scenario())

    assert ok(first) == ok(second)
    assert old.cdi.writes == [UID_A]
    assert new.cdi.writes == []
    assert len(shared.mig_instances()) == 1


def test_a_claim_prepared_by_one_instance_is_unprepared_by_the_other(shared: Shared) -> None:
    old, new = Instance(shared, POD_OLD), Instance(shared, POD_NEW)
    mig, whole = shared.add(UID_A, MIG), shared.add(UID_C, "gpu-2", name="whole")

    async def scenario() -> None:
        ok(await old.prepare(mig))
        ok(await old.prepare(whole))
        await new.preparer.recover()
        old.die()
        assert await new.unprepare(mig) is None
        assert await new.unprepare(whole) is None

    asyncio.run(scenario())

    assert shared.checkpoint().all() == {}
    assert shared.mig_instances() == {}
    assert list(shared.cdi_root.iterdir()) == []


def test_a_running_instances_unfinished_unprepare_is_left_to_it_and_a_dead_ones_finished(
    shared: Shared, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = Instance(shared, POD_OLD), Instance(shared, POD_NEW)
    claim = shared.add(UID_A, MIG)
    assert [d.device_name for d in ok(asyncio.run(old.prepare(claim)))] == [MIG]

    # The kubelet unprepares on the new instance; its unprepare fails after UnprepareStarted.
    def disk_error(claim_uid: str) -> bool:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(new.cdi, "remove", disk_error)
    assert "Input/output error" in (asyncio.run(new.unprepare(claim)) or "")
    monkeypatch.undo()
    entry = shared.checkpoint().get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.UNPREPARE_STARTED
    assert entry.owner == new.instance.token, "UnprepareStarted names the instance unpreparing"

    # A third instance starts while the new one runs: the unprepare is left to the running one.
    asyncio.run(Instance(shared, "00000000-0000-4000-8000-0000000000c3").preparer.recover())

    entry = shared.checkpoint().get(UID_A)
    assert entry is not None
    assert entry.phase is ClaimPhase.UNPREPARE_STARTED
    assert entry.owner == new.instance.token
    assert len(shared.mig_instances()) == 1, "the running instance's MIG device was destroyed"
    assert new.cdi.path_for(UID_A).exists()
    assert (shared.data_dir / "claims" / UID_A).is_dir()

    # The new instance dies with the unprepare unfinished: the next start-up finishes it.
    new.die()
    asyncio.run(Instance(shared, "00000000-0000-4000-8000-0000000000d4").preparer.recover())

    assert shared.checkpoint().get(UID_A) is None
    assert shared.mig_instances() == {}
    assert not new.cdi.path_for(UID_A).exists()
    assert not (shared.data_dir / "claims" / UID_A).exists()


def test_work_behind_a_deadline_reply_holds_the_node_wide_locks_for_the_other_instances_retry(
    shared: Shared,
) -> None:
    old, new = Instance(shared, POD_OLD), Instance(shared, POD_NEW)
    claim = shared.add(UID_A, MIG)
    old.cdi.gate = threading.Event()  # the old instance's CDI write hangs for 1.5 s
    threading.Timer(1.5, old.cdi.gate.set).start()

    async def call_then_retry() -> tuple[float, PrepareResult, PrepareResult]:
        started = time.monotonic()
        first = await ClaimCallHandler(old.preparer, call_timeout_s=0.3).prepare([claim])
        answered_after = time.monotonic() - started
        # The kubelet retries on the new instance while the old one's work goes on behind its
        # reply: the retry waits for it (claim and GPU locks, node-wide) and finds it prepared.
        retry = await ClaimCallHandler(new.preparer, call_timeout_s=10).prepare([claim])
        return answered_after, first[UID_A], retry[UID_A]

    answered_after, first, retry = asyncio.run(call_then_retry())

    assert answered_after < 1.0
    assert "prepare did not finish within 0.3s" in failed(first)
    assert [d.device_name for d in ok(retry)] == [MIG]
    assert (old.cdi.writes, new.cdi.writes) == ([UID_A], []), "prepared twice"
    entry = shared.checkpoint().get(UID_A)
    assert entry is not None
    assert (entry.phase, entry.owner) == (ClaimPhase.PREPARE_COMPLETED, old.instance.token)
    (instances,) = shared.mig_instances().values()
    assert len(instances) == 1
