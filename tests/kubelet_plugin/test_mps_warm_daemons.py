"""Warm shared MPS daemons (``--mps-share-daemon-warm``, docs/mps.md "Warm daemons"): the daemon
of every GPU (and static MIG device) offered as shares is started ahead of its first share,
adopted across plugin restarts (not swept as a leftover; with the pod runner too), started anew
after the last share left - at once, while the leaving claim's record is still there - stopped
when idle or off, and only by the instance that repairs; a record it cannot keep is logged with
why. The real preparer and `MpsDaemonManager` run the ``nvidia-cuda-mps-control`` test double on
the simulated hgx-h100 node (gpu-0 and gpu-1 offered; hgx-h100-mig's 1g.10gb slices for the MIG
case), compute modes through `NvmlComputeMode` on the simulated NVML. Every test fails if a
daemon process is left running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpu_dra.driver.nvml.simulated import SimulatedHost, SimulatedNvml
from gpu_dra.kubelet_plugin.mps import (
    DaemonHandle,
    MpsDaemonManager,
    NvmlComputeMode,
    PlainDirectoryShm,
    PodRunner,
    shared_daemon_id,
)
from gpu_dra.kubelet_plugin.mps.ids import is_shared_daemon
from gpu_dra.kubelet_plugin.mps.supervisor import DaemonSupervisor
from gpu_dra.kubelet_plugin.mps.warm_daemons import (
    IN_USE,
    KEPT,
    NONE,
    STARTED,
    STOPPED,
    WarmDaemons,
)
from gpu_dra.kubelet_plugin.mps.warm_policy import ALWAYS, OFF, WarmPolicy, WarmPolicyError
from tests.doubles import nvidia_cuda_mps_control as double
from tests.doubles.mps_helpers import DOUBLE_BINARY, double_env
from tests.fakes.pod_api import InMemoryPodApi
from tests.kubelet_plugin.nodes import (
    NODE,
    UID_A,
    UID_B,
    MigSharesNode,
    SharesNode,
    ok,
    wait_dead,
)

EXCLUSIVE = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
DEFAULT = pynvml.NVML_COMPUTEMODE_DEFAULT


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class WarmNode(SharesNode):
    """`SharesNode` whose manager sets compute modes on the simulated NVML (shared daemons
    only, the default ``--mps-exclusive-compute-mode=shares``), with a warm policy."""

    def __init__(
        self, root: Path, mps_root: Path, policy: WarmPolicy, pods: InMemoryPodApi | None = None
    ) -> None:
        """``pods``: run the daemons as pods over this API (the production runner), not as
        host processes."""
        self.policy = policy
        self.pods = pods
        self.nvml: SimulatedNvml = SimulatedHost.load("hgx-h100", NODE).nvml
        super().__init__(root, mps_root)

    def preparer_options(self) -> dict[str, Any]:
        options = super().preparer_options()
        runner = None
        if self.pods is not None:
            runner = PodRunner(self.pods, namespace="gpu-dra", node_name=NODE, image="mps:1")
        self.mps = MpsDaemonManager(
            self.mps_root,
            binary=DOUBLE_BINARY,
            base_env=double_env(),
            runner=runner,
            shm=PlainDirectoryShm(),
            compute_mode=NvmlComputeMode(self.nvml),
            exclusive=is_shared_daemon,
            start_timeout_s=15.0,
            remove_timeout_s=15.0,
        )
        return {**options, "mps": self.mps, "mps_share_warm": self.policy}

    def warmer(
        self,
        *,
        repair: bool = True,
        clock: Clock | None = None,
        policy: WarmPolicy | None = None,
        interval_s: float = 10,
    ) -> WarmDaemons:
        shared = self.preparer.shared_daemons
        assert shared is not None
        return WarmDaemons(
            shared,
            self.mps,
            self.inventory.mps_shares,
            policy=policy or self.policy,
            interval_s=interval_s,
            repair=lambda: repair,
            clock=clock or Clock(),
        )

    def warm(self, device: str = "gpu-0") -> DaemonHandle | None:
        return self.mps.recorded(shared_daemon_id(self.uuid_of(device)))

    def mode(self, device: str) -> int:
        self.nvml.init()
        try:
            handle = self.nvml.device_get_handle_by_uuid(self.uuid_of(device))
            return int(self.nvml.device_get_compute_mode(handle))
        finally:
            self.nvml.shutdown()


@pytest.fixture
def node(tmp_path: Path, mps_root: Path) -> WarmNode:
    return WarmNode(tmp_path, mps_root, ALWAYS)


@pytest.fixture
def pods() -> Iterator[InMemoryPodApi]:
    api = InMemoryPodApi(
        {"nvidia-cuda-mps-control": DOUBLE_BINARY}, extra_env={"PYTHON": sys.executable}
    )
    yield api
    api.close()


def stop_warm(node: WarmNode) -> None:
    """Stop the warm daemons of gpu-0 and gpu-1 (the test's end)."""
    for device in ("gpu-0", "gpu-1"):
        warm = node.warm(device)
        if warm is not None:
            node.mps.stop(warm)


def test_warm_daemons_start_at_plugin_start_with_the_first_shares_settings(
    node: WarmNode,
) -> None:
    node.recover()
    uuid0, uuid1 = node.uuid_of("gpu-0"), node.uuid_of("gpu-1")

    assert node.warmer().check() == {uuid0: STARTED, uuid1: STARTED}

    warm0, warm1 = node.warm("gpu-0"), node.warm("gpu-1")
    assert warm0 is not None
    assert warm1 is not None
    assert sorted(node.running()) == sorted([warm0.pid, warm1.pid])
    # The settings a daemon the first share starts gets: the largest share allowed.
    shared = node.preparer.shared_daemons
    assert shared is not None
    assert warm0.settings == shared.settings(node.inventory.mps_shares[0])
    assert double.read_state(warm0.paths.pipe)["defaults"] == {
        "activeThreadPercentage": 100.0,
        "pinnedMemLimits": {uuid0: "81559M"},
    }
    # No share yet: the GPUs keep their compute mode (a whole-GPU claim may still get them).
    assert node.mode("gpu-0") == DEFAULT
    assert node.mode("gpu-1") == DEFAULT

    share = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(share)[UID_A])

    [handle] = node.handles(UID_A)
    assert handle.pid == warm0.pid  # joined the warm daemon, started nothing
    assert sorted(node.running()) == sorted([warm0.pid, warm1.pid])
    assert node.mode("gpu-0") == EXCLUSIVE  # the first share set it, as a cold start does
    assert node.mode("gpu-1") == DEFAULT
    assert node.warmer().check() == {uuid0: IN_USE, uuid1: KEPT}

    node.unprepare(share)
    assert wait_dead(warm0.pid)  # the last share's daemon went with it
    node.mps.stop(warm1)


