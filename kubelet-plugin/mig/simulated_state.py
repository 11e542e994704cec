"""The simulated node's MIG state on disk: ``<data-dir>/simulated-nvml.json``.

A real GPU keeps its MIG mode and instances when the plugin process dies; a simulated one lives
in the process. So that restarts and crashes mean the same on a simulated node, the plugin hands
`SimulatedNvml` the saved state at start and writes every change back (atomically: a reader
sees the state before or after a change, never half of one). Tests read the file to see what
the "hardware" holds.

Format (JSON)::

    {"version": 1, "profile": "<--simulate value>",
     "gpus": {"<GPU UUID>": {"current": 1, "pending": 1, "computeInstancesCreated": 3,
                             "gpuInstances": [{"id": 7, "profileId": 19, "start": 0,
                                               "computeInstances": [{"id": 0, "profileId": 0,
                                                                     "uuid": "MIG-..."}]}]}}}

A file saved for another profile is ignored (logged): the GPUs it names are other GPUs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from gpu_dra.kubelet_plugin.atomic_file import write_atomically

log = logging.getLogger(__name__)

SIMULATED_STATE_FILE: Final = "simulated-nvml.json"
_VERSION: Final = 1


class SimulatedStateError(Exception):
    """The state file cannot be read; the message names it and says what to do."""


class SimulatedMigStateFile:
    """Load and save a `SimulatedNvml.mig_snapshot` for one profile."""

    def __init__(self, path: Path, profile: str) -> None:
        self.path = path
        self.profile = profile

    def load(self) -> Mapping[str, object] | None:
        """The saved snapshot, or None when there is none for this profile."""
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            saved = json.loads(raw)
        except json.JSONDecodeError as error:
            raise SimulatedStateError(
                f"simulated MIG state {self.path} is not JSON ({error}); delete it to start the "
                "simulated GPUs without MIG instances"
            ) from error
        if not isinstance(saved, dict) or saved.get("version") != _VERSION:
            raise SimulatedStateError(
                f"simulated MIG state {self.path} is not a version {_VERSION} state file; delete "
                "it to start the simulated GPUs without MIG instances"
            )
        if saved.get("profile") != self.profile:
            log.warning(
                "ignoring simulated MIG state of profile %r in %s (this node simulates %r)",
                saved.get("profile"),
                self.path,
                self.profile,
            )
            return None
        return {"gpus": saved.get("gpus")}

    def save(self, snapshot: Mapping[str, object]) -> None:
        """Replace the file with `snapshot` (durable when this returns)."""
        payload = {"version": _VERSION, "profile": self.profile, "gpus": snapshot["gpus"]}
        data = json.dumps(payload, indent=1, sort_keys=True) + "\n"
        write_atomically(self.path, data.encode(), mode=0o644)
