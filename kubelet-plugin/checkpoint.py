"""The plugin's record of prepared claims: ``<data_dir>/checkpoint.json``.

Prepare writes ``PrepareStarted`` before touching devices and ``PrepareCompleted`` with the
prepared devices at the end; unprepare works from this record alone (the ResourceClaim may
already be gone) and removes the entry last. The file survives plugin restarts and
upgrades, and is shared by two plugin instances during a rolling update.

File format (JSON, written compact on one line with sorted keys; shown indented here)::

    {
      "version": 1,                      # schema version, see the rules below
      "nodeBootID": "<boot id>",         # /proc/sys/kernel/random/boot_id at write time
      "claims": {
        "<claim uid>": {
          "namespace": "...", "name": "...",
          "phase": "PrepareStarted" | "PrepareCompleted",
          "devices": [{"requestNames": [...], "poolName": "...", "deviceName": "...",
                       "cdiDeviceIDs": [...], "shareID": "..."}],   # shareID optional
          "state": {...}                 # opaque per-claim bookkeeping (MIG, MPS, ...)
        }
      }
    }

Compatibility rules:

* Adding a field is not a schema change: readers ignore fields they do not know, and
  top-level and per-claim fields they do not know are written back unchanged. New fields
  must be optional (a missing field means its default) so older checkpoints stay valid.
  Unknown fields inside a device entry are dropped when an older writer rewrites the claim.
* Anything else (renaming or retyping a field, a new ``phase`` value) bumps ``version``.
  A reader refuses a file with a newer version instead of guessing.
* A checkpoint written during an earlier boot is discarded on :meth:`Checkpoint.load`:
  CDI specs in tmpfs, MIG devices, MPS daemons and time-slice settings do not survive a
  reboot. A file without ``nodeBootID`` is adopted for the current boot.
* A file that cannot be parsed raises :class:`CheckpointCorruptError`; it is never
  silently replaced, because it records claims that still need to be unprepared.

Group commit: :meth:`Checkpoint.put` and :meth:`Checkpoint.remove` calls from several threads
share writes. A call queues its change; if no write is under way, its thread becomes the
writer and applies every queued change to the document in arrival order, then writes the file
once (temporary file, fsync, rename, directory fsync). Calls that queue while a write is under
way wait, and the next writer (one of them) takes them all into the following single write.
Every call still returns only after a write that contains its change is durable; if that write
fails, every call of the batch raises the error (its own copy, caused by the writer's) and the
file keeps its previous version. Changes of one batch are applied in the order they queued, so
the changes of one thread keep their order.

All methods are thread-safe and serialize with other processes through ``flock`` on
``<data_dir>/checkpoint.lock``. Under the lock, every call checks the file and re-reads it
when it changed since this object last read or wrote it, so two instances see each other's
changes; otherwise the parsed document kept in memory is used. "Changed" means another
(device, inode, mtime, ctime, size) than the file had then. Every writer replaces the file
(write to a temporary file, rename), never rewrites it in place, so any change gives it a new
inode; and the object keeps the file it last saw open, so that inode number cannot be reused
by a later file while the document is cached. Entries handed out are shared with that cache:
treat them (and their ``state``) as read-only. The methods block (file I/O, fsync, up to
``lock_timeout_s`` for the lock): call them through ``asyncio.to_thread`` from async code.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, NoReturn, TypeAlias

from gpu_dra.kubelet_plugin.atomic_file import write_atomically
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice

log = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 1
# Not NVIDIA's "checkpoint.json": a node switched from NVIDIA's plugin starts clean instead of
# failing on a file of another format in the same directory.
CHECKPOINT_FILE: Final = "gpu-dra-checkpoint.json"
LOCK_FILE: Final = "checkpoint.lock"
BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")

JsonValue: TypeAlias = str | int | float | bool | list["JsonValue"] | dict[str, "JsonValue"] | None
JsonObject: TypeAlias = dict[str, JsonValue]

_KNOWN_TOP_LEVEL: Final = frozenset({"version", "nodeBootID", "claims"})
_KNOWN_CLAIM: Final = frozenset({"namespace", "name", "phase", "devices", "state"})


def read_boot_id() -> str:
    """The kernel's boot ID; changes on every boot."""
    return BOOT_ID_PATH.read_text(encoding="ascii").strip()


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