def test_the_last_share_leaving_starts_a_fresh_warm_daemon(node: WarmNode) -> None:
    node.recover()
    warmer = node.warmer()
    warmer.check()
    warm = node.warm()
    assert warm is not None
    share = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(share)[UID_A])
    assert node.mode("gpu-0") == EXCLUSIVE

    assert node.unprepare(share) == {UID_A: None}
    assert wait_dead(warm.pid)
    assert node.warm() is None  # stopped with what a tenant could have changed

    uuid0 = node.uuid_of("gpu-0")
    assert warmer.check()[uuid0] == STARTED
    fresh = node.warm()
    assert fresh is not None
    assert fresh.pid != warm.pid
    assert fresh.pid in node.running()
    assert node.mode("gpu-0") == DEFAULT  # reset with the old one, not set by the fresh one
    for handle in (fresh, node.warm("gpu-1")):
        assert handle is not None
        node.mps.stop(handle)


def test_a_warm_daemon_without_shares_is_adopted_after_a_restart_not_swept(
    node: WarmNode,
) -> None:
    node.recover()
    node.warmer().check()
    warm = node.warm()
    assert warm is not None

    node.restart()  # a new plugin process over the same files
    node.recover()

    assert warm.pid in node.running()  # the start-up sweep kept it
    warmer = node.warmer()
    assert warmer.check()[node.uuid_of("gpu-0")] == KEPT
    assert node.warm() == warm
    share = node.add_share(UID_B, "20Gi", "20")
    ok(node.prepare(share)[UID_B])
    [handle] = node.handles(UID_B)
    assert handle.pid == warm.pid
    node.unprepare(share)
    node.mps.stop(node.warm("gpu-1"))  # type: ignore[arg-type]


