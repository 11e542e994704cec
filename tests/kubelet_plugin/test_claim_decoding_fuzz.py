"""Fuzzing how the kubelet plugin decodes ResourceClaims from the API server (Hypothesis; profiles
in tests/fuzzing.py, docs/development.md): one watch line becomes an event or an `ApiError`.

Every node lists and watches all claims, so one tenant's claim must not stop the others: watch
lines (kube/watch.py), lists (kube/client.py) and GETs (kubelet-plugin/kubeapi.py) are decoded
by `gpu_dra.driver.jsonbounds.loads`. A claim nested ~2000 levels deep, or with an integer of
more than 4300 digits, is decoded with marker strings in it (it raised RecursionError or
ValueError, and the claim cache relisted forever: issue 12); prepare of that claim then fails
with a config error that names it, and the others are served.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubernetes import client as k8s

from gpu_dra.driver.jsonbounds import TOO_DEEP, TOO_LONG
from gpu_dra.kube import errors
from gpu_dra.kube.reflector import ReflectorSettings
from gpu_dra.kube.watch import parse_raw_watch_event
from gpu_dra.kubelet_plugin.claimcache import CachedClaimReader
from gpu_dra.kubelet_plugin.kubeapi import ClaimEvent, KubernetesClaimReader, claim_event
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef
from tests.fakes.claim_reader import allocation_result, resource_claim
from tests.fuzzing import cases, deep_text, huge_integer_text, json_values, mutated
from tests.kubelet_plugin.nodes import Node

UID_A = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
UID_B = "5d2c9f71-3e8a-4b6d-8c1f-6a4e2b0d9c02"
REF_A = ClaimRef("default", UID_A, "claim-a")
REF_B = ClaimRef("default", UID_B, "claim-b")


def claim(uid: str = UID_A, name: str = "claim-a") -> dict[str, Any]:
    return resource_claim(uid, name, results=[allocation_result("gpu-0")])


def claim_text(value: str, uid: str = UID_A, name: str = "claim-a") -> str:
    """A claim whose opaque parameters are ``value`` (JSON text), as JSON text."""
    config = {"opaque": {"driver": "gpu.nvidia.com", "parameters": "PARAMETERS"}}
    whole = resource_claim(uid, name, results=[allocation_result("gpu-0")], claim_configs=[config])
    return json.dumps(whole).replace('"PARAMETERS"', value)


def parse_claim_event(line: str) -> ClaimEvent:
    """One ResourceClaim watch line, decoded as the claim cache's watch decodes it."""
    return claim_event(*parse_raw_watch_event(line, "ResourceClaims"))


def encoded(value: Any) -> str | None:
    try:
        return json.dumps(value)
    except ValueError:  # an integer of more than 4300 digits
        return None


events = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR", "OTHER"]),
        "object": st.one_of(
            st.just(claim()),
            mutated(st.just(claim()), max_depth=300).map(lambda change: change[0]),
            json_values(),
        ),
    }
)
hostile_values = st.one_of(
    st.builds(deep_text, st.integers(500, 5000), st.just("{}"), st.booleans()),
    st.integers(4000, 6000).map(huge_integer_text),
)
lines = st.one_of(
    events.map(encoded).filter(lambda line: line is not None),
    json_values().map(encoded).filter(lambda line: line is not None),  # no event object
    st.builds(
        lambda kind, value: f'{{"type": "{kind}", "object": {claim_text(value)}}}',
        st.sampled_from(["ADDED", "MODIFIED"]),
        hostile_values,
    ),
)


@cases(ci=100, full=5_000)
@given(lines)
def test_a_watch_line_of_valid_json_is_an_event_or_an_api_error(line: str) -> None:
    try:
        parsed: ClaimEvent | errors.ApiError = parse_claim_event(line)
    except errors.ApiError as error:
        parsed = error
    if isinstance(parsed, ClaimEvent):
        assert parsed.type in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")
        assert isinstance(parsed.claim, dict)
    else:
        assert str(parsed).startswith("watch ResourceClaims: ")


# ---- hostile claims decode, bounded (these raised RecursionError, ValueError, AttributeError) ---
def test_a_watch_event_of_a_deeply_nested_claim_is_decoded() -> None:
    line = '{"type": "ADDED", "object": ' + claim_text(deep_text(2000, "{}", True)) + "}"
    parsed = parse_claim_event(line)
    assert parsed.claim["metadata"]["uid"] == UID_A
    assert TOO_DEEP in json.dumps(parsed.claim)


