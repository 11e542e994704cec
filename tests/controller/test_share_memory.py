"""The share-memory quota check (`gpu_dra.controller.share_memory`) against an in-memory API
that keeps resourceVersions as the apiserver does: verdicts, the ledger, failures refused with
their cause, and concurrent reviews (threads, several "replicas") of which only those that fit
pass."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

import pytest

from gpu_dra.controller.share_memory import (
    LedgerObject,
    ShareMemoryQuota,
    ledger_name,
)
from gpu_dra.driver.cluster import share_memory as sm
from gpu_dra.driver.cluster.tier_quota import SHARE_MEMORY
from gpu_dra.kube import errors

GI = 2**30
NAMESPACE = "team-a"
MPS = "mps.gpu.nvidia.com"
CLASSES: list[dict[str, Any]] = [
    {
        "metadata": {"name": MPS},
        "spec": {"selectors": [{"cel": {"expression": "device.allowMultipleAllocations"}}]},
    },
    {"metadata": {"name": "gpu.nvidia.com"}, "spec": {"selectors": []}},
]


class FakeApi:
    """Quotas, claims, slices and ledger ConfigMaps; writes check resourceVersions."""

    def __init__(self) -> None:
        self.quotas: dict[str, list[dict[str, Any]]] = {}
        self.claims: dict[str, list[dict[str, Any]]] = {}
        self.slices: list[dict[str, Any]] = []
        self.ledgers: dict[str, LedgerObject] = {}
        self.lock = threading.Lock()
        self.version = 0
        self.writes = 0
        self.conflicts = 0
        self.fail: dict[str, errors.ApiError] = {}
        self.before_write: Callable[[], None] = lambda: None

    def _maybe_fail(self, what: str) -> None:
        if what in self.fail:
            raise self.fail[what]

    def list_quotas(self, namespace: str) -> list[dict[str, Any]]:
        self._maybe_fail("quotas")
        return list(self.quotas.get(namespace, []))

    def list_claims(self, namespace: str) -> list[dict[str, Any]]:
        self._maybe_fail("claims")
        return list(self.claims.get(namespace, []))

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._maybe_fail("claims")
        found = [c for c in self.claims.get(namespace, []) if c["metadata"]["name"] == name]
        return found[0] if found else None

    def list_slices(self) -> list[dict[str, Any]]:
        self._maybe_fail("slices")
        return list(self.slices)

    def read_ledger(self, name: str) -> LedgerObject | None:
        self._maybe_fail("ledger")
        with self.lock:
            return self.ledgers.get(name)

    def _store(self, name: str, data: dict[str, str]) -> None:
        self.version += 1
        self.writes += 1
        self.ledgers[name] = LedgerObject(dict(data), str(self.version))

    def create_ledger(self, name: str, data: dict[str, str]) -> None:
        self.before_write()
        with self.lock:
            if name in self.ledgers:
                self.conflicts += 1
                raise errors.AlreadyExistsError(f"configmaps {name} already exists")
            self._store(name, data)

    def replace_ledger(self, name: str, data: dict[str, str], resource_version: str) -> None:
        self.before_write()
        with self.lock:
            if self.ledgers[name].resource_version != resource_version:
                self.conflicts += 1
                raise errors.ConflictError("the object has been modified")
            self._store(name, data)


def claim_object(name: str, memory: str | None, uid: str | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": MPS}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid or f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "share", "exactly": exactly}]}},
    }


def create(claim: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "uid": "review-" + claim["metadata"]["uid"],
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
        "operation": "CREATE",
        "namespace": claim["metadata"]["namespace"],
        "object": claim,
        **fields,
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def api() -> FakeApi:
    fake = FakeApi()
    quota = {"metadata": {"name": "gpu"}, "spec": {"hard": {SHARE_MEMORY: "16Gi"}}}
    fake.quotas[NAMESPACE] = [quota]
    return fake


@pytest.fixture
def clock() -> Clock:
    return Clock()


class Spawned(list[Callable[[], None]]):
    """The confirmations the check started, run when the test says."""

    def run(self) -> None:
        while self:
            self.pop(0)()


@pytest.fixture
def spawned() -> Spawned:
    return Spawned()


@pytest.fixture
def check(api: FakeApi, clock: Clock, spawned: Spawned) -> ShareMemoryQuota:
    return ShareMemoryQuota(
        api, lambda: CLASSES, driver="gpu.nvidia.com", clock=clock, sleep=lambda _: None,
        spawn=spawned.append,
    )  # fmt: skip


def store(api: FakeApi, claim: dict[str, Any]) -> None:
    """The apiserver stores an admitted claim."""
    api.claims.setdefault(NAMESPACE, []).append(claim)


def test_two_8gi_shares_fit_16gi_and_a_third_is_refused_until_one_is_deleted(
    api: FakeApi, check: ShareMemoryQuota, spawned: Spawned
) -> None:
    first, second = claim_object("a", "8Gi"), claim_object("b", "8Gi")
    for claim in (first, second):
        assert check.review(create(claim)).allowed
        store(api, claim)
    spawned.run()  # the claims are seen stored: their entries confirmed
    ledger = sm.decode_ledger(api.ledgers[ledger_name(NAMESPACE)].data, "cm")
    assert all(entry.confirmed for entry in ledger.values())
    third = check.review(create(claim_object("c", "8Gi")))
    assert not third.allowed
    assert third.code == HTTPStatus.FORBIDDEN
    assert third.message == (
        "exceeded quota: gpu, requested: gpu.nvidia.com/share-memory=8Gi, used: "
        "gpu.nvidia.com/share-memory=16Gi, limited: gpu.nvidia.com/share-memory=16Gi"
    )
    # Deleting a claim frees its memory at once (confirmed, and gone from the list).
    api.claims[NAMESPACE].remove(first)
    assert check.review(create(claim_object("d", "8Gi"))).allowed
    ledger = api.ledgers[ledger_name(NAMESPACE)].data or {}
    assert sorted(sm.decode_ledger(ledger, "cm")) == ["uid-b", "uid-d"]


def test_an_entry_never_seen_stored_counts_until_the_grace_ends(
    api: FakeApi, check: ShareMemoryQuota, clock: Clock, spawned: Spawned
) -> None:
    """A claim admitted but not (yet) stored may be on its way: it counts for the grace, then
    its entry is pruned (another admission step refused it). A confirmation that never finds the
    claim gives up at the grace without writing."""
    assert check.review(create(claim_object("on-its-way", "16Gi"))).allowed
    writes = api.writes
    spawned.run()
    assert api.writes == writes
    assert not check.review(create(claim_object("n", "8Gi"))).allowed
    clock.now += sm.LEDGER_GRACE_S
    assert check.review(create(claim_object("n", "8Gi"))).allowed
    assert sorted(sm.decode_ledger(api.ledgers[ledger_name(NAMESPACE)].data, "cm")) == ["uid-n"]


@pytest.mark.parametrize("ledger_exists", [True, False], ids=["update", "create"])
def test_concurrent_reviews_on_several_replicas_admit_only_what_fits(
    api: FakeApi, clock: Clock, ledger_exists: bool
) -> None:
    """Eight 4Gi claims reviewed at once by four checks (replicas) that all read the ledger
    before any writes: exactly four fit 16Gi; the others see the winners' entries on retry
    (after a Conflict, or AlreadyExists for the namespace's first ledger)."""
    replicas = [
        ShareMemoryQuota(api, lambda: CLASSES, driver="gpu.nvidia.com", clock=clock,
                         sleep=lambda _: None, spawn=lambda _: None)
        for _ in range(4)
    ]  # fmt: skip
    if ledger_exists:
        api.ledgers[ledger_name(NAMESPACE)] = LedgerObject({}, "0")
    claims = [claim_object(f"c{i}", "4Gi") for i in range(8)]
    barrier = threading.Barrier(len(claims))
    first_write = threading.local()

    def hold_first_write() -> None:
        if not getattr(first_write, "done", False):
            first_write.done = True
            barrier.wait(timeout=10)  # everybody has read the (empty) ledger

    api.before_write = hold_first_write
    with ThreadPoolExecutor(len(claims)) as pool:
        verdicts = list(
            pool.map(lambda i: replicas[i % 4].review(create(claims[i])), range(len(claims)))
        )
    allowed = [v for v in verdicts if v.allowed]
    assert len(allowed) == 4
    assert all("exceeded quota: gpu" in v.message for v in verdicts if not v.allowed)
    assert api.conflicts >= 7  # every loser of a round read again
    entries = sm.decode_ledger(api.ledgers[ledger_name(NAMESPACE)].data, "cm")
    assert sum(e.memory_bytes for e in entries.values()) == 16 * GI


def test_a_namespace_without_a_share_memory_limit_is_not_limited_and_costs_no_write(
    api: FakeApi, check: ShareMemoryQuota
) -> None:
    api.quotas[NAMESPACE] = [{"metadata": {"name": "gpu"}, "spec": {"hard": {"pods": "5"}}}]
    assert check.review(create(claim_object("big", "64Gi"))).allowed
    api.quotas[NAMESPACE] = []
    assert check.review(create(claim_object("big2", "64Gi"))).allowed
    assert api.writes == 0


def test_claims_without_share_requests_and_other_operations_are_not_checked(
    api: FakeApi, check: ShareMemoryQuota
) -> None:
    api.fail["quotas"] = errors.ApiError("should not be read")
    whole = claim_object("whole", None)
    whole["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.nvidia.com"
    assert check.review(create(whole)).allowed
    assert check.review(create(claim_object("s", "8Gi"), operation="UPDATE")).allowed


@pytest.mark.parametrize("failing", ["quotas", "claims", "ledger"])
def test_a_read_that_fails_refuses_the_claim_with_the_cause(
    api: FakeApi, check: ShareMemoryQuota, failing: str
) -> None:
    api.fail[failing] = errors.ApiError(f"list {failing}: 503 ServiceUnavailable: etcd is down")
    verdict = check.review(create(claim_object("s", "8Gi")))
    assert not verdict.allowed
    assert verdict.code == HTTPStatus.INTERNAL_SERVER_ERROR
    assert verdict.message == (
        "cannot check the gpu.nvidia.com/share-memory quota of namespace team-a (the claim is "
        f"refused until it can be checked): list {failing}: 503 ServiceUnavailable: etcd is down"
    )


def test_a_corrupt_ledger_or_quota_refuses_with_what_is_wrong(
    api: FakeApi, check: ShareMemoryQuota
) -> None:
    api.ledgers[ledger_name(NAMESPACE)] = LedgerObject({"x": "nonsense"}, "1")
    verdict = check.review(create(claim_object("s", "8Gi")))
    assert not verdict.allowed
    assert "ConfigMap gpu-dra-share-memory.team-a: entry 'x'" in verdict.message
    api.quotas[NAMESPACE][0]["spec"]["hard"][SHARE_MEMORY] = "plenty"
    verdict = check.review(create(claim_object("s", "8Gi")))
    assert "ResourceQuota gpu: spec.hard[gpu.nvidia.com/share-memory]" in verdict.message


def test_an_unnamed_share_counts_as_the_largest_published_default(
    api: FakeApi, check: ShareMemoryQuota
) -> None:
    """As the scheduler's claim for a pod asking for nvidia.com/gpu.shared: no memory named."""
    unnamed = claim_object("extended", None)
    verdict = check.review(create(unnamed))
    assert not verdict.allowed
    assert "no gpu.nvidia.com share device is published to size it by" in verdict.message
    memory = {"value": "80Gi", "requestPolicy": {"default": "10Gi"}}
    device = {"name": "gpu-0", "allowMultipleAllocations": True, "capacity": {"memory": memory}}
    api.slices = [{"spec": {"driver": "gpu.nvidia.com", "devices": [device]}}]
    assert check.review(create(unnamed)).allowed
    store(api, unnamed)
    refused = check.review(create(claim_object("more", "8Gi")))
    assert "used: gpu.nvidia.com/share-memory=10Gi" in refused.message


def test_a_dry_run_is_decided_but_not_entered(api: FakeApi, check: ShareMemoryQuota) -> None:
    assert check.review(create(claim_object("s", "8Gi"), dryRun=True)).allowed
    assert api.writes == 0
    assert not check.review(create(claim_object("s", "24Gi"), dryRun=True)).allowed


def test_a_catalog_that_cannot_be_read_refuses_until_it_can(api: FakeApi) -> None:
    def broken() -> list[dict[str, Any]]:
        raise ValueError("/etc/gpu-dra/deviceclasses: not a directory")

    check = ShareMemoryQuota(api, broken, driver="gpu.nvidia.com")
    verdict = check.review(create(claim_object("s", "8Gi")))
    assert not verdict.allowed
    assert "cannot read the DeviceClass catalog: /etc/gpu-dra/deviceclasses" in verdict.message