def test_a_dead_warm_daemon_is_restarted_in_place_by_the_next_pass(node: WarmNode) -> None:
    node.recover()
    warmer = node.warmer()
    warmer.check()
    warm = node.warm()
    assert warm is not None
    pipe_inode = warm.paths.pipe.stat().st_ino
    os.kill(warm.pid, signal.SIGKILL)
    assert wait_dead(warm.pid)

    assert warmer.check()[node.uuid_of("gpu-0")] == KEPT
    again = node.warm()
    assert again is not None
    assert again.pid != warm.pid
    assert again.pid in node.running()
    assert again.paths.pipe.stat().st_ino == pipe_inode  # in place
    for device in ("gpu-0", "gpu-1"):
        node.mps.stop(node.warm(device))  # type: ignore[arg-type]


def test_a_share_joining_a_dead_warm_daemon_restarts_it(node: WarmNode) -> None:
    node.recover()
    node.warmer().check()
    warm = node.warm()
    assert warm is not None
    os.kill(warm.pid, signal.SIGKILL)
    assert wait_dead(warm.pid)

    share = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(share)[UID_A])

    [handle] = node.handles(UID_A)
    assert handle.pid != warm.pid
    assert handle.pid in node.running()
    node.unprepare(share)
    node.mps.stop(node.warm("gpu-1"))  # type: ignore[arg-type]


def test_off_starts_nothing_and_the_sweep_removes_a_warm_daemon_left_before(
    tmp_path: Path, mps_root: Path
) -> None:
    warm_node = WarmNode(tmp_path, mps_root, ALWAYS)
    warm_node.recover()
    warm_node.warmer().check()
    assert len(warm_node.running()) == 2

    warm_node.policy = OFF
    warm_node.restart()
    warm_node.recover()  # with warm off, unrecorded shared daemons are leftovers

    assert warm_node.running() == []
    assert warm_node.daemon_dirs() == []
    uuid0, uuid1 = warm_node.uuid_of("gpu-0"), warm_node.uuid_of("gpu-1")
    assert warm_node.warmer().check() == {uuid0: NONE, uuid1: NONE}
    assert warm_node.running() == []
    # Today's lifecycle: the first share starts the daemon, the last stops it.
    share = warm_node.add_share(UID_A, "10Gi", "10")
    ok(warm_node.prepare(share)[UID_A])
    [handle] = warm_node.handles(UID_A)
    assert warm_node.running() == [handle.pid]
    warm_node.unprepare(share)
    assert wait_dead(handle.pid)
    assert warm_node.warmer().check() == {uuid0: NONE, uuid1: NONE}
    assert warm_node.running() == []


def test_off_stops_a_warm_daemon_another_instance_left(node: WarmNode) -> None:
    node.recover()
    node.warmer().check()
    assert len(node.running()) == 2

    uuid0, uuid1 = node.uuid_of("gpu-0"), node.uuid_of("gpu-1")
    assert node.warmer(policy=OFF).check() == {uuid0: STOPPED, uuid1: STOPPED}
    assert node.running() == []
    assert node.daemon_dirs() == []


def test_idle_stops_a_warm_daemon_after_its_idle_time_and_warms_after_a_share(
    tmp_path: Path, mps_root: Path
) -> None:
    node = WarmNode(tmp_path, mps_root, WarmPolicy.parse("idle:60s"))
    node.recover()
    clock = Clock()
    warmer = node.warmer(clock=clock)
    uuid0, uuid1 = node.uuid_of("gpu-0"), node.uuid_of("gpu-1")

    assert warmer.check() == {uuid0: STARTED, uuid1: STARTED}
    clock.now += 30
    assert warmer.check() == {uuid0: KEPT, uuid1: KEPT}
    clock.now += 31
    assert warmer.check() == {uuid0: STOPPED, uuid1: STOPPED}
    assert node.running() == []
    clock.now += 100
    assert warmer.check() == {uuid0: NONE, uuid1: NONE}

    share = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(share)[UID_A])  # started cold
    assert warmer.check() == {uuid0: IN_USE, uuid1: NONE}
    node.unprepare(share)  # the idle time of gpu-0's daemon starts now
    assert warmer.check() == {uuid0: STARTED, uuid1: NONE}
    clock.now += 61
    assert warmer.check() == {uuid0: STOPPED, uuid1: NONE}
    assert node.running() == []


