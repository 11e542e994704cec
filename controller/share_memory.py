"""The share-memory quota at admission: refuse a ResourceClaim whose share memory would bring its
namespace over ``gpu.nvidia.com/share-memory`` of the namespace's GPU quota. Race-safe across
webhook replicas: every admitted claim is written to the namespace's ledger (a ConfigMap in the
driver's namespace, which tenants cannot write) under the resourceVersion it was read at, so two
claims decided at once cannot both take the last room; a conflict reads and decides again.

What counts, and the ledger's pruning, is `gpu_dra.driver.cluster.share_memory`. Once the
admitted claim is stored, a background thread marks its entry confirmed, so that deleting the
claim frees its memory at the next review. A namespace
without a labelled quota, or whose quota has no share-memory key, is not limited and its claims
cost no write. A quota, claim list, slice list or ledger that cannot be read refuses the claim
with the cause. The webhook's HTTPS shell is `gpu_dra.controller.webhook`;
docs/shares.md#share-memory-quota.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final, Protocol

from kubernetes import client as k8s

from gpu_dra.controller.admission import ALLOWED, Verdict
from gpu_dra.driver.cluster import share_memory as sm
from gpu_dra.driver.cluster.tier_quota import SHARE_MEMORY, TIER_QUOTA_SELECTOR
from gpu_dra.kube import errors
from gpu_dra.kube.client import (
    CLAIMS_API,
    decoded_items,
    decoded_object,
    list_namespaced_objects,
    list_resource_objects,
    read_resource_claim,
    translated_errors,
)

log = logging.getLogger(__name__)

Obj = dict[str, Any]

LEDGER_PREFIX: Final = "gpu-dra-share-memory."
"""A namespace's ledger is the ConfigMap ``gpu-dra-share-memory.<namespace>``."""
ATTEMPTS: Final = 10
"""Ledger writes tried per review before giving up (each conflict reads everything again)."""
CLASSES_TTL_S: Final = 30.0
CONFIRM_TRIES: Final = 40
"""Looks for an admitted claim in storage (0.2 s apart, doubling up to 5 s: about the grace)."""


@dataclass(frozen=True)
class LedgerObject:
    data: dict[str, str] | None
    resource_version: str


class ShareQuotaApi(Protocol):
    """What the quota check reads and writes (blocking); errors are `errors.ApiError`."""

    def list_quotas(self, namespace: str) -> list[Obj]:
        """The namespace's ResourceQuotas labelled `TIER_QUOTA_SELECTOR`."""
        ...

    def list_claims(self, namespace: str) -> list[Obj]: ...

    def read_claim(self, namespace: str, name: str) -> Obj | None:
        """The ResourceClaim, or None when there is none."""
        ...

    def list_slices(self) -> list[Obj]: ...

    def read_ledger(self, name: str) -> LedgerObject | None:
        """The ledger ConfigMap, or None when there is none."""
        ...

    def create_ledger(self, name: str, data: dict[str, str]) -> None:
        """`errors.AlreadyExistsError` when another replica made it first."""
        ...

    def replace_ledger(self, name: str, data: dict[str, str], resource_version: str) -> None:
        """`errors.ConflictError` when it changed since `resource_version`."""
        ...


