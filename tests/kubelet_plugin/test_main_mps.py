"""The plugin's composition root builds the MPS daemon manager the settings ask for: the runner
(host process or pod, with the pod's namespace, node and image), the compute-mode control
(--mps-exclusive-compute-mode), its Events, the daemon supervision: who repairs, who only
watches for the health monitor, and the warm shared daemons: who keeps them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client import ApiClient

from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.shares import ShareSelectionError
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.claim_records import ClaimRecords
from gpu_dra.kubelet_plugin.mps import (
    NvmlComputeMode,
    PodRunner,
    ProcessRunner,
    claim_daemon_id,
    shared_daemon_id,
)
from gpu_dra.kubelet_plugin.mps.events import MpsEvents
from gpu_dra.kubelet_plugin.mps.shared_daemons import SharedDaemons
from gpu_dra.kubelet_plugin.mps.supervisor import DaemonSupervisor
from gpu_dra.kubelet_plugin.mps.warm_daemons import KEPT, STARTED, WarmDaemons
from gpu_dra.kubelet_plugin.plugin_instances import InstanceRegistry, PluginInstance
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup.discovery import discover, node_inventory
from gpu_dra.kubelet_plugin.startup.memory_caps import share_memory
from gpu_dra.kubelet_plugin.startup.mps_daemons import (
    HEALTH_MPS_INTERVAL_S,
    mps_manager,
    mps_supervisor,
    mps_warmer,
)
from tests.doubles.mps_helpers import (
    DOUBLE_BINARY,
    kill_processes_under,
    processes_under,
    scratch_root,
)
from tests.fakes.claim_reader import InMemoryClaimReader
from tests.fakes.event_api import RecordingEventApi

CLAIM = "0f6c2c6e-8a3c-4d0e-9a63-8e2b5e0c1d11"
GPU = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def data_dir() -> Iterator[Path]:
    path = scratch_root()
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def settings(data_dir: Path, *flags: str) -> KubeletPluginSettings:
    return KubeletPluginSettings.parse(
        [
            "--node-name=node-a",
            "--simulate=hgx-h100",
            f"--data-dir={data_dir}",
            f"--mps-control-binary={DOUBLE_BINARY}",
            *flags,
        ],
        {},
    )


def test_the_default_runs_daemons_as_host_processes_exclusive_on_share_gpus_only(
    data_dir: Path,
) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    manager = mps_manager(settings(data_dir), ApiClient(), host.nvml)

    assert manager is not None
    assert isinstance(manager.runner, ProcessRunner)
    assert isinstance(manager.compute_mode, NvmlComputeMode)
    assert manager.exclusive(shared_daemon_id(GPU))
    assert not manager.exclusive(claim_daemon_id(CLAIM, [GPU]))
    # Daemon pods of an earlier --mps-daemon-runner=pod are still found and stopped.
    assert isinstance(manager.runners["pod"], PodRunner)


def test_the_pod_runner_gets_its_namespace_node_and_image(data_dir: Path) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    flags = (
        "--mps-daemon-runner=pod",
        "--mps-daemon-image=registry.example/mps:1",
        "--mps-daemon-namespace=gpu-system",
        "--mps-exclusive-compute-mode=true",
        "--driver-root=/driver-root",
        "--nvidia-driver-root=/run/nvidia/driver",
    )
    manager = mps_manager(settings(data_dir, *flags), ApiClient(), host.nvml)

    assert manager is not None
    runner = manager.runner
    assert isinstance(runner, PodRunner)
    assert (runner.namespace, runner.node_name, runner.image) == (
        "gpu-system",
        "node-a",
        "registry.example/mps:1",
    )
    assert runner.driver_root == Path("/run/nvidia/driver")  # the pod mounts the host's path
    assert isinstance(manager.compute_mode, NvmlComputeMode)
    assert manager.exclusive(claim_daemon_id(CLAIM, [GPU]))  # true: every daemon
    assert manager.start_timeout_s > 10.0  # a pod needs longer than a host process


def test_exclusive_compute_mode_none_sets_no_gpu_but_still_resets(data_dir: Path) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    flags = ("--mps-exclusive-compute-mode=none",)
    manager = mps_manager(settings(data_dir, *flags), ApiClient(), host.nvml)

    assert manager is not None
    assert isinstance(manager.compute_mode, NvmlComputeMode)  # resets earlier records
    assert not manager.exclusive(shared_daemon_id(GPU))


def test_the_manager_reports_to_the_events(data_dir: Path) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    events = MpsEvents(RecordingEventApi(), InMemoryClaimReader(), dict, node_name="node-a")
    manager = mps_manager(settings(data_dir), ApiClient(), host.nvml, events)
    assert manager is not None
    assert manager.observer is events


def test_supervision_repairs_only_while_this_instance_is_the_newest_ready_one(
    data_dir: Path,
) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    plugin = settings(data_dir, "--mps-shares=0")
    inventory = node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))
    manager = mps_manager(plugin, ApiClient(), host.nvml)
    assert manager is not None
    registry = InstanceRegistry(data_dir)
    old = registry.register("old")
    new = registry.register("new")
    try:
        old.mark_ready()
        on_old = mps_supervisor(plugin, manager, Checkpoint(data_dir), old, inventory)
        on_new = mps_supervisor(plugin, manager, Checkpoint(data_dir), new, inventory)
        assert on_old is not None
        assert on_new is not None
        assert on_old.interval_s == on_new.interval_s == 10.0
        # During a rolling update the new instance takes over once its recovery is done.
        assert (on_old.repairs(), on_new.repairs()) == (True, False)
        new.mark_ready()
        assert (on_old.repairs(), on_new.repairs()) == (False, True)
        new.close()
        assert on_old.repairs()  # the new one went away: the old one repairs again
    finally:
        new.close()
        old.close()


def test_without_supervision_the_daemons_are_only_watched_for_the_health_monitor(
    data_dir: Path,
) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    registry = InstanceRegistry(data_dir)
    instance = registry.register("only")
    instance.mark_ready()
    try:

        def supervisor(*flags: str) -> DaemonSupervisor | None:
            plugin = settings(data_dir, *flags)
            inventory = node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))
            manager = mps_manager(plugin, ApiClient(), host.nvml)
            return mps_supervisor(plugin, manager, Checkpoint(data_dir), instance, inventory)

        off = "--mps-daemon-check-interval=0"
        assert supervisor(off) is None
        assert supervisor(off, "--mps-shares=0") is None  # no health monitor on simulated GPUs
        watching = supervisor(off, "--mps-shares=0", "--health-monitor=true")
        assert watching is not None
        assert watching.interval_s == HEALTH_MPS_INTERVAL_S
        assert not watching.repairs()
        supervising = supervisor("--mps-daemon-check-interval=3")
        assert supervising is not None
        assert supervising.interval_s == 3
        assert supervising.repairs()
    finally:
        instance.close()


def test_share_memory_caps_are_detected_at_start_and_reported_as_events(data_dir: Path) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    plugin = settings(data_dir, "--mps-shares=0")
    inventory = node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))
    events = MpsEvents(RecordingEventApi(), InMemoryClaimReader(), dict, node_name="node-a")

    memory = share_memory(plugin, host.nvml, inventory, events)

    [gpu] = inventory.mps_shares
    assert memory.support.enforcement(gpu.uuid).value == "mps-client"
    assert memory.support.why(gpu.uuid) == "simulated GPUs: no driver to apply a cgroup limit"
    assert memory.report == events.share_prepared


def test_warm_daemons_are_kept_only_by_the_newest_ready_instance(data_dir: Path) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    plugin = settings(
        data_dir,
        "--mps-shares=0",
        "--mps-daemon-check-interval=0",
        "--mps-share-daemon-warm=always",
    )
    inventory = node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))
    manager = mps_manager(plugin, ApiClient(), host.nvml)
    assert manager is not None
    checkpoint = Checkpoint(data_dir)
    checkpoint.load()
    registry = InstanceRegistry(data_dir)
    old = registry.register("old")
    new = registry.register("new")

    def warmer(instance: PluginInstance) -> WarmDaemons | None:
        records = ClaimRecords(checkpoint, owner=instance.token)
        shared = SharedDaemons(manager, records, max_percent=100, locks=instance.locks)
        return mps_warmer(plugin, manager, shared, instance, inventory)

    try:
        old.mark_ready()
        on_old, on_new = warmer(old), warmer(new)
        assert on_old is not None
        assert on_new is not None
        assert on_old.interval_s == HEALTH_MPS_INTERVAL_S  # supervision off: every 10 s still
        [uuid] = [gpu.uuid for gpu in inventory.mps_shares]
        assert on_new.check() == {}  # not ready yet: the old instance keeps them
        assert on_old.check() == {uuid: STARTED}
        new.mark_ready()
        assert on_old.check() == {}
        assert on_new.check() == {uuid: KEPT}  # the old instance's daemon, adopted
        warm = manager.recorded(shared_daemon_id(uuid))
        assert warm is not None
        assert processes_under(data_dir) == [warm.pid]
        no_shares = settings(data_dir)
        assert mps_warmer(no_shares, manager, None, new, inventory) is None
    finally:
        kill_processes_under(data_dir)
        new.close()
        old.close()


def test_mig_devices_offered_as_shares_are_never_capped_by_the_driver(data_dir: Path) -> None:
    host = SimulatedHost.load("hgx-h100-mig", "node-a")
    plugin = settings(data_dir, "--mps-shares=7", "--mps-shares-on-mig=3g.40gb")
    inventory = node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))

    memory = share_memory(plugin, host.nvml, inventory, None)

    assert [m.profile for m in inventory.mig_mps_shares] == ["3g.40gb"] * 3
    for mig in inventory.mig_mps_shares:
        assert memory.support.enforcement(mig.uuid).value == "mps-client"
        assert "do not support MIG handles" in memory.support.why(mig.uuid)
    [gpu] = inventory.mps_shares  # the one GPU with MIG off keeps its own reason
    assert memory.support.why(gpu.uuid) == "simulated GPUs: no driver to apply a cgroup limit"
    # What does check their memory, as each share's Event says: the watchdog's settings.
    assert memory.watchdog == (
        "the memory watchdog checks its processes every 1s and acts on an overrun after the "
        "fact (--mps-memory-watchdog=kill)"
    )
    off = settings(data_dir, "--mps-shares-on-mig=3g.40gb", "--mps-memory-watchdog=off")
    assert share_memory(off, host.nvml, inventory, None).watchdog == (
        "no memory watchdog checks it (--mps-memory-watchdog=off)"
    )


def test_static_mig_devices_offered_as_shares_get_warm_daemons_too(data_dir: Path) -> None:
    host = SimulatedHost.load("hgx-h100-mig", "node-a")
    plugin = settings(
        data_dir,
        "--mps-shares=7",
        "--mps-shares-on-mig=3g.40gb",
        "--mps-share-daemon-warm=always",  # off by default (docs/mps.md, "Warm daemons")
    )
    inventory = node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))
    manager = mps_manager(plugin, ApiClient(), host.nvml)
    assert manager is not None
    checkpoint = Checkpoint(data_dir)
    checkpoint.load()
    instance = InstanceRegistry(data_dir).register("only")
    try:
        instance.mark_ready()
        records = ClaimRecords(checkpoint, owner=instance.token)
        shared = SharedDaemons(manager, records, max_percent=100, locks=instance.locks)
        warmer = mps_warmer(plugin, manager, shared, instance, inventory)
        assert warmer is not None
        [gpu] = inventory.mps_shares
        migs = [mig.uuid for mig in inventory.mig_mps_shares]
        assert len(migs) == 3

        assert warmer.check() == dict.fromkeys([gpu.uuid, *migs], STARTED)

        for mig in inventory.mig_mps_shares:  # one daemon per MIG device, on that device only
            warm = manager.recorded(shared_daemon_id(mig.uuid))
            assert warm is not None
            assert warm.devices == (mig.uuid,)
            assert warm.settings == shared.settings(mig)
        assert len(processes_under(data_dir)) == 4
    finally:
        kill_processes_under(data_dir)
        instance.close()


def test_mig_shares_on_a_node_dynamic_mig_partitions_offer_nothing_and_say_why(
    data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = SimulatedHost.load("hgx-h100-mig", "node-a")
    plugin = settings(
        data_dir, "--simulate=hgx-h100-mig", "--dynamic-mig", "--mps-shares-on-mig=all"
    )

    with caplog.at_level("WARNING", logger="gpu_dra"):
        inventory = node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))

    assert inventory.mig_mps_shares == ()
    assert not any(d.get("allowMultipleAllocations") for d in inventory.published_devices())
    assert any(
        "--mps-shares-on-mig offers no MIG device of this node" in r.getMessage()
        and "offer their partitions with --mps-shares-on-dynamic-mig" in r.getMessage()
        for r in caplog.records
    ), caplog.text


def test_dynamic_mig_partitions_of_the_named_profiles_are_offered_as_shares(
    data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    plugin = settings(
        data_dir, "--simulate=hgx-h100", "--dynamic-mig", "--mps-shares-on-dynamic-mig=3g.40gb"
    )

    with caplog.at_level("INFO", logger="gpu_dra"):
        inventory = node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))

    # Two 3g.40gb placements on each of the eight H100s.
    assert {p.profile_name for p in inventory.partition_shares} == {"3g.40gb"}
    assert len(inventory.partition_shares) == 16
    shared = [d for d in inventory.published_devices() if d.get("allowMultipleAllocations")]
    assert len(shared) == 16
    assert all("-mig-3g40gb-" in d["name"] and d["consumesCounters"] for d in shared)
    assert "offering 16 dynamic MIG partition(s) of profile(s) 3g.40gb as MPS shares" in (
        caplog.text
    )


def test_partitions_as_shares_without_dynamic_mig_stop_the_plugin(data_dir: Path) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    plugin = settings(data_dir, "--simulate=hgx-h100", "--mps-shares-on-dynamic-mig=all")

    with pytest.raises(ShareSelectionError, match="--dynamic-mig is off"):
        node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))
