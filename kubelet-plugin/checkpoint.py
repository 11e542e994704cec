"""The plugin's record of prepared claims: ``<data_dir>/gpu-dra-checkpoint.json``.

`Checkpoint` loads the file for this boot (one from an earlier boot is discarded), reads it, and
changes one claim's entry at a time with `update` (`put` and `remove` are its shorthands). A
change returns once a write containing it is in the file, which every process on the node then
reads; changes of concurrent threads share writes (group commit). The file is durable for the
boot: writes are atomic but not fsynced, as a reboot discards the file anyway, and the boot
marker ``<data_dir>/gpu-dra-checkpoint.boot``, written durably at `load`, tells a file a power
loss left torn from a corrupt one. Methods are thread-safe, serialize with other processes
through ``flock`` on ``<data_dir>/checkpoint.lock`` and block (call them through
``asyncio.to_thread``). Entries handed out are shared with the parsed file kept in memory: treat
them as read-only. Plugin code changes claims only through `claim_records.ClaimRecords.update`.
Format (`checkpoint_format`), durability, group commit, caching and locking:
docs/architecture.md, "The checkpoint".
"""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn, TypeAlias

from gpu_dra.driver import jsonbounds
from gpu_dra.driver.jsonbounds import JsonBoundsError
from gpu_dra.kubelet_plugin import crash_points
from gpu_dra.kubelet_plugin.atomic_file import remove_temporaries, write_atomically
from gpu_dra.kubelet_plugin.checkpoint_format import (
    SCHEMA_VERSION,
    CheckpointCorruptError,
    CheckpointEntry,
    CheckpointError,
    CheckpointLockTimeoutError,
    CheckpointVersionError,
    ClaimPhase,
    Document,
    JsonObject,
    JsonValue,
    SchemaError,
    as_read_back,
    encode_document,
    parse_document,
)

__all__ = [
    "BOOT_ID_PATH",
    "BOOT_MARKER_FILE",
    "CHECKPOINT_FILE",
    "LOCK_FILE",
    "SCHEMA_VERSION",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointEntry",
    "CheckpointError",
    "CheckpointLockTimeoutError",
    "CheckpointVersionError",
    "ClaimPhase",
    "JsonObject",
    "JsonValue",
    "LoadResult",
    "Mutation",
    "read_boot_id",
]

log = logging.getLogger(__name__)

# Not NVIDIA's "checkpoint.json": a node switched from NVIDIA's plugin starts clean instead of
# failing on a file of another format in the same directory.
CHECKPOINT_FILE: Final = "gpu-dra-checkpoint.json"
BOOT_MARKER_FILE: Final = "gpu-dra-checkpoint.boot"
"""The boot ID of the last `Checkpoint.load`, written durably before the first write of that
boot that is not."""
LOCK_FILE: Final = "checkpoint.lock"
BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")

Mutation: TypeAlias = Callable[[CheckpointEntry | None], CheckpointEntry | None]
"""A change of one claim's entry: the entry now (None: none) -> the entry to keep (None:
remove it)."""


def read_boot_id() -> str:
    """The kernel's boot ID; changes on every boot."""
    return BOOT_ID_PATH.read_text(encoding="ascii").strip()


@dataclass(frozen=True)
class LoadResult:
    """What :meth:`Checkpoint.load` found."""

    entries: Mapping[str, CheckpointEntry]
    boot_id: str
    discarded_boot_id: str | None = None
    """Boot ID of a checkpoint from an earlier boot that was discarded, else ``None``."""
    discarded_claims: tuple[str, ...] = ()
    """UIDs of the claims recorded in that discarded checkpoint."""


