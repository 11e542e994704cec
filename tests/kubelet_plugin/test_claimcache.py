"""The ResourceClaim cache: served from the watch while it can be trusted, GET otherwise; list,
watch, resume, relist on 410 Gone, back off, stop. The cache runs against an in-memory apiserver;
the last tests run the real client against a stub HTTP server, and the preparer with a cache that
has not seen a claim replaced yet."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from gpu_dra.driver.discovery import discover_gpus
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kube import errors
from gpu_dra.kube.reflector import ReflectorSettings
from gpu_dra.kubelet_plugin.cdi import ClaimSpecStore
from gpu_dra.kubelet_plugin.checkpoint import Checkpoint
from gpu_dra.kubelet_plugin.claimcache import CachedClaimReader
from gpu_dra.kubelet_plugin.kubeapi import (
    ClaimNotFoundError,
    ClaimReadError,
    KubernetesClaimReader,
    ResourceClaim,
)
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare import NodeClaimPreparer
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from tests.fakes.claim_api import InMemoryClaimApi, Verb
from tests.fakes.claim_reader import allocation_result, resource_claim
from tests.fakes.stub_apiserver import Answer, Query, StubApiserver, status
from tests.kubelet_plugin.nodes import new_preparer

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
UID_A = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
UID_B = "5d2c9f71-3e8a-4b6d-8c1f-6a4e2b0d9c02"
UID_C = "9e4f2a10-6b3d-4c8e-a1f7-0d5b3c2e1f03"
CLAIM_A = ("default", "claim-a")

FAST = ReflectorSettings(backoff_initial_s=0.01, backoff_max_s=0.05, close_timeout_s=5.0)
BROKEN = errors.ApiError("watch ResourceClaims: stream broke: connection reset")


def gpu_claim(claim_uid: str, name: str = "claim-a", device: str = "gpu-0") -> ResourceClaim:
    return resource_claim(claim_uid, name, results=[allocation_result(device)])


@pytest.fixture
def api() -> InMemoryClaimApi:
    return InMemoryClaimApi()


@pytest.fixture
def cache(api: InMemoryClaimApi) -> Iterator[CachedClaimReader]:
    reader = CachedClaimReader(api, FAST)
    yield reader
    reader.close()


def start(cache: CachedClaimReader, api: InMemoryClaimApi) -> None:
    """Start the cache and wait until it has listed and watches."""
    cache.start()
    api.wait_watching()
    assert cache.serving


# ---- answers from the cache ----------------------------------------------------------------------


def test_allocated_claim_is_served_from_the_cache_without_a_get(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    api.add(gpu_claim(UID_A))
    start(cache, api)

    claim = cache.get_claim(*CLAIM_A)

    assert claim["metadata"]["uid"] == UID_A
    assert claim["status"] == gpu_claim(UID_A)["status"]
    assert api.reads == []


def test_cached_claims_are_copies_without_managed_fields(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    claim = gpu_claim(UID_A)
    claim["metadata"]["managedFields"] = [{"manager": "kube-scheduler", "fieldsV1": {}}]
    api.add(claim)
    start(cache, api)

    first = cache.get_claim(*CLAIM_A)
    first["status"]["allocation"]["devices"]["results"].clear()
    second = cache.get_claim(*CLAIM_A)

    assert "managedFields" not in first["metadata"]
    assert second["status"] == gpu_claim(UID_A)["status"]
    assert api.reads == []


def test_claim_added_after_the_list_comes_from_the_watch(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    start(cache, api)
    api.add(gpu_claim(UID_A))
    api.wait_watching()

    assert cache.get_claim(*CLAIM_A)["metadata"]["uid"] == UID_A
    assert api.reads == []


def test_claim_replaced_under_the_same_name_replaces_the_cached_one(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    api.add(gpu_claim(UID_A))
    start(cache, api)
    api.add(gpu_claim(UID_B, device="gpu-1"))
    api.wait_watching()

    claim = cache.get_claim(*CLAIM_A)

    assert claim["metadata"]["uid"] == UID_B
    assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"
    assert api.reads == []


def test_deleted_claim_is_removed_from_the_cache(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    api.add(gpu_claim(UID_A))
    start(cache, api)
    api.delete(*CLAIM_A)
    api.wait_watching()

    with pytest.raises(ClaimNotFoundError):
        cache.get_claim(*CLAIM_A)
    assert api.reads == [CLAIM_A]  # not in the cache: asked the API server


# ---- falling back to a GET -----------------------------------------------------------------------


def test_claim_the_watch_has_not_delivered_yet_is_read_from_the_api_server(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    start(cache, api)
    api.hold_watches()
    api.add(gpu_claim(UID_A))

    assert cache.get_claim(*CLAIM_A)["metadata"]["uid"] == UID_A
    assert api.reads == [CLAIM_A]


def test_claim_cached_unallocated_is_read_from_the_api_server(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    api.add(resource_claim(UID_A, "claim-a", allocated=False))
    start(cache, api)
    api.hold_watches()
    api.add(gpu_claim(UID_A))  # the scheduler allocated it; the watch lags

    claim = cache.get_claim(*CLAIM_A)

    assert claim["status"] == gpu_claim(UID_A)["status"]
    assert api.reads == [CLAIM_A]


def test_claims_are_read_from_the_api_server_before_start_and_after_close(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    api.add(gpu_claim(UID_A))
    cache.get_claim(*CLAIM_A)
    start(cache, api)
    cache.get_claim(*CLAIM_A)
    cache.close()
    cache.get_claim(*CLAIM_A)

    assert api.reads == [CLAIM_A, CLAIM_A]  # the one in between came from the cache


def test_cached_lookup_never_reads_the_api_server(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    api.add(gpu_claim(UID_A))
    assert cache.cached(*CLAIM_A) is None  # not listed yet: nothing, and no GET
    start(cache, api)
    found = cache.cached(*CLAIM_A)
    assert found is not None
    assert found["metadata"]["uid"] == UID_A
    assert cache.cached("default", "missing") is None
    cache.close()
    assert cache.cached(*CLAIM_A) is None  # no watch: not trusted
    assert api.reads == []


def test_cached_claims_are_not_served_while_the_watch_is_down(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    api.add(gpu_claim(UID_A))
    start(cache, api)
    api.fail_next("watch", BROKEN, times=1000)
    api.break_watches(BROKEN)
    api.wait_calls("watch", 2)  # the stream is gone, the cache tries again
    api.add(gpu_claim(UID_A, device="gpu-1"))  # a change no watch can deliver now

    claim = cache.get_claim(*CLAIM_A)

    assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"
    assert api.reads == [CLAIM_A]


# ---- list, watch, resume, relist -----------------------------------------------------------------


@pytest.mark.parametrize("error", [None, BROKEN], ids=["stream-ended", "stream-broke"])
def test_watch_resumes_from_the_last_event_without_listing_again(
    api: InMemoryClaimApi, cache: CachedClaimReader, error: errors.ApiError | None
) -> None:
    start(cache, api)
    listed = api.watch_versions[0]
    api.add(gpu_claim(UID_A))
    api.wait_watching()
    last_seen = api.version
    api.hold_watches()
    api.add(gpu_claim(UID_B, "claim-b"))  # only a watch from last_seen replays it

    api.break_watches(error)
    api.wait_watching()

    assert api.calls["list"] == 1
    assert api.watch_versions == [listed, last_seen]
    assert cache.get_claim("default", "claim-b")["metadata"]["uid"] == UID_B
    assert api.reads == []


def test_watch_resumes_from_the_last_bookmark(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    start(cache, api)
    bookmarked = api.bookmark()
    api.wait_watching()

    api.break_watches()
    api.wait_watching()

    assert api.watch_versions[-1] == bookmarked
    assert api.calls["list"] == 1


@pytest.mark.parametrize(
    "how",
    ["410-in-the-stream", "resumed-from-a-compacted-version"],
)
def test_gone_watch_lists_again_and_keeps_only_what_exists(
    api: InMemoryClaimApi, cache: CachedClaimReader, how: str
) -> None:
    api.add(gpu_claim(UID_A), gpu_claim(UID_B, "claim-b"))
    start(cache, api)
    api.hold_watches()
    api.delete("default", "claim-b")
    api.add(gpu_claim(UID_C, "claim-c"))
    api.compact()  # only a new list can tell what happened

    if how == "410-in-the-stream":
        api.break_watches(
            errors.ResourceExpiredError("too old resource version", status=410, reason="Expired")
        )
    else:
        api.break_watches(BROKEN)
    api.wait_watching()

    assert api.calls["list"] == 2
    assert cache.get_claim("default", "claim-c")["metadata"]["uid"] == UID_C
    assert cache.get_claim(*CLAIM_A)["metadata"]["uid"] == UID_A
    assert api.reads == []
    with pytest.raises(ClaimNotFoundError):
        cache.get_claim("default", "claim-b")
    assert api.reads == [("default", "claim-b")]


@pytest.mark.parametrize("verb", ["list", "watch"])
def test_failures_back_off_exponentially_then_recover(api: InMemoryClaimApi, verb: Verb) -> None:
    settings = ReflectorSettings(backoff_initial_s=0.02, backoff_max_s=0.05, close_timeout_s=5.0)
    cache = CachedClaimReader(api, settings)
    api.add(gpu_claim(UID_A))
    api.fail_next(verb, errors.ApiError("503 ServiceUnavailable"), times=3)
    try:
        start(cache, api)

        times = api.call_times[verb]
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        assert len(gaps) == 3
        for gap, expected in zip(gaps, [0.02, 0.04, 0.05], strict=True):  # doubled, then capped
            assert gap >= expected * 0.9
        assert api.calls["list"] == (4 if verb == "list" else 1)  # a failed watch resumes
        assert cache.get_claim(*CLAIM_A)["metadata"]["uid"] == UID_A
        assert api.reads == []
    finally:
        cache.close()


# ---- stopping ------------------------------------------------------------------------------------


def test_close_closes_the_open_watch_and_stops_the_thread(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    start(cache, api)  # the thread now blocks in the watch for up to watch_timeout_s (300 s)
    (watch,) = api.watches

    cache.close()

    assert not cache.running
    assert watch.closed
    assert not cache.serving


def test_close_ends_a_backoff_wait_at_once(api: InMemoryClaimApi) -> None:
    cache = CachedClaimReader(
        api, ReflectorSettings(backoff_initial_s=60.0, backoff_max_s=60.0, close_timeout_s=5.0)
    )
    api.fail_next("list", errors.ApiError("503 ServiceUnavailable"))
    cache.start()
    api.wait_calls("list", 1)

    cache.close()

    assert not cache.running
    assert api.calls["list"] == 1


def test_close_before_start_and_twice_is_harmless(
    api: InMemoryClaimApi, cache: CachedClaimReader
) -> None:
    cache.close()
    cache.close()

    assert not cache.running
    assert api.calls == {}


def test_a_cache_starts_once(api: InMemoryClaimApi, cache: CachedClaimReader) -> None:
    start(cache, api)

    with pytest.raises(RuntimeError, match="already started"):
        cache.start()


# ---- the preparer with a cache -------------------------------------------------------------------


@pytest.fixture(scope="module")
def inventory() -> NodeInventory:
    host = SimulatedHost.load("hgx-h100", NODE)
    return NodeInventory(tuple(discover_gpus(host.nvml, host.pci)), simulated=True)


@pytest.fixture
def preparer(
    tmp_path: Path, inventory: NodeInventory, api: InMemoryClaimApi, cache: CachedClaimReader
) -> NodeClaimPreparer:
    checkpoint = Checkpoint(tmp_path / "data", boot_id=lambda: "boot-1")
    checkpoint.load()
    return new_preparer(
        inventory=inventory,
        claims=cache,
        uncached_claims=api,
        checkpoint=checkpoint,
        cdi=ClaimSpecStore(tmp_path / "cdi", driver_name=DRIVER),
        claims_dir=tmp_path / "data" / "claims",
    )


def test_preparer_reads_a_claim_replaced_behind_the_cache_from_the_api_server(
    api: InMemoryClaimApi, cache: CachedClaimReader, preparer: NodeClaimPreparer
) -> None:
    api.add(gpu_claim(UID_A))
    start(cache, api)
    api.hold_watches()
    api.add(gpu_claim(UID_B, device="gpu-1"))  # deleted and created again; the watch lags
    assert cache.get_claim(*CLAIM_A)["metadata"]["uid"] == UID_A

    result = asyncio.run(preparer.prepare([ClaimRef("default", UID_B, "claim-a")]))[UID_B]

    assert result.error is None, result.error
    assert [d.device_name for d in result.devices] == ["gpu-1"]
    assert api.reads == [CLAIM_A]


def test_preparer_reports_a_replaced_claim_after_one_read_from_the_api_server(
    api: InMemoryClaimApi, cache: CachedClaimReader, preparer: NodeClaimPreparer
) -> None:
    api.add(gpu_claim(UID_A))
    start(cache, api)

    result = asyncio.run(preparer.prepare([ClaimRef("default", UID_C, "claim-a")]))[UID_C]

    assert result.error is not None
    assert f"replaced: the API server has UID {UID_A}" in result.error
    assert api.reads == [CLAIM_A]


def test_preparer_does_not_read_a_cached_claim_twice(
    api: InMemoryClaimApi, cache: CachedClaimReader, preparer: NodeClaimPreparer
) -> None:
    api.add(gpu_claim(UID_A))
    start(cache, api)

    result = asyncio.run(preparer.prepare([ClaimRef("default", UID_A, "claim-a")]))[UID_A]

    assert result.error is None, result.error
    assert api.reads == []


# ---- the real client against a stub apiserver ----------------------------------------------------

CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"


def claim_pages(query: Query, body: Any) -> Answer:
    """Two pages of claims: claim-a, then (``continue=page-2``) claim-b."""
    if query.get("continue") == ["page-2"]:
        return 200, {"metadata": {"resourceVersion": "7"}, "items": [gpu_claim(UID_B, "claim-b")]}
    metadata = {"resourceVersion": "7", "continue": "page-2"}
    return 200, {"metadata": metadata, "items": [gpu_claim(UID_A)]}


@pytest.fixture
def stub() -> Iterator[StubApiserver]:
    """Pages of claims, a GET (404), and a watch that sends `watch_events`, then holds the stream
    open until `release` is set (or ends it when `hold` is False)."""
    with StubApiserver.running() as server:
        server.route("GET", CLAIMS, claim_pages)
        server.watch_paths.add(CLAIMS)
        server.hold = True
        yield server


@pytest.fixture
def api_client(stub: StubApiserver) -> k8s.ApiClient:
    assert stub.client is not None
    return stub.client


def test_list_follows_pages_and_returns_the_snapshot_version(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    listing = KubernetesClaimReader(api_client, page_size=1).list_claims()

    assert [c["metadata"]["uid"] for c in listing.items] == [UID_A, UID_B]
    assert listing.resource_version == "7"
    first, second = stub.requests
    assert first["query"]["limit"] == ["1"]
    assert "continue" not in first["query"]
    assert second["query"]["continue"] == ["page-2"]


def test_watch_asks_for_bookmarks_and_reports_410_as_gone(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    stub.hold = False
    stub.watch_events = [
        {"type": "ADDED", "object": gpu_claim(UID_A) | {"kind": "ResourceClaim"}},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}},
        {"type": "ERROR", "object": status(410, "Expired", "too old resource version: 7 (8)")},
    ]
    watch = KubernetesClaimReader(api_client).watch_claims(resource_version="7", timeout_seconds=30)
    try:
        added, bookmark = watch.next_event(), watch.next_event()
        with pytest.raises(errors.ResourceExpiredError, match="too old resource version"):
            watch.next_event()
    finally:
        watch.close()

    assert added is not None
    assert (added.type, added.claim["metadata"]["uid"]) == ("ADDED", UID_A)
    assert bookmark is not None
    assert (bookmark.type, bookmark.resource_version) == ("BOOKMARK", "9")
    (request,) = stub.requests
    assert request["query"]["watch"] == ["true"]
    assert request["query"]["resourceVersion"] == ["7"]
    assert request["query"]["allowWatchBookmarks"] == ["true"]
    assert request["query"]["timeoutSeconds"] == ["30"]


def test_get_from_an_unreachable_api_server_is_a_read_error() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    configuration.retries = 0
    client = k8s.ApiClient(configuration)
    try:
        with pytest.raises(ClaimReadError, match="cannot read ResourceClaim default/claim-a"):
            KubernetesClaimReader(client).get_claim(*CLAIM_A)
    finally:
        client.close()  # type: ignore[no-untyped-call]


CLAIM_A_PATH = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/claim-a"


def test_get_reads_the_claim_from_the_api_server(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    stub.route("GET", CLAIM_A_PATH, (200, gpu_claim(UID_A)))

    claim = KubernetesClaimReader(api_client).get_claim(*CLAIM_A)

    assert claim == gpu_claim(UID_A)


def test_get_of_an_answer_that_is_no_object_is_a_read_error_saying_what_it_is(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    stub.route("GET", CLAIM_A_PATH, (200, [gpu_claim(UID_A)]))

    with pytest.raises(ClaimReadError) as error:
        KubernetesClaimReader(api_client).get_claim(*CLAIM_A)

    assert str(error.value) == (
        "cannot read ResourceClaim default/claim-a: expected a JSON object, got an array"
    )


@pytest.mark.parametrize(
    ("page", "complaint"),
    [
        ([], "expected a JSON object, got an array"),
        ({"items": {"a": 1}}, "items is not a list of objects"),
        ({"items": [5]}, "items is not a list of objects"),
        ({"items": [], "metadata": "7"}, "metadata is '7', not an object"),
    ],
    ids=["page-list", "items-object", "item-number", "metadata-string"],
)
def test_a_list_page_of_the_wrong_shape_is_an_api_error_saying_what_is_wrong(
    api_client: k8s.ApiClient, stub: StubApiserver, page: object, complaint: str
) -> None:
    stub.route("GET", CLAIMS, (200, page))

    with pytest.raises(errors.ApiError) as error:
        KubernetesClaimReader(api_client).list_claims()

    assert str(error.value) == f"list ResourceClaims: {complaint}"


def test_cache_on_the_real_client_serves_from_the_watch_and_closes_it_promptly(
    api_client: k8s.ApiClient, stub: StubApiserver
) -> None:
    reader = KubernetesClaimReader(api_client, page_size=1)
    cache = CachedClaimReader(reader, FAST)
    cache.start()
    try:
        assert cache.wait_serving(5.0)
        assert cache.get_claim("default", "claim-b")["metadata"]["uid"] == UID_B
        with pytest.raises(ClaimNotFoundError):
            cache.get_claim("default", "claim-z")
    finally:
        started = time.monotonic()
        cache.close()  # the stub holds the stream open: only closing the socket ends the read
        elapsed = time.monotonic() - started

    assert not cache.running
    assert elapsed < 2.0
    paths = [(r["path"], r["query"].get("watch")) for r in stub.requests]
    assert paths == [
        (CLAIMS, None),
        (CLAIMS, None),
        (CLAIMS, ["true"]),
        ("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/claim-z", None),
    ]