@dataclass(frozen=True)
class LoadResult:
    """What :meth:`Checkpoint.load` found."""

    entries: Mapping[str, CheckpointEntry]
    boot_id: str
    discarded_boot_id: str | None = None
    """Boot ID of a checkpoint from an earlier boot that was discarded, else ``None``."""
    discarded_claims: tuple[str, ...] = ()
    """UIDs of the claims recorded in that discarded checkpoint."""


class CheckpointError(Exception):
    """The checkpoint cannot be used; the message names the file and what to do."""


class CheckpointCorruptError(CheckpointError):
    pass


class CheckpointVersionError(CheckpointError):
    pass


class CheckpointLockTimeoutError(CheckpointError):
    pass


@dataclass
class _Document:
    boot_id: str | None
    entries: dict[str, CheckpointEntry]
    unknown_fields: JsonObject

    def copy(self) -> _Document:
        """A copy whose entries and fields can be changed without touching this one."""
        return _Document(self.boot_id, dict(self.entries), dict(self.unknown_fields))


@dataclass(eq=False)
class _Change:
    """One queued ``put`` (``entry`` set) or ``remove`` (``entry`` ``None``) of a group commit."""

    uid: str
    entry: CheckpointEntry | None
    done: bool = False
    removed: bool = False
    """For a remove: the entry existed when the change was applied."""
    error: BaseException | None = None


_FileKey: TypeAlias = tuple[int, int, int, int, int]


def _file_key(st: os.stat_result) -> _FileKey:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