class KubernetesShareQuotaApi:
    """`ShareQuotaApi` on the `kubernetes` client; ledgers live in `ledger_namespace`."""

    def __init__(
        self, api_client: k8s.ApiClient, *, ledger_namespace: str, request_timeout_s: float = 10.0
    ) -> None:
        self._client = api_client
        self._core: Any = k8s.CoreV1Api(api_client)
        self._objects: Any = k8s.CustomObjectsApi(api_client)
        self._namespace = ledger_namespace
        self._timeout = request_timeout_s

    def list_quotas(self, namespace: str) -> list[Obj]:
        action = f"list ResourceQuotas labelled {TIER_QUOTA_SELECTOR} in {namespace}"
        with translated_errors(action):
            response = self._core.list_namespaced_resource_quota(
                namespace, label_selector=TIER_QUOTA_SELECTOR, _preload_content=False,
                _request_timeout=self._timeout,
            )  # fmt: skip
        return [*decoded_items(response.data, action)]

    def list_claims(self, namespace: str) -> list[Obj]:
        return list_namespaced_objects(
            self._client, CLAIMS_API, "resourceclaims", namespace, request_timeout_s=self._timeout
        )

    def read_claim(self, namespace: str, name: str) -> Obj | None:
        try:
            return read_resource_claim(
                self._client, namespace, name, request_timeout_s=self._timeout
            )
        except errors.NotFoundError:
            return None

    def list_slices(self) -> list[Obj]:
        return list_resource_objects(
            self._client, "resourceslices", request_timeout_s=self._timeout
        )

    def read_ledger(self, name: str) -> LedgerObject | None:
        action = f"read ConfigMap {self._namespace}/{name}"
        try:
            with translated_errors(action):
                response = self._core.read_namespaced_config_map(
                    name, self._namespace, _preload_content=False, _request_timeout=self._timeout
                )
        except errors.NotFoundError:
            return None
        body = decoded_object(response.data, action)
        metadata = body.get("metadata") or {}
        version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
        if not isinstance(version, str) or not version:
            raise errors.ApiError(f"{action}: no metadata.resourceVersion")
        data = body.get("data")
        return LedgerObject(data if isinstance(data, dict) else None, version)

    def create_ledger(self, name: str, data: dict[str, str]) -> None:
        body = {"metadata": {"name": name, "labels": {LEDGER_LABEL: "true"}}, "data": data}
        with translated_errors(f"create ConfigMap {self._namespace}/{name}"):
            self._core.create_namespaced_config_map(
                self._namespace, body, _request_timeout=self._timeout
            )

    def replace_ledger(self, name: str, data: dict[str, str], resource_version: str) -> None:
        body = {
            "metadata": {
                "name": name,
                "resourceVersion": resource_version,
                "labels": {LEDGER_LABEL: "true"},
            },
            "data": data,
        }
        with translated_errors(f"update ConfigMap {self._namespace}/{name}"):
            self._core.replace_namespaced_config_map(
                name, self._namespace, body, _request_timeout=self._timeout
            )


LEDGER_LABEL: Final = "gpu.nvidia.com/share-memory-ledger"


def _in_thread(work: Callable[[], None]) -> None:
    threading.Thread(target=work, name="share-memory-confirm", daemon=True).start()


def ledger_name(namespace: str) -> str:
    return f"{LEDGER_PREFIX}{namespace}"


