"""The simulated node's MIG state on disk: ``<data-dir>/simulated-nvml.json``.

So that plugin restarts and crashes mean on a simulated node what they mean on real GPUs, the
plugin hands `SimulatedNvml` the saved state at start and writes every change back atomically; a
file saved for another profile is ignored. Two instances on one node share the file: once
`attach`ed, an instance writes only the GPUs it changed (under ``<file>.lock``), and `refresh`
takes in a GPU's state before the instance works on it. See docs/mig.md#dynamic-mig-lifecycle
("Simulated nodes") and docs/architecture.md#two-instances-on-one-node.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.nvml.simulated_mig import MigSnapshotError
from gpu_dra.kubelet_plugin.atomic_file import write_atomically
from gpu_dra.kubelet_plugin.mig.instances import MigError
from gpu_dra.kubelet_plugin.node_locks import acquire_blocking

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
        self._nvml: SimulatedNvml | None = None
        self._mine: dict[str, object] = {}
        """Each GPU's state as this process's simulator holds it (after `attach`)."""
        self._lock = threading.Lock()

    def attach(self, nvml: SimulatedNvml) -> None:
        """Share the file with other processes from now on (see the module doc): `nvml` is the
        simulator this file's `save` is called for."""
        with self._lock:
            self._nvml = nvml
            self._mine = dict(_gpus(nvml.mig_snapshot()))

    def refresh(self, uuid: str) -> None:
        """Take in GPU `uuid`'s state from the file when another process changed it (only
        after `attach`; the caller holds the GPU's node-wide lock). A file that cannot be used
        raises `MigError`."""
        with self._lock:
            if self._nvml is None:
                return
            try:
                saved = self.load()
                state = None if saved is None else _gpus(saved).get(uuid)
                if isinstance(state, Mapping) and state != self._mine.get(uuid):
                    self._nvml.restore_gpu(uuid, state)
                    self._mine[uuid] = state
                    log.info("simulated MIG state of %s taken from %s", uuid, self.path)
            except (SimulatedStateError, MigSnapshotError) as error:
                raise MigError(f"simulated MIG state of {uuid} in {self.path}: {error}") from error

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
        """Replace the file with `snapshot` (durable when this returns); once attached, only the
        GPUs whose state changed since this process last saved or refreshed them."""
        with self._lock:
            gpus = dict(_gpus(snapshot))
            if self._nvml is None:
                self._write(gpus)
                return
            changed = {uuid: state for uuid, state in gpus.items() if state != self._mine.get(uuid)}
            held = acquire_blocking(self.path.with_name(f"{self.path.name}.lock"), timeout_s=30)
            try:
                saved = self.load()
                merged = dict(_gpus(saved)) if saved is not None else {}
                merged.update({uuid: s for uuid, s in gpus.items() if uuid not in merged})
                merged.update(changed)
                self._write(merged)
            finally:
                held.release()
            self._mine = gpus

    def _write(self, gpus: Mapping[str, object]) -> None:
        payload = {"version": _VERSION, "profile": self.profile, "gpus": gpus}
        data = json.dumps(payload, indent=1, sort_keys=True) + "\n"
        write_atomically(self.path, data.encode(), mode=0o644)


def _gpus(snapshot: Mapping[str, object]) -> Mapping[str, object]:
    gpus = snapshot.get("gpus")
    return gpus if isinstance(gpus, Mapping) else {}