@dataclass(eq=False)
class _Change:
    """One queued `Checkpoint.update` of a group commit."""

    uid: str
    mutate: Mutation
    check: bool
    """Whether the entry ``mutate`` returns is still to be checked (`put` checks before)."""
    done: bool = False
    existed: bool = False
    """The claim had an entry when the change was applied."""
    result: CheckpointEntry | None = None
    """The entry the change left (None: none)."""
    refused: Exception | None = None
    """What ``mutate`` raised, or why its entry cannot be stored: this change alone failed."""
    error: BaseException | None = None
    """The batch's write failed: every change of it failed."""


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
        self.marker_path = data_dir / BOOT_MARKER_FILE
        self.lock_path = data_dir / LOCK_FILE
        self._read_boot_id = boot_id
        self._lock_timeout_s = lock_timeout_s
        self._thread_lock = threading.Lock()
        # Group commit: changes waiting for the next write, and whether a writer is at work.
        self._queue = threading.Condition(threading.Lock())
        self._pending: list[_Change] = []
        self._writing = False
        self._boot_id: str | None = None
        # The parsed file and its key, valid while the key still matches (docs/architecture.md).
        self._cached: tuple[_FileKey, Document] | None = None
        self._cached_file = _OpenFile()
        weakref.finalize(self, self._cached_file.close)

    def load(self) -> LoadResult:
        """Open the checkpoint for this boot; call once before the other methods.

        A checkpoint from an earlier boot is replaced by an empty one and reported in the
        result; so is one that cannot be read when the boot marker names an earlier boot (a
        power loss cut its last write short). Then the marker is set to this boot, durably,
        before any write that is not. Temporary files of interrupted writes of the checkpoint
        and the marker are removed (under the lock, which every checkpoint writer holds); those
        of the data dir's other files are not, as another plugin instance may be writing them
        (the preparer's recovery removes them while no instance works). Raises
        :class:`CheckpointCorruptError` or :class:`CheckpointVersionError` for a file it cannot
        trust.
        """
        boot_id = self._read_boot_id()
        if not boot_id:
            raise CheckpointError("node boot ID is empty; cannot tell whether the node rebooted")
        self.data_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        with self._locked():
            remove_temporaries(self.data_dir, lambda t: t in (CHECKPOINT_FILE, BOOT_MARKER_FILE))
            self._forget()  # the first read of this boot is a full one
            marker = self._read_marker()
            result = self._load_for(boot_id, marker)
            if marker != boot_id:
                write_atomically(self.marker_path, f"{boot_id}\n".encode(), mode=0o600)
            self._boot_id = boot_id
            return result

    def _load_for(self, boot_id: str, marker: str | None) -> LoadResult:
        """Read the file for boot ``boot_id``: kept, adopted or replaced (durably)."""
        try:
            document = self._read()
        except CheckpointCorruptError as err:
            if marker is None or marker == boot_id:
                raise  # not torn by a power loss: no write of this boot skips the fsync before
            log.warning(
                "checkpoint of an earlier boot is unreadable, starting clean path=%s "
                "marker_boot_id=%s boot_id=%s: %s",
                self.path,
                marker,
                boot_id,
                err,
            )
            self._write(Document(boot_id, {}, {}), boot_id, durable=True)
            return LoadResult({}, boot_id, marker)
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
            self._write(Document(boot_id, {}, {}), boot_id, durable=True)
            return LoadResult({}, boot_id, document.boot_id, discarded)
        if document.boot_id is None and self.path.exists():
            log.info("checkpoint has no boot ID, adopting it path=%s", self.path)
            self._write(document, boot_id, durable=True)
        log.info("checkpoint loaded path=%s claims=%d", self.path, len(document.entries))
        return LoadResult(dict(document.entries), boot_id)

    def _read_marker(self) -> str | None:
        """The boot ID in the boot marker; None without one (no plugin of this version loaded
        here yet: every write was durable) or when it is unreadable."""
        try:
            text = self.marker_path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as err:
            log.warning("boot marker unreadable, ignored path=%s: %s", self.marker_path, err)
            return None
        return text or None

    def get(self, uid: str) -> CheckpointEntry | None:
        self._require_loaded()
        with self._locked():
            return self._read().entries.get(uid)

    def all(self) -> dict[str, CheckpointEntry]:
        self._require_loaded()
        with self._locked():
            return dict(self._read().entries)

    def update(self, uid: str, mutate: Mutation) -> CheckpointEntry | None:
        """Set the entry of ``uid`` to ``mutate(entry now, or None)``; None removes it. Returns
        the entry kept (as a later read returns it) once that is in the file.

        ``mutate`` runs under the checkpoint's locks in the thread that writes the batch: it must
        be quick and must not call the checkpoint. What it raises, or `ValueError` for an entry
        that is not JSON or names another claim, is raised here, and this change is not made.
        """
        boot_id = self._require_loaded()
        change = _Change(uid, mutate, check=True)
        self._commit(change, boot_id)
        self._log(change)
        return change.result

    def put(self, entry: CheckpointEntry) -> None:
        """Insert or replace the entry of ``entry.uid``; returns once that is in the file."""
        boot_id = self._require_loaded()
        stored = as_read_back(entry)  # also refuses a value that is not JSON, before queueing
        change = _Change(entry.uid, lambda _: stored, check=False)
        self._commit(change, boot_id)
        self._log(change)

    def remove(self, uid: str) -> bool:
        """Drop the entry of ``uid``; ``False`` if there was none."""
        boot_id = self._require_loaded()
        change = _Change(uid, lambda _: None, check=False)
        self._commit(change, boot_id)
        self._log(change)
        return change.existed

    @staticmethod
    def _log(change: _Change) -> None:
        entry = change.result
        if entry is not None:
            log.debug(
                "checkpoint put claim_uid=%s namespace=%s name=%s phase=%s devices=%d",
                entry.uid,
                entry.claim.namespace,
                entry.claim.name,
                entry.phase,
                len(entry.devices),
            )
        elif change.existed:
            log.debug("checkpoint removed claim_uid=%s", change.uid)

    def _commit(self, change: _Change, boot_id: str) -> None:
        """Queue ``change``; return once a write containing it is done (group commit)."""
        with self._queue:
            self._pending.append(change)
            while self._writing and not change.done:
                self._queue.wait()
            if change.done:  # a writer took it into its batch while this thread waited
                _raise_failure(change)
                return
            self._writing = True
            batch, self._pending = self._pending, []
        try:
            self._apply(batch, boot_id)
        except BaseException as error:
            self._finish(batch, error)
            if change.refused is not None:
                raise change.refused from None
            raise
        self._finish(batch, None)
        _raise_failure(change)

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
                current = document.entries.get(change.uid)
                try:
                    entry = _mutated(change, current)
                except Exception as refused:
                    change.refused = refused
                    continue
                change.existed, change.result = current is not None, entry
                if entry is not None:
                    document.entries[change.uid] = entry
                elif current is not None:
                    del document.entries[change.uid]
                changed = changed or entry is not None or current is not None
            if changed:
                self._write(document, boot_id, durable=False)

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

    def _read(self) -> Document:
        """The document on disk; the caller holds the lock and must not change the result."""
        try:
            key = _file_key(os.stat(self.path))
        except FileNotFoundError:
            self._forget()
            return Document(None, {}, {})
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        self._forget()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return Document(None, {}, {})
        try:
            key = _file_key(os.fstat(fd))
            document = self._parse(_read_all(fd))
        except BaseException:
            os.close(fd)
            raise
        self._remember(fd, key, document)
        return document

    def _parse(self, raw: bytes) -> Document:
        try:
            parsed = jsonbounds.loads(raw, strict=True)
        except JsonBoundsError as err:  # valid JSON, but not what this plugin writes
            raise self._corrupt(f"JSON beyond the bounds of a checkpoint ({err})") from err
        except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
            raise self._corrupt(f"not valid JSON ({err})") from err
        try:
            return parse_document(parsed)
        except CheckpointVersionError as err:
            raise CheckpointVersionError(f"checkpoint {self.path}: {err}") from None
        except SchemaError as err:
            raise self._corrupt(str(err)) from err

    def _write(self, document: Document, boot_id: str, *, durable: bool) -> None:
        """Replace the file; ``durable`` only at `load`, before the boot marker is set."""
        data = encode_document(document, boot_id)
        self._forget()
        write_atomically(
            self.path,
            (data + "\n").encode(),
            mode=0o600,
            crash_point=crash_points.CHECKPOINT_BEFORE_RENAME,
            durable=durable,
        )
        # Nobody else writes while we hold the lock: what is there now is what we wrote.
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            key = _file_key(os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        self._remember(
            fd, key, Document(boot_id, dict(document.entries), dict(document.unknown_fields))
        )

    def _remember(self, fd: int, key: _FileKey, document: Document) -> None:
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


def _raise_failure(change: _Change) -> None:
    """Raise why ``change`` failed: its own refusal, else its batch's write error (a copy)."""
    if change.refused is not None:
        raise change.refused
    if change.error is not None:
        _raise_copy(change.error)


def _mutated(change: _Change, current: CheckpointEntry | None) -> CheckpointEntry | None:
    entry = change.mutate(current)
    if entry is None or not change.check:
        return entry
    if entry.uid != change.uid:
        raise ValueError(f"an update of claim {change.uid} returned the entry of {entry.uid}")
    return as_read_back(entry)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)
