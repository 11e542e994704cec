"""CDI container edits that connect a workload to its MPS control daemon.

NVIDIA's contract (``nvidia-compat.md`` §7), appended to every device of the daemon's group:
``CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps`` and bind mounts ``shm -> /dev/shm`` and
``pipe -> /tmp/nvidia-mps`` (``rw,nosuid,nodev,bind``). MPS shares, whose daemon serves many
tenants, get the pipe directory read-only (``pipe_read_only``): a tenant cannot remove, rename
or create files in it (``EROFS``), while ``connect()`` to the daemon's socket still works
(docs/mps.md, "The pipe directory, read-only mounts and /dev/shm").

Optional per-client caps (`ClientCaps`, for MPS shares of a device) add
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<UUID>=<N>M[,...]`` and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``.
They are cooperative: MPS applies them per client process, and a client can only lower the
daemon's defaults with them - a process that drops them from its environment gets the daemon
default, which is the enforced bound (``mps.md`` §2, §6).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from gpu_dra.kubelet_plugin.cdi import ContainerEdits, Mount
from gpu_dra.kubelet_plugin.mps.daemon_model import PINNED_LIMIT, DaemonPaths
from gpu_dra.kubelet_plugin.mps.ids import checked_device_uuid

CONTAINER_PIPE_DIRECTORY: Final = "/tmp/nvidia-mps"
CONTAINER_SHM: Final = "/dev/shm"
MOUNT_OPTIONS: Final = ("rw", "nosuid", "nodev", "bind")
READ_ONLY_MOUNT_OPTIONS: Final = ("ro", "nosuid", "nodev", "bind")


@dataclass(frozen=True)
class ClientCaps:
    """Per-client caps in the workload's environment (cooperative, see the module doc)."""

    pinned_limits: Mapping[str, str] = field(default_factory=dict)
    """Device UUID -> ``"<N>M"``."""
    active_thread_percentage: int | None = None

    def env(self) -> dict[str, str]:
        result: dict[str, str] = {}
        if self.pinned_limits:
            parts = []
            for uuid, limit in sorted(self.pinned_limits.items()):
                if not PINNED_LIMIT.fullmatch(limit):
                    raise ValueError(f"pinned memory limit {limit!r} for {uuid} is not <MiB>M")
                parts.append(f"{checked_device_uuid(uuid)}={limit}")
            result["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(parts)
        pct = self.active_thread_percentage
        if pct is not None:
            if isinstance(pct, bool) or not 0 <= pct <= 100:
                raise ValueError(f"active thread percentage must be 0..100, got {pct!r}")
            result["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(pct)
        return result


def workload_edits(
    paths: DaemonPaths, caps: ClientCaps | None = None, *, pipe_read_only: bool = False
) -> ContainerEdits:
    """The edits for each CDI device served by the daemon at ``paths``; ``pipe_read_only``
    mounts the pipe directory read-only (MPS shares)."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIRECTORY}
    if caps is not None:
        env.update(caps.env())
    mounts = (
        Mount(str(paths.shm), CONTAINER_SHM, MOUNT_OPTIONS),
        Mount(
            str(paths.pipe),
            CONTAINER_PIPE_DIRECTORY,
            READ_ONLY_MOUNT_OPTIONS if pipe_read_only else MOUNT_OPTIONS,
        ),
    )
    return ContainerEdits(env=env, mounts=mounts)
