"""The `gpu-dra` operator CLI: profiles, devices of a (simulated) node, check-config of manifests.

Every test calls `main(argv, environ={})` directly: no subprocess, no cluster, no GPU, and no
GPU_DRA_* variable of the caller's shell leaks in.
"""

from __future__ import annotations

import io
import json
import re
import textwrap
from pathlib import Path

import pynvml
import pytest
import yaml

from gpu_dra.controller.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from gpu_dra.driver.attributes import gpu_device
from gpu_dra.driver.config.resolve import NOT_OPAQUE
from gpu_dra.driver.discovery import discover_devices, discover_gpus
from gpu_dra.driver.nvml.profiles import builtin_profile_names
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.node_devices import NodeInventory

REPO = Path(__file__).resolve().parents[2]


def run(capsys: pytest.CaptureFixture[str], *argv: str, **environ: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `gpu-dra argv...` with only `environ` set."""
    code = main(list(argv), environ=environ)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table(text: str) -> list[list[str]]:
    """Rows of a table printed by the CLI (columns are separated by at least two spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]


def published(profile: str, node: str) -> list[object]:
    host = SimulatedHost.load(profile, node)
    gpus = sorted(discover_gpus(host.nvml, host.pci), key=lambda gpu: gpu.pci_bus_id)
    return [gpu_device(gpu) for gpu in gpus]


# ---- profiles ------------------------------------------------------------------------------------


def test_profiles_lists_hgx_h100_with_eight_h100_gpus(capsys):
    code, out, err = run(capsys, "profiles")

    assert code == EXIT_OK
    assert err == ""
    rows = {row[0]: row for row in table(out)[1:]}
    assert rows["hgx-h100"][1] == "8"
    assert rows["hgx-h100"][2] == "8x NVIDIA H100 80GB HBM3"


def test_profiles_lists_every_builtin_profile_and_counts_mixed_products(capsys):
    code, out, _ = run(capsys, "profiles", "-o", "json")

    assert code == EXIT_OK
    summaries = {summary["name"]: summary for summary in json.loads(out)}
    assert sorted(summaries) == builtin_profile_names()
    assert summaries["mixed"]["gpus"] == 4
    assert summaries["mixed"]["products"] == {"NVIDIA A100 80GB PCIe": 2, "NVIDIA L4": 2}
    assert summaries["t4"]["description"]


# ---- devices -------------------------------------------------------------------------------------


def test_devices_table_for_t4_shows_tesla_t4_and_dashes_for_unknown_facts(capsys):
    code, out, err = run(capsys, "devices", "--simulate", "t4", "--node", "node-a")

    assert code == EXIT_OK
    assert err == ""
    header, *rows = table(out)
    assert header == [
        "NAME",
        "PRODUCT",
        "MEMORY",
        "ARCHITECTURE",
        "COMPUTE CAPABILITY",
        "PCI BUS ID",
        "NUMA",
        "UUID",
    ]
    assert len(rows) == 1
    name, product, memory, architecture, capability, bus_id, numa, uuid = rows[0]
    assert (name, product, architecture, capability) == ("gpu-0", "Tesla T4", "Turing", "7.5.0")
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
    assert len(json.loads(out)) == 8 * 26
    code, out, _ = run(capsys, "devices", "--simulate", "hgx-h100", "--node", "n", "--dynamic-mig")
    names = [row[0] for row in table(out)[1:]]
    assert names[:3] == ["gpu-0", "gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1"]


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


# ---- check-config --------------------------------------------------------------------------------

GPU_CONFIG = "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig"


def manifest(tmp_path: Path, text: str, name: str = "manifest.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def claim(name: str, *configs: str) -> str:
    """A ResourceClaim document with the given `spec.devices.config` entries (YAML flow maps)."""
    entries = "".join(f"\n          - {config}" for config in configs)
    return f"""
    apiVersion: resource.k8s.io/v1
    kind: ResourceClaim
    metadata: {{name: {name}, namespace: team-a}}
    spec:
      devices:
        requests: [{{name: gpu, exactly: {{deviceClassName: gpu.nvidia.com}}}}]
        config:{entries}
    """


def opaque(parameters: str, driver: str = "gpu.nvidia.com", requests: str = "[gpu]") -> str:
    return (
        f"{{requests: {requests}, opaque: {{driver: {driver}, parameters: "
        f"{{apiVersion: resource.nvidia.com/v1beta1, {parameters}}}}}}}"
    )


def test_valid_claim_configs_are_ok_and_exit_zero(capsys, tmp_path):
    file = manifest(
        tmp_path,
        claim(
            "shared",
            opaque("kind: GpuConfig"),
            opaque("kind: GpuConfig, sharing: {strategy: TimeSlicing}"),
            opaque("kind: GpuConfig, sharing: {strategy: MPS, mpsConfig: {}}"),
        ),
    )

    code, out, err = run(capsys, "check-config", file)

    assert code == EXIT_OK
    assert err == ""
    assert out.splitlines() == [
        f"OK {file} ResourceClaim/shared spec.devices.config[{index}]" for index in range(3)
    ]


def test_unknown_field_is_an_error_naming_the_field_and_exit_one(capsys, tmp_path):
    file = manifest(tmp_path, claim("typo", opaque("kind: GpuConfig, sharng: {strategy: MPS}")))

    code, out, _ = run(capsys, "check-config", file)

    assert code == EXIT_FAILED
    assert out.startswith(f"ERROR {file} ResourceClaim/typo spec.devices.config[0]: ")
    assert "parameters.sharng: unknown field (allowed here: apiVersion, kind, sharing)" in out


def test_bad_strategy_is_an_error_listing_the_supported_strategies(capsys, tmp_path):
    file = manifest(tmp_path, claim("bad", opaque("kind: GpuConfig, sharing: {strategy: Often}")))

    code, out, _ = run(capsys, "check-config", file)

    assert code == EXIT_FAILED
    assert out == (
        f"ERROR {file} ResourceClaim/bad spec.devices.config[0]: parameters.sharing.strategy: "
        "unknown GPU sharing strategy 'Often': supported are TimeSlicing, MPS\n"
    )


def test_messages_match_the_kubelet_plugin_event_for_the_same_entry(capsys, tmp_path):
    # The plugin's event text for this claim: "resource claim team-a/bad: spec.devices.config[0]:
    # parameters.kind: unsupported kind ..."; the CLI prints the same after the entry's path.
    file = manifest(tmp_path, claim("bad", opaque("kind: GPUConfig")))

    _, out, _ = run(capsys, "check-config", file)

    assert out.startswith(
        f"ERROR {file} ResourceClaim/bad spec.devices.config[0]: parameters.kind: "
        "unsupported kind 'GPUConfig' of apiVersion resource.nvidia.com/v1beta1: "
        "supported kinds are GpuConfig, MigDeviceConfig"
    )


def test_template_and_class_configs_are_found_at_their_own_paths(capsys, tmp_path):
    file = manifest(
        tmp_path,
        f"""
        apiVersion: resource.k8s.io/v1
        kind: ResourceClaimTemplate
        metadata: {{name: per-pod}}
        spec:
          spec:
            devices:
              requests: [{{name: gpu, exactly: {{deviceClassName: gpu.nvidia.com}}}}]
              config:
              - {opaque("kind: GpuConfig, sharing: {strategy: MPS}")}
              - {opaque("kind: GpuConfig, sharing: {strategy: Sometimes}")}
        ---
        apiVersion: resource.k8s.io/v1
        kind: DeviceClass
        metadata: {{name: mps.gpu.nvidia.com}}
        spec:
          config:
          - {opaque("kind: GpuConfig, sharing: {strategy: MPS}", requests="null")}
          - {opaque("kind: WholeGpu", requests="null")}
        """,
    )

    code, out, _ = run(capsys, "check-config", file)

    assert code == EXIT_FAILED
    lines = out.splitlines()
    assert lines[0] == f"OK {file} ResourceClaimTemplate/per-pod spec.spec.devices.config[0]"
    assert lines[1].startswith(
        f"ERROR {file} ResourceClaimTemplate/per-pod spec.spec.devices.config[1]: "
        "parameters.sharing.strategy: unknown GPU sharing strategy 'Sometimes'"
    )
    assert lines[2] == f"OK {file} DeviceClass/mps.gpu.nvidia.com spec.config[0]"
    assert lines[3].startswith(
        f"ERROR {file} DeviceClass/mps.gpu.nvidia.com spec.config[1]: parameters.kind: "
        "unsupported kind 'WholeGpu'"
    )
    assert len(lines) == 4


def test_entries_of_other_drivers_are_skipped_and_do_not_fail(capsys, tmp_path):
    file = manifest(
        tmp_path,
        claim(
            "two-vendors",
            "{opaque: {driver: nic.example.com, parameters: {mtu: 9000}}}",
            opaque("kind: GpuConfig"),
        ),
    )

    code, out, _ = run(capsys, "check-config", file)

    assert code == EXIT_OK
    assert out.splitlines() == [
        f"SKIP {file} ResourceClaim/two-vendors spec.devices.config[0]: "
        "driver nic.example.com is not gpu.nvidia.com",
        f"OK {file} ResourceClaim/two-vendors spec.devices.config[1]",
    ]


def test_driver_name_flag_selects_whose_configs_are_checked(capsys, tmp_path):
    file = manifest(tmp_path, claim("renamed", opaque("kind: GpuConfig", driver="gpu.example.com")))

    skipped = run(capsys, "check-config", file)
    checked = run(capsys, "check-config", "--driver-name", "gpu.example.com", file)

    assert skipped[1].startswith("SKIP ")
    assert checked[1] == f"OK {file} ResourceClaim/renamed spec.devices.config[0]\n"


def test_non_opaque_entry_is_an_error_whatever_the_driver(capsys, tmp_path):
    file = manifest(tmp_path, claim("not-opaque", "{requests: [gpu]}"))

    code, out, _ = run(capsys, "check-config", file)

    assert code == EXIT_FAILED
    assert out == f"ERROR {file} ResourceClaim/not-opaque spec.devices.config[0]: {NOT_OPAQUE}\n"


def test_config_that_is_not_a_list_is_an_error(capsys, tmp_path):
    file = manifest(
        tmp_path,
        """
        apiVersion: resource.k8s.io/v1
        kind: DeviceClass
        metadata: {name: broken}
        spec: {config: {opaque: {driver: gpu.nvidia.com}}}
        """,
    )

    code, out, _ = run(capsys, "check-config", file)

    assert code == EXIT_FAILED
    assert (
        out == f"ERROR {file} DeviceClass/broken spec.config: expected a list of config entries\n"
    )


def test_lists_are_opened_and_other_objects_ignored(capsys, tmp_path):
    file = manifest(
        tmp_path,
        f"""
        apiVersion: v1
        kind: List
        items:
        - {{apiVersion: v1, kind: Pod, metadata: {{name: p}}, spec: {{containers: []}}}}
        - apiVersion: resource.k8s.io/v1
          kind: ResourceClaim
          metadata: {{name: listed}}
          spec:
            devices:
              config: [{opaque("kind: GpuConfig")}]
        """,
    )

    code, out, _ = run(capsys, "check-config", file)

    assert code == EXIT_OK
    assert out == f"OK {file} ResourceClaim/listed spec.devices.config[0]\n"


def test_the_shipped_device_classes_pass(capsys):
    files = sorted(str(path) for path in (REPO / "deviceclasses").glob("*.yaml"))

    code, out, err = run(capsys, "check-config", *files)

    assert code == EXIT_OK
    # The only class config: MPS for the shares class.
    mps = REPO / "deviceclasses" / "mps.gpu.nvidia.com.yaml"
    assert out == f"OK {mps} DeviceClass/mps.gpu.nvidia.com spec.config[0]\n"
    assert err == ""


def test_manifest_is_read_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr(
        "sys.stdin", io.StringIO(textwrap.dedent(claim("piped", opaque("kind: X"))))
    )

    code, out, _ = run(capsys, "check-config", "-")

    assert code == EXIT_FAILED
    assert out.startswith("ERROR <stdin> ResourceClaim/piped spec.devices.config[0]: ")


def test_bad_yaml_exits_two_naming_the_file_and_the_parser_problem(capsys, tmp_path):
    bad = manifest(tmp_path, "kind: ResourceClaim\nmetadata: {name: x\nspec: {}\n", "bad.yaml")

    code, out, err = run(capsys, "check-config", bad)

    assert code == EXIT_USAGE
    assert out == ""
    assert err.startswith(f"gpu-dra check-config: error: {bad}: not valid YAML: line ")
    assert "expected ',' or '}'" in err
    assert "Traceback" not in err


def test_unreadable_file_exits_two_but_the_other_files_are_still_checked(capsys, tmp_path):
    good = manifest(tmp_path, claim("fine", opaque("kind: GpuConfig")))
    missing = str(tmp_path / "missing.yaml")

    code, out, err = run(capsys, "check-config", missing, good)

    assert code == EXIT_USAGE
    assert f"cannot read {missing}" in err
    assert out == f"OK {good} ResourceClaim/fine spec.devices.config[0]\n"


def test_document_that_is_not_an_object_exits_two(capsys, tmp_path):
    file = manifest(tmp_path, "- just\n- a list\n")

    code, _, err = run(capsys, "check-config", file)

    assert code == EXIT_USAGE
    assert f"{file}: document 1 is not a Kubernetes object" in err


# ---- usage ---------------------------------------------------------------------------------------


def test_help_lists_every_command_with_examples(capsys):
    code, out, _ = run(capsys, "--help")

    assert code == EXIT_OK
    for command in ("profiles", "devices", "check-config"):
        assert command in out
    assert "examples:" in out
    assert "gpu-dra devices --simulate hgx-h100" in out


def test_no_command_prints_usage_and_exits_two(capsys):
    code, out, err = run(capsys)

    assert code == EXIT_USAGE
    assert out == ""
    assert err.startswith("usage: gpu-dra")


def test_bad_output_format_is_a_usage_error(capsys):
    code, _, err = run(capsys, "devices", "--simulate", "t4", "-o", "xml")

    assert code == EXIT_USAGE
    assert "invalid choice: 'xml'" in err