def test_only_the_instance_that_repairs_warms(node: WarmNode) -> None:
    node.recover()
    watching = node.warmer(repair=False)

    assert watching.check() == {}
    assert node.running() == []

    node.warmer(repair=True).check()
    assert len(node.running()) == 2
    node.mps.stop(node.warm("gpu-1"))  # type: ignore[arg-type]
    warm = node.warm("gpu-0")
    assert warm is not None
    os.kill(warm.pid, signal.SIGKILL)
    assert wait_dead(warm.pid)
    assert watching.check() == {}  # nor does it repair or stop
    assert node.running() == []
    assert node.warm("gpu-0") == warm
    node.mps.stop(warm)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("always", ALWAYS),
        ("off", OFF),
        (" Always ", ALWAYS),
        ("idle:10m", WarmPolicy(warm=True, idle_s=600.0)),
        ("idle:90s", WarmPolicy(warm=True, idle_s=90.0)),
        ("idle:1h", WarmPolicy(warm=True, idle_s=3600.0)),
        ("idle:1.5s", WarmPolicy(warm=True, idle_s=1.5)),
        ("idle:500ms", WarmPolicy(warm=True, idle_s=0.5)),
    ],
)
def test_warm_policy_parses(text: str, expected: WarmPolicy) -> None:
    assert WarmPolicy.parse(text) == expected


@pytest.mark.parametrize("text", ["", "on", "idle", "idle:", "idle:10", "idle:0s", "idle:-1m"])
def test_warm_policy_refuses(text: str) -> None:
    with pytest.raises(WarmPolicyError) as raised:
        WarmPolicy.parse(text)
    assert "always, idle:<duration> or off" in str(raised.value) or "idle time" in str(raised.value)


def test_a_gpu_offered_as_shares_but_held_whole_keeps_its_compute_mode(node: WarmNode) -> None:
    node.recover()
    warmer = node.warmer()
    warmer.check()
    warm = node.warm()
    assert warm is not None

    # All of gpu-0 without a share's config: allocated whole before share-only, exclusive.
    whole = node.add_gpus(UID_B, "whole", "gpu-0")
    ok(node.prepare(whole)[UID_B])

    # Its processes may open the GPU as they like; the idle warm daemon holds no context.
    assert node.mode("gpu-0") == DEFAULT
    assert warmer.check()[node.uuid_of("gpu-0")] == KEPT
    assert node.warm() == warm
    assert node.unprepare(whole) == {UID_B: None}
    assert warm.pid in node.running()
    for device in ("gpu-0", "gpu-1"):
        node.mps.stop(node.warm(device))  # type: ignore[arg-type]


# -- the last share leaving: the fresh warm daemon comes at once (e2e run of 2026-11-26) ----


def test_the_pass_right_after_the_last_release_starts_the_fresh_daemon_at_once(
    node: WarmNode,
) -> None:
    node.recover()
    warmer = node.warmer()
    warmer.check()
    warm = node.warm()
    assert warm is not None
    share = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(share)[UID_A])
    shared = node.preparer.shared_daemons
    assert shared is not None
    # The pass the last release wakes runs at once, in another thread, while the unprepare
    # goes on: here, before it goes on at all - the claim's record is still in the checkpoint.
    passes: list[tuple[list[str], dict[str, str]]] = []
    shared.add_idle_listener(
        lambda daemon_id: passes.append((node.users(daemon_id), warmer.check()))
    )

    assert node.unprepare(share) == {UID_A: None}

    uuid0 = node.uuid_of("gpu-0")
    [(recorded, result)] = passes
    assert recorded == [UID_A]  # the leaving claim's record was still there ...
    assert result[uuid0] == STARTED  # ... and still the fresh daemon started then
    fresh = node.warm()
    assert fresh is not None
    assert fresh.pid != warm.pid
    assert fresh.pid in node.running()
    assert wait_dead(warm.pid)
    assert warmer.check()[uuid0] == KEPT  # the record gone: the same daemon, kept
    assert node.warm() == fresh
    stop_warm(node)


