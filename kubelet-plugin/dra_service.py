"""DRAPlugin gRPC servicers (v1 and v1beta1): protobuf <-> domain translation.

Both services are backed by one :class:`ClaimCallHandler`: every requested claim UID gets an
entry and no other; failures, preparer exceptions and deadline overruns become per-claim errors,
never an RPC error; each call replies by its deadline (below the kubelet's 45 s) while work that
cannot stop finishes behind the reply holding its claim's locks. v1beta1 responses are the v1
responses without ``Device.share_id``. See docs/architecture.md#the-claimpreparer-contract.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, TypeAlias, TypeVar

import grpc
from prometheus_client import CollectorRegistry

from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2 as v1
from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2_grpc as v1_grpc
from gpu_dra.kubelet_plugin._generated.dra.v1beta1 import api_pb2 as v1beta1
from gpu_dra.kubelet_plugin._generated.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpu_dra.kubelet_plugin.metrics import PluginMetrics
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimPreparer, ClaimRef, PrepareResult

log = logging.getLogger(__name__)

KUBELET_CALL_TIMEOUT_S = 45.0
"""The kubelet's per-call deadline for NodePrepareResources / NodeUnprepareResources."""

DEFAULT_CALL_TIMEOUT_S = 40.0
"""Default time the preparer gets per call; must stay below :data:`KUBELET_CALL_TIMEOUT_S`."""

DEADLINE_MARGIN_S = 1.0
"""Time kept back from the client's own deadline to build and send the response; at most a
quarter of a shorter deadline (`DEADLINE_MARGIN_SHARE`), so that a call with a deadline of 1 s or
less still gets time to answer (an already-prepared claim takes milliseconds)."""
DEADLINE_MARGIN_SHARE = 0.25

_Result = TypeVar("_Result")
_PreparerMethod: TypeAlias = Callable[[Sequence[ClaimRef]], Awaitable[Mapping[str, _Result]]]
_FailureFactory: TypeAlias = Callable[[str], _Result]


class ClaimCallHandler:
    """Version-independent handling of prepare/unprepare batches around a ClaimPreparer."""

    def __init__(
        self,
        preparer: ClaimPreparer,
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        metrics: PluginMetrics | None = None,
    ) -> None:
        if not 0 < call_timeout_s < KUBELET_CALL_TIMEOUT_S:
            raise ValueError(
                f"call_timeout_s={call_timeout_s} must be > 0 and below the kubelet's "
                f"{KUBELET_CALL_TIMEOUT_S:.0f}s deadline"
            )
        self._preparer = preparer
        self._call_timeout_s = call_timeout_s
        self._metrics = metrics or PluginMetrics(CollectorRegistry())
        self._behind: set[asyncio.Future[object]] = set()
        """Calls answered at their deadline whose work still runs (strong references)."""

    def _budget(self, client_time_remaining: float | None) -> float:
        if client_time_remaining is None:
            return self._call_timeout_s
        margin = min(DEADLINE_MARGIN_S, client_time_remaining * DEADLINE_MARGIN_SHARE)
        return max(0.0, min(self._call_timeout_s, client_time_remaining - margin))

    async def prepare(
        self, claims: Sequence[ClaimRef], *, client_time_remaining: float | None = None
    ) -> dict[str, PrepareResult]:
        """Prepare a batch; the result has exactly one entry per distinct requested UID."""
        unique = _unique_claims(claims)
        if not unique:
            return {}
        budget = self._budget(client_time_remaining)
        started = time.perf_counter()
        outcome = await self._call(
            "prepare", self._preparer.prepare, unique, budget, PrepareResult.failure
        )
        results = {
            claim.uid: _pick(
                "prepare", outcome, claim, PrepareResult.failure, lambda r: r.error is None
            )
            for claim in unique
        }
        self._metrics.observe_call("prepare", time.perf_counter() - started)
        for result in results.values():
            self._metrics.count_claim("prepare", result.error is None)
        return results

    async def unprepare(
        self, claims: Sequence[ClaimRef], *, client_time_remaining: float | None = None
    ) -> dict[str, str | None]:
        """Unprepare a batch; ``None`` per UID means success."""
        unique = _unique_claims(claims)
        if not unique:
            return {}
        budget = self._budget(client_time_remaining)

        def failure(message: str) -> str | None:
            return message

        started = time.perf_counter()
        outcome = await self._call("unprepare", self._preparer.unprepare, unique, budget, failure)
        results = {
            claim.uid: _pick("unprepare", outcome, claim, failure, lambda r: r is None)
            for claim in unique
        }
        self._metrics.observe_call("unprepare", time.perf_counter() - started)
        for error in results.values():
            self._metrics.count_claim("unprepare", error is None)
        return results

    async def _call(
        self,
        operation: str,
        method: _PreparerMethod[_Result],
        claims: list[ClaimRef],
        budget: float,
        failure: _FailureFactory[_Result],
    ) -> Mapping[str, _Result]:
        uids = ",".join(c.uid for c in claims)
        log.info(
            "%s start claims=%d claim_uids=%s budget_s=%.1f", operation, len(claims), uids, budget
        )
        work = asyncio.ensure_future(method(claims))
        try:
            done, _ = await asyncio.wait({work}, timeout=budget)
        except asyncio.CancelledError:  # the RPC itself is gone
            self._leave_behind(work, operation, uids)
            raise
        if not done:
            # The reply goes now; the work stops where it waits and finishes (or rolls back)
            # behind it, holding its claims' locks until then.
            self._leave_behind(work, operation, uids)
            log.error("%s timed out claim_uids=%s budget_s=%.1f", operation, uids, budget)
            message = (
                f"{operation} did not finish within {budget:.1f}s "
                "(driver-side deadline below the kubelet's); the kubelet will retry"
            )
            return {c.uid: failure(message) for c in claims}
        try:
            outcome = work.result()
        except Exception as err:
            # Never let a preparer bug become a gRPC error: the kubelet would discard the
            # whole response. Report it on every claim of the batch instead.
            log.exception("%s raised claim_uids=%s", operation, uids)
            message = f"{operation} failed: {type(err).__name__}: {err}"
            return {c.uid: failure(message) for c in claims}
        extra = sorted(set(outcome) - {c.uid for c in claims})
        if extra:
            log.warning("%s returned unrequested claims, dropped claim_uids=%s", operation, extra)
        return outcome

    def _leave_behind(self, work: asyncio.Future[Any], operation: str, uids: str) -> None:
        """Cancel ``work`` without waiting for it: what runs in a worker thread finishes, the
        rest stops at its next wait. Logged when it is over."""
        started = time.perf_counter()

        def over(finished: asyncio.Future[Any]) -> None:
            self._behind.discard(finished)
            seconds = time.perf_counter() - started
            if not finished.cancelled() and finished.exception() is not None:
                log.error(
                    "%s failed after its reply claim_uids=%s after_s=%.1f: %r",
                    operation, uids, seconds, finished.exception(),
                )  # fmt: skip
            else:
                log.info(
                    "%s work over after its reply claim_uids=%s after_s=%.1f",
                    operation, uids, seconds,
                )  # fmt: skip

        self._behind.add(work)
        work.add_done_callback(over)
        work.cancel()


