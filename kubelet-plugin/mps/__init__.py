"""MPS control daemons for prepared claims: start, stop, status, adopt, and workload CDI edits.

The prepare path's MPS tiers (per-claim MPS and MPS shares) use it; the daemons outlive the
plugin process and are adopted again from the checkpoint. Module by module: docs/mps.md (the
table under its introduction); behaviour: docs/mps.md#the-daemon and docs/mps.md#lifecycle.
"""

from gpu_dra.kubelet_plugin.mps.computemode import (
    ComputeModeControl,
    ComputeModeError,
    NvmlComputeMode,
)
from gpu_dra.kubelet_plugin.mps.control import ControlClient
from gpu_dra.kubelet_plugin.mps.daemon import MpsDaemonManager
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    DaemonHandle,
    DaemonObserver,
    DaemonPaths,
    DaemonRepair,
    DaemonState,
    DaemonStatus,
    MpsCommandError,
    MpsControl,
    MpsDaemonGoneError,
    MpsError,
    MpsSettings,
    MpsStartError,
    MpsStateError,
    MpsStopError,
)
from gpu_dra.kubelet_plugin.mps.edits import (
    CONTAINER_PIPE_DIRECTORY,
    ClientCaps,
    workload_edits,
)
from gpu_dra.kubelet_plugin.mps.ids import claim_daemon_id, shared_daemon_id
from gpu_dra.kubelet_plugin.mps.pod import PodRunner
from gpu_dra.kubelet_plugin.mps.process import DaemonRunner, LaunchedDaemon, ProcessRunner
from gpu_dra.kubelet_plugin.mps.shm import PlainDirectoryShm, ShmMounter, TmpfsShmMounter

__all__ = [
    "CONTAINER_PIPE_DIRECTORY",
    "ClientCaps",
    "ComputeModeControl",
    "ComputeModeError",
    "ControlClient",
    "DaemonHandle",
    "DaemonObserver",
    "DaemonPaths",
    "DaemonRepair",
    "DaemonRunner",
    "DaemonState",
    "DaemonStatus",
    "LaunchedDaemon",
    "MpsCommandError",
    "MpsControl",
    "MpsDaemonGoneError",
    "MpsDaemonManager",
    "MpsError",
    "MpsSettings",
    "MpsStartError",
    "MpsStateError",
    "MpsStopError",
    "NvmlComputeMode",
    "PlainDirectoryShm",
    "PodRunner",
    "ProcessRunner",
    "ShmMounter",
    "TmpfsShmMounter",
    "claim_daemon_id",
    "shared_daemon_id",
    "workload_edits",
]