def test_the_warmer_loop_starts_the_fresh_daemon_without_waiting_its_interval(
    node: WarmNode,
) -> None:
    node.recover()
    warmer = node.warmer(interval_s=120)  # a pass after the interval would come far too late
    loop = asyncio.new_event_loop()
    task = loop.create_task(warmer.run())

    def serve() -> None:
        loop.run_until_complete(asyncio.wait([task]))
        loop.run_until_complete(loop.shutdown_default_executor())  # a pass under way ends

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        deadline = time.monotonic() + 15
        while not warmer.first_pass.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        warm = node.warm()
        assert warm is not None
        share = node.add_share(UID_A, "10Gi", "10")
        ok(node.prepare(share)[UID_A])
        assert node.unprepare(share) == {UID_A: None}

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            fresh = node.warm()
            if fresh is not None and fresh.pid != warm.pid:
                break
            time.sleep(0.02)
        else:
            pytest.fail("no fresh warm daemon 10 s after the last share left")
        assert fresh.pid in node.running()
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
        loop.close()
    stop_warm(node)


def test_a_retried_release_leaves_the_fresh_warm_daemon_running(node: WarmNode) -> None:
    node.recover()
    warmer = node.warmer()
    warmer.check()
    share = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(share)[UID_A])
    [handle] = node.handles(UID_A)
    shared = node.preparer.shared_daemons
    assert shared is not None

    shared.release(UID_A, handle)  # the unprepare fails after this; the kubelet retries it
    assert warmer.check()[node.uuid_of("gpu-0")] == STARTED
    fresh = node.warm()
    assert fresh is not None
    shared.release(UID_A, handle)  # the retry: the daemon it used is gone already
    assert node.unprepare(share) == {UID_A: None}

    assert node.warm() == fresh
    assert fresh.pid in node.running()
    stop_warm(node)


def test_a_share_joining_before_the_leaving_record_is_gone_sets_the_compute_mode(
    node: WarmNode,
) -> None:
    node.recover()
    warmer = node.warmer()
    warmer.check()
    first = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(first)[UID_A])
    [handle] = node.handles(UID_A)
    shared = node.preparer.shared_daemons
    assert shared is not None
    shared.release(UID_A, handle)  # its record stays until its unprepare ends
    assert warmer.check()[node.uuid_of("gpu-0")] == STARTED
    assert node.mode("gpu-0") == DEFAULT
    fresh = node.warm()
    assert fresh is not None

    second = node.add_share(UID_B, "20Gi", "20")
    ok(node.prepare(second)[UID_B])

    # Joined as the warm daemon it is (not as the leaving claim's), so the share set the mode.
    [joined] = node.handles(UID_B)
    assert joined.pid == fresh.pid
    assert node.mode("gpu-0") == EXCLUSIVE
    assert node.unprepare(first) == {UID_A: None}
    assert fresh.pid in node.running()  # the first claim's unprepare left it to the second
    assert node.unprepare(second) == {UID_B: None}
    assert wait_dead(fresh.pid)
    assert node.mode("gpu-0") == DEFAULT
    stop_warm(node)


# -- adoption across plugin restarts, and never a silent start anew -----------------------


