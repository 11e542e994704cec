"""The pod a process runs in, from its cgroup path (``/proc/<pid>/cgroup``).

The kubelet names a pod's cgroup after its UID, with the systemd driver
(``kubepods-burstable-pod<uid with _>.slice``) and the cgroupfs driver (``pod<uid>``), on
cgroup v1 and v2 alike. A process that is gone, or in no pod's cgroup, has no pod.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

_POD: Final = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod UID in the text of a ``/proc/<pid>/cgroup`` file, or None."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        match = _POD.search(path)
        if match is not None:
            return match.group(1).replace("_", "-")
    return None


def pod_uid_of(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The UID of the pod process `pid` runs in; None when it is gone or in no pod. Other
    errors (permissions) raise `OSError`."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8")
    except (FileNotFoundError, ProcessLookupError):
        return None
    return pod_uid_from_cgroup(text)
