"""Fuzzing prepare with ResourceClaims whose status or spec is changed (Hypothesis; profiles in
tests/fuzzing.py, docs/development.md), on the simulated hgx-h100 node with the real checkpoint
and CDI store: every claim gets its own result, success or an error that names the claim, and
unprepare leaves nothing behind.

A malformed allocation result fails only its own claim, with a message of one line that names
the field (`NodeClaimPreparer.prepare`); names from the claim are quoted and shortened where they
are odd. Claims are nested at most 200 levels here; deeper ones reach prepare with a marker
string where the decoding stopped (test_claim_decoding_fuzz.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from tests.fakes.claim_reader import allocation_result, opaque_config, resource_claim
from tests.fuzzing import cases, mutated, valid_parameters
from tests.kubelet_plugin.nodes import NODE, UID_A, Node

REQUESTS = st.sampled_from(["gpu", "gpu/small", "other"])
GPUS = st.sampled_from([f"gpu-{i}" for i in range(8)])
REF = ClaimRef("default", UID_A, "claim-a")


@st.composite
def claims(draw: st.DrawFn) -> dict[str, Any]:
    """A claim allocated GPUs of this node (maybe one of another), with configs; then one thing
    in its status or spec changed."""
    devices = draw(st.lists(GPUS, min_size=1, max_size=3, unique=True))
    results = [allocation_result(device, request=draw(REQUESTS)) for device in devices]
    if draw(st.booleans()):
        results.append(allocation_result("gpu-0", pool="node-b"))
    configs = draw(
        st.lists(
            st.builds(
                opaque_config, valid_parameters, requests=st.none() | st.lists(REQUESTS, max_size=2)
            ),
            max_size=2,
        )
    )
    claim = resource_claim(UID_A, results=results, claim_configs=configs)
    part = draw(st.sampled_from(["status", "spec"]))
    claim[part], _, _ = draw(mutated(st.just(claim[part]), max_depth=200))
    return claim


@pytest.fixture(scope="module")
def node(inventory: NodeInventory) -> Iterator[Node]:
    with tempfile.TemporaryDirectory(prefix="gpu-dra-prepare-fuzz-") as root:
        yield Node(Path(root), inventory)


MAX_MESSAGE_CHARS = 4000  # ConfigError: 10 problems of at most 300 characters, and the claim


@cases(ci=40, full=3_000)
@given(claim=claims())
def test_any_claim_is_prepared_or_refused_naming_the_claim(
    node: Node, claim: dict[str, Any]
) -> None:
    node.add(claim)
    result = node.prepare(REF)[UID_A]
    if result.error is not None:
        assert result.error.startswith(f"claim default/claim-a ({UID_A}): ")
        assert "unexpected" not in result.error, result.error[:500]
        assert "\n" not in result.error, result.error[:500]
        assert len(result.error) <= MAX_MESSAGE_CHARS, result.error[:500]
    else:
        assert all(device.pool_name == NODE for device in result.devices)
    assert node.unprepare(REF) == {UID_A: None}
    node.assert_nothing_left(UID_A)


# ---- malformed allocations and odd names (each raised or was shown as is before its fix) ----
@pytest.fixture
def fresh(tmp_path: Path, inventory: NodeInventory) -> Node:
    return Node(tmp_path, inventory)


def allocated(results: object) -> dict[str, Any]:
    claim = resource_claim(UID_A, results=[allocation_result("gpu-0")])
    claim["status"]["allocation"]["devices"]["results"] = results
    return claim


@pytest.mark.parametrize(
    "results",
    [
        None,  # TypeError: 'NoneType' object is not iterable
        [5],  # AttributeError: 'int' object has no attribute 'get'
        [{"driver": "gpu.nvidia.com", "pool": NODE, "request": "gpu"}],  # KeyError: 'device'
        [{"driver": "gpu.nvidia.com", "pool": NODE, "device": ["gpu-0"], "request": "gpu"}],
        [{"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0", "request": None}],
    ],
    ids=["null", "not-an-object", "no-device", "device-list", "request-null"],
)
def test_a_malformed_result_fails_only_its_claim_with_a_message(
    fresh: Node, results: object
) -> None:
    fresh.add(allocated(results))
    result = fresh.prepare(REF)[UID_A]
    assert result.error is not None
    assert result.error.startswith(f"claim default/claim-a ({UID_A}): ")


def test_the_message_about_an_unknown_device_stays_one_line(fresh: Node) -> None:
    fresh.add(allocated([allocation_result("gpu-0\n" + "x" * 10_000)]))
    error = fresh.prepare(REF)[UID_A].error
    shown = repr("gpu-0\n" + "x" * 31 + "...")  # quoted, escaped, cut to 40 characters
    assert error == (
        f"claim default/claim-a ({UID_A}): allocated device {shown} does not exist on node "
        f"{NODE}; the ResourceSlice it came from is stale"
    )


def test_a_malformed_spec_that_prepare_does_not_read_does_not_fail_it(fresh: Node) -> None:
    """Prepare reads the allocation (devices and its config), never spec: a spec that is not an
    object (the apiserver would not store it) is not a reason to fail."""
    claim = allocated([allocation_result("gpu-0")])
    claim["spec"] = []
    fresh.add(claim)
    result = fresh.prepare(REF)[UID_A]
    assert result.error is None
    assert [d.device_name for d in result.devices] == ["gpu-0"]


@pytest.mark.parametrize(
    ("part", "value", "message"),
    [
        ("status", [1], "the claim's status is not an object: an array"),
        ("status", [], "the claim's status is not an object: an array"),
        (
            "status",
            {"allocation": [1]},
            "the claim's status.allocation is not an object: an array",
        ),
        ("status", {"allocation": {"devices": []}}, "status.allocation.devices is not an object"),
    ],
    ids=["status", "status-empty-list", "allocation", "devices"],
)
def test_a_malformed_allocation_fails_only_its_claim_naming_the_field_for_good(
    fresh: Node, part: str, value: object, message: str
) -> None:
    """A malformation the claim keeps (never fixed by a retry) is reported as such: the field,
    not an unexpected exception, and no "(will retry)"."""
    claim = allocated([allocation_result("gpu-0")])
    claim[part] = value
    fresh.add(claim)
    result = fresh.prepare(REF)[UID_A]
    assert result.error is not None
    assert message in result.error
    assert "unexpected" not in result.error
    assert not result.error.endswith("(will retry)")
