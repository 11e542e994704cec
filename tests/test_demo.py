"""The demo's examples and stages, checked without a cluster: every example runs in exactly one
stage, its opaque configs and CEL selectors pass `gpu-dra check-config` and `gpu-dra lint`, and
each stage's plugin flags are accepted on the demo node and publish what its examples need.
(e2e/test_demo_examples.py runs the examples on the real local cluster.)"""

from __future__ import annotations

import pytest

from demo.stages import (
    MPS_SHARE_GPU,
    PROFILE,
    STAGES,
    Stage,
    example_dirs,
    namespace_of,
    published_devices,
    stage_of,
)
from gpu_dra.cli.__main__ import main
from gpu_dra.cli.command import EXIT_OK

EXAMPLES = example_dirs()


def test_every_example_runs_in_exactly_one_stage_in_the_examples_order() -> None:
    assert [name for stage in STAGES for name in stage.examples] == [p.name for p in EXAMPLES]
    for example in EXAMPLES:
        assert stage_of(example).examples.count(example.name) == 1
        assert (example / "README.md").read_text().startswith("# ")
    namespaces = [namespace_of(example) for example in EXAMPLES]
    assert len(set(namespaces)) == len(namespaces)  # a stage deletes exactly its examples


def test_an_example_in_no_stage_is_named() -> None:
    with pytest.raises(ValueError, match=r"10-new is in no stage of demo/stages\.py"):
        stage_of(PROFILE.parent / "examples" / "10-new")


def test_examples_pass_check_config_and_lint_on_the_demo_node(
    capsys: pytest.CaptureFixture[str],
) -> None:
    files = [str(example / "example.yaml") for example in EXAMPLES]
    assert main(["check-config", *files], environ={}) == EXIT_OK, capsys.readouterr().out
    capsys.readouterr()
    code = main(["lint", "--profile", str(PROFILE), "deviceclasses", *files], environ={})
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "ERROR" not in out


@pytest.mark.parametrize("stage", STAGES, ids=[s.flags for s in STAGES])
def test_each_stage_flags_publish_what_its_examples_ask_for(stage: Stage) -> None:
    published = published_devices(stage)
    types = {d["attributes"]["type"]["string"] for d in published}
    shared = [d for d in published if d.get("allowMultipleAllocations")]
    if "06-dynamic-mig" in stage.examples:
        assert "mig" in types
    if "07-mps-shares" in stage.examples:
        assert [d["name"] for d in shared] == [f"gpu-{MPS_SHARE_GPU}"]
        assert shared[0]["attributes"]["productName"]["string"] == "NVIDIA A100 80GB PCIe"
    else:
        assert shared == []
