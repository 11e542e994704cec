"""Events for simulated GPUs from outside the plugin: ``<data-dir>/simulated-nvml-events/``.

On a simulated node (``--simulate``) the e2e tests, the demo or a developer make the simulated
GPUs misbehave by dropping one JSON file per event into this directory (`write_event` writes
one atomically); the plugin's health monitor takes them in name order, hands them to
`SimulatedNvml` and deletes them. A file it cannot use is replaced by ``<name>.error`` holding
the reason. Files whose name starts with ``.`` are ignored (half-written). Forms::

    {"gpu": "GPU-... or an NVML index", "event": "xid", "xid": 79}
    {"gpu": ..., "event": "xid", "xid": 94, "gpuInstanceId": 2, "computeInstanceId": 0}
    {"gpu": ..., "event": "double-bit-ecc"}
    {"gpu": ..., "event": "lost"}        # falls off the bus: every NVML call on it fails
    {"gpu": ..., "event": "recovered"}   # repaired: its health problems are cleared
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from gpu_dra.driver.nvml.interface import (
    NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
)
from gpu_dra.driver.nvml.simulated import SimulatedNvml

log = logging.getLogger(__name__)

SIMULATED_EVENTS_DIR: Final = "simulated-nvml-events"
EVENTS: Final = ("xid", "double-bit-ecc", "lost", "recovered")


class InboxError(ValueError):
    """An event file that cannot be used; the message says why."""


def write_event(directory: Path, name: str, event: Mapping[str, Any]) -> Path:
    """Drop `event` into the inbox `directory` as ``<name>.json`` (atomically: the plugin never
    reads half of it); the path written."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{name}.json"
    handle, temporary = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=directory)
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        json.dump(dict(event), file)
    Path(temporary).chmod(0o644)
    Path(temporary).replace(target)
    return target


class SimulatedEventInbox:
    """Takes the event files of `directory` into `nvml` (see the module doc)."""

    def __init__(self, directory: Path, nvml: SimulatedNvml) -> None:
        self.directory = directory
        self._nvml = nvml

    def poll(self) -> int:
        """Handle every waiting event file; how many were used. Blocking."""
        try:
            names = sorted(
                p.name for p in self.directory.iterdir() if p.suffix == ".json" and p.name[0] != "."
            )
        except FileNotFoundError:
            return 0
        used = 0
        for name in names:
            path = self.directory / name
            try:
                event = json.loads(path.read_text(encoding="utf-8"))
                reached = self._deliver(event)
            except (OSError, ValueError) as error:  # JSONDecodeError and InboxError are both
                log.error("simulated NVML event %s refused: %s", path, error)
                path.with_suffix(".error").write_text(f"{error}\n", encoding="utf-8")
            else:
                used += 1
                log.info("simulated NVML event %s: %s (event sets: %d)", name, event, reached)
            path.unlink(missing_ok=True)
        return used

    def _deliver(self, event: object) -> int:
        if not isinstance(event, dict):
            raise InboxError("an event is a JSON object with 'gpu' and 'event'")
        kind, gpu = event.get("event"), event.get("gpu")
        if kind not in EVENTS:
            raise InboxError(f"'event' must be one of {', '.join(EVENTS)}, got {kind!r}")
        if not isinstance(gpu, str | int) or isinstance(gpu, bool):
            raise InboxError(f"'gpu' must be a GPU UUID or an NVML index, got {gpu!r}")
        if kind == "lost":
            self._nvml.lose_gpu(gpu)
            return 0
        if kind == "recovered":
            return self._nvml.recover_gpu(gpu)
        if kind == "double-bit-ecc":
            return self._nvml.inject_event(gpu, NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR)
        xid = event.get("xid")
        gi, ci = event.get("gpuInstanceId"), event.get("computeInstanceId")
        for field, value in (("xid", xid), ("gpuInstanceId", gi), ("computeInstanceId", ci)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise InboxError(f"{field!r} must be a whole number, got {value!r}")
        if xid is None:
            raise InboxError("an 'xid' event needs 'xid', the XID number")
        return self._nvml.inject_event(
            gpu,
            NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
            xid,
            gpu_instance_id=gi,
            compute_instance_id=ci,
        )