class ShareMemoryQuota:
    """Decides admission reviews of ResourceClaim creations against the share-memory quota.

    `classes` gives the DeviceClass objects that define which classes serve shares (the
    controller's catalog); it is read again after `CLASSES_TTL_S`."""

    def __init__(
        self,
        api: ShareQuotaApi,
        classes: Callable[[], list[Mapping[str, Any]]],
        *,
        driver: str,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        grace_s: float = sm.LEDGER_GRACE_S,
        spawn: Callable[[Callable[[], None]], None] = _in_thread,
    ) -> None:
        self._api = api
        self._spawn = spawn
        self._classes = classes
        self._driver = driver
        self._clock = clock
        self._sleep = sleep
        self._grace_s = grace_s
        self._share_classes: frozenset[str] = frozenset()
        self._classes_read_at: float | None = None

    def share_classes(self) -> frozenset[str]:
        """The share classes of the catalog, read again after `CLASSES_TTL_S`; a catalog that
        cannot be read keeps the last ones, or is `ShareQuotaError` when there are none yet."""
        now = time.monotonic()
        if self._classes_read_at is None or now - self._classes_read_at >= CLASSES_TTL_S:
            try:
                self._share_classes = sm.share_classes(self._classes())
            except ValueError as error:  # CatalogError
                if self._classes_read_at is None:
                    raise sm.ShareQuotaError(
                        f"cannot read the DeviceClass catalog: {error}"
                    ) from error
                log.error("cannot read the DeviceClass catalog, keeping the last one: %s", error)
            self._classes_read_at = now
        return self._share_classes

    def review(self, request: Mapping[str, Any]) -> Verdict:
        """The verdict on one admission request (blocking: run it in a worker thread). Only a
        CREATE of a ResourceClaim with share requests is checked; the rest is allowed."""
        resource = request.get("resource")
        plural = resource.get("resource") if isinstance(resource, Mapping) else None
        obj = request.get("object")
        if (
            plural != "resourceclaims"
            or request.get("operation") != "CREATE"
            or request.get("subResource")
            or not isinstance(obj, Mapping)
        ):
            return ALLOWED
        namespace = request.get("namespace")
        metadata = obj.get("metadata")
        metadata = metadata if isinstance(metadata, Mapping) else {}
        name = str(metadata.get("name") or metadata.get("generateName") or "")
        uid = str(metadata.get("uid") or request.get("uid") or "")
        if not isinstance(namespace, str) or not namespace:
            return _bad_request("the ResourceClaim CREATE request names no namespace")
        try:
            return self._review(namespace, name, uid, obj.get("spec"), bool(request.get("dryRun")))
        except sm.ShareQuotaError as error:
            return Verdict(
                allowed=False,
                code=HTTPStatus.FORBIDDEN,
                reason="Forbidden",
                message=f"cannot count share memory against {SHARE_MEMORY}: {error}",
            )
        except errors.ApiError as error:
            return Verdict(
                allowed=False,
                code=HTTPStatus.INTERNAL_SERVER_ERROR,
                reason="InternalError",
                message=f"cannot check the {SHARE_MEMORY} quota of namespace {namespace} "
                f"(the claim is refused until it can be checked): {error}",
            )

    def _review(self, namespace: str, name: str, uid: str, spec: object, dry_run: bool) -> Verdict:
        classes = self.share_classes()
        unnamed: int | None = None
        if sm.needs_unnamed(spec, classes):
            unnamed = self._unnamed()
        requested = sm.claim_share_memory(spec, classes, unnamed)
        if requested == 0:
            return ALLOWED
        limits = sm.share_memory_limits(self._api.list_quotas(namespace))
        if not limits:
            return ALLOWED
        ledger = ledger_name(namespace)
        for attempt in range(ATTEMPTS):
            stored = self._api.read_ledger(ledger)
            entries = sm.decode_ledger(
                None if stored is None else stored.data, f"ConfigMap {ledger}"
            )
            existing, unnamed = self._existing(namespace, classes, unnamed)
            decision = sm.admit(
                uid, name, requested, limits=limits, ledger=entries, existing=existing,
                now=self._clock(), grace_s=self._grace_s,
            )  # fmt: skip
            if not decision.allowed:
                if not dry_run and stored is not None and decision.ledger != entries:
                    self._tidy(ledger, decision.ledger, stored.resource_version)
                return Verdict(
                    allowed=False,
                    code=HTTPStatus.FORBIDDEN,
                    reason="Forbidden",
                    message=decision.message,
                )
            if dry_run or (decision.ledger == entries and stored is not None):
                return ALLOWED
            data = sm.encode_ledger(decision.ledger)
            try:
                if stored is None:
                    self._api.create_ledger(ledger, data)
                else:
                    self._api.replace_ledger(ledger, data, stored.resource_version)
            except (errors.ConflictError, errors.AlreadyExistsError):
                log.debug("ledger %s changed, deciding %s/%s again", ledger, namespace, name)
                self._sleep(random.uniform(0, 0.05 * (attempt + 1)))  # noqa: S311 (jitter)
                continue
            log.info(
                "admitted share claim %s/%s: %s=%d bytes, used before %d",
                namespace, name, SHARE_MEMORY, requested, decision.used_bytes,
            )  # fmt: skip
            self._spawn(lambda: self._confirm(namespace, name, uid))
            return ALLOWED
        raise errors.ApiError(
            f"the ledger ConfigMap {ledger} changed {ATTEMPTS} times while the claim was "
            "decided (many claims at once); create it again"
        )

    def _tidy(self, ledger: str, entries: sm.Ledger, resource_version: str) -> None:
        """Write the pruned and confirmed entries after a refusal; a conflict or error leaves
        it to the next review."""
        try:
            self._api.replace_ledger(ledger, sm.encode_ledger(entries), resource_version)
        except errors.ApiError as error:
            log.debug("ledger %s not tidied: %s", ledger, error)

    def _confirm(self, namespace: str, name: str, uid: str) -> None:
        """Mark the admitted claim's entry as seen stored once the claim exists, so that its
        deletion frees its memory at the next review rather than after the grace period. Gives up
        after the grace period (the claim was never created; pruning takes the entry) or when
        the entry is gone."""
        ledger = ledger_name(namespace)
        deadline = self._clock() + self._grace_s
        delay = 0.2
        for _ in range(CONFIRM_TRIES):
            if self._clock() >= deadline:
                break
            self._sleep(delay)
            delay = min(delay * 2, 5.0)
            try:
                claim = self._api.read_claim(namespace, name)
                metadata = claim.get("metadata") if claim is not None else None
                if not isinstance(metadata, Mapping) or metadata.get("uid") != uid:
                    continue
                while True:
                    stored = self._api.read_ledger(ledger)
                    if stored is None:
                        return
                    entries = sm.decode_ledger(stored.data, f"ConfigMap {ledger}")
                    entry = entries.get(uid)
                    if entry is None or entry.confirmed:
                        return
                    entries[uid] = sm.confirmed(entry)
                    try:
                        self._api.replace_ledger(
                            ledger, sm.encode_ledger(entries), stored.resource_version
                        )
                    except errors.ConflictError:
                        continue
                    return
            except (errors.ApiError, sm.ShareQuotaError) as error:
                log.debug("cannot confirm share claim %s/%s yet: %s", namespace, name, error)
        log.debug(
            "share claim %s/%s not seen stored; its entry goes with the grace", namespace, name
        )

    def _unnamed(self) -> int:
        size = sm.unnamed_share_memory(self._api.list_slices(), self._driver)
        if size is None:
            raise sm.UnsizedShareError(
                f"a share request names no capacity.requests.memory and no {self._driver} share "
                "device is published to size it by (its requestPolicy default): name the memory "
                f"to count it against {SHARE_MEMORY}"
            )
        return size

    def _existing(
        self, namespace: str, classes: frozenset[str], unnamed: int | None
    ) -> tuple[dict[str, tuple[str, int]], int | None]:
        """The namespace's claims with share memory (UID -> name, bytes); the unnamed share
        size, read when one of them needs it."""
        existing: dict[str, tuple[str, int]] = {}
        for claim in self._api.list_claims(namespace):
            metadata = claim.get("metadata")
            metadata = metadata if isinstance(metadata, Mapping) else {}
            uid, name = str(metadata.get("uid") or ""), str(metadata.get("name") or "")
            spec = claim.get("spec")
            if unnamed is None and sm.needs_unnamed(spec, classes):
                unnamed = self._unnamed()
            try:
                size = sm.claim_share_memory(spec, classes, unnamed)
            except sm.ShareQuotaError as error:
                raise sm.ShareQuotaError(f"existing ResourceClaim {name}: {error}") from error
            existing[uid] = (name, size)
        return existing, unnamed


def _bad_request(message: str) -> Verdict:
    return Verdict(allowed=False, code=HTTPStatus.BAD_REQUEST, reason="BadRequest", message=message)
