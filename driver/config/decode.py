"""Decode ``opaque.parameters`` into a config object: strict, normalized, validated.

Decoding mirrors the Kubernetes strict JSON decoder NVIDIA's driver uses: unknown fields, wrong
JSON types and unknown enum values are errors. Every problem is reported with its JSON path
(``parameters.sharing.mpsConfig.defaultActiveThreadPercentage``) in plain words. Before anything
else the value is checked against `PARAMETERS_LIMITS` (depth, size, JSON types only), so no input
makes decoding raise anything but `ConfigError` (``docs/config.md``, Limits).
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping, Sequence
from typing import Any, Final, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from gpu_dra.driver.config.api import API_VERSION
from gpu_dra.driver.config.errors import ConfigError, ConfigProblem
from gpu_dra.driver.config.gpuconfig import GpuConfig
from gpu_dra.driver.config.migconfig import MigDeviceConfig
from gpu_dra.driver.config.sharing import INTERVALS, STRATEGIES
from gpu_dra.driver.config.validate import config_problems
from gpu_dra.driver.jsonbounds import JsonLimits, describe, json_problem, path_key, render_path

DeviceConfig = GpuConfig | MigDeviceConfig
"""A decoded config of any supported kind."""

KINDS: Final[dict[str, type[GpuConfig] | type[MigDeviceConfig]]] = {
    GpuConfig.KIND: GpuConfig,
    MigDeviceConfig.KIND: MigDeviceConfig,
}

ROOT: Final = "parameters"

MAX_PARAMETERS_DEPTH: Final = 32
"""Objects and arrays nested in ``parameters`` (itself level 1); a valid config uses 4."""
MAX_PARAMETERS_BYTES: Final = 64 * 1024
"""Compact JSON size of ``parameters``; a valid config of 64 per-device limits is below 5 KiB,
and the API server refuses parameters above 10 KiB."""
PARAMETERS_LIMITS: Final = JsonLimits(
    max_depth=MAX_PARAMETERS_DEPTH, max_bytes=MAX_PARAMETERS_BYTES
)

# Enum fields: what the value means and which values are allowed.
_ENUMS: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "strategy": ("GPU sharing strategy", STRATEGIES),
    "interval": ("time-slice interval", INTERVALS),
}

# Pydantic error types about a wrong JSON type -> the JSON type that was expected.
_EXPECTED: Final[dict[str, str]] = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "string_type": "a string",
    "bool_type": "true or false",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "dict_type": "an object",
}


def decode_parameters(parameters: object, *, config: str = "", claim: str = "") -> DeviceConfig:
    """The normalized config in ``parameters`` (the JSON object of ``opaque.parameters``).

    ``config`` names the config entry and ``claim`` the claim (``namespace/name``) in messages.
    Raises `ConfigError` listing every problem found; never anything else.
    """
    bounds = json_problem(parameters, PARAMETERS_LIMITS)
    if bounds is not None:
        problem = ConfigProblem(field=render_path(ROOT, bounds.path), reason=bounds.reason)
        raise ConfigError([problem.located(config)], claim=claim)
    kind, problems = _kind(parameters)
    if kind is None or problems:
        raise ConfigError([p.located(config) for p in problems], claim=claim)
    try:
        text = json.dumps(parameters, allow_nan=False)
        decoded = kind.model_validate_json(text, strict=True, by_alias=True, by_name=False)
    except (TypeError, ValueError) as error:
        if isinstance(error, ValidationError):
            problems = explain(error, kind)
        else:
            problems = [ConfigProblem(field=ROOT, reason=f"not valid JSON: {error}")]
        raise ConfigError([p.located(config) for p in problems], claim=claim) from error
    normalized = decoded.normalized()
    problems = config_problems(normalized)
    if problems:
        raise ConfigError([p.located(config) for p in problems], claim=claim)
    return normalized


def _kind(
    parameters: object,
) -> tuple[type[GpuConfig] | type[MigDeviceConfig] | None, list[ConfigProblem]]:
    """The config class that ``apiVersion`` and ``kind`` select, or the problems with them."""
    supported_kinds = ", ".join(KINDS)
    if not isinstance(parameters, Mapping):
        reason = f"expected a JSON object with apiVersion and kind, got {describe(parameters)}"
        return None, [ConfigProblem(field=ROOT, reason=reason)]
    problems: list[ConfigProblem] = []
    version = parameters.get("apiVersion")
    if version is None:
        reason = f"apiVersion is missing: set it to {API_VERSION}"
        problems.append(ConfigProblem(field=f"{ROOT}.apiVersion", reason=reason))
    elif version != API_VERSION:
        reason = f"unsupported apiVersion {describe(version)}: the supported one is {API_VERSION}"
        problems.append(ConfigProblem(field=f"{ROOT}.apiVersion", reason=reason))
    name = parameters.get("kind")
    kind = KINDS.get(name) if isinstance(name, str) else None
    if name is None:
        reason = f"kind is missing: set it to one of {supported_kinds}"
        problems.append(ConfigProblem(field=f"{ROOT}.kind", reason=reason))
    elif kind is None:
        reason = (
            f"unsupported kind {describe(name)} of apiVersion {API_VERSION}: "
            f"supported kinds are {supported_kinds}"
        )
        problems.append(ConfigProblem(field=f"{ROOT}.kind", reason=reason))
    return kind, problems


def explain(error: ValidationError, model: type[BaseModel]) -> list[ConfigProblem]:
    """Pydantic's findings about ``model`` as problems with JSON paths and plain reasons."""
    return [_explain_one(detail, model) for detail in error.errors(include_url=False)]


