"""The plugin process the harness kills: forked from the harness, it builds the plugin's
preparer as ``__main__`` does (the start-up helpers of `startup`, the real checkpoint, CDI store,
node-wide locks, simulated NVML with its MIG state file, the recorded time slicer, MPS daemons
of the test double), runs start-up recovery, then serves prepare and unprepare calls that come
as JSON lines on a pipe, concurrently, as the kubelet's gRPC calls would. The armed crash point
(`crash_points.arm`) SIGKILLs it at the n-th time that point is reached.

Left out of the process (they hold no node state): gRPC, the API server (claims come with the
calls), slice publishing, health. Forking keeps a restart in milliseconds, so hundreds of
cycles run in a minute.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.mps import MpsDaemonManager, PlainDirectoryShm
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from gpu_dra.kubelet_plugin.startup import discovery, node_guard, userspace
from tests.crash_harness.nodes import NodeKind
from tests.doubles.mps_helpers import DOUBLE_BINARY, double_env
from tests.fakes.claim_reader import InMemoryClaimReader
from tests.kubelet_plugin.nodes import new_preparer


class PluginDiedError(Exception):
    """The plugin process ended (killed at its crash point, or a bug) before it answered."""


class PluginProcess:
    """One forked plugin process of a node; `point` armed for its `nth` hit (None: no point)."""

    def __init__(
        self, kind: NodeKind, root: Path, point: str | None, nth: int, log_path: Path
    ) -> None:
        self.point = point
        command_read, self._command_write = os.pipe()
        self._reply_read, reply_write = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12 warns of a fork beside threads: the child starts its own and takes
            # no lock another thread of the harness may hold (logging's are reset at fork).
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the plugin
            os.close(self._command_write)
            os.close(self._reply_read)
            code = 70
            try:
                code = _plugin_main(kind, root, point, nth, command_read, reply_write, log_path)
            except BaseException:
                with log_path.open("a") as log:
                    log.write(traceback.format_exc())
            finally:
                os._exit(code)
        os.close(command_read)
        os.close(reply_write)
        self.pid = pid
        self._buffer = b""
        self.status: int | None = None

    def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        try:
            while data:
                data = data[os.write(self._command_write, data) :]
        except BrokenPipeError:
            pass  # it died: the caller sees that in `receive`

    def receive(self, timeout_s: float) -> dict[str, Any]:
        """The next reply; `PluginDiedError` when the process ended, `TimeoutError` when
        none came."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the plugin (pid {self.pid}) answered nothing in {timeout_s}s")
            ready, _, _ = select.select([self._reply_read], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._reply_read, 65536)
            if not chunk:
                self.wait()
                raise PluginDiedError(f"exit status {self.status}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def killed_at_point(self) -> bool:
        """Whether it died of SIGKILL, which only its crash point sends itself."""
        return self.status == -signal.SIGKILL

    def wait(self) -> int:
        if self.status is None:
            _, raw = os.waitpid(self.pid, 0)
            self.status = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
            os.close(self._command_write)
            os.close(self._reply_read)
        return self.status

    def kill(self) -> None:
        """SIGKILL from outside (an idle plugin restarted), and reap it."""
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait()


def _plugin_main(
    kind: NodeKind,
    root: Path,
    point: str | None,
    nth: int,
    command_read: int,
    reply_write: int,
    log_path: Path,
) -> int:
    logger = logging.getLogger()
    for handler in list(logger.handlers):  # the harness's (pytest's) handlers stay there
        logger.removeHandler(handler)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {os.getpid()} %(levelname)s %(name)s "
                                           "%(message)s"))  # fmt: skip
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    logging.getLogger(__name__).info("plugin starts; crash point %s (hit %d)", point, nth)
    asyncio.run(_serve(kind, root, point, nth, command_read, reply_write))
    return 0


def _arm(point: str | None, nth: int, reply: Callable[[dict[str, Any]], None]) -> None:
    """Arm ``point`` for its ``nth`` hit; every point reached the first time is reported
    (``{"reached": name}``), so that the harness learns which points a node's calls reach."""
    lock = threading.Lock()
    hits = [0]
    seen: set[str] = set()

    def crash(reached: str) -> None:
        with lock:
            if reached not in seen:
                seen.add(reached)
                reply({"reached": reached})
            if reached != point:
                return
            hits[0] += 1
            if hits[0] == nth:
                crash_points.kill_self(reached)

    crash_points.arm(crash)


async def _serve(
    kind: NodeKind, root: Path, point: str | None, nth: int, command_read: int, reply_write: int
) -> None:
    lock = threading.Lock()

    def reply(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        with lock:  # from the event loop and from worker threads (`_arm`)
            while data:
                data = data[os.write(reply_write, data) :]

    _arm(point, nth, reply)  # before the instance registers, as `__main__` arms it
    settings = kind.settings(root)
    nvml, pci, simulated = discovery.node_nvml_and_state(settings)
    devices = await asyncio.to_thread(discovery.discover, settings, nvml, pci)
    inventory = discovery.node_inventory(settings, devices)
    instance = node_guard.register_instance(settings)
    checkpoint = Checkpoint(settings.state_dir)
    checkpoint.load()
    claims = InMemoryClaimReader()
    preparer = new_preparer(
        driver_name=settings.driver_name,
        node_name=settings.node_name,
        inventory=inventory,
        claims=claims,
        checkpoint=checkpoint,
        cdi=ClaimSpecStore(settings.cdi_root, driver_name=settings.driver_name),
        claims_dir=settings.state_dir / "claims",
        mps=MpsDaemonManager(
            settings.state_dir,
            binary=DOUBLE_BINARY,
            base_env=double_env(),
            shm=PlainDirectoryShm(),
        ),
        time_slicer=userspace.time_slicer(settings, devices),
        mps_share_max_percent=settings.mps_share_max_percent,
        dynamic_mig=discovery.dynamic_mig(settings, nvml, inventory, instance.locks, simulated),
        instance=instance,
    )
    await preparer.recover()
    await asyncio.to_thread(instance.mark_ready)
    reply({"ready": True})

    async def call(message: dict[str, Any]) -> None:
        if message["op"] == "prepare":
            claims.add(*message["claims"])
            refs = [_ref(claim["metadata"]) for claim in message["claims"]]
            prepared = await preparer.prepare(refs)
            results = {uid: result.error for uid, result in prepared.items()}
        else:
            refs = [_ref(metadata) for metadata in message["claims"]]
            results = dict(await preparer.unprepare(refs))
        reply({"id": message["id"], "results": results})

    loop = asyncio.get_running_loop()
    stream = asyncio.StreamReader()
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(command_read, "rb")
    )
    calls: set[asyncio.Task[None]] = set()
    while line := await stream.readline():
        task = asyncio.create_task(call(json.loads(line)))
        calls.add(task)
        task.add_done_callback(calls.discard)
    await asyncio.gather(*calls)


def _ref(metadata: dict[str, Any]) -> ClaimRef:
    return ClaimRef(metadata["namespace"], metadata["uid"], metadata["name"])
