"""MPS control daemons for prepared claims: start, stop, status, adopt, and workload CDI edits.

The prepare path's MPS tiers use it (``docs/mps.md``). Layout:

* :mod:`.daemon_model` - what a daemon is: `MpsSettings` (rendered as ``set_default_*``
  commands), `DaemonHandle` (and its checkpoint form), `DaemonStatus`, the `MpsControl` Protocol
  and the error vocabulary;
* :mod:`.ids` - NVIDIA-compatible per-claim daemon ids and per-device shared-daemon ids;
* :mod:`.control` - runs control commands through the control binary (stdin, one per call);
* :mod:`.process` - the `DaemonRunner` seam and the host-process runner, process checks;
* :mod:`.pod` - `PodRunner`: the daemon as a pod bound to this node (production);
* :mod:`.computemode` - the `ComputeModeControl` seam: EXCLUSIVE_PROCESS on full GPUs via NVML;
* :mod:`.shm` - the `ShmMounter` seam: tmpfs in production, a plain directory in tests;
* :mod:`.daemon` - `MpsDaemonManager`, the real `MpsControl` (restart in place, `ensure`);
* :mod:`.supervisor` - `DaemonSupervisor`: `ensure` for the daemons of prepared claims, every
  ``--mps-daemon-check-interval``;
* :mod:`.events` - `MpsEvents`: Kubernetes Events on the claims and pods a repair concerns;
* :mod:`.edits` - the CDI container edits of a daemon's workloads;
* :mod:`.memory_limits` - per-container GPU memory caps of MPS shares by the driver (the
  ``apply-cuda-memory-limits`` hook), detected at start;
* :mod:`.shared_daemons` - the per-GPU shared daemon of MPS shares and its checkpoint-derived
  reference count;
* :mod:`.claim_tier`, :mod:`.share_tier` - the per-claim MPS and MPS share tiers of prepare
  (`gpu_dra.kubelet_plugin.tier`), and :mod:`.recorded_daemons`, the daemons their records
  name (undo, adoption and the sweep at start-up).
"""

from gpu_dra.kubelet_plugin.mps.computemode import (
    ComputeModeControl,
    ComputeModeError,
    NvmlComputeMode,
)
from gpu_dra.kubelet_plugin.mps.control import ControlClient
from gpu_dra.kubelet_plugin.mps.daemon import MpsDaemonManager
from gpu_dra.kubelet_plugin.mps.daemon_model import (
    MPS_STATE_KEY,
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
    claims_using,
    handles_from_state,
    handles_to_state,
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
    "MPS_STATE_KEY",
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
    "claims_using",
    "handles_from_state",
    "handles_to_state",
    "shared_daemon_id",
    "workload_edits",
]
