"""Fact files of simulated devices, shared by the claims of a device through hard links.

A container given a simulated GPU or MIG device reads ``/run/gpu-dra/devices/<device>.json``,
mounted from ``<claim dir>/<device>.json`` (`node_devices.NodeInventory.container_edits`). The
facts of a device the node has from its start (a whole GPU, a static MIG device) never change,
so `SharedFactFiles` writes each once, durably, to ``<directory>/<device>-<digest>.json`` and
hard-links it into every claim's directory instead of creating a file per claim. The digest of
the content is in the name, so a node simulated as another machine later gets new files and a
link never shows other facts; files of facts no longer current stay (a few hundred bytes each,
one per device and machine simulated). A MIG device made for one claim keeps a file of its own. See
docs/architecture.md, "What a container gets".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Final

from gpu_dra.kubelet_plugin.atomic_file import write_atomically

SIMULATED_FACTS_DIR: Final = "simulated-facts"
"""The directory under the plugin's data dir the plugin keeps them in."""
FILE_MODE: Final = 0o644
_DIGEST_CHARS: Final = 16


class SharedFactFiles:
    """Fact files in ``directory``, linked into claim directories. Thread-safe: two claims of
    one device (shares) may link at once; a file written twice has the same content."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._written: set[Path] = set()

    def link(self, device: str, text: str, target: Path) -> None:
        """Make ``target`` (in an existing claim directory) the fact file of ``device`` with
        content ``text``; a file already at ``target`` is replaced."""
        digest = hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_CHARS]
        shared = self.directory / f"{device}-{digest}.json"
        for _ in range(3):
            self._ensure(shared, text)
            try:
                os.link(shared, target)
                return
            except FileExistsError:  # a re-prepare of the claim: link the current facts
                with contextlib.suppress(FileNotFoundError):
                    target.unlink()
            except FileNotFoundError:  # the shared file was removed since it was written
                self._written.discard(shared)
        raise OSError(f"could not link fact file {shared} to {target}")

    def _ensure(self, shared: Path, text: str) -> None:
        if shared in self._written:
            return
        if not shared.exists():  # written durably by this process or an earlier one
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            write_atomically(shared, text.encode(), mode=FILE_MODE)
        self._written.add(shared)
