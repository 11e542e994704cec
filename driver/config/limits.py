"""MPS pinned-memory limits of a config group, per device UUID, as the MPS daemon takes them.

``defaultPinnedDeviceMemoryLimit`` applies to every device of the group;
``defaultPerDevicePinnedMemoryLimit`` overrides it per device, keyed by device UUID or by index
into the group's UUIDs in sorted order (not the nvidia-smi index). Limits are rendered as whole
MiB, truncating: ``10Gi`` -> ``10240M``, ``1G`` -> ``953M``, ``10M`` -> ``9M``.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_dra.driver.config.decode import DeviceConfig
from gpu_dra.driver.config.errors import ConfigError, ConfigProblem
from gpu_dra.driver.config.quantity import quantity_value
from gpu_dra.driver.config.resolve import ConfigGroup
from gpu_dra.driver.config.sharing import MpsConfig
from gpu_dra.driver.config.validate import INDEX_KEY, MIB, PER_DEVICE_LIMITS

# How many UUIDs a message lists before "...".
_UUIDS_SHOWN = 2


def render_pinned_limit(quantity: str) -> str:
    """A pinned-memory limit as ``set_default_device_pinned_mem_limit`` takes it: ``<MiB>M``."""
    return f"{quantity_value(quantity) // MIB}M"


def mps_config(config: DeviceConfig) -> MpsConfig | None:
    """The `MpsConfig` of a normalized config whose strategy is MPS, else None."""
    sharing = config.sharing
    if sharing is None or sharing.strategy != "MPS":
        return None
    return sharing.mps_config or MpsConfig()


def pinned_memory_limits(group: ConfigGroup, uuids: Sequence[str], *, claim: str) -> dict[str, str]:
    """The pinned-memory limit of each device of ``group`` that has one: ``{uuid: "<N>M"}``.

    ``uuids`` are the UUIDs of the group's devices (full GPUs or MIG devices), in any order.
    Empty for groups without MPS or without limits. Raises `ConfigError` (naming ``claim``)
    when a per-device key names no device of the group, or two keys name one device with
    different limits.
    """
    mps = mps_config(group.config)
    if mps is None:
        return {}
    ordered = sorted(uuids)
    limits: dict[str, str] = {}
    if mps.default_pinned_device_memory_limit is not None:
        default = render_pinned_limit(mps.default_pinned_device_memory_limit)
        limits = dict.fromkeys(ordered, default)
    problems: list[ConfigProblem] = []
    named_by: dict[str, str] = {}
    for key, quantity in (mps.default_per_device_pinned_memory_limit or {}).items():
        field = f"{PER_DEVICE_LIMITS}[{key}]"
        uuid = _device(key, ordered)
        if uuid is None:
            problems.append(ConfigProblem(field=field, reason=_unknown_key(key, ordered)))
            continue
        limit = render_pinned_limit(quantity)
        other = named_by.get(uuid)
        if other is not None and limits[uuid] != limit:
            reason = (
                f"keys {other!r} and {key!r} both name device {uuid} with different limits: "
                "keep one"
            )
            problems.append(ConfigProblem(field=field, reason=reason))
        named_by[uuid] = key
        limits[uuid] = limit
    if problems:
        located = [problem.located(group.origin.label) for problem in problems]
        raise ConfigError(located, claim=claim)
    return limits


def _device(key: str, ordered: Sequence[str]) -> str | None:
    """The UUID that ``key`` names among ``ordered``, if any."""
    if key in ordered:
        return key
    if INDEX_KEY.fullmatch(key) and int(key) < len(ordered):
        return ordered[int(key)]
    return None


def _unknown_key(key: str, ordered: Sequence[str]) -> str:
    count = len(ordered)
    indexes = f"0..{count - 1}" if count else "none"
    if INDEX_KEY.fullmatch(key):
        return (
            f"device index {int(key)} is out of range: this config group has {count} "
            f"device(s), indexes {indexes} in sorted UUID order"
        )
    shown = ", ".join(ordered[:_UUIDS_SHOWN]) + (", ..." if count > _UUIDS_SHOWN else "")
    return (
        f"key {key[:60]!r} is neither the UUID of a device in this config group "
        f"({shown or 'no devices'}) nor an index ({indexes})"
    )
