"""The checkpoint file's schema: claim entries, and their JSON form (parse, format, encode).

Version 1; readers ignore and writers keep fields they do not know; anything but an added
optional field bumps the version, and a newer version is refused, never guessed at. A file that
does not parse raises `CheckpointCorruptError` (it records claims still to be unprepared). The
format and its rules: docs/architecture.md, "The checkpoint".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, TypeAlias

from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice

SCHEMA_VERSION: Final = 1

JsonValue: TypeAlias = str | int | float | bool | list["JsonValue"] | dict[str, "JsonValue"] | None
JsonObject: TypeAlias = dict[str, JsonValue]

_KNOWN_TOP_LEVEL: Final = frozenset({"version", "nodeBootID", "claims"})
_KNOWN_CLAIM: Final = frozenset({"namespace", "name", "phase", "devices", "state"})


class ClaimPhase(StrEnum):
    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"


@dataclass(frozen=True)
class CheckpointEntry:
    """One claim's record. ``state`` is opaque to the checkpoint (JSON values only)."""

    claim: ClaimRef
    phase: ClaimPhase
    devices: tuple[PreparedDevice, ...] = ()
    state: Mapping[str, JsonValue] = field(default_factory=dict)
    unknown_fields: Mapping[str, JsonValue] = field(default_factory=dict, compare=False)
    """Fields from a newer writer, kept so that rewriting this entry does not lose them."""

    @property
    def uid(self) -> str:
        return self.claim.uid


class CheckpointError(Exception):
    """The checkpoint cannot be used; the message names the file and what to do."""


class CheckpointCorruptError(CheckpointError):
    pass


class CheckpointVersionError(CheckpointError):
    pass


class CheckpointLockTimeoutError(CheckpointError):
    pass


class SchemaError(ValueError):
    """The document does not follow the schema; the message says where."""


@dataclass
class Document:
    """The whole file: boot ID, entries by claim UID, and top-level fields of newer writers."""

    boot_id: str | None
    entries: dict[str, CheckpointEntry]
    unknown_fields: JsonObject

    def copy(self) -> Document:
        """A copy whose entries and fields can be changed without touching this one."""
        return Document(self.boot_id, dict(self.entries), dict(self.unknown_fields))


def encode_document(document: Document, boot_id: str) -> str:
    """The file's text (without the final newline), as `boot_id` writes it; `ValueError` for a
    value that is not JSON."""
    payload: JsonObject = dict(document.unknown_fields)
    payload["version"] = SCHEMA_VERSION
    payload["nodeBootID"] = boot_id
    payload["claims"] = {uid: _format_entry(e) for uid, e in document.entries.items()}
    try:
        return _encode(payload)
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint entry holds a value that is not JSON: {err}") from err


def as_read_back(entry: CheckpointEntry) -> CheckpointEntry:
    """``entry`` as a later read of the file returns it (JSON types: lists, not tuples);
    `ValueError` for a value that is not JSON or an entry the schema refuses."""
    try:
        raw = json.loads(_encode(_format_entry(entry)))
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint entry holds a value that is not JSON: {err}") from err
    try:
        return _parse_entry(entry.uid, raw)
    except SchemaError as err:
        raise ValueError(f"checkpoint entry of claim {entry.uid} is invalid: {err}") from err


def _encode(payload: JsonObject) -> str:
    # Compact: json's C encoder is used only without ``indent`` (5x faster at 64 claims).
    return json.dumps(payload, separators=(",", ":"), sort_keys=True, allow_nan=False)


def parse_document(parsed: object) -> Document:
    """The document of a parsed file; `SchemaError`, or `CheckpointVersionError` for a version
    newer than `SCHEMA_VERSION`."""
    if not isinstance(parsed, dict):
        raise SchemaError("top level is not a JSON object")
    version = parsed.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SchemaError(f"'version' must be a positive integer, got {version!r}")
    if version > SCHEMA_VERSION:
        raise CheckpointVersionError(
            f"schema version {version} was written by a newer driver; this driver reads up to "
            f"version {SCHEMA_VERSION}. Downgrading over prepared claims is not supported"
        )
    boot_id = parsed.get("nodeBootID")
    if boot_id is not None and not isinstance(boot_id, str):
        raise SchemaError(f"'nodeBootID' must be a string, got {boot_id!r}")
    claims = parsed.get("claims", {})
    if not isinstance(claims, dict):
        raise SchemaError("'claims' is not a JSON object")
    entries = {uid: _parse_entry(uid, raw) for uid, raw in claims.items()}
    unknown = {k: v for k, v in parsed.items() if k not in _KNOWN_TOP_LEVEL}
    return Document(boot_id or None, entries, unknown)


def _parse_entry(uid: str, raw: object) -> CheckpointEntry:
    where = f"claims[{uid!r}]"
    if not isinstance(raw, dict):
        raise SchemaError(f"{where} is not a JSON object")
    phase_value = _string(raw, "phase", where)
    try:
        phase = ClaimPhase(phase_value)
    except ValueError:
        raise SchemaError(
            f"{where}.phase {phase_value!r} is not one of {[p.value for p in ClaimPhase]}"
        ) from None
    devices_raw = raw.get("devices", [])
    if not isinstance(devices_raw, list):
        raise SchemaError(f"{where}.devices is not a list")
    state = raw.get("state", {})
    if not isinstance(state, dict):
        raise SchemaError(f"{where}.state is not a JSON object")
    return CheckpointEntry(
        claim=ClaimRef(
            namespace=_string(raw, "namespace", where), uid=uid, name=_string(raw, "name", where)
        ),
        phase=phase,
        devices=tuple(
            _parse_device(device, f"{where}.devices[{i}]") for i, device in enumerate(devices_raw)
        ),
        state=state,
        unknown_fields={k: v for k, v in raw.items() if k not in _KNOWN_CLAIM},
    )


def _parse_device(raw: object, where: str) -> PreparedDevice:
    if not isinstance(raw, dict):
        raise SchemaError(f"{where} is not a JSON object")
    share_id = raw.get("shareID")
    if share_id is not None and not isinstance(share_id, str):
        raise SchemaError(f"{where}.shareID must be a string, got {share_id!r}")
    return PreparedDevice(
        request_names=_strings(raw, "requestNames", where),
        pool_name=_string(raw, "poolName", where),
        device_name=_string(raw, "deviceName", where),
        cdi_device_ids=_strings(raw, "cdiDeviceIDs", where),
        share_id=share_id,
    )


def _string(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str):
        raise SchemaError(f"{where}.{key} must be a string, got {value!r}")
    return value


def _strings(raw: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SchemaError(f"{where}.{key} must be a list of strings, got {value!r}")
    return tuple(value)


def _format_entry(entry: CheckpointEntry) -> JsonObject:
    formatted: JsonObject = dict(entry.unknown_fields)
    formatted.update(
        {
            "namespace": entry.claim.namespace,
            "name": entry.claim.name,
            "phase": entry.phase.value,
            "devices": [_format_device(d) for d in entry.devices],
            "state": dict(entry.state),
        }
    )
    return formatted


def _format_device(device: PreparedDevice) -> JsonObject:
    formatted: JsonObject = {
        "requestNames": list(device.request_names),
        "poolName": device.pool_name,
        "deviceName": device.device_name,
        "cdiDeviceIDs": list(device.cdi_device_ids),
    }
    if device.share_id is not None:
        formatted["shareID"] = device.share_id
    return formatted