def _explain_one(detail: ErrorDetails, model: type[BaseModel]) -> ConfigProblem:
    loc = detail["loc"]
    kind = detail["type"]
    given = detail["input"]
    name = str(loc[-1]) if loc else ""
    field = _path(model, loc)
    if kind == "extra_forbidden":
        allowed = ", ".join(_aliases(_model_at(model, loc[:-1])))
        reason = "unknown field" + (f" (allowed here: {allowed})" if allowed else "")
    elif kind == "missing":
        reason = "required field is missing"
        if name in _ENUMS:
            reason += f": set it to one of {', '.join(_ENUMS[name][1])}"
    elif kind == "literal_error" and name in _ENUMS:
        what, allowed_values = _ENUMS[name]
        reason = f"unknown {what} {describe(given)}: supported are {', '.join(allowed_values)}"
    elif kind in _EXPECTED:
        shown = f"a string ({describe(given)})" if isinstance(given, str) else describe(given)
        reason = f"expected {_EXPECTED[kind]}, got {shown}"
    else:
        message = detail["msg"]
        reason = message[:1].lower() + message[1:]
    return ConfigProblem(field=field, reason=reason)


def _path(model: type[BaseModel], loc: Sequence[int | str]) -> str:
    """``parameters.a.b[key]`` for a pydantic location inside ``model``."""
    path = ROOT
    current: object = model
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel):
            path += path_key(str(part), brackets=False)
            current = _field_type(current, str(part))
        else:
            path += path_key(str(part), brackets=True)
            current = None
    return path


def _model_at(model: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model class found at ``loc`` inside ``model``, if the location is a model."""
    current: object = model
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        current = _field_type(current, str(part))
    if isinstance(current, type) and issubclass(current, BaseModel):
        return current
    return None


def _field_type(model: type[BaseModel], alias: str) -> object:
    """The model class of the field with JSON name ``alias``, a dict marker, or None."""
    for info in model.model_fields.values():
        if info.alias == alias:
            return _unwrap(info.annotation)
    return None


def _unwrap(annotation: Any) -> object:
    """``X | None`` -> ``X``; ``dict[...]`` -> ``dict``; anything else unchanged."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [arg for arg in get_args(annotation) if arg is not type(None)]
        annotation = members[0] if len(members) == 1 else annotation
    if get_origin(annotation) is dict:
        return dict
    return annotation


def _aliases(model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return [info.alias or name for name, info in model.model_fields.items()]
