"""The kubelet plugin under test, in its own process, wired like ``gpu_dra.kubelet_plugin``.

``launch_plugin()`` (client side) starts ``python -m bench.plugin`` in a fresh temporary
directory and yields once its DRA socket accepts connections. The child builds what the
composition root builds - simulated NVML, discovery, ``NodeInventory``, ``Checkpoint``,
``ClaimSpecStore``, ``NodeClaimPreparer``, ``PluginServer`` - with three differences:

* claims come from :class:`bench.claims.InMemoryClaimReader`, not the API server;
* sockets, checkpoint, claim files and CDI specs live under the temporary directory;
* no SlicePublisher runs (``bench/publish_time.py`` measures it on its own).

Logging is configured as in production (INFO, one line per record) but goes to
``<tmp>/plugin.log``, so its cost stays in the numbers. The plugin runs in its own process
because the kubelet does: the client's CPU time is not spent in the plugin's event loop.

``--cprofile FILE`` profiles the event loop thread and every worker thread of the default
executor (where the checkpoint and CDI file I/O runs) and writes one merged pstats file at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import logging
import os
import pstats
import signal
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from bench.claims import DRIVER, InMemoryClaimReader, allocated_claims
from bench.report import Reporter
from gpu_dra.driver.discovery import discover_gpus
from gpu_dra.driver.naming import gpu_device_name
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry, PluginInstance
from gpu_dra.kubelet_plugin.plugin_sockets import PluginServer
from gpu_dra.kubelet_plugin.prepare import NodeClaimPreparer
from gpu_dra.kubelet_plugin.simulated_facts import SIMULATED_FACTS_DIR, SharedFactFiles
from gpu_dra.kubelet_plugin.tiers.assembly import node_tiers

REPO_ROOT = Path(__file__).resolve().parents[1]
NODE_NAME = "bench-node"
DEFAULT_CDI_PARENT: Path | None = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
"""tmpfs, like the /var/run/cdi of a node."""
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(frozen=True)
class CpuTimes:
    """Seconds of CPU: in user space, and in the kernel (file system work, fsync, sockets)."""

    user: float
    system: float

    @property
    def total(self) -> float:
        return self.user + self.system

    def __sub__(self, other: CpuTimes) -> CpuTimes:
        return CpuTimes(self.user - other.user, self.system - other.system)


@dataclass(frozen=True)
class Plugin:
    """A running plugin process, as its client sees it."""

    socket: Path
    devices: tuple[str, ...]
    root: Path
    """Holds the sockets, the checkpoint and claim files (``state/``) and ``plugin.log``."""
    cdi_root: Path
    pid: int

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    @property
    def log_path(self) -> Path:
        return self.root / "plugin.log"

    def layout(self) -> dict[str, str]:
        """The file systems under the state and the CDI specs, for the report."""
        return {"state_fs": file_system(self.root), "cdi_fs": file_system(self.cdi_root)}

    def cpu_seconds(self) -> CpuTimes:
        """CPU time the plugin process (all threads) used so far; Linux only.

        Kernel clock ticks: 10 ms resolution at the usual 100 Hz, so compare long spans only.
        """
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        tick = os.sysconf("SC_CLK_TCK")
        # utime and stime are fields 14 and 15 of the line; fields[0] is field 3.
        return CpuTimes(user=int(fields[11]) / tick, system=int(fields[12]) / tick)


@contextlib.asynccontextmanager
async def launch_plugin(
    *,
    machine: str,
    claims: int,
    cdi_parent: Path | None = DEFAULT_CDI_PARENT,
    cprofile: Path | None = None,
) -> AsyncIterator[Plugin]:
    """Start the plugin process serving ``claims`` pre-built claims on ``machine``; stop it after.

    ``machine`` is a built-in simulated profile name or a profile file path; ``cprofile`` an
    absolute path (the plugin process runs in the repository root).

    File systems: the state (checkpoint, claim files) goes to a new directory in ``$TMPDIR``
    (default /tmp), the CDI specs to one in ``cdi_parent``, or next to the state when it is
    None. The default mirrors a node: ``/var/run/cdi`` is on tmpfs, the plugin's data directory
    under ``/var/lib/kubelet`` on disk.
    """
    with contextlib.ExitStack() as directories:
        # Unix socket paths are limited to 107 bytes: keep the root short.
        root = Path(directories.enter_context(tempfile.TemporaryDirectory(prefix="gpu-dra-bench-")))
        cdi_root = root / "cdi"
        if cdi_parent is not None:
            cdi_root = Path(
                directories.enter_context(
                    tempfile.TemporaryDirectory(prefix="gpu-dra-bench-cdi-", dir=cdi_parent)
                )
            )
        command = [sys.executable, "-m", "bench.plugin", "--root", str(root)]
        command += ["--machine", machine, "--claims", str(claims), "--cdi-root", str(cdi_root)]
        if cprofile is not None:
            command += ["--cprofile", str(cprofile)]
        with (root / "stderr.txt").open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *command, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=stderr
            )
        try:
            assert process.stdout is not None
            try:
                line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
            except TimeoutError:
                line = b""
            if not line:
                errors = (root / "stderr.txt").read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the plugin process did not start:\n{errors}")
            ready = json.loads(line)
            yield Plugin(
                socket=Path(ready["socket"]),
                devices=tuple(ready["devices"]),
                root=root,
                cdi_root=cdi_root,
                pid=process.pid,
            )
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
                except TimeoutError:
                    process.kill()
                    await process.wait()


def file_system(path: Path) -> str:
    """``<type> at <mount point>`` of the mount holding ``path`` (from /proc/self/mounts)."""
    resolved = str(path.resolve())
    fs_type, mount_point = "unknown", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, kind, *_ = line.split()
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(mount_point):  # the last, innermost mount wins
            fs_type, mount_point = kind, point
    return f"{fs_type} at {mount_point}"


class _ProfilingExecutor(ThreadPoolExecutor):
    """A default executor whose work items run under one cProfile profiler per worker thread."""

    def __init__(self) -> None:
        # The size asyncio's own default executor gets.
        super().__init__(max_workers=min(32, (os.cpu_count() or 1) + 4))
        self._local = threading.local()
        self._lock = threading.Lock()
        self.profiles: list[cProfile.Profile] = []

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        return super().submit(self._profiled, fn, *args, **kwargs)

    def _profiled(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
        profile: cProfile.Profile | None = getattr(self._local, "profile", None)
        if profile is None:
            profile = self._local.profile = cProfile.Profile()
            with self._lock:
                self.profiles.append(profile)
        return profile.runcall(fn, *args, **kwargs)


def bench_preparer(
    state_dir: Path, cdi_root: Path, machine: str, claim_count: int
) -> tuple[NodeClaimPreparer, PluginInstance, list[str]]:
    """The preparer as the plugin wires it (node-wide locks included) over simulated ``machine``,
    state in ``state_dir``, CDI specs in ``cdi_root``, serving `bench.claims` claims
    ``0..claim_count-1``; with its plugin instance (close it) and the GPUs' device names."""
    host = SimulatedHost.load(machine, NODE_NAME)
    gpus = discover_gpus(host.nvml, host.pci)
    inventory = NodeInventory(
        tuple(gpus), simulated=True, fact_files=SharedFactFiles(state_dir / SIMULATED_FACTS_DIR)
    )
    devices = [gpu_device_name(gpu.minor) for gpu in inventory.gpus]
    checkpoint = Checkpoint(state_dir)
    checkpoint.load()
    instance = InstanceRegistry(state_dir).register("")  # its node-wide locks, as in production
    records = ClaimRecords(checkpoint, owner=instance.token)
    cdi = ClaimSpecStore(cdi_root, driver_name=DRIVER)
    preparer = NodeClaimPreparer(
        driver_name=DRIVER,
        node_name=NODE_NAME,
        inventory=inventory,
        claims=InMemoryClaimReader(
            allocated_claims(claim_count, node_name=NODE_NAME, device_names=devices)
        ),
        records=records,
        cdi=cdi,
        claims_dir=state_dir / "claims",
        tiers=node_tiers(records, inventory, node_name=NODE_NAME, cdi=cdi, instance=instance),
        instance=instance,
    )
    return preparer, instance, devices


