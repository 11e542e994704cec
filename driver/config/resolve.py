"""Which config applies to each allocated device of a claim, and which devices share one.

Input is the claim's ``status.allocation.devices.config`` and the devices this driver was
allocated. Precedence follows NVIDIA's driver (``shared/reference/nvidia-compat.md`` §4.3):
defaults < class configs < claim configs, later entries winning; an entry naming the device's
request must fit its type (else an error), one without ``requests`` applies only where it fits.
Devices resolved to the same entry form a `ConfigGroup`. The config list is untrusted JSON: any
shape becomes a `ConfigError` naming the entry and field. See docs/config.md#precedence.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from gpu_dra.driver.config.api import DeviceType
from gpu_dra.driver.config.decode import (
    MAX_PARAMETERS_BYTES,
    MAX_PARAMETERS_DEPTH,
    DeviceConfig,
    decode_parameters,
)
from gpu_dra.driver.config.errors import ConfigError, ConfigProblem
from gpu_dra.driver.config.gpuconfig import GpuConfig
from gpu_dra.driver.config.migconfig import MigDeviceConfig
from gpu_dra.driver.jsonbounds import JsonLimits, describe, json_problem, short_key

ConfigSource = Literal["default", "FromClass", "FromClaim"]

NOT_OPAQUE: Final = "only opaque parameters are supported by this driver"

_SOURCES: Final[dict[object, ConfigSource]] = {"FromClass": "FromClass", "FromClaim": "FromClaim"}

_KIND_FOR_TYPE: Final[dict[str, str]] = {"gpu": GpuConfig.KIND, "mig": MigDeviceConfig.KIND}

CONFIG_FIELD: Final = "status.allocation.devices.config"

# Device and request names shown unquoted in messages (DNS labels, `<request>/<subrequest>`).
_PLAIN_NAME: Final = re.compile(r"[A-Za-z0-9._/-]{1,80}")

# An `opaque` object whose parameters are within the decoder's limits: safe to compare.
_OPAQUE_LIMITS: Final = JsonLimits(
    max_depth=MAX_PARAMETERS_DEPTH + 1, max_bytes=MAX_PARAMETERS_BYTES + 1024
)


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of this driver: ``request`` (``<req>`` or ``<req>/<sub>``), the
    ``device`` name and its ``type`` (the device's ``type`` attribute)."""

    request: str
    device: str
    type: DeviceType


@dataclass(frozen=True)
class ConfigOrigin:
    """Where an effective config came from.

    ``index`` is the position in ``status.allocation.devices.config`` (None for the built-in
    defaults); ``label`` names the entry the way messages do (``spec.devices.config[1]``,
    ``config[0] (FromClass)``, ``default GpuConfig``).
    """

    source: ConfigSource
    index: int | None
    label: str


@dataclass(frozen=True)
class ConfigGroup:
    """Devices of one claim that resolved to the same config entry, in allocation order."""

    config: DeviceConfig
    origin: ConfigOrigin
    devices: tuple[AllocatedDevice, ...]


@dataclass(frozen=True)
class ResolvedConfigs:
    """The effective config of every allocated device of a claim, grouped by config entry."""

    groups: tuple[ConfigGroup, ...]

    def group_of(self, device: AllocatedDevice) -> ConfigGroup:
        """The group ``device`` belongs to (KeyError if it was not among the resolved devices)."""
        for group in self.groups:
            if device in group.devices:
                return group
        raise KeyError(device)

    def config_of(self, device: AllocatedDevice) -> DeviceConfig:
        """The effective, normalized config of ``device``."""
        return self.group_of(device).config


@dataclass(frozen=True)
class _Candidate:
    origin: ConfigOrigin
    requests: tuple[str, ...]
    config: DeviceConfig


def resolve_configs(
    configs: object,
    devices: Sequence[AllocatedDevice],
    *,
    driver: str,
    claim: str,
    spec_configs: object = None,
) -> ResolvedConfigs:
    """Resolve the effective config of each of ``devices`` and group the devices.

    ``configs`` is the claim's ``status.allocation.devices.config`` as JSON: a list (or null)
    of objects ``{source, requests?, opaque: {driver, parameters}}``; ``devices`` the allocation
    results of ``driver`` on this node. Entries for other drivers are skipped; every entry for
    ``driver`` is decoded and validated, used or not. ``claim`` (``namespace/name``) and
    ``spec_configs`` (the claim's ``spec.devices.config``, to name claim entries by their
    position there; ignored where it is no list of objects) are used in messages only.

    Raises `ConfigError` with every problem found, whatever ``configs`` holds.
    """
    if configs is None:
        configs = []
    if not isinstance(configs, list | tuple):
        reason = f"expected a list of config entries, got {describe(configs)}"
        raise ConfigError([ConfigProblem(field=CONFIG_FIELD, reason=reason)], claim=claim)
    candidates, problems = _decode_entries(configs, driver, spec_configs)
    if problems:
        raise ConfigError(problems, claim=claim)

    chosen: dict[AllocatedDevice, _Candidate] = {}
    for device in devices:
        candidate = _select(candidates, device)
        if isinstance(candidate, ConfigProblem):
            problems.append(candidate)
        else:
            chosen[device] = candidate
    if problems:
        raise ConfigError(problems, claim=claim)
    return _group(devices, chosen)