def test_a_warm_daemon_pod_is_adopted_after_a_restart_and_joined_by_the_first_share(
    tmp_path: Path, mps_root: Path, pods: InMemoryPodApi, caplog: pytest.LogCaptureFixture
) -> None:
    node = WarmNode(tmp_path, mps_root, ALWAYS, pods=pods)
    node.recover()
    uuid0 = node.uuid_of("gpu-0")
    assert node.warmer().check()[uuid0] == STARTED
    warm = node.warm()
    assert warm is not None
    assert warm.runner == "pod"
    [pod] = [p for p in pods.pods.values() if p["metadata"]["uid"] == warm.runner_ref]

    node.restart()  # SIGKILL: no shutdown code ran, the daemon pod stays
    caplog.set_level(logging.INFO, logger="gpu_dra.kubelet_plugin.mps")
    node.recover()
    assert node.warmer().check()[uuid0] == KEPT

    assert node.warm() == warm
    assert [p["metadata"]["uid"] for p in pods.pods.values()].count(warm.runner_ref) == 1
    assert pod["metadata"]["uid"] == warm.runner_ref
    assert f"mps warm daemon adopted daemon_id={warm.daemon_id} pid={warm.pid}" in caplog.text
    assert "started anew" not in caplog.text
    assert "mps leftover removed" not in caplog.text
    share = node.add_share(UID_A, "10Gi", "10")
    ok(node.prepare(share)[UID_A])
    [handle] = node.handles(UID_A)
    assert (handle.pid, handle.runner_ref) == (warm.pid, warm.runner_ref)
    assert node.unprepare(share) == {UID_A: None}
    node.warmer().check()
    stop_warm(node)


def test_a_warm_daemon_recorded_with_other_settings_is_started_anew_and_says_why(
    node: WarmNode, caplog: pytest.LogCaptureFixture
) -> None:
    node.recover()
    node.warmer().check()
    warm = node.warm()
    assert warm is not None
    record = warm.root / "daemon.json"
    data = json.loads(record.read_text())
    data["settings"]["pinnedLimits"] = {warm.devices[0]: "1024M"}  # e.g. another max share
    record.write_text(json.dumps(data))

    node.restart()
    node.recover()
    caplog.set_level(logging.INFO, logger="gpu_dra.kubelet_plugin.mps")
    assert node.warmer().check()[node.uuid_of("gpu-0")] == STARTED

    uuid0 = warm.devices[0]
    expected = (
        f"not kept, started anew: its record (daemon.json) has settings "
        f"['set_default_active_thread_percentage 100', "
        f"'set_default_device_pinned_mem_limit {uuid0} 1024M'], not "
        f"['set_default_active_thread_percentage 100', "
        f"'set_default_device_pinned_mem_limit {uuid0} 81559M']"
    )
    assert expected in caplog.text
    assert wait_dead(warm.pid)
    fresh = node.warm()
    assert fresh is not None
    assert fresh.pid != warm.pid
    stop_warm(node)


def test_a_warm_start_the_plugin_died_in_is_not_adopted_and_the_log_says_why(
    node: WarmNode, caplog: pytest.LogCaptureFixture
) -> None:
    node.recover()
    node.warmer().check()
    warm = node.warm()
    assert warm is not None
    # The plugin died after launching the daemon, before it verified the settings and wrote
    # daemon.json: what runs there was never checked, so it is replaced, not adopted.
    (warm.root / "daemon.json").unlink()

    node.restart()
    caplog.set_level(logging.INFO, logger="gpu_dra.kubelet_plugin.mps")
    node.recover()
    assert warm.pid in node.running()  # the start-up sweep keeps a warm daemon's directory
    assert node.warmer().check()[node.uuid_of("gpu-0")] == STARTED

    assert "mps leftover removed daemon_id=" + warm.daemon_id in caplog.text
    assert f"mps warm daemon started daemon_id={warm.daemon_id}" in caplog.text
    assert "(none recorded)" in caplog.text
    assert wait_dead(warm.pid)
    fresh = node.warm()
    assert fresh is not None
    assert sorted(node.running()) == sorted([fresh.pid, node.warm("gpu-1").pid])  # type: ignore[union-attr]
    stop_warm(node)


