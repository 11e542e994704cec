"""Which shares' memory the driver caps per container, found at start-up (`memory_limits.detect`):
the GPUs offered as MPS shares (each share's enforcement reported on its claim, naming the memory
watchdog where the driver does not cap) and those offered as capped shares (only the GPUs where
the cap works stay offered). See docs/shares.md.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.kubelet_plugin.memory_limits import MemoryLimitSupport, ShareMemory, watchdog_note
from gpu_dra.kubelet_plugin.memory_limits import detect as detect_memory_limits
from gpu_dra.kubelet_plugin.mps.events import MpsEvents
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.tiers.capped_shares import offer_capped

log = logging.getLogger("gpu_dra.kubelet_plugin")


def share_memory(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    events: MpsEvents | None,
) -> ShareMemory:
    """Which GPUs offered as MPS shares the driver caps per container (`memory_limits.detect`:
    ``--mps-share-memory-limits``, driver, cgroup v2, the hook's version, NVML; never a MIG
    device), logged; each share's enforcement is reported as an Event on its claim, naming the
    memory watchdog where the driver does not cap."""
    hook = settings.nvidia_cdi_hook_path
    uuids = [gpu.uuid for gpu in inventory.mps_shares]
    mig = [device.uuid for device in inventory.mig_mps_shares]
    support = detect_memory_limits(
        nvml,
        uuids,
        mode=settings.mps_share_memory_limits,
        simulated=settings.simulate is not None,
        hook_path=hook,
        driver_root=str(settings.host_driver_root),
        hook_candidates=list(dict.fromkeys([Path(hook), settings.driver_root / hook.lstrip("/")])),
        disabled_hooks=settings.disable_cdi_hooks,
    ).without_mig(mig)
    for uuid in [*uuids, *mig]:
        log.info("mps share memory of %s: %s (%s)", uuid, support.enforcement(uuid).value,
                 support.why(uuid))  # fmt: skip
    return ShareMemory(
        support,
        None if events is None else events.share_prepared,
        watchdog_note(settings.mps_memory_watchdog, settings.mps_memory_watchdog_interval_s),
    )


def capped_shares(
    settings: KubeletPluginSettings,
    nvml: NvmlLibrary,
    inventory: NodeInventory,
    events: MpsEvents | None,
) -> tuple[NodeInventory, ShareMemory]:
    """The inventory with only the GPUs of ``--capped-shares`` whose driver caps a container's
    memory (`memory_limits.detect`, as for MPS shares: driver, cgroup v2, the hook's version,
    NVML); each GPU left out is logged with why, and stays a plain whole GPU."""
    if not inventory.capped_shares:
        return inventory, ShareMemory(MemoryLimitSupport(), None)
    hook = settings.nvidia_cdi_hook_path
    support = detect_memory_limits(
        nvml,
        [gpu.uuid for gpu in inventory.capped_shares],
        mode="auto",
        simulated=settings.simulate is not None,
        hook_path=hook,
        driver_root=str(settings.host_driver_root),
        hook_candidates=list(dict.fromkeys([Path(hook), settings.driver_root / hook.lstrip("/")])),
        disabled_hooks=settings.disable_cdi_hooks,
    )
    capped = offer_capped(inventory, support)
    return capped, ShareMemory(support, None if events is None else events.capped_share_prepared)
