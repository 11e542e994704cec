"""The checkpoint file's schema: claim entries, and their JSON form (parse, format, encode).

Version 2 (adds phase ``UnprepareStarted`` to version 1); every version up to it is read. A
writer labels the file with the oldest version that holds its entries, so a plugin of version 1
reads it unless an unprepare is under way. Readers ignore and writers keep fields they do not
know; anything but an added optional field bumps the version, and a newer version is refused,
never guessed at. A file that does not parse raises `CheckpointCorruptError` (it records claims
still to be unprepared). The format and its rules: docs/architecture.md, "The checkpoint".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final, TypeAlias

from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice

SCHEMA_VERSION: Final = 2
"""The newest schema version this plugin reads and writes."""

JsonValue: TypeAlias = str | int | float | bool | list["JsonValue"] | dict[str, "JsonValue"] | None
JsonObject: TypeAlias = dict[str, JsonValue]

_KNOWN_TOP_LEVEL: Final = frozenset({"version", "nodeBootID", "claims"})
_KNOWN_CLAIM: Final = frozenset({"namespace", "name", "phase", "devices", "state", "owner"})


class ClaimPhase(StrEnum):
    """Where a claim's prepare or unprepare stands (docs/architecture.md, "Claim states")."""

    PREPARE_STARTED = "PrepareStarted"
    """Written before any change of a prepare; undone on sight (rollback)."""
    PREPARE_COMPLETED = "PrepareCompleted"
    """Prepared: the devices were handed to the kubelet."""
    UNPREPARE_STARTED = "UnprepareStarted"
    """Written before an unprepare tears anything down; finished on sight. Schema version 2."""


_PHASE_VERSION: Final = {
    ClaimPhase.PREPARE_STARTED: 1,
    ClaimPhase.PREPARE_COMPLETED: 1,
    ClaimPhase.UNPREPARE_STARTED: 2,
}
"""The schema version that introduced each phase."""


@dataclass(frozen=True)
class CheckpointEntry:
    """One claim's record. ``state`` is opaque to the checkpoint (JSON values only)."""

    claim: ClaimRef
    phase: ClaimPhase
    devices: tuple[PreparedDevice, ...] = ()
    state: Mapping[str, JsonValue] = field(default_factory=dict)
    owner: str | None = None
    """Token of the plugin instance that wrote the entry (`plugin_instances`); None: written before
    plugins had tokens."""
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
    payload["version"] = schema_version(document)
    payload["nodeBootID"] = boot_id
    payload["claims"] = {uid: _format_entry(e) for uid, e in document.entries.items()}
    try:
        return _encode(payload)
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint entry holds a value that is not JSON: {err}") from err


def schema_version(document: Document) -> int:
    """The oldest schema version that holds ``document``: 2 while an entry is
    ``UnprepareStarted``, else 1, which a plugin of schema 1 reads (downgrades)."""
    return max((_PHASE_VERSION[e.phase] for e in document.entries.values()), default=1)


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
            f"version {SCHEMA_VERSION}. Run the newer driver until the claims it recorded in a "
            'newer form are unprepared (docs/architecture.md, "The checkpoint")'
        )
    boot_id = parsed.get("nodeBootID")
    if boot_id is not None and not isinstance(boot_id, str):
        raise SchemaError(f"'nodeBootID' must be a string, got {boot_id!r}")
    claims = parsed.get("claims", {})
    if not isinstance(claims, dict):
        raise SchemaError("'claims' is not a JSON object")
    entries = {uid: _parse_entry(uid, raw) for uid, raw in claims.items()}
    for uid, entry in entries.items():
        if _PHASE_VERSION[entry.phase] > version:
            raise SchemaError(
                f"claims[{uid!r}].phase {entry.phase.value!r} does not exist in schema version "
                f"{version}"
            )
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
    owner = raw.get("owner")
    if owner is not None and not isinstance(owner, str):
        raise SchemaError(f"{where}.owner must be a string, got {owner!r}")
    return CheckpointEntry(
        claim=ClaimRef(
            namespace=_string(raw, "namespace", where), uid=uid, name=_string(raw, "name", where)
        ),
        phase=phase,
        devices=tuple(
            _parse_device(device, f"{where}.devices[{i}]") for i, device in enumerate(devices_raw)
        ),
        state=state,
        owner=owner,
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
    if entry.owner is not None:
        formatted["owner"] = entry.owner
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