class MigWarmNode(MigSharesNode):
    """`MigSharesNode` (the 1g.10gb slices of hgx-h100-mig offered as shares) with warm
    daemons kept by a `WarmDaemons` over every offered device."""

    def __init__(self, root: Path, mps_root: Path) -> None:
        self.nvml: SimulatedNvml = SimulatedHost.load("hgx-h100-mig", NODE).nvml
        super().__init__(root, mps_root)

    def preparer_options(self) -> dict[str, Any]:
        options = super().preparer_options()
        self.mps = MpsDaemonManager(
            self.mps_root,
            binary=DOUBLE_BINARY,
            base_env=double_env(),
            shm=PlainDirectoryShm(),
            compute_mode=NvmlComputeMode(self.nvml),
            exclusive=is_shared_daemon,
        )
        return {**options, "mps": self.mps, "mps_share_warm": ALWAYS}

    def warmer(self) -> WarmDaemons:
        shared = self.preparer.shared_daemons
        assert shared is not None
        return WarmDaemons(
            shared, self.mps, self.inventory.shared_devices, policy=ALWAYS, interval_s=10
        )


def test_a_mig_device_offered_as_shares_is_warmed_adopted_and_joined(
    tmp_path: Path, mps_root: Path
) -> None:
    node = MigWarmNode(tmp_path, mps_root)
    slice_name = "gpu-0-mig-1g10gb-19-0"
    uuid = node.uuid_of(slice_name)
    migs = [mig.uuid for mig in node.inventory.mig_mps_shares]
    assert uuid in migs
    node.recover()
    try:
        assert node.warmer().check() == dict.fromkeys(migs, STARTED)
        warm = node.mps.recorded(shared_daemon_id(uuid))
        assert warm is not None
        assert warm.devices == (uuid,)  # the MIG device's own daemon

        node.restart()
        node.recover()
        assert warm.pid in node.running()  # the sweep keeps a MIG device's warm daemon too
        assert node.warmer().check()[uuid] == KEPT

        share = node.add_share(UID_A, "2Gi", "25", device=slice_name)
        ok(node.prepare(share)[UID_A])
        [handle] = node.handles(UID_A)
        assert handle.pid == warm.pid  # the share joined the warm daemon
        node.unprepare(share)
    finally:
        for mig in migs:
            left = node.mps.recorded(shared_daemon_id(mig))
            if left is not None:
                node.mps.stop(left)


class HeldChecks:
    """A `DaemonChecker` that vouches as ``supervisor`` does and records the checks asked for
    instead of starting them."""

    def __init__(self, supervisor: DaemonSupervisor) -> None:
        self.supervisor = supervisor
        self.asked: list[DaemonHandle] = []

    def vouches_for(self, daemon_id: str) -> bool:
        return self.supervisor.vouches_for(daemon_id)

    def check_soon(self, handle: DaemonHandle) -> bool:
        self.asked.append(handle)
        return True


def test_the_first_shares_join_has_the_warm_daemon_checked_beside_it_and_the_second_sends_none(
    node: WarmNode,
) -> None:
    node.recover()
    node.warmer().check()
    warm = node.warm("gpu-0")
    assert warm is not None
    shared = node.preparer.shared_daemons
    assert shared is not None
    supervisor = DaemonSupervisor(node.mps, node.checkpoint.all, interval_s=30)
    shared.set_checker(supervisor)
    assert not supervisor.vouches_for(warm.daemon_id)  # never checked: a join would read back

    a = node.add_share(UID_A, "10Gi", "10", name="a")
    ok(node.prepare(a)[UID_A])
    deadline = time.monotonic() + 10
    while not supervisor.vouches_for(warm.daemon_id):  # the check the warm join started
        assert time.monotonic() < deadline, "the warm daemon was not checked after the join"
        time.sleep(0.02)
    for thread in threading.enumerate():  # the check's thread: done once it is gone
        if thread.name.startswith("mps-check-"):
            thread.join(10)
    log = warm.paths.log / "control.log"
    before = log.read_text().count("Cmd:")
    later = HeldChecks(supervisor)  # vouches as the supervisor does, starts no check
    shared.set_checker(later)
    b = node.add_share(UID_B, "20Gi", "20", name="b")
    ok(node.prepare(b)[UID_B])

    assert log.read_text().count("Cmd:") == before  # the second share's prepare sent none
    assert [h.pid for h in later.asked] == [warm.pid]  # but asked for the check beside it
    assert [h.pid for h in node.handles(UID_B)] == [warm.pid]
    node.unprepare(a, b)
    assert wait_dead(warm.pid)
    stop_warm(node)
