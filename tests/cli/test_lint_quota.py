"""`gpu-dra lint` on ResourceQuotas: the holes a tier quota leaves over the catalog (issue 23,
docs/quotas.md), through the command on the shipped catalog and the recipe's quotas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_dra.cli.__main__ import main
from gpu_dra.cli.command import EXIT_OK
from gpu_dra.cli.lint_quota import LintedClass, Quota, quota_findings, read_quota

REPO = Path(__file__).resolve().parents[2]
CATALOG = str(REPO / "deviceclasses")
SUFFIX = ".deviceclass.resource.k8s.io/devices"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["lint", *argv], environ={})
    return code, capsys.readouterr().out


def quota(hard: dict[str, str], *, labelled: bool = True, namespace: str = "team-a") -> Any:
    metadata: dict[str, Any] = {"name": "gpu-tiers", "namespace": namespace}
    if labelled:
        metadata["labels"] = {"gpu.nvidia.com/tier-quota": "true"}
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": metadata,
            "spec": {"hard": hard}}  # fmt: skip


def write(path: Path, document: Any) -> str:
    path.write_text(yaml.safe_dump(document))
    return str(path)


def findings(out: str, level: str) -> list[str]:
    prefix = f"{level} "
    return [
        line for line in out.splitlines() if line.startswith(prefix) and "ResourceQuota" in line
    ]


def test_the_recipes_quotas_leave_no_hole(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "--strict", CATALOG, str(REPO / "deployments" / "quotas"))

    assert code == EXIT_OK, out
    assert findings(out, "WARNING") == []
    assert findings(out, "INFO") == []
    assert "2 ResourceQuotas" in out


def test_an_unlabelled_quota_names_the_classes_that_get_around_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hard = {f"gpu.nvidia.com{SUFFIX}": "2", "requests.nvidia.com/gpu": "2"}
    path = write(tmp_path / "q.yaml", quota(hard, labelled=False))
    code, out = run(capsys, CATALOG, path)

    (warning,) = findings(out, "WARNING")
    assert warning.startswith(f"WARNING {path} ResourceQuota/gpu-tiers: metadata.labels: ")
    assert "every class it does not name stays unlimited in namespace team-a" in warning
    for other in ("hopper.gpu.nvidia.com", "large-memory.gpu.nvidia.com",
                  "training.gpu.nvidia.com"):  # fmt: skip
        assert other in warning
    assert "mig-1g.gpu.nvidia.com" not in warning  # selects none of the whole GPUs
    assert 'Fix: label it gpu.nvidia.com/tier-quota: "true"' in warning
    assert code == EXIT_OK  # warnings fail only with --strict


def test_two_limited_classes_over_common_devices_are_a_hole(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hard = {f"gpu.nvidia.com{SUFFIX}": "4", f"hopper.gpu.nvidia.com{SUFFIX}": "2",
            "requests.nvidia.com/gpu": "4"}  # fmt: skip
    code, out = run(capsys, "--strict", CATALOG, write(tmp_path / "q.yaml", quota(hard)))

    (warning,) = findings(out, "WARNING")
    assert "limits both gpu.nvidia.com (4) and hopper.gpu.nvidia.com (2), which select" in warning
    assert "claims of one take them without counting against the other's limit" in warning
    assert code != EXIT_OK


def test_a_pod_route_without_its_own_limit_is_reported(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    hard = {f"gpu.nvidia.com{SUFFIX}": "2", f"mps.gpu.nvidia.com{SUFFIX}": "4"}
    _, out = run(capsys, CATALOG, write(tmp_path / "q.yaml", quota(hard)))

    infos = findings(out, "INFO")
    assert len(infos) == 2, infos
    assert any('add requests.nvidia.com/gpu: "2" to refuse them at creation' in i for i in infos)
    assert any('add requests.nvidia.com/gpu.shared: "4"' in i for i in infos)


def test_a_class_the_catalog_lacks_is_named_with_the_closest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(tmp_path / "q.yaml", quota({f"mig-1g.gpu.nvidai.com{SUFFIX}": "2"}))
    _, out = run(capsys, CATALOG, path)

    (warning,) = findings(out, "WARNING")
    assert "limits DeviceClass mig-1g.gpu.nvidai.com, which is not among the linted files" in (
        warning
    )
    assert "did you mean mig-1g.gpu.nvidia.com?" in warning


def test_disjoint_limits_of_zero_are_no_hole() -> None:
    """Two overlapping classes both limited to 0 let nothing through either."""
    devices = frozenset({("p", "gpu-0"), ("p", "gpu-1")})
    classes = {
        "a": LintedClass("a", devices),
        "b": LintedClass("b", frozenset({("p", "gpu-1")})),
        "c": LintedClass("c", frozenset({("p", "gpu-2")})),
    }
    zero = Quota("q", None, True, {f"a{SUFFIX}": "0", f"b{SUFFIX}": "0", f"c{SUFFIX}": "3"})
    some = Quota("q", None, True, {f"a{SUFFIX}": "1", f"b{SUFFIX}": "0"})

    assert quota_findings(zero, classes, str) == []
    ((level, message, _),) = quota_findings(some, classes, str)
    assert level == "WARNING"
    assert message.startswith("limits both a (1) and b (0), which select 1 common devices")


def test_only_v1_resource_quotas_are_read() -> None:
    assert read_quota({"apiVersion": "v1", "kind": "ConfigMap"}) is None
    read = read_quota(quota({"pods": "3"}, labelled=False))
    assert read == Quota("gpu-tiers", "team-a", False, {"pods": "3"})
    assert read is not None
    assert read.classes == {}
