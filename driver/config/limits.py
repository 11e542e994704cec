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
from gpu_dra.driver.jsonbounds import path_key, short_key

# How many UUIDs a message lists before "...".
_UUIDS_SHOWN = 2
# Index keys are read as numbers only up to this many digits (leading zeros aside): a longer one
# is out of range for any group, and Python refuses int() of more than 4300 digits.
_INDEX_DIGITS = 18


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
        field = PER_DEVICE_LIMITS + path_key(key, brackets=True)
        uuid = _device(key, ordered)
        if uuid is None:
            problems.append(ConfigProblem(field=field, reason=_unknown_key(key, ordered)))
            continue
        limit = render_pinned_limit(quantity)
        other = named_by.get(uuid)
        if other is not None and limits[uuid] != limit:
            reason = (
                f"keys {short_key(other)!r} and {short_key(key)!r} both name device {uuid} "
                "with different limits: keep one"
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
    index = _index(key)
    if index is not None and index < len(ordered):
        return ordered[index]
    return None


def _index(key: str) -> int | None:
    """The index an all-digits ``key`` names (a huge one: above any group), else None."""
    if not INDEX_KEY.fullmatch(key):
        return None
    digits = key.lstrip("0") or "0"
    return int(digits) if len(digits) <= _INDEX_DIGITS else 10**_INDEX_DIGITS


def _unknown_key(key: str, ordered: Sequence[str]) -> str:
    count = len(ordered)
    indexes = f"0..{count - 1}" if count else "none"
    if INDEX_KEY.fullmatch(key):
        digits = key.lstrip("0") or "0"
        return (
            f"device index {short_key(digits)} is out of range: this config group has {count} "
            f"device(s), indexes {indexes} in sorted UUID order"
        )
    shown = ", ".join(ordered[:_UUIDS_SHOWN]) + (", ..." if count > _UUIDS_SHOWN else "")
    return (
        f"key {short_key(key)!r} is neither the UUID of a device in this config group "
        f"({shown or 'no devices'}) nor an index ({indexes})"
    )
