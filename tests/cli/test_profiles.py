"""`gpu-dra profiles`: the built-in simulated machine profiles."""

from __future__ import annotations

import json

from gpu_dra.cli.command import EXIT_OK
from gpu_dra.driver.nvml.simulated_profiles import builtin_profile_names
from tests.cli.support import run, table


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
