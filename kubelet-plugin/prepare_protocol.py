"""The seam between the kubelet-facing gRPC service and the prepare/unprepare logic.

The servicer (``dra_service.py``) translates protobuf messages into these values and calls a
:class:`ClaimPreparer`, which never sees protobuf or gRPC. Implementations return an entry per
claim UID, report per-claim failures as values (an exception fails the batch), are idempotent
and cancellation-safe, expect concurrent calls (serialize per claim / device), and run blocking
work through ``asyncio.to_thread``. See docs/architecture.md#the-claimpreparer-contract.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ClaimRef:
    """Identity of a ResourceClaim as sent by the kubelet (namespace, UID, name)."""

    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device made available to the claim's containers.

    ``request_names`` holds the *base* request names (``"req"`` for a ``"req/sub"``
    firstAvailable result); empty means the device belongs to all requests of the claim.
    ``cdi_device_ids`` are fully qualified CDI names (``vendor/class=name``).
    ``share_id`` is the allocation's ``shareID`` for multi-allocatable devices; it is only
    sent on the DRA v1 service (dropped on v1beta1).
    """

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class PrepareResult:
    """Outcome of preparing one claim: the prepared devices, or an error message.

    Use :meth:`success` and :meth:`failure` to build one. An error message should tell the
    user what failed and what to fix; the kubelet shows it in a pod event.
    """

    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None

    def __post_init__(self) -> None:
        if self.error is not None and not self.error:
            raise ValueError("PrepareResult.error must be None or a non-empty message")
        if self.error is not None and self.devices:
            raise ValueError("a failed PrepareResult carries no devices")

    @classmethod
    def success(cls, devices: Sequence[PreparedDevice]) -> PrepareResult:
        return cls(devices=tuple(devices))

    @classmethod
    def failure(cls, error: str) -> PrepareResult:
        return cls(error=error)

    @property
    def ok(self) -> bool:
        return self.error is None


class ClaimPreparer(Protocol):
    """Prepares and unprepares batches of claims for one driver on this node."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        """Prepare ``claims``; return a result per claim UID."""
        ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        """Unprepare ``claims``; return per claim UID ``None`` on success or an error message."""
        ...
