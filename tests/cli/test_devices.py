"""`gpu-dra devices`: the devices of a (simulated) node, as the kubelet plugin publishes them."""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest
import yaml

from gpu_dra.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gpu_dra.cli.devices import device_form, plugin_devices
from gpu_dra.driver.attributes import gpu_device
from gpu_dra.driver.discovery import discover_devices, discover_gpus
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from tests.cli.support import run, table

REPO = Path(__file__).resolve().parents[2]


def published(profile: str, node: str) -> list[object]:
    host = SimulatedHost.load(profile, node)
    gpus = sorted(discover_gpus(host.nvml, host.pci), key=lambda gpu: gpu.pci_bus_id)
    return [gpu_device(gpu) for gpu in gpus]


def test_devices_table_for_t4_shows_tesla_t4_and_dashes_for_unknown_facts(capsys):
    code, out, err = run(capsys, "devices", "--simulate", "t4", "--node", "node-a")

    assert code == EXIT_OK
    assert err == ""
    header, *rows = table(out)
    assert header == [
        "NAME",
        "TYPE",
        "PROFILE",
        "PRODUCT",
        "MEMORY",
        "ARCHITECTURE",
        "COMPUTE CAPABILITY",
        "PCI BUS ID",
        "NUMA",
        "UUID",
    ]
    assert len(rows) == 1
    name, kind, profile, product, memory, architecture, capability, bus_id, numa, uuid = rows[0]
    assert (name, product, architecture, capability) == ("gpu-0", "Tesla T4", "Turing", "7.5.0")
    assert (kind, profile) == ("gpu", "-")
    assert memory == "15Gi"
    assert bus_id == "0000:00:1e.0"
    assert numa == "-"  # the T4 cloud VM has no NUMA information
    assert uuid.startswith("GPU-")


@pytest.mark.parametrize("profile", ["hgx-h100", "mixed", "t4"])
def test_devices_json_is_exactly_what_the_plugin_publishes(capsys, profile):
    code, out, _ = run(capsys, "devices", "--simulate", profile, "--node", "node-a", "-o", "json")

    assert code == EXIT_OK
    assert json.loads(out) == published(profile, "node-a")


def test_devices_dynamic_mig_shows_the_partitionable_form_the_plugin_publishes(capsys):
    code, out, _ = run(
        capsys, "devices", "--simulate", "hgx-h100", "--node", "n", "--dynamic-mig", "-o", "json"
    )
    host = SimulatedHost.load("hgx-h100", "n")
    found = discover_devices(host.nvml, host.pci, mig_profiles=True)
    plugin = NodeInventory.from_discovery(found, simulated=True, dynamic_mig=True)

    assert code == EXIT_OK
    assert json.loads(out) == plugin.published_devices()
    assert len(json.loads(out)) == 8 * 15  # default policy: 1g x7, 2g x3, 3g x2, 4g, 7g, whole
    code, out, _ = run(capsys, "devices", "--simulate", "hgx-h100", "--node", "n", "--dynamic-mig")
    names = [row[0] for row in table(out)[1:]]
    assert names[:3] == ["gpu-0", "gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1"]


def test_devices_table_says_what_each_device_is_and_its_mig_profile(capsys):
    code, out, _ = run(capsys, "devices", "--simulate", "mixed", "--node", "n")
    assert code == EXIT_OK
    kinds = {row[0]: (row[1], row[2]) for row in table(out)[1:]}
    assert kinds["gpu-0"] == ("gpu", "-")  # an A100 with MIG off: a whole GPU
    code, out, _ = run(capsys, "devices", "--simulate", "hgx-h100-mig", "--node", "n")
    rows = table(out)[1:]
    assert {(row[1], row[2]) for row in rows} >= {("mig", "1g.10gb"), ("mig", "3g.40gb")}
    assert {row[1] for row in rows} == {"mig", "gpu"}  # static MIG slices; gpu-7 has MIG off
    code, out, _ = run(capsys, "devices", "--simulate", "hgx-h100", "--node", "n", "--dynamic-mig")
    kinds = {row[0]: (row[1], row[2]) for row in table(out)[1:]}
    assert kinds["gpu-0"] == ("gpu partitionable", "-")
    assert kinds["gpu-0-mig-1g10gb-19-0"] == ("mig partition", "1g.10gb")


