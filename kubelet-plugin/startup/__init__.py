"""What the kubelet plugin's composition root (`__main__.py`) builds at start-up, one module per
concern: `discovery` (NVML, the GPUs: `StartupError` when NVML fails node-wide or no reported GPU
can be read; the node inventory, the dynamic MIG lifecycle), `node_guard` (the guard against
another owner of the node's GPUs, the instance registration), `userspace` (the driver userspace
edits, the time slicer), `memory_caps` (which shares' memory the driver caps), `mps_daemons` (the
MPS daemon manager, its supervisor, the warm daemons) and `slice_publishing` (the ResourceSlice
publishing turn). Each helper logs what it found; a missing optional part (MPS, nvidia-smi) is
logged and None, so that only the claims asking for it fail. See docs/architecture.md, "Start-up
of the kubelet plugin".
"""

from __future__ import annotations

import os

from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings


class StartupError(Exception):
    """The plugin cannot start; the message says why (logged, exit status 1)."""


def arm_test_crash_point(settings: KubeletPluginSettings) -> None:
    """Arm the test-only fault injection point ``GPU_DRA_TEST_CRASH_AT`` names (simulated nodes
    only, `crash_points`); `StartupError` for a name that is no such point."""
    try:
        crash_points.arm_from_env(os.environ, simulated=settings.simulate is not None)
    except ValueError as error:
        raise StartupError(str(error)) from error