def _unique_claims(claims: Sequence[ClaimRef]) -> list[ClaimRef]:
    """Claims in request order, one per UID (the response map has one entry per UID)."""
    seen: dict[str, ClaimRef] = {}
    for claim in claims:
        seen.setdefault(claim.uid, claim)
    return list(seen.values())


def _pick(
    operation: str,
    outcome: Mapping[str, _Result],
    claim: ClaimRef,
    failure: _FailureFactory[_Result],
    succeeded: Callable[[_Result], bool],
) -> _Result:
    if claim.uid not in outcome:
        log.error(
            "%s returned no result claim_uid=%s namespace=%s name=%s",
            operation,
            claim.uid,
            claim.namespace,
            claim.name,
        )
        return failure(f"{operation} returned no result for this claim (driver bug); retrying")
    result = outcome[claim.uid]
    ok = succeeded(result)
    # A success is logged by the preparer ("prepared ..."/"unprepared ..."); a failure too, at
    # WARNING or above, but this line names the claim as the kubelet asked for it.
    log.log(
        logging.DEBUG if ok else logging.INFO,
        "%s done claim_uid=%s namespace=%s name=%s ok=%s",
        operation,
        claim.uid,
        claim.namespace,
        claim.name,
        ok,
    )
    return result


def _client_time_remaining(context: grpc.aio.ServicerContext[object, object]) -> float | None:
    # grpc returns None when the client set no deadline (the stubs say float).
    remaining: float | None = context.time_remaining()
    return remaining


class _DRAPluginServicer:
    """One implementation of ``DRAPlugin`` for both API versions.

    The v1 and v1beta1 messages are wire-identical except ``Device.share_id`` (v1 only), so the
    servicer takes the version's message module and whether it carries share IDs.
    """

    def __init__(self, handler: ClaimCallHandler, messages: ModuleType, *, share_ids: bool) -> None:
        self._handler = handler
        self._messages = messages
        self._share_ids = share_ids

    async def NodePrepareResources(  # noqa: N802 (gRPC method name)
        self, request: Any, context: grpc.aio.ServicerContext[object, object]
    ) -> Any:
        claims = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
        results = await self._handler.prepare(
            claims, client_time_remaining=_client_time_remaining(context)
        )
        response = self._messages.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            if result.error is not None:
                entry.error = result.error
                continue
            for device in result.devices:
                message = entry.devices.add(
                    request_names=device.request_names,
                    pool_name=device.pool_name,
                    device_name=device.device_name,
                    cdi_device_ids=device.cdi_device_ids,
                )
                if self._share_ids and device.share_id is not None:
                    message.share_id = device.share_id
        return response

    async def NodeUnprepareResources(  # noqa: N802 (gRPC method name)
        self, request: Any, context: grpc.aio.ServicerContext[object, object]
    ) -> Any:
        claims = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
        results = await self._handler.unprepare(
            claims, client_time_remaining=_client_time_remaining(context)
        )
        response = self._messages.NodeUnprepareResourcesResponse()
        for uid, error in results.items():
            entry = response.claims[uid]
            if error:
                entry.error = error
        return response


class DRAPluginV1Servicer(_DRAPluginServicer, v1_grpc.DRAPluginServicer):
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (kubelet 1.34+), with ``share_id``."""

    def __init__(self, handler: ClaimCallHandler) -> None:
        super().__init__(handler, v1, share_ids=True)


class DRAPluginV1beta1Servicer(_DRAPluginServicer, v1beta1_grpc.DRAPluginServicer):
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`` (kubelet 1.32+), no ``share_id``."""

    def __init__(self, handler: ClaimCallHandler) -> None:
        super().__init__(handler, v1beta1, share_ids=False)


def add_dra_services(server: grpc.aio.Server, handler: ClaimCallHandler) -> None:
    """Register the v1 and v1beta1 DRAPlugin services, both backed by ``handler``."""
    v1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1Servicer(handler), server)  # type: ignore[no-untyped-call]
    v1beta1_grpc.add_DRAPluginServicer_to_server(  # type: ignore[no-untyped-call]
        DRAPluginV1beta1Servicer(handler), server
    )
