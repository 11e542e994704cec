"""bench/slice_bytes.py: a node's slices per publishing shape, as the plugin writes them, and
their size (issue 15). The slices are valid for the apiserver (the fake API's validation) and
hold exactly what the plugin's inventory publishes."""

from __future__ import annotations

import json

import pytest

from bench.slice_bytes import SHAPES, main, measure, node_slices, stored, stored_bytes
from gpu_dra.driver.mig_policy import parse_policy
from tests.fakes.slice_api import validate_slice

NODE = "bench-node-007"


@pytest.mark.parametrize(
    ("shape", "devices", "slices"),
    [("whole", 8, 1), ("mps-shares", 8, 1), ("dynamic-mig-all", 208, 5), ("dynamic-mig", 120, 3)],
)
def test_each_shape_renders_the_plugins_slices_for_the_node(
    shape: str, devices: int, slices: int
) -> None:
    rendered = node_slices(NODE, shape)

    assert len(rendered) == slices
    assert sum(len(s["spec"].get("devices", [])) for s in rendered) == devices
    for index, body in enumerate(rendered):
        validate_slice(stored(body, index))
        assert body["spec"]["nodeName"] == NODE
        assert body["metadata"]["generateName"] == f"{NODE}-gpu.nvidia.com-"
        (owner,) = body["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("Node", NODE, True)
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in rendered} == {slices}


def test_the_policy_decides_the_dynamic_mig_devices() -> None:
    rendered = node_slices(NODE, "dynamic-mig", policy=parse_policy("3g,7g"))
    names = {d["name"] for s in rendered for d in s["spec"].get("devices", [])}
    assert len(names) == 8 * 4
    assert {n.split("-mig-")[1].split("-")[0] for n in names if "-mig-" in n} == {
        "3g40gb",
        "7g80gb",
    }
    with pytest.raises(ValueError, match="unknown shape 'mig'"):
        node_slices(NODE, "mig")


def test_stored_bytes_are_the_compact_json_of_what_the_apiserver_keeps() -> None:
    rendered = node_slices(NODE, "whole")
    (body,) = rendered
    kept = stored(body, 0)
    assert kept["metadata"]["name"].startswith(f"{NODE}-gpu.nvidia.com-")
    assert "generateName" not in kept["metadata"]
    assert kept["metadata"]["managedFields"][0]["operation"] == "Update"
    assert stored_bytes(rendered) == len(json.dumps(kept, separators=(",", ":")).encode())
    sizes = {shape: measure(shape).bytes for shape in SHAPES}
    assert sizes["whole"] < sizes["mps-shares"] < sizes["dynamic-mig"] < sizes["dynamic-mig-all"]


def test_the_command_prints_one_line_per_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "--dynamic-mig-profiles", "1g,7g"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["shape"] for row in rows] == list(SHAPES)
    assert rows[3]["devices"] == 8 * 9  # 1g x7, 7g and the whole GPU
    assert rows[3]["counterSets"] == 8
