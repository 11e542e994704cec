"""Counting share memory against a namespace's quota (`gpu_dra.driver.cluster.share_memory`):
which classes serve shares, what a claim asks for, limits, the ledger and its pruning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_dra.driver.cluster import share_memory as sm
from gpu_dra.driver.cluster.tier_quota import SHARE_MEMORY

GI = 2**30
MI = 2**20
SHARE_CLASSES = frozenset({"mps.gpu.nvidia.com", "mps.mig.nvidia.com", "capped.gpu.nvidia.com"})
CATALOG = Path(__file__).parents[2] / "deviceclasses"


def request(device_class: str, memory: str | None = None, **fields: Any) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class, **fields}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory, "compute": "10"}}
    return {"name": "r", "exactly": exactly}


def spec(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"devices": {"requests": list(requests)}}


def test_the_catalogs_share_classes_are_those_that_require_multiple_allocations() -> None:
    classes = [
        document
        for path in sorted(CATALOG.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]
    assert sm.share_classes(classes) == SHARE_CLASSES


@pytest.mark.parametrize(
    ("expression", "share"),
    [
        ("device.driver == 'x' && device.allowMultipleAllocations", True),
        ("device.allowMultipleAllocations &&\n  device.driver == 'x'", True),
        ("device.driver == 'x' && !device.allowMultipleAllocations", False),
        ("device.allowMultipleAllocations || device.driver == 'x'", False),
        ("device.driver == 'x'", False),
    ],
)
def test_a_share_class_requires_multiple_allocations_as_a_top_level_term(
    expression: str, share: bool
) -> None:
    device_class = {
        "metadata": {"name": "c"},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }
    assert sm.is_share_class(device_class) is share


def test_a_claim_counts_each_share_request_times_its_count_rounded_up_to_mib() -> None:
    claim = spec(
        request("mps.gpu.nvidia.com", "8Gi"),
        request("capped.gpu.nvidia.com", "1000Ki", count=2),
        request("gpu.nvidia.com"),  # a whole GPU: no share memory
    )
    assert sm.claim_share_memory(claim, SHARE_CLASSES, None) == 8 * GI + 2 * MI


def test_an_unnamed_amount_counts_as_the_largest_default_share() -> None:
    claim = spec(request("mps.gpu.nvidia.com", count=2))
    assert sm.needs_unnamed(claim, SHARE_CLASSES)
    assert sm.claim_share_memory(claim, SHARE_CLASSES, 20389 * MI) == 2 * 20389 * MI
    with pytest.raises(sm.UnsizedShareError, match=r"names no capacity\.requests\.memory"):
        sm.claim_share_memory(claim, SHARE_CLASSES, None)
    assert not sm.needs_unnamed(spec(request("mps.gpu.nvidia.com", "1Gi")), SHARE_CLASSES)


def test_first_available_counts_its_largest_share_subrequest() -> None:
    claim = spec(
        {
            "name": "any",
            "firstAvailable": [
                {"name": "big", "deviceClassName": "mps.gpu.nvidia.com",
                 "capacity": {"requests": {"memory": "20Gi"}}},
                {"name": "whole", "deviceClassName": "gpu.nvidia.com"},
                {"name": "small", "deviceClassName": "mps.mig.nvidia.com", "count": 3,
                 "capacity": {"requests": {"memory": "4Gi"}}},
            ],
        }
    )  # fmt: skip
    assert sm.claim_share_memory(claim, SHARE_CLASSES, None) == 20 * GI


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"allocationMode": "All"}, "allocationMode 'All' of share class mps.gpu.nvidia.com"),
        ({"count": 0}, r"requests\[0\].exactly.count: expected a whole number"),
        ({"capacity": {"requests": {"memory": "lots"}}}, "is not a Kubernetes quantity"),
        ({"capacity": {"requests": {"memory": 8}}}, "expected a quantity, got"),
    ],
)
def test_a_share_request_that_cannot_be_counted_is_an_error_naming_it(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(sm.ShareQuotaError, match=message):
        sm.claim_share_memory(spec(request("mps.gpu.nvidia.com", **fields)), SHARE_CLASSES, GI)


def test_the_unnamed_share_is_the_largest_default_of_the_drivers_share_devices() -> None:
    def device(default: str, multiple: bool = True) -> dict[str, Any]:
        memory = {"value": "80Gi", "requestPolicy": {"default": default}}
        return {"name": "d", "allowMultipleAllocations": multiple, "capacity": {"memory": memory}}

    slices = [
        {"spec": {"driver": "gpu.nvidia.com", "devices": [device("20389Mi"), device("6Gi")]}},
        {"spec": {"driver": "gpu.nvidia.com", "devices": [device("70Gi", multiple=False)]}},
        {"spec": {"driver": "other.example.com", "devices": [device("40Gi")]}},
        {"spec": {"driver": "gpu.nvidia.com", "devices": [device("junk")]}},
    ]
    assert sm.unnamed_share_memory(slices, "gpu.nvidia.com") == 20389 * MI
    assert sm.unnamed_share_memory(slices[1:2], "gpu.nvidia.com") is None


def quota(name: str, hard: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"hard": hard}}


def test_limits_come_from_the_share_memory_key_and_a_bad_value_names_the_quota() -> None:
    quotas = [quota("gpu", {SHARE_MEMORY: "64Gi", "pods": "10"}), quota("other", {"pods": "1"})]
    assert sm.share_memory_limits(quotas) == (sm.Limit("gpu", 64 * GI),)
    with pytest.raises(
        sm.ShareQuotaError, match=r"ResourceQuota gpu: spec.hard\[gpu.nvidia.com/share-memory\]"
    ):
        sm.share_memory_limits([quota("gpu", {SHARE_MEMORY: "much"})])


LIMIT = (sm.Limit("gpu", 64 * GI),)


def test_a_claim_that_fits_is_entered_and_one_that_does_not_is_refused_as_quota_words_it() -> None:
    ledger = {"a": sm.LedgerEntry("a", 56 * GI, 100.0)}
    existing = {"a": ("a", 56 * GI)}
    fits = sm.admit("b", "b", 8 * GI, limits=LIMIT, ledger=ledger, existing=existing, now=200.0)
    assert fits.allowed
    assert fits.ledger["b"] == sm.LedgerEntry("b", 8 * GI, 200.0)
    refused = sm.admit(
        "c", "c", 8 * GI, limits=LIMIT, ledger=fits.ledger, existing=existing, now=201.0
    )
    assert not refused.allowed
    assert refused.message == (
        "exceeded quota: gpu, requested: gpu.nvidia.com/share-memory=8Gi, used: "
        "gpu.nvidia.com/share-memory=64Gi, limited: gpu.nvidia.com/share-memory=64Gi"
    )
    assert "c" not in refused.ledger


def test_unconfirmed_entries_of_missing_claims_are_kept_for_the_grace_confirmed_ones_not() -> None:
    ledger = {
        "never-seen": sm.LedgerEntry("never-seen", 60 * GI, 0.0),
        "deleted": sm.LedgerEntry("deleted", 60 * GI, 995.0, confirmed=True),
        "on-its-way": sm.LedgerEntry("on-its-way", 60 * GI, 990.0),
        "stored": sm.LedgerEntry("stored", 0, 990.0),
    }
    existing = {"stored": ("stored", 0)}
    refused = sm.admit("n", "n", 8 * GI, limits=LIMIT, ledger=ledger, existing=existing, now=1000.0)
    assert not refused.allowed  # the claim admitted 10 s ago may not be stored yet
    assert refused.ledger == {
        "on-its-way": ledger["on-its-way"],
        "stored": sm.LedgerEntry("stored", 0, 990.0, confirmed=True),
    }
    ledger = {"on-its-way": ledger["on-its-way"]}
    later = sm.admit("n", "n", 8 * GI, limits=LIMIT, ledger=ledger, existing={}, now=1200.0)
    assert later.allowed
    assert set(later.ledger) == {"n"}


def test_existing_claims_the_ledger_lacks_count_too_and_a_repeated_review_is_allowed() -> None:
    existing = {"old": ("old", 60 * GI)}
    refused = sm.admit("n", "n", 8 * GI, limits=LIMIT, ledger={}, existing=existing, now=0.0)
    assert not refused.allowed
    assert "used: gpu.nvidia.com/share-memory=60Gi" in refused.message
    entered = {"n": sm.LedgerEntry("n", 8 * GI, 0.0)}
    again = sm.admit("n", "n", 8 * GI, limits=LIMIT, ledger=entered, existing={}, now=1.0)
    assert again.allowed
    assert again.ledger == entered


def test_every_limit_must_hold() -> None:
    limits = (sm.Limit("wide", 64 * GI), sm.Limit("narrow", 4 * GI))
    refused = sm.admit("n", "n", 8 * GI, limits=limits, ledger={}, existing={}, now=0.0)
    assert refused.message.startswith("exceeded quota: narrow,")


def test_the_ledger_round_trips_and_a_corrupt_one_is_an_error_naming_the_entry() -> None:
    ledger = {"u1": sm.LedgerEntry("a", GI, 1.5), "u2": sm.LedgerEntry("b", 2 * GI, 2.0, True)}
    assert sm.decode_ledger(sm.encode_ledger(ledger), "cm") == ledger
    assert sm.decode_ledger(None, "cm") == {}
    with pytest.raises(sm.ShareQuotaError, match="cm: entry 'u1': expected a JSON object"):
        sm.decode_ledger({"u1": "[1]"}, "cm")
    with pytest.raises(sm.ShareQuotaError, match="cm: entry 'u1': expected name and memoryBytes"):
        sm.decode_ledger({"u1": '{"name": "a", "memoryBytes": "1Gi", "admittedAt": 1}'}, "cm")