async def _serve(
    root: Path, cdi_root: Path, machine: str, claim_count: int, cprofile: Path | None
) -> None:
    loop = asyncio.get_running_loop()
    executor = None
    main_profile = None
    if cprofile is not None:
        executor = _ProfilingExecutor()
        loop.set_default_executor(executor)
        main_profile = cProfile.Profile()

    preparer, instance, devices = bench_preparer(root / "state", cdi_root, machine, claim_count)
    await preparer.recover()
    server = PluginServer(
        driver_name=DRIVER,
        preparer=preparer,
        plugins_dir=root / "plugins",
        registry_dir=root / "registry",
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    print(json.dumps({"socket": str(server.dra_socket), "devices": devices}), flush=True)
    if main_profile is not None:
        main_profile.enable()
    try:
        await stop.wait()
    finally:
        if main_profile is not None:
            main_profile.disable()
        await server.stop(grace_s=1)
        instance.close()
    if cprofile is not None and main_profile is not None and executor is not None:
        executor.shutdown(wait=True)
        stats = pstats.Stats(main_profile)
        for profile in executor.profiles:
            stats.add(profile)
        stats.dump_stats(cprofile)


def print_profile(path: Path, *, limit: int = 25) -> None:
    """The top of a ``--cprofile`` file, by own time and by cumulative time, on stderr."""
    stats = pstats.Stats(str(path), stream=sys.stderr)
    stats.strip_dirs()
    for order in ("tottime", "cumulative"):
        print(f"\n--- plugin process profile, by {order} ({path}) ---", file=sys.stderr)
        stats.sort_stats(order).print_stats(limit)


def run_plugin_bench(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    bench: str,
    run: Callable[[argparse.Namespace, Reporter], Awaitable[None]],
) -> int:
    """A plugin benchmark's ``main``: adds the options every such benchmark has
    (``--cdi-with-state``, ``--json``, ``--cprofile``) to ``parser``, parses ``argv``, runs
    ``run`` with a `Reporter` and prints the profile when one was taken."""
    parser.add_argument(
        "--cdi-with-state",
        action="store_true",
        help="write CDI specs next to the state in $TMPDIR, not on tmpfs (/dev/shm)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    parser.add_argument(
        "--cprofile",
        type=lambda value: Path(value).absolute(),
        help="profile the plugin process into FILE (slows it down)",
    )
    args = parser.parse_args(argv)
    reporter = Reporter(bench, json_lines=args.json)
    asyncio.run(run(args, reporter))
    if args.cprofile is not None:
        print_profile(args.cprofile)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="directory for all state")
    parser.add_argument("--cdi-root", type=Path, required=True, help="directory for CDI specs")
    parser.add_argument("--machine", required=True, help="simulated profile name or file")
    parser.add_argument("--claims", type=int, required=True, help="claims to pre-build")
    parser.add_argument("--cprofile", type=Path, help="write merged pstats here at exit")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        filename=args.root / "plugin.log",
    )
    asyncio.run(_serve(args.root, args.cdi_root, args.machine, args.claims, args.cprofile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
