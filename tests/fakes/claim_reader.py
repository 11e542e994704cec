"""In-memory ClaimReader double, and builders for ResourceClaims as the scheduler writes them."""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu_dra.kubelet_plugin.kubeapi import ClaimNotFoundError, ClaimReadError, ResourceClaim

DRIVER = "gpu.nvidia.com"
CONFIG_API_VERSION = "resource.nvidia.com/v1beta1"


@dataclass
class InMemoryClaimReader:
    """:class:`gpu_dra.kubelet_plugin.kubeapi.ClaimReader` over raw ResourceClaim dicts.

    Claims are keyed by ``(namespace, name)`` and handed out as deep copies, like GETs from an
    API server. A missing claim raises ``ClaimNotFoundError`` with the adapter's message; a
    claim listed in ``read_errors`` raises ``ClaimReadError`` with that message (the API server
    could not be asked). Every GET is recorded in ``reads``. Thread-safe: the preparer reads
    claims from worker threads.
    """

    claims: dict[tuple[str, str], ResourceClaim] = field(default_factory=dict)
    read_errors: dict[tuple[str, str], str] = field(default_factory=dict)
    reads: list[tuple[str, str]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, *claims: ResourceClaim) -> None:
        """Create or replace claims (a replaced claim is a new object under the same name)."""
        with self._lock:
            for claim in claims:
                metadata = claim["metadata"]
                self.claims[metadata["namespace"], metadata["name"]] = copy.deepcopy(claim)

    def delete(self, namespace: str, name: str) -> None:
        with self._lock:
            del self.claims[namespace, name]

    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        with self._lock:
            self.reads.append((namespace, name))
            if (namespace, name) in self.read_errors:
                raise ClaimReadError(self.read_errors[namespace, name])
            claim = self.claims.get((namespace, name))
            if claim is None:
                raise ClaimNotFoundError(f"ResourceClaim {namespace}/{name} not found")
            return copy.deepcopy(claim)


def allocation_result(
    device: str,
    *,
    request: str = "gpu",
    driver: str = DRIVER,
    pool: str = "node-a",
    admin_access: bool | None = None,
    share_id: str | None = None,
    consumed_capacity: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One ``status.allocation.devices.results[]`` entry."""
    result: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if admin_access is not None:
        result["adminAccess"] = admin_access
    if share_id is not None:
        result["shareID"] = share_id
    if consumed_capacity is not None:
        result["consumedCapacity"] = dict(consumed_capacity)
    return result


def opaque_config(
    parameters: Mapping[str, Any],
    *,
    requests: Sequence[str] | None = None,
    driver: str = DRIVER,
) -> dict[str, Any]:
    """A ``spec.devices.config[]`` entry (no ``source``: the scheduler adds it when copying)."""
    entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": dict(parameters)}}
    if requests is not None:
        entry["requests"] = list(requests)
    return entry


def gpu_config(**fields: Any) -> dict[str, Any]:
    """``opaque.parameters`` of a ``GpuConfig``; ``fields`` are its JSON fields (``sharing``)."""
    return {"apiVersion": CONFIG_API_VERSION, "kind": "GpuConfig", **fields}


def resource_claim(
    uid: str,
    name: str = "claim-a",
    namespace: str = "default",
    *,
    results: Sequence[Mapping[str, Any]] = (),
    requests: Sequence[Mapping[str, Any]] | None = None,
    class_configs: Sequence[Mapping[str, Any]] = (),
    claim_configs: Sequence[Mapping[str, Any]] = (),
    allocated: bool = True,
) -> ResourceClaim:
    """A ``resource.k8s.io/v1`` ResourceClaim as the API server serves it after scheduling.

    ``requests`` defaults to one ``exactly`` request per base request name in ``results``.
    ``claim_configs`` go to ``spec.devices.config``; the allocation's ``config`` is what the
    scheduler copies there: the class configs (``FromClass``) first, then the claim's
    (``FromClaim``). ``allocated=False`` leaves ``status`` empty.
    """
    if requests is None:
        names = dict.fromkeys(str(r["request"]).split("/", 1)[0] for r in results)
        requests = [{"name": n, "exactly": {"deviceClassName": DRIVER, "count": 1}} for n in names]
    spec_devices: dict[str, Any] = {"requests": copy.deepcopy(list(requests))}
    if claim_configs:
        spec_devices["config"] = copy.deepcopy(list(claim_configs))
    claim: ResourceClaim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "spec": {"devices": spec_devices},
        "status": {},
    }
    if allocated:
        configs = [{"source": "FromClass", **copy.deepcopy(dict(c))} for c in class_configs]
        configs += [{"source": "FromClaim", **copy.deepcopy(dict(c))} for c in claim_configs]
        devices: dict[str, Any] = {"results": copy.deepcopy(list(results))}
        if configs:
            devices["config"] = configs
        claim["status"]["allocation"] = {"devices": devices}
    return claim
