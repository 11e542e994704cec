"""The plugin's composition root builds the MPS daemon manager the settings ask for: the runner
(host process or pod, with the pod's namespace, node and image), the compute-mode control
(only with --mps-exclusive-compute-mode), its Events, and the daemon supervision task."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client import ApiClient

from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.__main__ import (
    _mps,
    _share_memory,
    _supervise,
    discover,
    node_inventory,
)
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.mps import (
    MpsDaemonManager,
    NvmlComputeMode,
    PodRunner,
    ProcessRunner,
    claim_daemon_id,
    shared_daemon_id,
)
from gpu_dra.kubelet_plugin.mps.events import MpsEvents
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from tests.doubles.mps_helpers import DOUBLE_BINARY, scratch_root
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
    manager = _mps(settings(data_dir), ApiClient(), host.nvml)

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
    manager = _mps(settings(data_dir, *flags), ApiClient(), host.nvml)

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
    manager = _mps(settings(data_dir, "--mps-exclusive-compute-mode=none"), ApiClient(), host.nvml)

    assert manager is not None
    assert isinstance(manager.compute_mode, NvmlComputeMode)  # resets earlier records
    assert not manager.exclusive(shared_daemon_id(GPU))


def test_the_manager_reports_to_the_events_and_supervision_follows_the_interval(
    data_dir: Path,
) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    checkpoint = Checkpoint(data_dir)
    events = MpsEvents(RecordingEventApi(), InMemoryClaimReader(), dict, node_name="node-a")
    manager = _mps(settings(data_dir), ApiClient(), host.nvml, events)
    assert manager is not None
    assert manager.observer is events

    async def tasks(*flags: str, mps: MpsDaemonManager | None = manager) -> list[str]:
        started = _supervise(settings(data_dir, *flags), mps, checkpoint)
        for task in started:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)
        return [task.get_name() for task in started]

    assert asyncio.run(tasks()) == ["mps-supervisor"]
    assert asyncio.run(tasks("--mps-daemon-check-interval=0")) == []
    assert asyncio.run(tasks(mps=None)) == []


def test_share_memory_caps_are_detected_at_start_and_reported_as_events(data_dir: Path) -> None:
    host = SimulatedHost.load("hgx-h100", "node-a")
    plugin = settings(data_dir, "--mps-shares=0")
    inventory = node_inventory(plugin, discover(plugin, host.nvml, host.pci, None))
    events = MpsEvents(RecordingEventApi(), InMemoryClaimReader(), dict, node_name="node-a")

    memory = _share_memory(plugin, host.nvml, inventory, events)

    [gpu] = inventory.mps_shares
    assert memory.support.enforcement(gpu.uuid).value == "mps-client"
    assert memory.support.why(gpu.uuid) == "simulated GPUs: no driver to apply a cgroup limit"
    assert memory.report == events.share_prepared