def _decode_entries(
    configs: Sequence[object], driver: str, spec_configs: object
) -> tuple[list[_Candidate], list[ConfigProblem]]:
    """Defaults, then class entries, then claim entries for ``driver``, decoded, in precedence
    order (lowest first); or the problems with them."""
    labels = _labels(configs, spec_configs)
    problems: list[ConfigProblem] = []
    by_source: dict[ConfigSource, list[_Candidate]] = {"FromClass": [], "FromClaim": []}
    for index, entry in enumerate(configs):
        label = labels[index]
        if not isinstance(entry, Mapping):
            reason = f"expected a config entry (an object), got {describe(entry)}"
            problems.append(ConfigProblem(config=label, reason=reason))
            continue
        given = entry.get("source")
        source = _SOURCES.get(given) if isinstance(given, str) else None
        if source is None:
            reason = f"unknown config source {describe(given)}: expected FromClass or FromClaim"
            problems.append(ConfigProblem(config=label, field="source", reason=reason))
            continue
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping):
            problems.append(ConfigProblem(config=label, reason=NOT_OPAQUE))
            continue
        if opaque.get("driver") != driver:
            continue
        requests = _requests(entry)
        if requests is None:
            reason = "requests must be a list of request names"
            problems.append(ConfigProblem(config=label, field="requests", reason=reason))
            continue
        try:
            config = decode_parameters(opaque.get("parameters"), config=label)
        except ConfigError as error:
            problems.extend(error.problems)
            continue
        origin = ConfigOrigin(source=source, index=index, label=label)
        by_source[source].append(_Candidate(origin=origin, requests=requests, config=config))
    defaults = [
        _Candidate(ConfigOrigin("default", None, f"default {kind.KIND}"), (), kind())
        for kind in (MigDeviceConfig, GpuConfig)
    ]
    return defaults + by_source["FromClass"] + by_source["FromClaim"], problems


def _select(
    candidates: Sequence[_Candidate], device: AllocatedDevice
) -> _Candidate | ConfigProblem:
    """The highest-precedence candidate for ``device``, or why the one naming it cannot apply."""
    for candidate in reversed(candidates):
        fits = device.type == candidate.config.DEVICE_TYPE
        if any(_names(request, device.request) for request in candidate.requests):
            if fits:
                return candidate
            reason = (
                f'cannot apply {candidate.config.KIND} to device "{shown_name(device.device)}" of '
                f'type "{device.type}" (request: {shown_name(device.request)}): use kind '
                f"{_KIND_FOR_TYPE[device.type]} for {device.type} devices"
            )
            return ConfigProblem(config=candidate.origin.label, reason=reason)
        if not candidate.requests and fits:
            return candidate
    # Unreachable: the defaults (no requests, one per device type) always match.
    raise AssertionError(f"no config for device type {device.type!r}")


def shown_name(name: str) -> str:
    """A device, request or driver name for a message: as is when plain, else quoted and
    shortened (it comes from the claim: the message stays one short line)."""
    return name if _PLAIN_NAME.fullmatch(name) else repr(short_key(name))


def _names(config_request: str, result_request: str) -> bool:
    """Whether a config's ``requests`` entry names a result's request (or its parent request)."""
    return result_request == config_request or result_request.startswith(f"{config_request}/")


def _group(
    devices: Sequence[AllocatedDevice], chosen: Mapping[AllocatedDevice, _Candidate]
) -> ResolvedConfigs:
    """One group per chosen entry, in the order of each group's first device."""
    members: dict[ConfigOrigin, list[AllocatedDevice]] = {}
    configs: dict[ConfigOrigin, DeviceConfig] = {}
    for device in devices:
        candidate = chosen[device]
        configs[candidate.origin] = candidate.config
        group = members.setdefault(candidate.origin, [])
        if device not in group:
            group.append(device)
    return ResolvedConfigs(
        groups=tuple(
            ConfigGroup(config=configs[origin], origin=origin, devices=tuple(group))
            for origin, group in members.items()
        )
    )


def _requests(entry: Mapping[object, object]) -> tuple[str, ...] | None:
    requests = entry.get("requests")
    if requests is None:
        return ()
    if isinstance(requests, list | tuple) and all(isinstance(r, str) for r in requests):
        return tuple(requests)
    return None


def _labels(configs: Sequence[object], spec_configs: object) -> list[str]:
    """How messages name each entry of ``configs``.

    Class entries are ``config[i] (FromClass)`` (the allocation does not say which class).
    Claim entries are ``spec.devices.config[k]`` when found in ``spec_configs``: the scheduler
    copies them in order, dropping those for unallocated subrequests and repeating some, so
    the search moves forward only. Otherwise ``config[i] (FromClaim)``.
    """
    spec = list(spec_configs) if isinstance(spec_configs, list | tuple) else []
    comparable = [_comparable(entry) for entry in spec]
    labels: list[str] = []
    next_spec = 0
    for index, entry in enumerate(configs):
        source = entry.get("source") if isinstance(entry, Mapping) else None
        shown = isinstance(source, str) and source.isidentifier() and len(source) <= 40
        label = f"config[{index}]" + (f" ({source})" if shown else "")
        if source == "FromClaim" and isinstance(entry, Mapping) and _comparable(entry):
            for position in range(next_spec, len(spec)):
                if comparable[position] and _same_entry(entry, spec[position]):
                    label = f"spec.devices.config[{position}]"
                    next_spec = position
                    break
        labels.append(label)
    return labels


def _comparable(entry: object) -> bool:
    """Whether ``entry`` is an object whose ``opaque`` can be compared without deep recursion."""
    return isinstance(entry, Mapping) and json_problem(entry.get("opaque"), _OPAQUE_LIMITS) is None


def _same_entry(allocated: Mapping[object, object], spec: object) -> bool:
    if not isinstance(spec, Mapping):
        return False
    return allocated.get("opaque") == spec.get("opaque") and _requests(allocated) == _requests(spec)