def test_shares_are_told_apart_from_the_devices_they_share() -> None:
    host = SimulatedHost.load("hgx-h100-mig", "n")
    shared = plugin_devices(host.nvml, host.pci, mps_shares=True)
    forms = {device["name"]: device_form(device) for device in shared}
    assert forms["gpu-7"] == "gpu share"
    assert forms["gpu-0-mig-1g10gb-19-0"] == "mig share"
    plain = {device["name"]: device_form(device) for device in plugin_devices(host.nvml, host.pci)}
    assert (plain["gpu-7"], plain["gpu-0-mig-1g10gb-19-0"]) == ("gpu", "mig")


def test_devices_dynamic_mig_profiles_choose_the_published_profiles(capsys):
    args = ["devices", "--simulate", "hgx-h100", "--node", "n", "--dynamic-mig", "-o", "json"]
    code, out, _ = run(capsys, *args, "--dynamic-mig-profiles", "all")
    assert code == EXIT_OK
    assert len(json.loads(out)) == 8 * 26
    code, out, _ = run(capsys, *args, "--dynamic-mig-profiles", "1g+me,7g.80gb")
    profiles = {d["attributes"].get("profile", {}).get("string") for d in json.loads(out)}
    assert profiles == {None, "1g.10gb+me", "7g.80gb"}  # None: the whole GPUs
    code, _, err = run(capsys, *args, "--dynamic-mig-profiles", "7g.80")
    assert code == EXIT_USAGE
    assert "--dynamic-mig-profiles: dynamic MIG profiles entry '7g.80': '7g.80' is not" in err


def test_devices_yaml_holds_the_same_device_objects_as_json(capsys):
    code, out, _ = run(capsys, "devices", "--simulate", "l4x4", "--node", "n", "-o", "yaml")

    assert code == EXIT_OK
    assert yaml.safe_load(out) == published("l4x4", "n")


def test_simulated_uuids_follow_the_node_name_like_on_the_node(capsys):
    def uuids(node: str) -> list[str]:
        _, out, _ = run(capsys, "devices", "--simulate", "t4", "--node", node, "-o", "json")
        return [device["attributes"]["uuid"]["string"] for device in json.loads(out)]

    assert uuids("node-a") == uuids("node-a")
    assert uuids("node-a") != uuids("node-b")


def test_devices_reads_the_kubelet_plugin_environment(capsys):
    from_env = run(capsys, "devices", "-o", "json", GPU_DRA_SIMULATE="mixed", NODE_NAME="node-b")
    from_flags = run(capsys, "devices", "-o", "json", "--simulate", "mixed", "--node", "node-b")

    assert from_env == from_flags
    assert from_env[0] == EXIT_OK


def test_unknown_profile_is_a_usage_error_that_lists_the_profiles(capsys):
    code, out, err = run(capsys, "devices", "--simulate", "dgx-z9000", "--node", "n")

    assert code == EXIT_USAGE
    assert out == ""
    assert "gpu-dra devices: error: unknown simulated machine profile 'dgx-z9000'" in err
    assert "hgx-h100" in err
    assert "Traceback" not in err


def test_real_mode_without_nvml_library_fails_with_the_nvml_error(capsys, tmp_path):
    if pynvml.nvmlLib is not None:
        pytest.skip("a real libnvidia-ml is already loaded in this process")

    code, out, err = run(capsys, "devices", "--driver-root", str(tmp_path))

    assert code == EXIT_FAILED
    assert out == ""
    assert err.startswith("gpu-dra devices: error: cannot initialise NVML")
    assert "NVML_ERROR_LIBRARY_NOT_FOUND" in err
    assert f"libnvidia-ml.so.1 not found under driver root {tmp_path}" in err
    assert "Traceback" not in err


ISSUE_10_PROFILE = REPO / "tests" / "fakes" / "profiles" / "hgx-h100-mig-unreadable.yaml"


