"""The ``--dynamic-mig-profiles`` policy: its text, and which profiles it offers on which GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_dra.driver.mig_policy import (
    DEFAULT,
    EVERYTHING,
    MigPolicy,
    MigPolicyError,
    parse_policy,
    profile_suffix,
)
from gpu_dra.driver.model import MigCapableGpu
from tests.driver.test_partitions import mig_gpu


def offered(policy: MigPolicy, gpu: MigCapableGpu) -> list[str]:
    return [profile.name for profile in policy.offered(gpu.gpu, gpu.profiles)]


H100 = "H100-SXM5-80GB"


def test_shapes_pick_the_plain_profile_of_fewest_memory_slices() -> None:
    gpu = mig_gpu(H100)
    assert offered(parse_policy("1g"), gpu) == ["1g.10gb"]  # not 1g.20gb, not 1g.10gb+me
    assert offered(parse_policy("1g+me"), gpu) == ["1g.10gb+me"]
    assert offered(parse_policy("4g, 7G"), gpu) == ["4g.40gb", "7g.80gb"]
    assert offered(parse_policy("5g,2g+gfx"), gpu) == []  # no such shape on an H100
    assert offered(DEFAULT, gpu) == ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]


def test_a_shape_takes_every_profile_tied_for_fewest_memory_slices() -> None:
    """go-nvml's mock H100 gives 1g.20gb the 1g.10gb placements (one slice each): NVML's
    answers decide, the same way in real mode and in the simulator (docs/real-nodes.md)."""
    gpu = mig_gpu(H100)
    mock_like = replace(
        gpu,
        profiles=tuple(
            replace(p, placement_starts=tuple(range(7)), placement_size=1)
            if p.name == "1g.20gb"
            else p
            for p in gpu.profiles
        ),
    )
    assert offered(parse_policy("1g"), mock_like) == ["1g.10gb", "1g.20gb"]
    assert offered(DEFAULT, mock_like) == [
        "1g.10gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
        "1g.20gb",
    ]


def test_names_pick_exactly_that_profile_where_the_gpu_has_it() -> None:
    assert offered(parse_policy("1g.20gb,1g.10gb+me"), mig_gpu(H100)) == [
        "1g.10gb+me",
        "1g.20gb",
    ]  # in NVML's profile order
    assert offered(parse_policy("1g.20gb,1g.18gb"), mig_gpu("H200-141GB")) == ["1g.18gb"]


def test_all_offers_every_profile() -> None:
    gpu = mig_gpu("A30")
    assert offered(EVERYTHING, gpu) == [profile.name for profile in gpu.profiles]
    assert offered(parse_policy("1g,all"), gpu) == offered(EVERYTHING, gpu)
    assert EVERYTHING.publishes_everything
    assert not DEFAULT.publishes_everything
    assert not parse_policy("H100=all").publishes_everything


def test_model_entries_match_the_product_name_first_match_first() -> None:
    h100 = mig_gpu(H100)  # "NVIDIA H100 80GB HBM3"
    a100 = mig_gpu("A100-SXM4-80GB")
    policy = parse_policy("h100 80GB=7g; H100=1g; 3g")
    assert offered(policy, h100) == ["7g.80gb"]
    assert offered(policy, a100) == ["3g.40gb"]
    only_h100 = parse_policy("H100=1g")
    assert offered(only_h100, a100) == []  # no entry covers the A100: it is not partitioned
    renamed = replace(h100, gpu=replace(h100.gpu, product_name="NVIDIA H100 NVL"))
    assert offered(policy, renamed) == ["1g.10gb"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no entry"),
        (" ; ", "no entry"),
        ("1g,3g.40", "'3g.40' is not a MIG profile"),
        ("0g", "'0g' is not a MIG profile"),
        ("1c.3g.40gb", "'1c.3g.40gb' is not a MIG profile"),
        ("H100=", "no profile named"),
        ("H100=1g;h100=3g", "two entries for model 'h100'"),
        ("1g;3g", "two entries without a model"),
        ("H/100=1g", "'H/100' is not a GPU model"),
    ],
)
def test_bad_policies_are_errors_naming_the_entry(text: str, message: str) -> None:
    with pytest.raises(MigPolicyError, match=message):
        parse_policy(text)


def test_the_suffix_of_a_profile_name() -> None:
    assert profile_suffix("1g.10gb+me") == "+me"
    assert profile_suffix("1g.23gb+gfx") == "+gfx"
    assert profile_suffix("3g.40gb") == ""


TOKENS = st.sampled_from(
    ["all", "1g", "2g", "3g", "4g", "7g", "1g+me", "1g.10gb", "1g.20gb", "3g.40gb+me"]
)
ENTRY = st.tuples(
    st.sampled_from([None, "H100", "A100", "H200 141GB"]),
    st.lists(TOKENS, min_size=1, max_size=4),
)


@given(st.lists(ENTRY, min_size=1, max_size=4, unique_by=lambda entry: entry[0]))
def test_a_policy_reads_back_from_its_text(entries: list[tuple[str | None, list[str]]]) -> None:
    text = ";".join(
        ",".join(tokens) if model is None else f"{model}={','.join(tokens)}"
        for model, tokens in entries
    )
    policy = parse_policy(text)

    assert parse_policy(str(policy)) == policy
    for model in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H200 141GB"):
        gpu = mig_gpu(H100)
        renamed = replace(gpu, gpu=replace(gpu.gpu, product_name=model))
        assert offered(parse_policy(str(policy)), renamed) == offered(policy, renamed)
