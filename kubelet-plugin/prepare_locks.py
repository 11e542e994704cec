"""The locks `prepare.NodeClaimPreparer` takes around a claim's prepare or unprepare.

In-process `asyncio` locks, one per claim UID and one per GPU (each lives while someone holds
it), and with a `PluginInstance` the node-wide ones of `node_locks` beside them: the node lock
(shared by every call, exclusive for recovery), the claim's and the GPUs'. A MIG device's lock
is its parent GPU's; GPUs are locked in name order. Order: node, claim, GPUs. See
docs/architecture.md, "Prepare and unprepare" and "Two instances on one node".
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Sequence

from gpu_dra.driver.naming import (
    InvalidNameError,
    MigDeviceName,
    gpu_device_name,
    parse_device_name,
)
from gpu_dra.kubelet_plugin.checkpoint import CheckpointEntry
from gpu_dra.kubelet_plugin.plugin_instances import PluginInstance


class PrepareLocks:
    """The locks of one `NodeClaimPreparer`; node-wide too when ``instance`` is given, whose
    exclusive node lock waits up to ``recovery_wait_s`` for the other instances' calls."""

    def __init__(self, instance: PluginInstance | None, recovery_wait_s: float) -> None:
        self._instance = instance
        self._recovery_wait_s = recovery_wait_s
        # Locks live while someone holds them: no growth with the number of claims ever seen.
        self._device_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )
        self._claim_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )

    @contextlib.asynccontextmanager
    async def operation(self) -> AsyncIterator[None]:
        """One claim's prepare or unprepare: the node lock, shared (recovery takes it
        exclusive)."""
        if self._instance is None:
            yield
            return
        async with self._instance.locks.operation():
            yield

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        if self._instance is None:
            yield
            return
        async with self._instance.locks.exclusive(self._recovery_wait_s):
            yield

    @contextlib.asynccontextmanager
    async def claim(self, uid: str) -> AsyncIterator[None]:
        lock = self._claim_locks.get(uid)
        if lock is None:
            lock = self._claim_locks[uid] = asyncio.Lock()
        async with lock:
            if self._instance is None:
                yield
                return
            async with self._instance.locks.claim(uid):
                yield

    @contextlib.asynccontextmanager
    async def devices(self, devices: Sequence[str]) -> AsyncIterator[None]:
        """The locks of the GPUs ``devices`` are on (a MIG device's is its parent's: a whole GPU
        and a MIG device of it are checked one after the other), in name order; node-wide
        too with an instance."""
        names = sorted({_gpu_of(device) for device in devices})
        async with contextlib.AsyncExitStack() as stack:
            held = []  # strong references while held
            for name in names:
                lock = self._device_locks.get(name)
                if lock is None:
                    lock = self._device_locks[name] = asyncio.Lock()
                held.append(lock)
                await stack.enter_async_context(lock)
            if self._instance is not None:
                await stack.enter_async_context(self._instance.locks.devices(names))
            yield


def lock_names(entry: CheckpointEntry) -> list[str]:
    """The devices whose locks an undo of ``entry`` takes: those it records (a
    `PrepareStarted` entry of schema 1 records none; recovery, under the exclusive node
    lock, rolls those back before this instance serves)."""
    return sorted({d.device_name for d in entry.devices})


def _gpu_of(device: str) -> str:
    """``gpu-<minor>`` of a GPU or MIG device name (any other name as it is)."""
    try:
        name = parse_device_name(device)
    except InvalidNameError:
        return device
    return gpu_device_name(name.parent_minor) if isinstance(name, MigDeviceName) else device
