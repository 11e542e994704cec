"""`NodeLocks`: flocks in ``<data-dir>/locks`` that exclude two plugin instances as the asyncio
locks exclude the calls of one. Each `NodeLocks` opens its own files, so two of them in one
process exclude each other exactly as two processes do."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin.node_locks import LockTimeoutError, NodeLocks


def test_operations_of_two_instances_run_together(tmp_path: Path) -> None:
    first, second = NodeLocks(tmp_path), NodeLocks(tmp_path)

    async def both() -> None:
        async with first.operation(), second.operation():
            pass

    async def scenario() -> None:
        await asyncio.wait_for(both(), 1)

    asyncio.run(scenario())


def test_recovery_waits_for_operations_in_flight_and_new_ones_wait_for_it(
    tmp_path: Path,
) -> None:
    serving, starting = NodeLocks(tmp_path), NodeLocks(tmp_path)
    order: list[str] = []

    async def scenario() -> None:
        in_flight_done = asyncio.Event()

        async def in_flight() -> None:
            async with serving.operation():
                order.append("operation started")
                await in_flight_done.wait()
                order.append("operation done")

        async def recovery() -> None:
            async with starting.exclusive():
                order.append("recovery")
                await asyncio.sleep(0.1)
                order.append("recovery done")

        async def late_operation() -> None:
            async with serving.operation():
                order.append("late operation")

        first = asyncio.create_task(in_flight())
        await asyncio.sleep(0.05)
        recovering = asyncio.create_task(recovery())
        await asyncio.sleep(0.05)  # recovery now waits, holding the gate
        late = asyncio.create_task(late_operation())
        await asyncio.sleep(0.05)
        assert order == ["operation started"]
        in_flight_done.set()
        await asyncio.gather(first, recovering, late)

    asyncio.run(scenario())
    assert order == [
        "operation started",
        "operation done",
        "recovery",
        "recovery done",
        "late operation",
    ]


def test_recovery_that_cannot_get_the_node_gives_up_after_its_timeout(tmp_path: Path) -> None:
    serving, starting = NodeLocks(tmp_path), NodeLocks(tmp_path)

    async def scenario() -> None:
        async with serving.operation():
            with pytest.raises(LockTimeoutError, match=r"locks/node\.lock"):
                async with starting.exclusive(timeout_s=0.2):
                    pass
        # The gate is free again: new operations are not blocked by the failed attempt.
        async with serving.operation():
            pass

    asyncio.run(scenario())


def test_a_claim_is_locked_node_wide_while_one_process_never_waits_for_its_own_claims(
    tmp_path: Path,
) -> None:
    first, second = NodeLocks(tmp_path), NodeLocks(tmp_path)
    uid = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
    order: list[str] = []

    async def holder(locks: NodeLocks, name: str, claim: str = uid) -> None:
        async with locks.claim(claim):
            order.append(f"{name} in")
            await asyncio.sleep(0.05)
            order.append(f"{name} out")

    async def scenario() -> None:
        await asyncio.gather(holder(first, "a"), holder(second, "b"))
        # Claims of one stripe in one process: the stripe is held once for both.
        order.clear()
        twin = next(u for u in (f"{i:08x}-0000-4000-8000-000000000000" for i in range(10**5))
                    if stripe(u) == stripe(uid))  # fmt: skip
        await asyncio.wait_for(asyncio.gather(holder(first, "c"), holder(first, "d", twin)), 1)
        assert order[:2] == ["c in", "d in"]

    asyncio.run(scenario())
    # Never two processes at once, whichever got it first.
    assert first.path(f"claim-{stripe(uid):02x}").exists()


def stripe(uid: str) -> int:
    return int.from_bytes(hashlib.sha256(uid.encode()).digest()[:4]) % NodeLocks.CLAIM_STRIPES


def test_two_processes_holding_one_claim_stripe_take_turns(tmp_path: Path) -> None:
    first, second = NodeLocks(tmp_path), NodeLocks(tmp_path)
    uid = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
    order: list[str] = []

    async def holder(locks: NodeLocks, name: str) -> None:
        async with locks.claim(uid):
            order.append(f"{name} in")
            await asyncio.sleep(0.05)
            order.append(f"{name} out")

    async def scenario() -> None:
        await asyncio.wait_for(asyncio.gather(holder(first, "a"), holder(second, "b")), 5)

    asyncio.run(scenario())

    assert [entry.split()[1] for entry in order] == ["in", "out", "in", "out"]


def test_conflicting_device_sets_exclude_each_other_and_disjoint_ones_do_not(
    tmp_path: Path,
) -> None:
    first, second = NodeLocks(tmp_path), NodeLocks(tmp_path)

    async def take(locks: NodeLocks, names: list[str]) -> None:
        async with locks.devices(names):
            pass

    async def scenario() -> None:
        async with first.devices(["gpu-1", "gpu-0"]):
            await asyncio.wait_for(take(second, ["gpu-2"]), 1)
            waiting = asyncio.create_task(take(second, ["gpu-1"]))
            await asyncio.sleep(0.1)
            assert not waiting.done()
        await asyncio.wait_for(waiting, 1)

    asyncio.run(scenario())


def test_a_cancelled_wait_holds_nothing(tmp_path: Path) -> None:
    first, second = NodeLocks(tmp_path), NodeLocks(tmp_path)

    async def take() -> None:
        async with second.devices(["gpu-0"]):
            pass

    async def scenario() -> None:
        async with first.devices(["gpu-0"]):
            waiting = asyncio.create_task(take())
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        async with first.devices(["gpu-0"]):
            pass

    asyncio.run(scenario())


def test_a_blocking_lock_held_by_another_process_times_out_as_an_os_error(
    tmp_path: Path,
) -> None:
    locks = NodeLocks(tmp_path, blocking_timeout_s=0.2)
    path = locks.path("mig-GPU-1")
    path.parent.mkdir(parents=True)
    with subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    ) as holder:  # fmt: skip
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "held"
            with pytest.raises(LockTimeoutError) as timed_out, locks.blocking("mig-GPU-1"):
                pass
            assert isinstance(timed_out.value, OSError)
            assert str(path) in str(timed_out.value)
        finally:
            holder.kill()
    # The holder died: its lock went with it.
    with locks.blocking("mig-GPU-1"):
        pass


def test_blocking_locks_of_two_instances_exclude_each_other_across_threads(
    tmp_path: Path,
) -> None:
    first, second = NodeLocks(tmp_path), NodeLocks(tmp_path)
    inside = 0
    most = 0
    guard = threading.Lock()

    def work(locks: NodeLocks) -> None:
        nonlocal inside, most
        for _ in range(20):
            with locks.blocking("mps-shared-0"):
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.001)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work, args=(locks,)) for locks in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most == 1
