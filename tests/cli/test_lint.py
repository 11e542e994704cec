"""`gpu-dra lint`: compile and evaluate DeviceClass and claim selectors on simulated GPUs.

CLI tests call `main(argv, environ={})` directly; the logic tests call `lint` with hand-made
devices where no simulated profile has the shape needed (a GPU without productName).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from gpu_dra.cli.__main__ import main
from gpu_dra.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from gpu_dra.cli.lint import (
    Reference,
    SimulatedDevice,
    Source,
    lint,
    selector_references,
)
from gpu_dra.driver.nvml.simulated_profiles import builtin_profile_names

REPO = Path(__file__).resolve().parents[2]
G = "device.attributes['gpu.nvidia.com']"
C = "device.capacity['gpu.nvidia.com']"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["lint", *argv], environ={})
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def device_class(name: str, *expressions: str) -> dict[str, object]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": e}} for e in expressions]},
    }


def write(path: Path, *documents: object) -> str:
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return str(path)


def lines(out: str, level: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(f"{level} ")]


# ---- the shipped catalog ---------------------------------------------------------------------


def test_shipped_catalog_lints_clean_on_every_builtin_profile(capsys):
    code, out, err = run(capsys, str(REPO / "deviceclasses"))

    assert code == EXIT_OK, out
    assert err == ""
    assert lines(out, "ERROR") == []
    classes = len(list((REPO / "deviceclasses").glob("*.yaml")))
    assert out.splitlines()[-1].startswith(
        f"gpu-dra lint: {classes} files: {classes} DeviceClasses"
    )
    # Each profile as published by default, with --mps-shares=all and with --capped-shares=all;
    # with --dynamic-mig the two profiles with partitionable GPUs (H100s).
    assert f"of {3 * len(builtin_profile_names()) + 2} profiles" in out.splitlines()[-1]
    assert "hgx-h100+dynamic-mig, hgx-h100-mig, hgx-h100-mig+mps-shares, " in out


def test_shipped_catalog_passes_lint_strict_on_every_builtin_profile(capsys):
    # What CI should run: no warning either. training adds compute capability >= 8.0 to
    # large-memory's conditions, which no simulated GPU of >= 40 GiB fails: INFO, not WARNING.
    code, out, _ = run(capsys, "--strict", str(REPO / "deviceclasses"))

    assert lines(out, "WARNING") == []
    assert code == EXIT_OK, out
    training = REPO / "deviceclasses" / "training.gpu.nvidia.com.yaml"
    assert (
        f"INFO {training} DeviceClass/training.gpu.nvidia.com: selects the same 35 devices as "
        "DeviceClass/large-memory.gpu.nvidia.com on the simulated profiles; "
        "DeviceClass/training.gpu.nvidia.com adds "
        f"{G}.cudaComputeCapability.compareTo(semver('8.0.0')) >= 0, which excludes none of them"
    ) in lines(out, "INFO")


def test_an_extended_resource_name_on_two_classes_is_warned_about(capsys, tmp_path):
    one = device_class("a.example.com", f"{G}.type == 'gpu'")
    other = device_class("b.example.com", f"{G}.type == 'mig'")
    third = device_class("c.example.com", f"{G}.architecture == 'Hopper'")
    for cls, name in ((one, "nvidia.com/gpu.shared"), (other, "nvidia.com/gpu.shared")):
        cls["spec"]["extendedResourceName"] = name  # type: ignore[index]
    third["spec"]["extendedResourceName"] = "example.com/other"  # type: ignore[index]
    file = write(tmp_path / "classes.yaml", one, other, third)

    code, out, _ = run(capsys, file)

    assert code == EXIT_OK, out
    assert lines(out, "WARNING") == [
        f"WARNING {file} DeviceClass/b.example.com: spec.extendedResourceName: "
        "extendedResourceName nvidia.com/gpu.shared is also that of DeviceClass/a.example.com "
        f"({file}): pods asking for nvidia.com/gpu.shared get devices of only one of them (the "
        "class created later); give each name to one class"
    ]


# Profiles without MIG devices: what mig.nvidia.com meets on most clusters today.
WHOLE_GPU_PROFILES = ("hgx-h100", "dgx-a100", "l4x4", "mixed", "t4")


def test_shipped_catalog_warns_that_mig_selects_nothing_without_mig_devices(capsys):
    profiles = [arg for name in WHOLE_GPU_PROFILES for arg in ("--profile", name)]

    code, out, _ = run(capsys, *profiles, str(REPO / "deviceclasses"))

    assert code == EXIT_OK, out
    assert lines(out, "ERROR") == []
    file = REPO / "deviceclasses" / "mig.nvidia.com.yaml"
    profile_list = ", ".join(WHOLE_GPU_PROFILES)
    assert (
        f"WARNING {file} DeviceClass/mig.nvidia.com: selects no device of the simulated "
        f"profiles ({profile_list})"
    ) in lines(out, "WARNING")
    assert main(["lint", "--strict", *profiles, str(REPO / "deviceclasses")], environ={}) == (
        EXIT_FAILED
    )


def test_shipped_catalog_selects_what_docs_say(capsys):
    code, out, _ = run(capsys, "-o", "json", str(REPO / "deviceclasses"))

    assert code == EXIT_OK
    selects = {c["name"]: c["selects"] for c in json.loads(out)["classes"]}
    # MIG devices only where static MIG is configured or MIG is dynamic, only through the MIG
    # classes; each family class selects its family on every one of those profiles.
    # (+mps-shares offers hgx-h100-mig's static MIG devices as shares: share-only, so no MIG
    # class selects them there.)
    mig_profiles = {
        "hgx-h100-mig",
        "hgx-h100+dynamic-mig",
        "hgx-h100-mig+dynamic-mig",
    }
    assert set(selects["mig.nvidia.com"]) == mig_profiles
    assert all("-mig-" in name for name in selects["mig.nvidia.com"]["hgx-h100-mig"])
    # the default --dynamic-mig-profiles (1g, 2g, 3g, 4g, 7g): 14 placements per H100
    assert len(selects["mig.nvidia.com"]["hgx-h100+dynamic-mig"]) == 8 * 14
    for family in ("1g", "2g", "3g", "4g", "7g"):
        by_profile = selects[f"mig-{family}.gpu.nvidia.com"]
        assert set(by_profile) == mig_profiles
        names = [name for names in by_profile.values() for name in names]
        assert all(f"-mig-{family}" in name for name in names), family
    assert "gpu-0" in selects["gpu.nvidia.com"]["hgx-h100+dynamic-mig"]
    for whole in ("gpu.nvidia.com", "hopper.gpu.nvidia.com", "training.gpu.nvidia.com"):
        assert not any("-mig-" in name for names in selects[whole].values() for name in names)
    assert selects["gpu.nvidia.com"]["t4"] == ["gpu-0"]
    # MPS shares only on GPUs offered as shares; whole-GPU classes never select those.
    assert all(profile.endswith("+mps-shares") for profile in selects["mps.gpu.nvidia.com"])
    assert selects["mps.gpu.nvidia.com"]["t4+mps-shares"] == ["gpu-0"]
    # MPS shares of MIG devices only on the static MIG devices offered as shares, all of them.
    assert list(selects["mps.mig.nvidia.com"]) == ["hgx-h100-mig+mps-shares"]
    assert (
        selects["mps.mig.nvidia.com"]["hgx-h100-mig+mps-shares"]
        == selects["mig.nvidia.com"]["hgx-h100-mig"]
    )
    assert not any("-mig-" in n for names in selects["mps.gpu.nvidia.com"].values() for n in names)
    for whole in (
        "gpu.nvidia.com",
        "hopper.gpu.nvidia.com",
        "mig.nvidia.com",
        "mig-1g.gpu.nvidia.com",
    ):
        assert not any(p.endswith(("+mps-shares", "+capped-shares")) for p in selects[whole])
    # Capped shares only on GPUs offered as capped shares, and those are not MPS shares.
    assert all(profile.endswith("+capped-shares") for profile in selects["capped.gpu.nvidia.com"])
    assert selects["capped.gpu.nvidia.com"]["t4+capped-shares"] == ["gpu-0"]
    assert not any(p.endswith("+capped-shares") for p in selects["mps.gpu.nvidia.com"])
    assert "hgx-h100" in selects["hopper.gpu.nvidia.com"]
    assert "dgx-a100" not in selects["hopper.gpu.nvidia.com"]
    assert "l4x4" not in selects["large-memory.gpu.nvidia.com"]


# ---- the dynamic MIG profile policy ------------------------------------------------------------

POLICY_WARNING = "selects no dynamic MIG partition published with --dynamic-mig-profiles="


def test_the_default_policy_offers_every_class_of_the_catalog(capsys):
    code, out, _ = run(capsys, str(REPO / "deviceclasses"))

    assert code == EXIT_OK
    assert [w for w in lines(out, "WARNING") if POLICY_WARNING in w] == []


def test_a_class_for_a_profile_the_policy_leaves_out_is_a_warning(capsys):
    code, out, _ = run(capsys, "--dynamic-mig-profiles", "1g,2g,3g,7g", str(REPO / "deviceclasses"))

    assert code == EXIT_OK
    file = REPO / "deviceclasses" / "mig-4g.gpu.nvidia.com.yaml"
    assert [w for w in lines(out, "WARNING") if POLICY_WARNING in w] == [
        f"WARNING {file} DeviceClass/mig-4g.gpu.nvidia.com: {POLICY_WARNING}1g,2g,3g,7g, "
        "only 16 it leaves out (4g.40gb): its claims stay pending on nodes with --dynamic-mig "
        "unless the policy offers those profiles"
    ]


@pytest.mark.parametrize("policy", ["all", "1g,2g,3g,4g,7g", "h100 80gb=1g,2g,3g,4g,7g;1g"])
def test_a_policy_offering_the_profile_silences_the_warning_and_publishes_it(capsys, policy):
    code, out, _ = run(
        capsys, "--dynamic-mig-profiles", policy, "-o", "json", str(REPO / "deviceclasses")
    )

    assert code == EXIT_OK
    report = json.loads(out)
    assert [f for f in report["findings"] if POLICY_WARNING in f["message"]] == []
    selects = {c["name"]: c["selects"] for c in report["classes"]}
    assert sorted(selects["mig-4g.gpu.nvidia.com"]["hgx-h100+dynamic-mig"]) == [
        f"gpu-{minor}-mig-4g40gb-5-0" for minor in range(8)
    ]


def test_a_class_for_media_extension_slices_needs_them_named(capsys, tmp_path):
    media = device_class("media", f"{G}.type == 'mig' && {G}.profile.endsWith('+me')")
    file = write(tmp_path / "media.yaml", media)

    code, out, _ = run(capsys, file)
    assert [w.split(": ", 1)[1] for w in lines(out, "WARNING") if POLICY_WARNING in w] == [
        f"{POLICY_WARNING}1g,2g,3g,4g,7g, only 112 it leaves out (1g.10gb+me): its claims stay "
        "pending on nodes with --dynamic-mig unless the policy offers those profiles"
    ]
    code, out, _ = run(capsys, "--dynamic-mig-profiles", "1g,1g+me,7g", file)
    assert [w for w in lines(out, "WARNING") if POLICY_WARNING in w] == []
    code, _, err = run(capsys, "--dynamic-mig-profiles", "1g;;3g", file)
    assert code == EXIT_USAGE
    assert "--dynamic-mig-profiles: dynamic MIG profiles: two entries without a model" in err


# ---- compile errors, runtime errors, names ----------------------------------------------------


def test_syntax_error_fails_with_file_object_and_selector_path(capsys, tmp_path):
    file = write(
        tmp_path / "bad.yaml",
        device_class("ok", "device.driver == 'gpu.nvidia.com'"),
        device_class("broken", "device.driver == 'gpu.nvidia.com'", "device.driver =="),
    )

    code, out, _ = run(capsys, file)

    assert code == EXIT_FAILED
    [error] = lines(out, "ERROR")
    assert error.startswith(
        f"ERROR {file} DeviceClass/broken: spec.selectors[1].cel.expression: compile error: "
    )
    assert "Syntax error" in error


def test_objects_inside_a_list_are_linted(capsys, tmp_path):
    broken = device_class("broken", "device.driver ==")
    file = write(tmp_path / "list.yaml", {"apiVersion": "v1", "kind": "List", "items": [broken]})

    code, out, _ = run(capsys, file)

    assert code == EXIT_FAILED
    [error] = lines(out, "ERROR")
    assert error.startswith(f"ERROR {file} DeviceClass/broken: spec.selectors[0].cel.expression")


def test_claim_selectors_are_compiled_with_their_request_paths(capsys, tmp_path):
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "a", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
                        {
                            "name": "b",
                            "firstAvailable": [
                                {"name": "x", "deviceClassName": "gpu.nvidia.com"},
                                {
                                    "name": "y",
                                    "deviceClassName": "gpu.nvidia.com",
                                    "selectors": [{"cel": {"expression": "gpuCount > 1"}}],
                                },
                            ],
                        },
                    ]
                }
            }
        },
    }
    file = write(tmp_path / "claim.yaml", claim)

    code, out, _ = run(capsys, file, str(REPO / "deviceclasses" / "gpu.nvidia.com.yaml"))

    assert code == EXIT_FAILED
    [error] = lines(out, "ERROR")
    assert (
        "ResourceClaimTemplate/t: spec.spec.devices.requests[1].firstAvailable[1]"
        ".selectors[0].cel.expression: compile error: " in error
    )
    assert "undeclared reference to 'gpuCount'" in error


def hand_made(name: str, **attributes: str) -> SimulatedDevice:
    return SimulatedDevice(
        "custom",
        {
            "name": name,
            "attributes": {"type": {"string": "gpu"}}
            | {key: {"string": value} for key, value in attributes.items()},
        },
    )


def test_attribute_read_without_has_is_a_runtime_error_on_the_device_lacking_it():
    devices = [
        hand_made("gpu-0", productName="NVIDIA H100 80GB HBM3"),
        hand_made("gpu-1"),  # a device without productName
    ]
    guarded = device_class("guarded", f"has({G}.productName) && {G}.productName == 'x'")
    unguarded = device_class("unguarded", f"{G}.productName.startsWith('NVIDIA')")

    report = lint([Source("c.yaml", [guarded, unguarded])], devices)

    [error] = [f for f in report.findings if f.level == "ERROR"]
    assert error.object == "DeviceClass/unguarded"
    assert error.path == "spec.selectors[0].cel.expression"
    assert "CEL runtime error on 1 of 2 devices" in error.message
    assert "custom/gpu-1" in error.message
    assert error.message.endswith("no such key: productName")
    assert report.failed()


def test_capacity_read_without_guard_fails_on_a_profile_gpu_without_memory(capsys, tmp_path):
    profile = tmp_path / "no-memory.yaml"
    profile.write_text(
        textwrap.dedent(
            """\
            driverVersion: "580.95.05"
            cudaDriverVersion: 13000
            gpus:
              - {model: H100-SXM5-80GB, busId: "0000:1b:00.0"}
              - model: H100-SXM5-80GB
                busId: "0000:2b:00.0"
                faults: {device_get_memory_info: NOT_SUPPORTED}
            """
        )
    )
    file = write(
        tmp_path / "c.yaml", device_class("big", f"{C}.memory.compareTo(quantity('40Gi')) >= 0")
    )

    code, out, _ = run(capsys, "--profile", str(profile), file)

    assert code == EXIT_FAILED
    [error] = lines(out, "ERROR")
    assert "CEL runtime error on 1 of 2 devices, e.g. no-memory/gpu-1" in error
    assert error.endswith("no such key: memory")


def test_memory_read_as_an_attribute_suggests_the_capacity(capsys, tmp_path):
    file = write(tmp_path / "c.yaml", device_class("mem", f"has({G}.memory) && {G}.memory > 0"))

    code, out, _ = run(capsys, file)

    assert code == EXIT_FAILED
    [error] = lines(out, "ERROR")
    assert (
        "device.attributes['gpu.nvidia.com'].memory: gpu-dra never publishes attribute memory; "
        "memory is a capacity: device.capacity['gpu.nvidia.com'].memory" in error
    )


def test_misspelt_attribute_suggests_the_published_name(capsys, tmp_path):
    file = write(
        tmp_path / "c.yaml",
        device_class("typo", f"'prodctName' in {G} && {G}.prodctName == 'NVIDIA L4'"),
    )

    code, out, _ = run(capsys, file)

    assert code == EXIT_FAILED
    [error] = lines(out, "ERROR")  # one finding per name, however often it is read
    assert "gpu-dra never publishes attribute prodctName; did you mean productName: " in error
    assert error.endswith("device.attributes['gpu.nvidia.com'].productName?")


def test_names_in_the_wrong_domain_and_nvidia_only_names():
    report = lint(
        [
            Source(
                "c.yaml",
                [
                    device_class("wrong-domain", f"has({G}.pciBusID)"),
                    device_class("mig", f"has({G}.profile) && {G}.profile == '1g.10gb'"),
                    device_class("fabric", f"has({G}.gpuModuleID) && {G}.gpuModuleID == 1"),
                ],
            )
        ],
        [hand_made("gpu-0", productName="x")],
    )

    by_object = {f.object: f for f in report.findings if f.path}  # the name findings
    assert (
        "it is in domain resource.kubernetes.io: " in by_object["DeviceClass/wrong-domain"].message
    )
    assert "DeviceClass/mig" not in by_object  # gpu-dra publishes profile on MIG devices
    assert by_object["DeviceClass/fabric"].level == "WARNING"
    assert (
        "NVIDIA's driver publishes it with FabricManagerPartitioning"
        in by_object["DeviceClass/fabric"].message
    )


def test_published_names_include_optional_ones_no_profile_has():
    # addressingMode is published where NVML reports it; no simulated profile does.
    report = lint(
        [Source("c.yaml", [device_class("hmm", f"has({G}.addressingMode)")])],
        [hand_made("gpu-0")],
    )

    assert [f.level for f in report.findings] == ["WARNING"]  # selects nothing, name is fine


def test_selector_references_follow_cel_bind_and_ignore_strings():
    expression = (
        f"cel.bind(g, {G}, has(g.profile) && 'uuid' in g && g['brand'] == 'x') && "
        f"{C}.?memory.hasValue() && \"device.attributes['gpu.nvidia.com'].fake\" != '' && "
        f"{G}.productName.startsWith('N')"
    )

    assert selector_references(expression) == [
        Reference("capacity", "gpu.nvidia.com", "memory"),
        Reference("attributes", "gpu.nvidia.com", "productName"),
        Reference("attributes", "gpu.nvidia.com", "profile"),
        Reference("attributes", "gpu.nvidia.com", "uuid"),
        Reference("attributes", "gpu.nvidia.com", "brand"),
    ]


# ---- comparing classes --------------------------------------------------------------------------


def test_identical_classes_warn_and_overlapping_ones_are_info(capsys, tmp_path):
    file = write(
        tmp_path / "c.yaml",
        device_class("l4", f"{G}.productName == 'NVIDIA L4'"),
        device_class("ada", f"{G}.architecture == 'Ada Lovelace'"),
        device_class("all", "device.driver == 'gpu.nvidia.com'"),
    )

    code, out, _ = run(capsys, "--profile", "mixed", file)

    assert code == EXIT_OK
    assert lines(out, "WARNING") == [
        f"WARNING {file} DeviceClass/ada: selects the same 2 devices as DeviceClass/l4 on the "
        "simulated profiles"
    ]
    superset = "selects a superset of DeviceClass/l4 (its 2 devices and 2 more)"
    assert f"INFO {file} DeviceClass/all: {superset}" in out


def test_a_class_adding_a_condition_that_excludes_nothing_is_info_a_reworded_one_warns(
    capsys, tmp_path
):
    big = f"{C}.memory.compareTo(quantity('40Gi')) >= 0"
    file = write(
        tmp_path / "c.yaml",
        # the narrower class first: the finding goes on the later one, naming the narrower
        device_class("training", f"{G}.type == 'gpu' && ({big}) && {G}.brand == 'Nvidia'"),
        device_class("big", f"{G}.type == 'gpu'", big),  # two selectors are ANDed too
        device_class("reworded", f"{G}.productName == 'NVIDIA H100 80GB HBM3'"),
        device_class("or", f"{G}.type == 'gpu' && {big} || {G}.brand == 'Nvidia'"),
    )

    code, out, _ = run(capsys, "--strict", "--profile", "hgx-h100", "--profile", "l4x4", file)

    assert (
        f"INFO {file} DeviceClass/big: selects the same 8 devices as DeviceClass/training on the "
        f"simulated profiles; DeviceClass/training adds {G}.brand == 'Nvidia', which excludes "
        "none of them"
    ) in lines(out, "INFO")
    assert lines(out, "WARNING") == [
        f"WARNING {file} DeviceClass/reworded: selects the same 8 devices as "
        f"DeviceClass/{other} on the simulated profiles"
        for other in ("training", "big")
    ]
    assert code == EXIT_FAILED


def test_a_claim_naming_a_class_not_linted_fails_strict_and_gets_the_closest_class(
    capsys, tmp_path
):
    def claim(class_name: str) -> dict[str, object]:
        request = {"name": "gpu", "exactly": {"deviceClassName": class_name}}
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": {"devices": {"requests": [request]}},
        }

    typo = write(tmp_path / "typo.yaml", claim("gpu.nvidai.com"))
    catalog = str(REPO / "deviceclasses")

    code, out, _ = run(capsys, "--strict", catalog, typo)

    assert code == EXIT_FAILED
    assert lines(out, "WARNING") == [
        f"WARNING {typo} ResourceClaim/c: spec.devices.requests[0].exactly: DeviceClass "
        "gpu.nvidai.com is not among the linted files; did you mean gpu.nvidia.com? (a claim "
        "naming a class the cluster lacks stays pending); the request's selectors were compiled "
        "but not evaluated"
    ]
    assert run(capsys, catalog, typo)[0] == EXIT_OK  # a warning, not an error
    right = write(tmp_path / "right.yaml", claim("gpu.nvidia.com"))
    code, out, _ = run(capsys, "--strict", catalog, right)
    assert (code, lines(out, "WARNING")) == (EXIT_OK, [])


def test_this_drivers_config_under_a_misspelt_driver_name_is_an_error(capsys, tmp_path):
    def config(driver: str, kind: str = "GpuConfig") -> dict[str, object]:
        parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind}
        return {"opaque": {"driver": driver, "parameters": parameters}}

    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}],
                "config": [
                    config("gpu.nvidia.com"),
                    config("gpu.nvidai.com"),
                    config("compute-domain.nvidia.com", "ComputeDomainChannelConfig"),
                ],
            }
        },
    }
    shared = device_class("gpu", "device.driver == 'gpu.nvidia.com'")
    shared["spec"]["config"] = [config("mig.nvidia.com", "MigDeviceConfig")]  # type: ignore[index]
    file = write(tmp_path / "c.yaml", shared, claim)

    code, out, _ = run(capsys, "--profile", "t4", file)

    assert code == EXIT_FAILED
    assert lines(out, "ERROR") == [
        f"ERROR {file} DeviceClass/gpu: spec.config[0]: opaque.driver: mig.nvidia.com is not "
        "gpu.nvidia.com, but the parameters are gpu.nvidia.com's MigDeviceConfig: did you mean "
        "gpu.nvidia.com? As written, gpu.nvidia.com ignores this config",
        f"ERROR {file} ResourceClaim/c: spec.devices.config[1]: opaque.driver: gpu.nvidai.com "
        "is not gpu.nvidia.com, but the parameters are gpu.nvidia.com's GpuConfig: did you mean "
        "gpu.nvidia.com? As written, gpu.nvidia.com ignores this config",
    ]


# ---- output and exit status ---------------------------------------------------------------------


def test_json_output_shape(capsys, tmp_path):
    file = write(
        tmp_path / "c.yaml",
        device_class("t4", f"{G}.productName == 'Tesla T4'"),
        device_class("none", f"{G}.type == 'mig'"),
    )

    code, out, _ = run(capsys, "-o", "json", "--profile", "t4", "--profile", "l4x4", file)

    assert code == EXIT_OK
    data = json.loads(out)
    assert set(data) == {"findings", "classes", "summary", "unreadable"}
    assert data["summary"] == {
        "files": 1,
        "deviceClasses": 2,
        "resourceClaims": 0,
        "resourceClaimTemplates": 0,
        "resourceQuotas": 0,
        "profiles": ["t4", "l4x4"],
        "devices": 5,
        "errors": 0,
        "warnings": 1,
        "infos": 1,
    }
    assert data["classes"][0] == {
        "file": file,
        "name": "t4",
        "evaluated": True,
        "devices": 1,
        "selects": {"t4": ["gpu-0"]},
    }
    assert data["findings"][1] == {
        "level": "WARNING",
        "file": file,
        "object": "DeviceClass/none",
        "path": "",
        "message": "selects no device of the simulated profiles (t4, l4x4)",
    }
    assert data["unreadable"] == []


def test_bad_yaml_exits_2_and_still_lints_the_other_files(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: DeviceClass\nspec: [unclosed\n")
    good = write(tmp_path / "good.yaml", device_class("all", "device.driver == 'gpu.nvidia.com'"))

    code, out, err = run(capsys, str(bad), good)

    assert code == EXIT_USAGE
    assert f"gpu-dra lint: error: {bad}: not valid YAML: line 3" in err
    assert "DeviceClass/all: selects" in out
    assert out.splitlines()[-1].endswith("1 inputs unreadable")


@pytest.mark.parametrize("problem", ["missing file", "empty directory", "unknown profile"])
def test_unusable_inputs_exit_2(capsys, tmp_path, problem):
    good = write(tmp_path / "good.yaml", device_class("all", "device.driver == 'gpu.nvidia.com'"))
    argv = {
        "missing file": [str(tmp_path / "absent.yaml")],
        "empty directory": [str(tmp_path / "empty")],
        "unknown profile": ["--profile", "no-such-profile", good],
    }[problem]
    (tmp_path / "empty").mkdir()

    code, _, err = run(capsys, *argv)

    assert code == EXIT_USAGE
    assert err.startswith("gpu-dra lint: error: ")


def test_malformed_selectors_are_errors_and_stop_evaluation(capsys, tmp_path):
    broken = device_class("broken")
    broken["spec"] = {"selectors": [{"cel": {"expr": "true"}}]}
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {"devices": {"requests": [{"name": "a", "exactly": {"selectors": "x"}}]}},
    }
    file = write(tmp_path / "c.yaml", broken, claim)

    code, out, _ = run(capsys, file)

    assert code == EXIT_FAILED
    assert lines(out, "ERROR") == [
        f"ERROR {file} DeviceClass/broken: spec.selectors[0]: expected a selector with a "
        "cel.expression string",
        f"ERROR {file} ResourceClaim/c: spec.devices.requests[0].exactly.selectors: "
        "expected a list",
    ]
    assert "selects" not in out.replace("gpu-dra lint", "")


def test_claim_requests_are_evaluated_on_the_devices_of_their_class(capsys, tmp_path):
    def request(name: str, class_name: str, expression: str) -> dict[str, object]:
        selectors = [{"cel": {"expression": expression}}]
        return {"name": name, "exactly": {"deviceClassName": class_name, "selectors": selectors}}

    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {
            "devices": {
                "requests": [
                    request("hmm", "l4", f"{G}.addressingMode == 'HMM'"),
                    request("t4", "l4", f"{G}.productName == 'Tesla T4'"),
                    request("elsewhere", "not-linted", "true"),
                ]
            }
        },
    }
    file = write(tmp_path / "c.yaml", device_class("l4", f"{G}.productName == 'NVIDIA L4'"), claim)

    code, out, _ = run(capsys, "--profile", "mixed", file)

    assert code == EXIT_FAILED
    assert lines(out, "ERROR") == [
        f"ERROR {file} ResourceClaim/c: spec.devices.requests[0].exactly.selectors[0]"
        ".cel.expression: CEL runtime error on 2 of 2 devices DeviceClass l4 selects, e.g. "
        "mixed/gpu-2 (NVIDIA L4): no such key: addressingMode"
    ]
    assert lines(out, "WARNING") == [
        f"WARNING {file} ResourceClaim/c: spec.devices.requests[1].exactly: the selectors "
        "reject all 2 devices DeviceClass l4 selects (2x NVIDIA L4)",
        f"WARNING {file} ResourceClaim/c: spec.devices.requests[2].exactly: DeviceClass "
        "not-linted is not among the linted files; lint the claim with its class (e.g. "
        "deviceclasses/), or make sure the cluster has it (a claim naming a class the cluster "
        "lacks stays pending); the request's selectors were compiled but not evaluated",
    ]


SHARE_CLAIMS = """\
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: shares
spec:
  spec:
    devices:
      requests:
        - name: memory-only
          exactly:
            deviceClassName: mps.gpu.nvidia.com
            capacity:
              requests:
                memory: 8Gi
        - name: nothing
          exactly:
            deviceClassName: mps.gpu.nvidia.com
        - name: both
          exactly:
            deviceClassName: mps.gpu.nvidia.com
            capacity:
              requests:
                memory: 8Gi
                compute: "10"
        - name: whole
          exactly:
            deviceClassName: gpu.nvidia.com
"""


def test_lint_says_what_a_share_gets_for_an_amount_it_does_not_name(capsys, tmp_path):
    file = tmp_path / "shares.yaml"
    file.write_text(SHARE_CLAIMS)

    code, out, _ = run(capsys, str(REPO / "deviceclasses"), str(file))

    assert code == EXIT_OK, out
    mine = [line for line in lines(out, "INFO") if "ResourceClaimTemplate/shares" in line]
    where = f"INFO {file} ResourceClaimTemplate/shares: spec.spec.devices.requests"
    gets = (
        "on the shared devices DeviceClass mps.gpu.nvidia.com selects it gets the request "
        "policy's default, 1/4 of the device (the node's --mps-share-replicas; the simulated "
        "nodes use the default)"
    )
    assert mine == [
        f"{where}[0].exactly: names no compute: {gets}",
        f"{where}[1].exactly: names no compute: {gets}",
        f"{where}[1].exactly: names no memory: {gets}",
    ]
