"""The driver userspace at start-up: the driver root, the edits every real GPU container gets
(found now, so that a wrong driver root is logged) and the time slicer (`nvidia-smi` from the
driver, or the recorded fake on simulated nodes; None when it is not found, so that only
TimeSlicing claims fail). See docs/architecture.md, "Start-up of the kubelet plugin".
"""

from __future__ import annotations

import asyncio
import functools
import logging

from gpu_dra.driver.model import NodeDevices
from gpu_dra.driver.nvml.interface import (
    NVML_INIT_FLAG_NO_GPUS,
    NVMLError,
    NvmlLibrary,
    return_code,
    return_code_name,
)
from gpu_dra.kubelet_plugin.nvidia_driver_root import DriverRoot, DriverUserspaceError
from gpu_dra.kubelet_plugin.nvidia_userspace import CommonEdits
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.time_slicer import (
    RECORD_FILE,
    NvidiaSmiTimeSlicer,
    RecordedTimeSlicer,
    TimeSlicer,
    driver_tool_env,
)

log = logging.getLogger("gpu_dra.kubelet_plugin")


def nvml_driver_version(nvml: NvmlLibrary) -> str:
    """``nvmlSystemGetDriverVersion`` between an init and a shutdown of its own; an NVML error
    is raised with its return code name."""
    try:
        nvml.init_with_flags(NVML_INIT_FLAG_NO_GPUS)
        try:
            return nvml.system_get_driver_version()
        finally:
            nvml.shutdown()
    except NVMLError as error:
        code = return_code(error)
        name = return_code_name(code) if code is not None else type(error).__name__
        raise DriverUserspaceError(f"nvmlSystemGetDriverVersion failed: {name}") from error


def driver_root(settings: KubeletPluginSettings) -> DriverRoot:
    """The driver root as the plugin sees it (`--driver-root`) and as the host does
    (`--nvidia-driver-root`)."""
    return DriverRoot(settings.driver_root, settings.host_driver_root)


async def common_edits(settings: KubeletPluginSettings, nvml: NvmlLibrary) -> CommonEdits | None:
    """The driver userspace every real GPU container gets (None on simulated nodes), found now
    so that a wrong driver root is logged at start; prepares recompute it when the driver
    changes and fail with the message while it cannot be found."""
    if settings.simulate:
        return None
    common = CommonEdits(
        driver_root(settings),
        functools.partial(nvml_driver_version, nvml),
        hook_path=settings.nvidia_cdi_hook_path,
        disabled_hooks=settings.disable_cdi_hooks,
    )
    try:
        await asyncio.to_thread(common.current)
    except DriverUserspaceError as error:
        log.error("driver userspace not found, GPU claims will fail until it is: %s", error)
    return common


PASCAL_ARCHITECTURE = 4
"""``NVML_DEVICE_ARCH_PASCAL``: simulated GPUs of this architecture or older answer "Not
Supported" to time-slice commands, as the Tesla P4 does (NVIDIA issues #41, #81, #363)."""


def time_slicer(settings: KubeletPluginSettings, devices: NodeDevices) -> TimeSlicer | None:
    """nvidia-smi on real GPUs (None when it is not found: TimeSlicing claims then fail with a
    message); on simulated nodes the recorded fake, writing `<data-dir>/time-slicing.json`."""
    if settings.simulate:
        unsupported = {g.uuid for g in devices.gpus if g.architecture <= PASCAL_ARCHITECTURE}
        path = settings.state_dir / RECORD_FILE
        log.info("time-slicing simulated: recorded in %s", path)
        return RecordedTimeSlicer(path, not_supported=unsupported)
    binary = settings.resolved_nvidia_smi()
    if binary is None:
        log.warning(
            "nvidia-smi %r not found on PATH nor under %s/usr/bin: claims with sharing strategy "
            "TimeSlicing on full GPUs will fail on this node",
            settings.nvidia_smi,
            settings.driver_root,
        )
        return None
    try:
        env = driver_tool_env(binary, settings.driver_root)
    except FileNotFoundError as error:
        log.warning("%s: claims with sharing strategy TimeSlicing will fail on this node", error)
        return None
    preloaded = f" (LD_PRELOAD={env['LD_PRELOAD']})" if "LD_PRELOAD" in env else ""
    log.info("time-slicing with %s%s", binary, preloaded)
    return NvidiaSmiTimeSlicer(binary, base_env=env)
