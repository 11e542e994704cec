"""Rules that a decoded config must also follow, beyond what each field's type allows.

Types, enums and ranges are checked while decoding (`gpu_dra.driver.config.decode`); this module
checks combinations of fields and values that need arithmetic. Rules that need the devices of a
config group (per-device pinned-memory keys) are in `gpu_dra.driver.config.limits`.
"""

from __future__ import annotations

import re
from typing import Final

from gpu_dra.driver.config.errors import ConfigProblem
from gpu_dra.driver.config.gpuconfig import GpuConfig
from gpu_dra.driver.config.migconfig import MigDeviceConfig
from gpu_dra.driver.config.quantity import quantity_value
from gpu_dra.driver.config.sharing import GpuSharing, MpsConfig
from gpu_dra.driver.jsonbounds import path_key

MIB: Final = 1024 * 1024

# A per-device pinned-memory key: a device UUID or an index into the group's sorted UUIDs.
UUID_PREFIXES: Final = ("GPU-", "MIG-")
INDEX_KEY: Final = re.compile(r"[0-9]+")

SHARING: Final = "parameters.sharing"
MPS_CONFIG: Final = f"{SHARING}.mpsConfig"
PER_DEVICE_LIMITS: Final = f"{MPS_CONFIG}.defaultPerDevicePinnedMemoryLimit"


def config_problems(config: GpuConfig | MigDeviceConfig) -> list[ConfigProblem]:
    """What is wrong with a decoded, normalized config (empty if nothing)."""
    sharing = config.sharing
    if sharing is None:
        return []
    problems: list[ConfigProblem] = []
    if sharing.strategy == "TimeSlicing" and sharing.mps_config is not None:
        problems.append(
            ConfigProblem(
                field=MPS_CONFIG,
                reason="mpsConfig cannot be used with strategy TimeSlicing: "
                "remove mpsConfig or set strategy: MPS",
            )
        )
    if (
        isinstance(sharing, GpuSharing)
        and sharing.strategy == "MPS"
        and sharing.time_slicing_config is not None
    ):
        problems.append(
            ConfigProblem(
                field=f"{SHARING}.timeSlicingConfig",
                reason="timeSlicingConfig cannot be used with strategy MPS: "
                "remove timeSlicingConfig or set strategy: TimeSlicing",
            )
        )
    if sharing.mps_config is not None:
        problems.extend(mps_problems(sharing.mps_config))
    return problems


def mps_problems(mps: MpsConfig) -> list[ConfigProblem]:
    """Pinned-memory limits must be at least 1Mi; per-device keys must be UUIDs or indexes."""
    problems: list[ConfigProblem] = []
    if mps.default_pinned_device_memory_limit is not None:
        problem = _limit_problem(mps.default_pinned_device_memory_limit)
        if problem:
            problems.append(
                ConfigProblem(field=f"{MPS_CONFIG}.defaultPinnedDeviceMemoryLimit", reason=problem)
            )
    for key, limit in (mps.default_per_device_pinned_memory_limit or {}).items():
        field = PER_DEVICE_LIMITS + path_key(key, brackets=True)
        if not (key.startswith(UUID_PREFIXES) or INDEX_KEY.fullmatch(key)):
            problems.append(ConfigProblem(field=field, reason=key_syntax_reason(key)))
        problem = _limit_problem(limit)
        if problem:
            problems.append(ConfigProblem(field=field, reason=problem))
    return problems


def key_syntax_reason(key: str) -> str:
    """Why ``key`` cannot name a device of a config group."""
    return (
        f"invalid device key {_short(key)}: use a device UUID (GPU-... or MIG-...) or an index "
        "0, 1, ... into the config group's device UUIDs in sorted order"
    )


def _limit_problem(limit: str) -> str:
    if quantity_value(limit) < MIB:
        return f"pinned memory limit {_short(limit)} is too low: it must be at least 1Mi"
    return ""


def _short(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")
