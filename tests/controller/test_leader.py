"""Leader election on a Lease: candidates race on an in-memory Lease with the apiserver's write
rules (tests/fakes/lease_api.py), with short durations in real time; the Lease adapter runs
through the real client against a stub apiserver."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
from kubernetes import client as k8s

from gpu_dra.controller import errors
from gpu_dra.controller.leader import (
    ElectionConfig,
    KubernetesLeaseApi,
    LeaderElector,
    LeaseApi,
    LeaseRecord,
    lease_object,
    lease_record,
    micro_time,
)
from tests.controller.asyncwait import until
from tests.fakes.lease_api import LeaseClient, LeaseStore

LEASE_S, RENEW_S, RETRY_S = 1.0, 0.6, 0.1


def config(identity: str) -> ElectionConfig:
    return ElectionConfig(
        lease_name="gpu-dra-controller",
        namespace="gpu-dra",
        identity=identity,
        lease_duration_s=LEASE_S,
        renew_deadline_s=RENEW_S,
        retry_period_s=RETRY_S,
    )


@dataclass
class Candidate:
    """One replica: an elector whose duty records when it ran (monotonic start, end)."""

    name: str
    api: LeaseApi
    terms: list[list[float]] = field(default_factory=list)
    api_reports: list[tuple[bool, str]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    duty_status: int | None = None
    task: asyncio.Task[int | None] | None = None

    def start(self) -> None:
        elector = LeaderElector(
            self.api,
            config(self.name),
            on_api=lambda ok, reason: self.api_reports.append((ok, reason)),
        )
        self.elector = elector
        self.task = asyncio.create_task(elector.run(self.duty, self.stop))

    async def duty(self) -> int:
        term = [time.monotonic(), float("inf")]
        self.terms.append(term)
        try:
            if self.duty_status is not None:
                await asyncio.sleep(0.05)
                return self.duty_status
            await asyncio.Event().wait()
            raise AssertionError("unreachable")
        finally:
            term[1] = time.monotonic()

    @property
    def leading(self) -> bool:
        return bool(self.terms) and self.terms[-1][1] == float("inf")

    async def finish(self) -> int | None:
        self.stop.set()
        assert self.task is not None
        return await asyncio.wait_for(self.task, 5)


def no_overlap(*candidates: Candidate) -> None:
    terms = sorted(t for c in candidates for t in c.terms)
    for earlier, later in itertools.pairwise(terms):
        assert earlier[1] <= later[0], f"two leaders at once: {terms}"


def test_exactly_one_of_two_candidates_leads_and_holds_the_lease() -> None:
    async def scenario() -> None:
        store = LeaseStore()
        a, b = Candidate("pod-a", LeaseClient(store)), Candidate("pod-b", LeaseClient(store))
        a.start()
        b.start()
        await until("a leader", lambda: a.leading or b.leading)
        await asyncio.sleep(3 * LEASE_S)  # renewals keep it: nobody takes over

        leader, standby = (a, b) if a.leading else (b, a)
        assert leader.leading
        assert not standby.leading
        assert len(leader.terms) == 1
        assert standby.terms == []
        assert store.record is not None
        assert store.record.holder == leader.name
        assert store.record.lease_duration_s == 1
        assert store.record.transitions == 0
        renewals = [w for w in store.writes if w.holder == leader.name]
        assert len(renewals) >= 3 * LEASE_S / (RETRY_S * 1.5)
        await a.finish()
        await b.finish()

    asyncio.run(scenario())


def test_a_stopping_leader_releases_and_the_other_takes_over_at_once() -> None:
    async def scenario() -> None:
        store = LeaseStore()
        a, b = Candidate("pod-a", LeaseClient(store)), Candidate("pod-b", LeaseClient(store))
        a.start()
        await until("a to lead", lambda: a.leading)
        b.start()
        await asyncio.sleep(2 * RETRY_S)

        assert await a.finish() is None
        assert not a.leading
        took = await until("b to lead", lambda: b.leading)

        assert took < LEASE_S  # released: no need to wait for the lease to run out
        assert store.record is not None
        assert (store.record.holder, store.record.transitions) == ("pod-b", 1)
        assert any(w.holder == "" for w in store.writes)
        no_overlap(a, b)
        await b.finish()

    asyncio.run(scenario())


def test_a_leader_cut_off_stops_its_duty_before_the_other_takes_over() -> None:
    async def scenario() -> None:
        store = LeaseStore()
        a_api = LeaseClient(store)
        a, b = Candidate("pod-a", a_api), Candidate("pod-b", LeaseClient(store))
        a.start()
        await until("a to lead", lambda: a.leading)
        b.start()
        await asyncio.sleep(2 * RETRY_S)

        a_api.down = True  # a can no longer renew (nor release)
        cut = time.monotonic()
        await until("a to stop leading", lambda: not a.leading)
        stopped_after = a.terms[0][1] - cut
        await until("b to lead", lambda: b.leading, limit_s=3 * LEASE_S)
        took_over_after = b.terms[0][0] - cut

        assert RENEW_S - 2 * RETRY_S <= stopped_after <= RENEW_S + 5 * RETRY_S
        assert took_over_after >= LEASE_S - 2 * RETRY_S  # b waited for the lease to run out
        no_overlap(a, b)
        assert (False, "read Lease: connection refused") in a.api_reports

        a_api.down = False  # back: a candidate again, it does not take the lease from b
        await asyncio.sleep(2 * LEASE_S)
        assert b.leading
        assert not a.leading
        assert len(a.terms) == 1
        assert a.api_reports[-1] == (True, "")
        await a.finish()
        await b.finish()

    asyncio.run(scenario())


def test_a_lease_someone_else_overwrote_ends_the_term_at_the_next_renewal() -> None:
    async def scenario() -> None:
        store = LeaseStore()
        a = Candidate("pod-a", LeaseClient(store))
        a.start()
        await until("a to lead", lambda: a.leading)
        current = store.record
        assert current is not None
        store.replace(LeaseRecord("intruder", 60, resource_version=current.resource_version))

        took = await until("a to stop leading", lambda: not a.leading)

        assert took < RENEW_S  # at the next renewal, not after the renew deadline
        assert store.record is not None
        assert store.record.holder == "intruder"  # a lost lease is not released
        await a.finish()

    asyncio.run(scenario())


def test_a_duty_that_ends_on_its_own_ends_the_election_with_its_status() -> None:
    async def scenario() -> None:
        store = LeaseStore()
        a = Candidate("pod-a", LeaseClient(store), duty_status=2)
        a.start()
        assert a.task is not None

        assert await asyncio.wait_for(a.task, 5) == 2
        assert store.record is not None
        assert store.record.holder == ""  # released for the next replica

    asyncio.run(scenario())


def test_candidates_that_race_to_create_the_lease_do_not_report_the_apiserver_down() -> None:
    async def scenario() -> None:
        store = LeaseStore()
        candidates = [Candidate(f"pod-{i}", LeaseClient(store)) for i in range(4)]
        for candidate in candidates:
            candidate.start()
        await until("a leader", lambda: any(c.leading for c in candidates))
        await asyncio.sleep(3 * RETRY_S)

        assert sum(c.leading for c in candidates) == 1
        assert all(ok for c in candidates for ok, _ in c.api_reports)
        for candidate in candidates:
            await candidate.finish()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("lease", "renew", "retry", "complaint"),
    [
        (10, 10, 2, "longer than the renew deadline"),
        (15, 2, 2, "1.2 times the retry period"),
        (0.5, 0.2, 0.1, "at least 1 second"),
    ],
)
def test_durations_must_follow_client_gos_rules(
    lease: float, renew: float, retry: float, complaint: str
) -> None:
    with pytest.raises(ValueError, match=complaint):
        ElectionConfig("l", "ns", "me", lease, renew, retry)


def test_lease_objects_round_trip_with_micro_times() -> None:
    moment = datetime(2026, 3, 4, 5, 6, 7, 89, tzinfo=UTC)
    record = LeaseRecord("pod-a", 15, moment, moment, 3, "42")

    lease = lease_object(record, "gpu-dra", "gpu-dra-controller")

    assert lease["spec"] == {
        "holderIdentity": "pod-a",
        "leaseDurationSeconds": 15,
        "leaseTransitions": 3,
        "acquireTime": "2026-03-04T05:06:07.000089Z",
        "renewTime": "2026-03-04T05:06:07.000089Z",
    }
    assert lease["metadata"]["resourceVersion"] == "42"
    assert lease_record(lease) == record
    assert micro_time(moment) == "2026-03-04T05:06:07.000089Z"
    assert lease_record({"metadata": {}, "spec": {}}) == LeaseRecord("", 0)


# ---- the Lease adapter through the real client -------------------------------------------------
class StubLeases(BaseHTTPRequestHandler):
    """Leases of one namespace with the apiserver's rules: 404, 409 AlreadyExists, 409 Conflict."""

    leases: ClassVar[dict[str, dict[str, Any]]] = {}
    version: ClassVar[int] = 0
    lock: ClassVar[threading.Lock] = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, code: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str) -> None:
        self._reply(code, {"kind": "Status", "code": code, "reason": reason, "message": reason})

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        return body

    def _store(self, name: str, body: dict[str, Any]) -> None:
        type(self).version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.leases[name] = body

    def do_GET(self) -> None:
        name = self.path.rsplit("/", 1)[1]
        with self.lock:
            lease = self.leases.get(name)
        if lease is None:
            self._status(404, "NotFound")
        else:
            self._reply(200, lease)

    def do_POST(self) -> None:
        body = self._body()
        with self.lock:
            if body["metadata"]["name"] in self.leases:
                return self._status(409, "AlreadyExists")
            self._store(body["metadata"]["name"], body)
        self._reply(201, body)

    def do_PUT(self) -> None:
        body, name = self._body(), self.path.rsplit("/", 1)[1]
        with self.lock:
            current = self.leases[name]["metadata"]["resourceVersion"]
            if body["metadata"].get("resourceVersion") != current:
                return self._status(409, "Conflict")
            self._store(name, body)
        self._reply(200, body)


