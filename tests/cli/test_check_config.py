"""`gpu-dra check-config`: opaque configs of manifests, judged as the kubelet plugin judges them."""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import yaml

from gpu_dra.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gpu_dra.driver.config.resolve import NOT_OPAQUE
from tests.cli.support import run

REPO = Path(__file__).resolve().parents[2]


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
    # The only class configs: TimeSlicing for capped shares, MPS for the MPS shares classes
    # (whole GPUs, MIG devices).
    capped = REPO / "deviceclasses" / "capped.gpu.nvidia.com.yaml"
    gpu = REPO / "deviceclasses" / "mps.gpu.nvidia.com.yaml"
    mig = REPO / "deviceclasses" / "mps.mig.nvidia.com.yaml"
    assert out == (
        f"OK {capped} DeviceClass/capped.gpu.nvidia.com spec.config[0]\n"
        f"OK {gpu} DeviceClass/mps.gpu.nvidia.com spec.config[0]\n"
        f"OK {mig} DeviceClass/mps.mig.nvidia.com spec.config[0]\n"
    )
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


def test_json_output_holds_every_verdict_and_the_counts(capsys, tmp_path):
    file = manifest(
        tmp_path,
        claim(
            "mixed",
            opaque("kind: GpuConfig"),
            opaque("kind: GpuConfig, sharing: {strategy: Often}"),
            opaque("kind: NicConfig", driver="nic.example.com"),
        ),
    )

    code, out, err = run(capsys, "check-config", "-o", "json", file)

    assert code == EXIT_FAILED
    assert err == ""
    data = json.loads(out)
    assert [(c["verdict"], c["path"]) for c in data["checks"]] == [
        ("OK", "spec.devices.config[0]"),
        ("ERROR", "spec.devices.config[1]"),
        ("SKIP", "spec.devices.config[2]"),
    ]
    assert {c["file"] for c in data["checks"]} == {file}
    assert {c["object"] for c in data["checks"]} == {"ResourceClaim/mixed"}
    assert "parameters.sharing.strategy" in data["checks"][1]["message"]
    assert data["summary"] == {"ok": 1, "errors": 1, "skipped": 1}
    assert data["unreadable"] == []
    code, out, _ = run(capsys, "check-config", "-o", "yaml", file)
    assert code == EXIT_FAILED
    assert yaml.safe_load(out) == data


def test_json_output_lists_unreadable_files_and_exits_two(capsys, tmp_path):
    good = manifest(tmp_path, claim("fine", opaque("kind: GpuConfig")))
    missing = str(tmp_path / "missing.yaml")

    code, out, err = run(capsys, "check-config", "-o", "json", good, missing)

    assert code == EXIT_USAGE
    data = json.loads(out)  # stdout stays one JSON document
    assert data["summary"] == {"ok": 1, "errors": 0, "skipped": 0}
    (unreadable,) = data["unreadable"]
    assert missing in unreadable
    assert missing in err


def test_this_drivers_config_under_a_misspelt_driver_is_an_error_with_did_you_mean(
    capsys, tmp_path
):
    file = manifest(
        tmp_path,
        claim(
            "typo",
            opaque("kind: GpuConfig, sharing: {strategy: TimeSlicing}", driver="gpu.nvidai.com"),
            opaque("kind: MigDeviceConfig", driver="gpu.nvidia.co"),
            opaque("kind: ComputeDomainChannelConfig", driver="compute-domain.nvidia.com"),
        ),
    )

    code, out, _ = run(capsys, "check-config", file)

    assert code == EXIT_FAILED
    assert out.splitlines() == [
        f"ERROR {file} ResourceClaim/typo spec.devices.config[0]: opaque.driver: gpu.nvidai.com "
        "is not gpu.nvidia.com, but the parameters are gpu.nvidia.com's GpuConfig: did you mean "
        "gpu.nvidia.com? As written, gpu.nvidia.com ignores this config",
        f"ERROR {file} ResourceClaim/typo spec.devices.config[1]: opaque.driver: gpu.nvidia.co "
        "is not gpu.nvidia.com, but the parameters are gpu.nvidia.com's MigDeviceConfig: did "
        "you mean gpu.nvidia.com? As written, gpu.nvidia.com ignores this config",
        # NVIDIA's compute domain driver: its own config kinds, a name far from ours
        f"SKIP {file} ResourceClaim/typo spec.devices.config[2]: driver compute-domain.nvidia.com "
        "is not gpu.nvidia.com",
    ]


def test_near_misses_are_judged_against_the_driver_name_given(capsys, tmp_path):
    file = manifest(tmp_path, claim("ours", opaque("kind: GpuConfig", driver="gpu.example.com")))

    assert run(capsys, "check-config", file)[0] == EXIT_OK  # SKIP: far from gpu.nvidia.com
    code, out, _ = run(capsys, "check-config", "--driver-name", "gpu.example.co", file)
    assert code == EXIT_FAILED
    assert "did you mean gpu.example.co?" in out
