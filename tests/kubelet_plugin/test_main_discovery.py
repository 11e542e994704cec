"""The plugin's start-up discovery never reads an NVML error as "no GPUs": a GPU that cannot be
read is logged at ERROR with its return code and exported as ``gpu_dra_gpu_discovery_errors``;
NVML that cannot start, or GPUs of which none can be read, stop the plugin with exit status 1."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gpu_dra.kubelet_plugin.__main__ import main
from gpu_dra.kubelet_plugin.metrics import DiscoveryMetrics
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup import StartupError
from gpu_dra.kubelet_plugin.startup.discovery import discover, node_inventory, node_nvml

ISSUE_10_PROFILE = Path(__file__).resolve().parents[1] / "fakes" / "profiles"
ISSUE_10_PROFILE /= "hgx-h100-mig-unreadable.yaml"


def profile_file(tmp_path: Path, gpus: list[dict[str, object]], **extra: object) -> str:
    path = tmp_path / "node.yaml"
    doc = {"driverVersion": "580.95.05", "cudaDriverVersion": 13000, "gpus": gpus, **extra}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def argv(tmp_path: Path, profile: str, *flags: str) -> list[str]:
    return [
        "--node-name=node-a",
        f"--simulate={profile}",
        f"--data-dir={tmp_path / 'data'}",
        *flags,
    ]


def settings(tmp_path: Path, profile: str, *flags: str) -> KubeletPluginSettings:
    return KubeletPluginSettings.parse(argv(tmp_path, profile, *flags), {})


def test_a_gpu_that_cannot_be_read_is_logged_with_its_return_code_and_exported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = profile_file(
        tmp_path,
        [
            {"model": "L4", "busId": "00000000:01:00.0"},
            {"model": "L4", "busId": "00000000:41:00.0", "faults": {"device_get_name": 15}},
        ],
    )
    plugin = settings(tmp_path, node)
    nvml, pci = node_nvml(plugin)
    registry = CollectorRegistry()

    with caplog.at_level(logging.INFO):
        devices = discover(plugin, nvml, pci, DiscoveryMetrics(registry, "node-a"))
        inventory = node_inventory(plugin, devices)

    assert [gpu.index for gpu in devices.gpus] == [0]
    assert [device["name"] for device in inventory.published_devices()] == ["gpu-0"]
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.ERROR
    assert "GPU left out, not published: GPU 1 (0000:41:00.0): nvmlDeviceGetName" in record.message
    assert "NVML_ERROR_GPU_IS_LOST" in record.message
    assert "discovered 1 GPU(s) (1 left out)" in caplog.text
    labels = {
        "node": "node-a",
        "gpu": "1",
        "pci_bus_id": "0000:41:00.0",
        "uuid": devices.problems[0].uuid or "",
        "call": "nvmlDeviceGetName",
        "reason": "NVML_ERROR_GPU_IS_LOST",
    }
    assert registry.get_sample_value("gpu_dra_gpu_discovery_errors", labels) == 1
    assert labels["uuid"].startswith("GPU-")


def test_no_discovery_error_series_when_every_gpu_is_read(tmp_path: Path) -> None:
    plugin = settings(tmp_path, "l4x4")
    nvml, pci = node_nvml(plugin)
    registry = CollectorRegistry()
    discover(plugin, nvml, pci, DiscoveryMetrics(registry, "node-a"))
    assert not [
        sample
        for metric in registry.collect()
        if metric.name == "gpu_dra_gpu_discovery_errors"
        for sample in metric.samples
    ]


@pytest.mark.parametrize("flags", [[], ["--dynamic-mig"]])
def test_issue_10_the_plugin_refuses_to_start_instead_of_publishing_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, flags: list[str]
) -> None:
    with caplog.at_level(logging.INFO):
        code = main(argv(tmp_path, str(ISSUE_10_PROFILE), *flags))

    assert code == 1
    errors = [r.message for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 9
    for index, message in enumerate(errors[:8]):
        assert message.startswith(f"GPU left out, not published: GPU {index} (")
        assert "nvmlDeviceGetGpuInstanceProfileInfo answered NVML_ERROR_NOT_SUPPORTED" in message
    assert errors[-1].startswith("cannot start: none of the 8 GPU(s) NVML reports can be read")
    assert "NVML_ERROR_NOT_SUPPORTED" in errors[-1]


@pytest.mark.parametrize(
    ("faults", "call", "code"),
    [
        ({"init": "DRIVER_NOT_LOADED"}, "cannot initialise NVML", "NVML_ERROR_DRIVER_NOT_LOADED"),
        ({"device_get_count": "UNKNOWN"}, "nvmlDeviceGetCount failed", "NVML_ERROR_UNKNOWN"),
    ],
)
def test_the_plugin_refuses_to_start_when_nvml_init_or_the_count_fails(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    faults: dict[str, str],
    call: str,
    code: str,
) -> None:
    node = profile_file(tmp_path, [{"model": "L4", "busId": "00000000:01:00.0"}], faults=faults)

    with caplog.at_level(logging.INFO):
        assert main(argv(tmp_path, node)) == 1

    (message,) = [r.message for r in caplog.records if r.levelno == logging.ERROR]
    assert message.startswith(f"cannot start: GPU discovery failed: {call}")
    assert code in message


def test_discover_raises_startup_error_rather_than_returning_no_gpus(tmp_path: Path) -> None:
    plugin = settings(tmp_path, str(ISSUE_10_PROFILE), "--dynamic-mig")
    nvml, pci = node_nvml(plugin)
    with pytest.raises(StartupError, match="none of the 8 GPU"):
        discover(plugin, nvml, pci)


def test_a_node_with_nothing_to_publish_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = profile_file(
        tmp_path, [{"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0", "migMode": [1, 1]}]
    )
    plugin = settings(tmp_path, node)
    nvml, pci = node_nvml(plugin)
    with caplog.at_level(logging.INFO):
        inventory = node_inventory(plugin, discover(plugin, nvml, pci))
    assert inventory.published_devices() == []
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.WARNING
    assert "no device to publish: every usable GPU is in MIG mode" in record.message


def test_the_dynamic_mig_policy_is_applied_and_logged_per_gpu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = profile_file(
        tmp_path,
        [
            {"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0"},
            {"model": "A100-SXM4-80GB", "busId": "00000000:2B:00.0", "migMode": [1, 1]},
        ],
    )
    plugin = settings(tmp_path, node, "--dynamic-mig", "--dynamic-mig-profiles=H100=3g,7g")
    nvml, pci = node_nvml(plugin)
    with caplog.at_level(logging.INFO):
        inventory = node_inventory(plugin, discover(plugin, nvml, pci))

    names = sorted(d["name"] for d in inventory.published_devices())
    assert names == [
        "gpu-0",
        "gpu-0-mig-3g40gb-9-0",
        "gpu-0-mig-3g40gb-9-4",
        "gpu-0-mig-7g80gb-0-0",
    ]
    assert "dynamic MIG profiles of GPU 0 (NVIDIA H100 80GB HBM3): 3g.40gb,7g.80gb" in caplog.text
    (warning,) = [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith(
        "--dynamic-mig-profiles=H100=3g,7g offers none of the MIG profiles of GPU 1 "
        "(NVIDIA A100-SXM4-80GB: 1g.10gb,"
    )
    assert "publishing 4 devices (--dynamic-mig-profiles=H100=3g,7g)" in caplog.text