def profile_file(tmp_path: Path, gpus: list[dict[str, object]], **extra: object) -> str:
    path = tmp_path / "node.yaml"
    doc = {"driverVersion": "580.95.05", "cudaDriverVersion": 13000, "gpus": gpus, **extra}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("flags", [[], ["--dynamic-mig"]])
def test_devices_fails_naming_every_gpu_and_return_code_when_mig_state_is_unreadable(capsys, flags):
    """Issue 10: not "no GPUs found" with exit 0."""
    code, out, err = run(
        capsys, "devices", "--simulate", str(ISSUE_10_PROFILE), "--node", "n", *flags
    )

    assert code == EXIT_FAILED
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 9
    host = SimulatedHost.load(str(ISSUE_10_PROFILE), "n")
    for index, (line, gpu) in enumerate(zip(lines, host.profile.gpus, strict=False)):
        bus_id = gpu.bus_id.lower()[4:]
        assert line.startswith(f"gpu-dra devices: error: GPU {index} ({bus_id}): ")
        assert "nvmlDeviceGetGpuInstanceProfileInfo answered NVML_ERROR_NOT_SUPPORTED" in line
        assert line.endswith("; not published")
    assert (
        lines[-1]
        == "gpu-dra devices: error: no usable GPU: all 8 GPU(s) NVML reports cannot be read"
    )
    assert "no GPUs found" not in err


def test_devices_prints_the_usable_gpus_and_fails_for_the_unreadable_one(capsys, tmp_path):
    node = profile_file(
        tmp_path,
        [
            {"model": "L4", "busId": "00000000:01:00.0"},
            {
                "model": "L4",
                "busId": "00000000:41:00.0",
                "faults": {"device_get_uuid": "GPU_IS_LOST"},
            },
        ],
    )
    code, out, err = run(capsys, "devices", "--simulate", node, "--node", "n")

    assert code == EXIT_FAILED
    assert [row[0] for row in table(out)[1:]] == ["gpu-0"]
    assert err == (
        "gpu-dra devices: error: GPU 1 (0000:41:00.0): nvmlDeviceGetUUID failed: GPU is lost "
        "(NVML_ERROR_GPU_IS_LOST); not published\n"
    )
    code, out, err = run(capsys, "devices", "--simulate", node, "--node", "n", "-o", "json")
    assert code == EXIT_FAILED
    assert [device["name"] for device in json.loads(out)] == ["gpu-0"]
    assert "NVML_ERROR_GPU_IS_LOST" in err


def test_devices_on_a_node_without_gpus_fails(capsys, tmp_path):
    code, out, err = run(capsys, "devices", "--simulate", profile_file(tmp_path, []), "-o", "json")

    assert code == EXIT_FAILED
    assert json.loads(out) == []
    assert err.startswith("gpu-dra devices: error: no GPUs found: NVML reports 0 GPUs")


def test_devices_with_only_mig_gpus_without_mig_devices_says_so(capsys, tmp_path):
    node = profile_file(
        tmp_path, [{"model": "H100-SXM5-80GB", "busId": "00000000:1B:00.0", "migMode": [1, 1]}]
    )
    code, out, err = run(capsys, "devices", "--simulate", node, "--node", "n")

    assert code == EXIT_FAILED
    assert out == ""
    assert "no device to publish: GPU 0 (0000:1b:00.0, GPU-" in err
    assert "has MIG mode on and no MIG device" in err
    code, out, err = run(capsys, "devices", "--simulate", node, "--node", "n", "--dynamic-mig")
    assert code == EXIT_OK
    assert err == ""


def test_devices_fails_with_the_return_code_when_the_device_count_fails(capsys, tmp_path):
    node = profile_file(
        tmp_path, [{"model": "L4", "busId": "00000000:01:00.0"}], faults={"device_get_count": 15}
    )
    code, out, err = run(capsys, "devices", "--simulate", node, "--node", "n")

    assert code == EXIT_FAILED
    assert out == ""
    assert err.startswith("gpu-dra devices: error: nvmlDeviceGetCount failed")
    assert "NVML_ERROR_GPU_IS_LOST" in err
