"""`gpu-dra lint` on the table of common mistakes in docs/cel.md: each row's selector, as a
DeviceClass on every built-in profile, gets the error the table says (compile error with the
apiserver's words, or runtime error) and the table's suggestion, which compiles and selects
what the table says."""

from __future__ import annotations

import json
from functools import cache

import pytest

from gpu_dra.cli.__main__ import main
from gpu_dra.cli.command import EXIT_FAILED
from gpu_dra.cli.lint import (
    LintReport,
    SimulatedDevice,
    Source,
    _lint_devices,
    _published,
    lint,
)
from gpu_dra.cli.lint_fixes import Names, suggest_fix
from gpu_dra.driver.cel import compile_selector
from gpu_dra.driver.nvml.simulated_profiles import builtin_profile_names
from tests.cel_mistakes import Mistake, mistakes

ROWS = mistakes()


@cache
def _devices() -> list[SimulatedDevice]:
    return _lint_devices(builtin_profile_names(), variants=True)


def _lint_class(expression: str) -> LintReport:
    devices = _devices()
    document = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "tutorial"},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }
    return lint(
        [Source("class.yaml", [document])], devices, published=_published(devices, "gpu.nvidia.com")
    )


def test_the_table_has_every_kind_of_mistake_the_issue_names():
    assert len(ROWS) >= 10
    assert {row.outcome for row in ROWS} == {"compile error", "runtime error"}
    words = " ".join(row.mistake for row in ROWS)
    for mistake in (
        "attribute name used as a domain",
        "capacity read as an attribute",
        "unqualified name where the published one is qualified",
        "int compared with a quantity",
        "string compared with a version",
    ):
        assert mistake in words
    assert ROWS[0].selector == "device.attributes['memory'] >= 40000"  # the tutorial's class


@pytest.mark.parametrize("row", ROWS, ids=[row.selector for row in ROWS])
def test_lint_reports_the_mistake_and_teaches_the_fix(row: Mistake):
    report = _lint_class(row.selector)
    errors = [finding for finding in report.findings if finding.level == "ERROR"]
    if row.outcome == "compile error":
        assert errors[0].message.startswith("compile error: ERROR: <input>:1:")
        assert row.message in errors[0].message
        assert len(errors) == 1
    else:
        assert not any(e.message.startswith("compile error") for e in errors)
        runtime = [e for e in errors if e.message.startswith("CEL runtime error on")]
        assert len(runtime) == 1
        assert row.message in runtime[0].message
    taught = [finding for finding in errors if finding.suggestion is not None]
    assert taught == errors[:1]  # the first error of the selector teaches, once
    suggestion = taught[0].suggestion
    assert suggestion is not None
    assert suggestion.expression == row.suggestion
    assert suggestion.verdict == f"compiles and selects {row.selects}"
    assert suggestion.reasons
    text = str(taught[0])
    assert f"\n  write instead: {row.suggestion}\n  which compiles and selects" in text


@pytest.mark.parametrize("row", ROWS, ids=[row.selector for row in ROWS])
def test_each_suggestion_lints_clean(row: Mistake):
    compile_selector(row.suggestion)
    report = _lint_class(row.suggestion)
    assert report.count("ERROR") == 0, [str(f) for f in report.findings]
    assert any(
        f.level == "INFO" and f.message.startswith(f"selects {row.selects.split(':')[0]}")
        for f in report.findings
    )


NAMES = Names(
    "gpu.nvidia.com",
    {
        ("gpu.nvidia.com", "productName"): "string",
        ("gpu.nvidia.com", "driverVersion"): "version",
        ("resource.kubernetes.io", "pciBusID"): "string",
    },
    frozenset({("gpu.nvidia.com", "memory"), ("gpu.nvidia.com", "multiprocessors")}),
)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # correct selectors: nothing to teach
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('1Gi')) > 0", None),
        ("device.attributes['gpu.nvidia.com'].productName == 'x'", None),
        ("device.capacity['gpu.nvidia.com'].memory == quantity('1Gi')", None),
        ("device.attributes['other.example.com'].size() == 0", None),
        ("device.attributes['nothing'].x == 1", None),  # not a name anyone publishes
        ("'device.attributes[\"memory\"] >= 1' == ''", None),  # inside a string
        # the literal first: the operator turns round
        (
            "40 < device.capacity['gpu.nvidia.com'].multiprocessors",
            "device.capacity['gpu.nvidia.com'].multiprocessors.compareTo(quantity('40')) > 0",
        ),
        # a byte count stays bytes
        (
            "device.capacity['gpu.nvidia.com'].memory >= 42949672960",
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('42949672960')) >= 0",
        ),
        (
            "device.capacity['gpu.nvidia.com'].memory != '40Gi' && true",
            "device.capacity['gpu.nvidia.com'].memory != quantity('40Gi') && true",
        ),
        (
            "device.attributes['gpu.nvidia.com'].driverVersion < 'v550.1'",
            "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('550.1.0')) < 0",
        ),
        (
            "device.attributes['gpu.nvidia.com']['resource.kubernetes.io/pciBusID'] == 'x'",
            "device.attributes['resource.kubernetes.io'].pciBusID == 'x'",
        ),
        (
            "has(device.attributes['pciBusID'])",
            "has(device.attributes['resource.kubernetes.io'].pciBusID)",
        ),
        # the field form of a name used as a domain
        (
            "device.attributes.productName == 'x'",
            "device.attributes['gpu.nvidia.com'].productName == 'x'",
        ),
        ("device.attributes.exists(d, d == 'x')", None),
        # two mistakes in one selector, both fixed
        (
            "device.attributes['productName'] == 'x' && device.attributes['memory'] > 1",
            "device.attributes['gpu.nvidia.com'].productName == 'x' && "
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('1Gi')) > 0",
        ),
    ],
)
def test_suggest_fix_rewrites_paths_and_comparisons(expression, expected):
    fix = suggest_fix(expression, NAMES)
    assert (fix.expression if fix else None) == expected


