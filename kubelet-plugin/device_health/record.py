"""The node's health record: NVML problems that outlive the plugin, and the operator's clears.

``<data-dir>/device-health.json`` holds `driver.health.persisted` of the monitor's state (a GPU's
XIDs, ECC errors, a lost GPU), versioned, written atomically (temporary file, fsync, rename,
directory fsync) whenever that part changes, and read at start: a GPU tainted for XID 48 stays
tainted across upgrades, crashes and node reboots. The health monitor writes it (during a rolling
update both instances' monitors do; the newer one starts from what the older wrote, and a clear
request is applied by whichever sees it first). Problems clear only on evidence: a recovery NVML
reports (the simulator's), or an operator's ``gpu-dra-kubelet-plugin clear-health``
(`request_clear`), which leaves a request in ``<data-dir>/device-health-clear.json`` that the
running monitor applies within ``MonitorTiming.clear_poll_s`` (2 s; or the next one at its start).
An unreadable record stops the plugin with a message (`HealthRecordError`): it is never read as
"healthy". See docs/architecture.md, "Health monitor".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gpu_dra.driver.health import (
    HealthRecordError,
    HealthState,
    persisted,
    persisted_from_json,
    persisted_to_json,
)
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.atomic_file import remove_durably, remove_temporaries, write_atomically

log = logging.getLogger(__name__)

HEALTH_RECORD_FILE: Final = "device-health.json"
CLEAR_REQUEST_FILE: Final = "device-health-clear.json"
ALL_GPUS: Final = "*"


@dataclass(frozen=True)
class ClearRequest:
    """GPUs whose recorded problems the operator clears (``ALL_GPUS``: every GPU)."""

    gpus: frozenset[str]

    def covers(self, gpu_uuid: str) -> bool:
        return ALL_GPUS in self.gpus or gpu_uuid in self.gpus


class HealthRecord:
    """The record of one data dir (see the module doc). Blocking file I/O."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / HEALTH_RECORD_FILE
        self.clear_path = data_dir / CLEAR_REQUEST_FILE
        self._written: dict[str, object] | None = None

    def load(self) -> HealthState:
        """The recorded problems (none without a record); `HealthRecordError` naming the file
        when it cannot be read. Temporaries of a write that died are removed first."""
        remove_temporaries(self.path.parent, lambda target: target == HEALTH_RECORD_FILE)
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return HealthState()
        except OSError as error:
            raise HealthRecordError(f"health record {self.path}: {error}") from error
        try:
            state = persisted_from_json(json.loads(text))
        except (ValueError, HealthRecordError) as error:
            raise HealthRecordError(
                f"health record {self.path} is unusable ({error}); the plugin does not start "
                "rather than forget a GPU's faults: repair the file, or remove it to start "
                "with every GPU healthy"
            ) from error
        self._written = persisted_to_json(state)
        return state

    def save(self, state: HealthState, *, also: HealthState | None = None) -> bool:
        """Write ``persisted(state)`` (and ``also``'s problems: those of GPUs the node does
        not have now) when it differs from what is on disk; whether it wrote. Returns once the
        change is on disk."""
        for target, problems in (also or HealthState()).problems.items():
            for problem in problems.values():
                state = state.with_problem(target, problem)
        document = persisted_to_json(persisted(state))
        if document == self._written:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(document, indent=1, sort_keys=True) + "\n").encode()
        write_atomically(
            self.path, data, mode=0o644, crash_point=crash_points.HEALTH_RECORD_BEFORE_RENAME
        )
        self._written = document
        return True

    def pending_clear(self) -> ClearRequest | None:
        """The operator's clear request waiting to be applied, if any; an unreadable one is
        logged and removed (the operator's command said it was written; its log says why)."""
        try:
            raw = json.loads(self.clear_path.read_text(encoding="utf-8"))
            gpus = raw["gpus"]
            if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
                raise TypeError("gpus is not a list of strings")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.error("health clear request %s unusable, removed: %s", self.clear_path, error)
            remove_durably(self.clear_path)
            return None
        return ClearRequest(frozenset(gpus))

    def done_clearing(self) -> None:
        """The request was applied (and the record written): remove it."""
        remove_durably(self.clear_path)


def split_by_gpu(state: HealthState, gpus: set[str]) -> tuple[HealthState, HealthState]:
    """``state``'s problems of ``gpus``, and the others'."""
    present = {t: p for t, p in state.problems.items() if t.gpu_uuid in gpus}
    absent = {t: p for t, p in state.problems.items() if t.gpu_uuid not in gpus}
    return HealthState(present), HealthState(absent)


def request_clear(data_dir: Path, gpus: Iterable[str]) -> ClearRequest:
    """Leave a clear request for the monitor (merged with one still waiting); returns it."""
    record = HealthRecord(data_dir)
    waiting = record.pending_clear()
    wanted = frozenset(gpus) | (waiting.gpus if waiting is not None else frozenset())
    data = (json.dumps({"gpus": sorted(wanted)}) + "\n").encode()
    write_atomically(record.clear_path, data, mode=0o644)
    return ClearRequest(wanted)
