"""MPS daemon ids: directory names under ``<data_dir>/mps/`` and, later, pod name suffixes.

* Per claim and config group (NVIDIA-compatible, ``nvidia-compat.md`` §7):
  ``<claimUID>-<first 5 hex of sha256(",".join(sorted(UUIDs)))>``, 42 characters.
* Per device, shared by the claims that hold MPS shares of it (consumable-capacity mode):
  ``shared-<first 16 hex of sha256(UUID)>``. It never collides with a per-claim id, which
  starts with the claim UID's hex digits.

Both are DNS labels short enough for ``mps-control-daemon-<id>`` (at most 63 characters).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Final

from gpu_dra.driver.naming import InvalidNameError
from gpu_dra.kubelet_plugin.cdi import checked_claim_uid

_DAEMON_ID: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,42}[a-z0-9])?")
# GPU-<uuid>, MIG-<uuid> and the old MIG-GPU-<uuid>/<gi>/<ci>: no whitespace, commas or "=",
# so a UUID can go into a control command line and a CUDA_MPS_* variable as it is.
_DEVICE_UUID: Final = re.compile(r"(GPU|MIG)-[A-Za-z0-9][A-Za-z0-9/-]{0,126}")
SHARED_PREFIX: Final = "shared-"


def checked_device_uuid(uuid: str) -> str:
    """``uuid`` if it looks like a GPU or MIG device UUID."""
    if not _DEVICE_UUID.fullmatch(uuid):
        raise InvalidNameError(f"{uuid!r} is not a GPU or MIG device UUID")
    return uuid


def checked_daemon_id(daemon_id: str) -> str:
    """``daemon_id`` if it is a DNS label of at most 44 characters (one path component)."""
    if not _DAEMON_ID.fullmatch(daemon_id):
        raise InvalidNameError(f"MPS daemon id {daemon_id!r} is not a DNS label of <= 44 chars")
    return daemon_id


def devices_hash(uuids: Iterable[str]) -> str:
    """First 5 hex digits of sha256 of the sorted, comma-joined UUIDs (NVIDIA's formula)."""
    ordered = sorted(checked_device_uuid(u) for u in uuids)
    if not ordered:
        raise ValueError("an MPS daemon needs at least one device")
    return hashlib.sha256(",".join(ordered).encode()).hexdigest()[:5]


def claim_daemon_id(claim_uid: str, uuids: Iterable[str]) -> str:
    """The daemon id of one claim's config group, as NVIDIA's DRA driver names it."""
    return f"{checked_claim_uid(claim_uid)}-{devices_hash(uuids)}"


def shared_daemon_id(uuid: str) -> str:
    """The id of the one daemon per GPU or MIG device that serves MPS shares of it."""
    digest = hashlib.sha256(checked_device_uuid(uuid).encode()).hexdigest()[:16]
    return f"{SHARED_PREFIX}{digest}"


def is_shared_daemon(daemon_id: str) -> bool:
    """Whether ``daemon_id`` is a per-GPU shared daemon (not a per-claim one)."""
    return daemon_id.startswith(SHARED_PREFIX)
