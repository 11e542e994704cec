"""Fact files of simulated devices, one file per device shared by all the claims of it.

A container given a simulated GPU or MIG device reads ``/run/gpu-dra/devices/<device>.json``
(`node_devices.NodeInventory.container_edits`). The facts of a device the node has from its
start (a whole GPU, a static MIG device) never change, so `SharedFactFiles` writes each once,
durably, to ``<directory>/<device>-<digest>.json`` and every claim's CDI spec mounts that file
read-only: a prepare of such a device makes no file and no claim directory. The digest of the
content is in the name, so a node simulated as another machine later gets new files and a
mount never shows other facts; files of facts no longer current stay (a few hundred bytes each,
one per device and machine simulated). A MIG device made for one claim gets a file of its own
in the claim's directory. See docs/architecture.md, "What a container gets".
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Final

from gpu_dra.kubelet_plugin.atomic_file import write_atomically

SIMULATED_FACTS_DIR: Final = "simulated-facts"
"""The directory under the plugin's data dir the plugin keeps them in."""
FILE_MODE: Final = 0o644
_DIGEST_CHARS: Final = 16


class SharedFactFiles:
    """Fact files in ``directory``, mounted by claims. Thread-safe: two claims of one device
    (shares) may ask at once; a file written twice has the same content."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, device: str, text: str) -> Path:
        """The fact file of ``device`` with content ``text``, written (durably) first when it
        is not there: by this process or an earlier one, or removed since."""
        digest = hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_CHARS]
        shared = self.directory / f"{device}-{digest}.json"
        if not shared.exists():
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            write_atomically(shared, text.encode(), mode=FILE_MODE)
        return shared