def test_a_claim_request_is_taught_on_the_devices_of_its_class():
    devices = _lint_devices(["l4x4", "hgx-h100"])
    documents = [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "gpu"},
            "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]},
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "big"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu",
                                "selectors": [
                                    {"cel": {"expression": "device.attributes['memory'] > 40000"}}
                                ],
                            },
                        }
                    ]
                }
            },
        },
    ]
    report = lint(
        [Source("claim.yaml", documents)], devices, published=_published(devices, "gpu.nvidia.com")
    )
    [error] = [f for f in report.findings if f.level == "ERROR"]
    assert error.object == "ResourceClaim/big"
    assert error.path == "spec.devices.requests[0].exactly.selectors[0].cel.expression"
    assert error.suggestion is not None
    assert error.suggestion.verdict == (
        "compiles and selects 8 of the 12 devices DeviceClass gpu selects: 8x NVIDIA H100 80GB HBM3"
    )


def test_the_command_prints_the_fix_and_gives_it_in_json(tmp_path, capsys):
    manifest = tmp_path / "tutorial.yaml"
    manifest.write_text(
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: big\nspec:\n"
        "  selectors:\n  - cel:\n      expression: \"device.attributes['memory'] >= 40000\"\n"
    )
    profile = ["--profile", "hgx-h100", "--profile", "l4x4"]
    assert main(["lint", *profile, str(manifest)], environ={}) == EXIT_FAILED
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(
        "compile error: ERROR: <input>:1:29: found no matching overload for '_>=_' applied to "
        "'(map(string, any), int)'"
    )
    assert out[1].startswith("  why: 'memory' is not a domain")
    fix = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40000Mi')) >= 0"
    assert out[3] == f"  write instead: {fix}"
    assert out[4] == "  which compiles and selects 8 of 12 devices: 8x NVIDIA H100 80GB HBM3"
    assert main(["lint", "-o", "json", *profile, str(manifest)], environ={}) == EXIT_FAILED
    [finding] = json.loads(capsys.readouterr().out)["findings"]
    assert finding["suggestion"] == {
        "expression": fix,
        "reasons": [out[1].removeprefix("  why: "), out[2].removeprefix("  why: ")],
        "selects": 8,
        "of": 12,
        "products": "8x NVIDIA H100 80GB HBM3",
        "runtimeErrors": 0,
    }


@pytest.mark.parametrize(
    ("number", "quantity"),
    [("40", "40Gi"), ("80", "80Gi"), ("1023", "1023Gi"), ("1024", "1024Mi"), ("40000", "40000Mi")],
)
def test_a_number_compared_with_gpu_memory_reads_as_gib_below_1024(number, quantity):
    fix = suggest_fix(f"device.capacity['gpu.nvidia.com'].memory >= {number}", NAMES)
    assert fix is not None
    assert fix.expression == (
        f"device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('{quantity}')) >= 0"
    )


def test_memory_at_least_40_suggests_40gi_which_selects_the_big_gpus_only(tmp_path, capsys):
    manifest = tmp_path / "big.yaml"
    manifest.write_text(
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: big\nspec:\n"
        "  selectors:\n  - cel:\n      expression: "
        "\"device.capacity['gpu.nvidia.com'].memory >= 40\"\n"
    )
    profile = ["--profile", "hgx-h100", "--profile", "l4x4"]
    assert main(["lint", "-o", "json", *profile, str(manifest)], environ={}) == EXIT_FAILED
    [finding] = json.loads(capsys.readouterr().out)["findings"]
    suggestion = finding["suggestion"]
    assert suggestion["expression"] == (
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"
    )
    assert (suggestion["selects"], suggestion["of"]) == (8, 12)  # not the L4s (22.5 GiB)
    (reason,) = suggestion["reasons"]
    assert "40 read as GiB is quantity('40Gi'); as MiB, quantity('40Mi')" in reason


def test_an_ambiguous_memory_number_shows_both_readings():
    fix = suggest_fix("device.capacity['gpu.nvidia.com'].memory >= 512", NAMES)
    assert fix is not None
    assert "quantity('512Gi')" in fix.expression
    (reason,) = fix.reasons
    assert "512 is ambiguous" in reason
    assert "as GiB, quantity('512Gi')" in reason
    assert "as MiB, quantity('512Mi')" in reason
