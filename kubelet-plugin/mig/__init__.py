"""Dynamic MIG at the plugin edge: MIG devices made at prepare and destroyed at unprepare.

* :mod:`.lifecycle` - `MigLifecycle`: NVML create/destroy of GPU and compute instances, MIG
  mode on Hopper and later;
* :mod:`.instances` - `MigState`: listing what exists, the per-GPU lock and NVML session, clear
  `MigError` messages;
* :mod:`.intents` - `MigIntent`: one MIG device a claim makes, as its record keeps it;
* :mod:`.claims` - `DynamicMig`: the claim side (create, release, the start-up sweep of
  instances no prepared claim owns), which the dynamic-MIG tier (`tiers.dynamic_mig`) runs;
* :mod:`.simulated_state` - the simulated node's MIG state file, so simulated MIG instances
  outlive a plugin restart as real ones do.
"""

from gpu_dra.kubelet_plugin.crash_points import (
    CRASH_AFTER_GPU_INSTANCE,
    TEST_CRASH_ENV,
    CrashPoint,
    crash_point_from_env,
)
from gpu_dra.kubelet_plugin.mig.instances import MigError, MigInstance
from gpu_dra.kubelet_plugin.mig.lifecycle import MigLifecycle
from gpu_dra.kubelet_plugin.mig.simulated_state import (
    SIMULATED_STATE_FILE,
    SimulatedMigStateFile,
    SimulatedStateError,
)

__all__ = [
    "CRASH_AFTER_GPU_INSTANCE",
    "SIMULATED_STATE_FILE",
    "TEST_CRASH_ENV",
    "CrashPoint",
    "MigError",
    "MigInstance",
    "MigLifecycle",
    "SimulatedMigStateFile",
    "SimulatedStateError",
    "crash_point_from_env",
]