LeaseApiFactory = Callable[[], KubernetesLeaseApi]


@pytest.fixture
def lease_api() -> Iterator[LeaseApiFactory]:
    """Makes `KubernetesLeaseApi`s on their own clients, all talking to one stub apiserver."""
    StubLeases.leases = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubLeases)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    clients: list[k8s.ApiClient] = []

    def make() -> KubernetesLeaseApi:
        configuration = k8s.Configuration()
        configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
        clients.append(k8s.ApiClient(configuration))
        return KubernetesLeaseApi(
            clients[-1], namespace="gpu-dra", name="gpu-dra-controller", request_timeout_s=5
        )

    try:
        yield make
    finally:
        for client in clients:
            client.close()  # type: ignore[no-untyped-call]
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_adapter_maps_the_apiservers_answers(lease_api: LeaseApiFactory) -> None:
    api = lease_api()
    now = datetime(2026, 1, 1, tzinfo=UTC)

    assert api.get() is None
    created = api.create(LeaseRecord("pod-a", 15, now, now))
    with pytest.raises(errors.AlreadyExistsError):
        api.create(LeaseRecord("pod-b", 15, now, now))
    renewed = api.replace(LeaseRecord("pod-a", 15, now, now, 0, created.resource_version))
    with pytest.raises(errors.ConflictError):
        api.replace(LeaseRecord("pod-b", 15, now, now, 1, created.resource_version))

    assert api.get() == renewed
    assert renewed.resource_version != created.resource_version
    stored = StubLeases.leases["gpu-dra-controller"]
    assert stored["apiVersion"] == "coordination.k8s.io/v1"
    assert stored["spec"]["renewTime"] == "2026-01-01T00:00:00.000000Z"


def test_two_candidates_elect_one_leader_through_the_real_client(
    lease_api: LeaseApiFactory,
) -> None:
    async def scenario() -> None:
        a = Candidate("pod-a", lease_api())
        b = Candidate("pod-b", lease_api())
        a.start()
        b.start()
        await until("a leader", lambda: a.leading or b.leading)
        await asyncio.sleep(2 * LEASE_S)

        assert a.leading != b.leading
        leader = a if a.leading else b
        holder = StubLeases.leases["gpu-dra-controller"]["spec"]["holderIdentity"]
        assert holder == leader.name
        await leader.finish()
        other = b if leader is a else a
        await until("the other to lead", lambda: other.leading, limit_s=LEASE_S)
        await other.finish()

    asyncio.run(scenario())