def test_a_watch_event_of_a_claim_with_a_huge_integer_is_decoded() -> None:
    line = '{"type": "ADDED", "object": ' + claim_text(huge_integer_text(5000)) + "}"
    parsed = parse_claim_event(line)
    assert parsed.claim["metadata"]["uid"] == UID_A
    assert parameters(parsed.claim) == TOO_LONG


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"type": "ERROR", "object": ["Status"]}',
            "ERROR event without a Status object: an array",
        ),
        ('["ADDED"]', "expected an event object, got an array"),
        ('{"type": ["ADDED"], "object": {}}', "unexpected event type an array"),
    ],
    ids=["error-list", "list", "type-list"],
)
def test_a_watch_line_that_is_no_event_object_is_an_api_error(line: str, message: str) -> None:
    with pytest.raises(errors.ApiError) as error:
        parse_claim_event(line)
    assert str(error.value) == f"watch ResourceClaims: {message}"


def parameters(claim: dict[str, Any]) -> object:
    return claim["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]


class ApiserverWithADeepClaim(BaseHTTPRequestHandler):
    """Lists two claims, one of them (claim-a, also answered to a GET) nested 2000 levels deep;
    watches send nothing and hold."""

    listing: ClassVar[bytes] = b""
    deep_claim: ClassVar[bytes] = b""
    release: ClassVar[threading.Event] = threading.Event()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        query = parse_qs(urlsplit(self.path).query)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if query.get("watch") == ["true"]:
            self.end_headers()
            self.wfile.flush()
            self.release.wait(10)
            return
        body = self.deep_claim if self.path.endswith("/claim-a") else self.listing
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def api_client() -> Iterator[k8s.ApiClient]:
    items = [claim_text(deep_text(2000, "{}", True)), json.dumps(claim(UID_B, "claim-b"))]
    listing = '{"metadata": {"resourceVersion": "7"}, "items": [' + ", ".join(items) + "]}"
    ApiserverWithADeepClaim.listing = listing.encode()
    ApiserverWithADeepClaim.deep_claim = items[0].encode()
    ApiserverWithADeepClaim.release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), ApiserverWithADeepClaim)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    client = k8s.ApiClient(configuration)
    try:
        yield client
    finally:
        ApiserverWithADeepClaim.release.set()
        client.close()  # type: ignore[no-untyped-call]
        server.shutdown()
        server.server_close()


def test_one_deeply_nested_claim_does_not_stop_the_cache_from_serving_the_others(
    api_client: k8s.ApiClient,
) -> None:
    settings = ReflectorSettings(backoff_initial_s=0.01, backoff_max_s=0.05, close_timeout_s=5.0)
    cache = CachedClaimReader(KubernetesClaimReader(api_client), settings)
    cache.start()
    try:
        assert cache.wait_serving(3.0), "the cache never served: every list failed"
        assert cache.get_claim("default", "claim-b")["metadata"]["uid"] == UID_B
        deep = cache.get_claim("default", "claim-a")  # a copy: nothing recurses 2000 levels
        assert deep["metadata"]["uid"] == UID_A
        assert TOO_DEEP in json.dumps(deep)
    finally:
        cache.close()


def test_a_get_of_a_deeply_nested_claim_is_decoded(api_client: k8s.ApiClient) -> None:
    claim = KubernetesClaimReader(api_client).get_claim("default", "claim-a")
    assert claim["metadata"]["uid"] == UID_A
    assert TOO_DEEP in json.dumps(claim)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (deep_text(2000, "{}", True), "nested too deeply"),
        (
            huge_integer_text(5000),
            f"parameters: expected a JSON object with apiVersion and kind, got '{TOO_LONG}'",
        ),
    ],
    ids=["deep", "huge-integer"],
)
def test_a_claim_read_with_markers_fails_only_its_own_prepare_naming_it(
    tmp_path: Path, inventory: NodeInventory, value: str, reason: str
) -> None:
    """Decoding the claim succeeds, so the error is the prepare's: it names the claim and why."""
    line = '{"type": "ADDED", "object": ' + claim_text(value) + "}"
    node = Node(tmp_path, inventory)
    node.add(parse_claim_event(line).claim)
    node.add(resource_claim(UID_B, "claim-b", results=[allocation_result("gpu-1")]))

    results = node.prepare(REF_A, REF_B)

    error = results[UID_A].error
    assert error is not None
    assert error.startswith(f"claim default/claim-a ({UID_A}): ")
    assert reason in error
    assert "\n" not in error
    assert results[UID_B].error is None