class _OpenFile:
    """The checkpoint file the cached document was read from or written to, held open."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def replace(self, fd: int | None) -> None:
        old, self.fd = self.fd, fd
        if old is not None:
            os.close(old)

    def close(self) -> None:
        self.replace(None)


class Checkpoint:
    """Versioned, atomically written, file-locked record of prepared claims."""

    def __init__(
        self,
        data_dir: Path,
        *,
        boot_id: Callable[[], str] = read_boot_id,
        lock_timeout_s: float = 10.0,
    ) -> None:
        self.data_dir = data_dir
        self.path = data_dir / CHECKPOINT_FILE
        self.lock_path = data_dir / LOCK_FILE
        self._read_boot_id = boot_id
        self._lock_timeout_s = lock_timeout_s
        self._thread_lock = threading.Lock()
        # Group commit: changes waiting for the next write, and whether a writer is at work.
        self._queue = threading.Condition(threading.Lock())
        self._pending: list[_Change] = []
        self._writing = False
        self._boot_id: str | None = None
        # The parsed file and its key, valid while the key still matches (see the module doc).
        self._cached: tuple[_FileKey, _Document] | None = None
        self._cached_file = _OpenFile()
        weakref.finalize(self, self._cached_file.close)

    def load(self) -> LoadResult:
        """Open the checkpoint for this boot; call once before the other methods.

        A checkpoint from an earlier boot is replaced by an empty one and reported in the
        result. Raises :class:`CheckpointCorruptError` or :class:`CheckpointVersionError`
        for a file it cannot trust.
        """
        boot_id = self._read_boot_id()
        if not boot_id:
            raise CheckpointError("node boot ID is empty; cannot tell whether the node rebooted")
        self.data_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        with self._locked():
            self._forget()  # the first read of this boot is a full one
            document = self._read()
            if document.boot_id is not None and document.boot_id != boot_id:
                discarded = tuple(sorted(document.entries))
                log.warning(
                    "checkpoint is from an earlier boot, starting clean path=%s "
                    "checkpoint_boot_id=%s boot_id=%s discarded_claims=%d",
                    self.path,
                    document.boot_id,
                    boot_id,
                    len(discarded),
                )
                self._write(_Document(boot_id, {}, {}), boot_id)
                self._boot_id = boot_id
                return LoadResult({}, boot_id, document.boot_id, discarded)
            if document.boot_id is None and self.path.exists():
                log.info("checkpoint has no boot ID, adopting it path=%s", self.path)
                self._write(document, boot_id)
            self._boot_id = boot_id
            log.info("checkpoint loaded path=%s claims=%d", self.path, len(document.entries))
            return LoadResult(dict(document.entries), boot_id)

    def get(self, uid: str) -> CheckpointEntry | None:
        self._require_loaded()
        with self._locked():
            return self._read().entries.get(uid)

    def all(self) -> dict[str, CheckpointEntry]:
        self._require_loaded()
        with self._locked():
            return dict(self._read().entries)

    def put(self, entry: CheckpointEntry) -> None:
        """Insert or replace the entry of ``entry.uid``; returns once that is on disk."""
        boot_id = self._require_loaded()
        stored = _as_read_back(entry)  # also refuses a value that is not JSON, before queueing
        self._commit(_Change(entry.uid, stored), boot_id)
        log.info(
            "checkpoint put claim_uid=%s namespace=%s name=%s phase=%s devices=%d",
            entry.uid,
            entry.claim.namespace,
            entry.claim.name,
            entry.phase,
            len(entry.devices),
        )

    def remove(self, uid: str) -> bool:
        """Drop the entry of ``uid``; ``False`` if there was none."""
        boot_id = self._require_loaded()
        change = _Change(uid, None)
        self._commit(change, boot_id)
        if not change.removed:
            return False
        log.info("checkpoint removed claim_uid=%s", uid)
        return True

    def _commit(self, change: _Change, boot_id: str) -> None:
        """Queue ``change``; return once a write containing it is durable (group commit)."""
        with self._queue:
            self._pending.append(change)
            while self._writing and not change.done:
                self._queue.wait()
            if change.done:  # a writer took it into its batch while this thread waited
                if change.error is not None:
                    _raise_copy(change.error)
                return
            self._writing = True
            batch, self._pending = self._pending, []
        try:
            self._apply(batch, boot_id)
        except BaseException as error:
            self._finish(batch, error)
            raise
        self._finish(batch, None)

    def _finish(self, batch: list[_Change], error: BaseException | None) -> None:
        with self._queue:
            for change in batch:
                change.done = True
                change.error = error
            self._writing = False
            self._queue.notify_all()  # the waiters of this batch return; one of the rest writes

    def _apply(self, batch: list[_Change], boot_id: str) -> None:
        with self._locked():
            document = self._read().copy()
            changed = False
            for change in batch:
                if change.entry is not None:
                    document.entries[change.uid] = change.entry
                    changed = True
                else:
                    change.removed = document.entries.pop(change.uid, None) is not None
                    changed = changed or change.removed
            if changed:
                self._write(document, boot_id)

    def _require_loaded(self) -> str:
        if self._boot_id is None:
            raise RuntimeError("Checkpoint.load() must be called before use")
        return self._boot_id

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fd = self._open_lock_file()
            try:
                self._flock(fd)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _open_lock_file(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            return os.open(self.lock_path, flags, 0o600)
        except FileNotFoundError:  # the directory was removed after load(): make it again
            self.data_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            return os.open(self.lock_path, flags, 0o600)

    def _flock(self, fd: int) -> None:
        deadline = time.monotonic() + self._lock_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                raise CheckpointLockTimeoutError(
                    f"checkpoint lock {self.lock_path} still held by another process after "
                    f"{self._lock_timeout_s:.0f}s (another plugin instance stuck?)"
                )
            time.sleep(0.05)

    def _read(self) -> _Document:
        """The document on disk; the caller holds the lock and must not change the result."""
        try:
            key = _file_key(os.stat(self.path))
        except FileNotFoundError:
            self._forget()
            return _Document(None, {}, {})
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        self._forget()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return _Document(None, {}, {})
        try:
            key = _file_key(os.fstat(fd))
            document = self._parse(_read_all(fd))
        except BaseException:
            os.close(fd)
            raise
        self._remember(fd, key, document)
        return document

    def _parse(self, raw: bytes) -> _Document:
        try:
            parsed = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self._corrupt(f"not valid JSON ({err})") from err
        try:
            return _parse_document(parsed)
        except CheckpointVersionError as err:
            raise CheckpointVersionError(f"checkpoint {self.path}: {err}") from None
        except _SchemaError as err:
            raise self._corrupt(str(err)) from err

    def _write(self, document: _Document, boot_id: str) -> None:
        payload: JsonObject = dict(document.unknown_fields)
        payload["version"] = SCHEMA_VERSION
        payload["nodeBootID"] = boot_id
        payload["claims"] = {uid: _format_entry(e) for uid, e in document.entries.items()}
        try:
            data = _encode(payload)
        except (TypeError, ValueError) as err:
            raise ValueError(f"checkpoint entry holds a value that is not JSON: {err}") from err
        self._forget()
        write_atomically(self.path, (data + "\n").encode(), mode=0o600)
        # Nobody else writes while we hold the lock: what is there now is what we wrote.
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            key = _file_key(os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        self._remember(
            fd, key, _Document(boot_id, dict(document.entries), dict(document.unknown_fields))
        )

    def _remember(self, fd: int, key: _FileKey, document: _Document) -> None:
        self._cached_file.replace(fd)
        self._cached = (key, document)

    def _forget(self) -> None:
        self._cached = None
        self._cached_file.close()

    def _corrupt(self, reason: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"checkpoint {self.path} is corrupt: {reason}. It records prepared claims, so it is "
            "not replaced automatically; repair it, or move it aside to start clean (claims "
            "prepared before are then not cleaned up by the plugin)"
        )


class _SchemaError(ValueError):
    pass


def _raise_copy(error: BaseException) -> NoReturn:
    """Raise the writer's ``error`` in a waiter of its batch: a copy, caused by the original.

    One exception object raised in several threads at once would collect all their tracebacks.
    """
    try:
        clone: BaseException | None = copy.copy(error)
    except Exception:  # an exception type that cannot be rebuilt from its args
        clone = None
    if clone is None or clone is error:
        raise error
    raise clone.with_traceback(None) from error


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _encode(payload: JsonObject) -> str:
    # Compact: json's C encoder is used only without ``indent`` (5x faster at 64 claims).
    return json.dumps(payload, separators=(",", ":"), sort_keys=True, allow_nan=False)


def _as_read_back(entry: CheckpointEntry) -> CheckpointEntry:
    """``entry`` as a later read of the file returns it (JSON types: lists, not tuples)."""
    try:
        raw = json.loads(_encode(_format_entry(entry)))
    except (TypeError, ValueError) as err:
        raise ValueError(f"checkpoint entry holds a value that is not JSON: {err}") from err
    try:
        return _parse_entry(entry.uid, raw)
    except _SchemaError as err:
        raise ValueError(f"checkpoint entry of claim {entry.uid} is invalid: {err}") from err


def _parse_document(parsed: object) -> _Document:
    if not isinstance(parsed, dict):
        raise _SchemaError("top level is not a JSON object")
    version = parsed.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise _SchemaError(f"'version' must be a positive integer, got {version!r}")
    if version > SCHEMA_VERSION:
        raise CheckpointVersionError(
            f"schema version {version} was written by a newer driver; this driver reads up to "
            f"version {SCHEMA_VERSION}. Downgrading over prepared claims is not supported"
        )
    boot_id = parsed.get("nodeBootID")
    if boot_id is not None and not isinstance(boot_id, str):
        raise _SchemaError(f"'nodeBootID' must be a string, got {boot_id!r}")
    claims = parsed.get("claims", {})
    if not isinstance(claims, dict):
        raise _SchemaError("'claims' is not a JSON object")
    entries = {uid: _parse_entry(uid, raw) for uid, raw in claims.items()}
    unknown = {k: v for k, v in parsed.items() if k not in _KNOWN_TOP_LEVEL}
    return _Document(boot_id or None, entries, unknown)


def _parse_entry(uid: str, raw: object) -> CheckpointEntry:
    where = f"claims[{uid!r}]"
    if not isinstance(raw, dict):
        raise _SchemaError(f"{where} is not a JSON object")
    phase_value = _string(raw, "phase", where)
    try:
        phase = ClaimPhase(phase_value)
    except ValueError:
        raise _SchemaError(
            f"{where}.phase {phase_value!r} is not one of {[p.value for p in ClaimPhase]}"
        ) from None
    devices_raw = raw.get("devices", [])
    if not isinstance(devices_raw, list):
        raise _SchemaError(f"{where}.devices is not a list")
    state = raw.get("state", {})
    if not isinstance(state, dict):
        raise _SchemaError(f"{where}.state is not a JSON object")
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
        raise _SchemaError(f"{where} is not a JSON object")
    share_id = raw.get("shareID")
    if share_id is not None and not isinstance(share_id, str):
        raise _SchemaError(f"{where}.shareID must be a string, got {share_id!r}")
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
        raise _SchemaError(f"{where}.{key} must be a string, got {value!r}")
    return value


def _strings(raw: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = raw.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _SchemaError(f"{where}.{key} must be a list of strings, got {value!r}")
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
