"""The prepared-claims checkpoint: atomic, boot-aware, forward compatible, loud when corrupt."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpu_dra.kubelet_plugin import checkpoint as checkpoint_module
from gpu_dra.kubelet_plugin.checkpoint import (
    BOOT_MARKER_FILE,
    SCHEMA_VERSION,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointEntry,
    CheckpointError,
    CheckpointLockTimeoutError,
    CheckpointVersionError,
    ClaimPhase,
    read_boot_id,
)
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef, PreparedDevice

UID_A = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
UID_B = "5d2c9f71-3e8a-4b6d-8c1f-6a4e2b0d9c02"
UID_C = "9e4f2a10-6b3d-4c8e-a1f7-0d5b3c2e1f03"

DEVICE = PreparedDevice(
    request_names=("gpu",),
    pool_name="node-a",
    device_name="gpu-0",
    cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={UID_A}-gpu-0",),
    share_id="share-1",
)


class Boot:
    """A node whose boot ID a test can change (a reboot)."""

    def __init__(self, boot_id: str = "boot-1") -> None:
        self.id = boot_id

    def __call__(self) -> str:
        return self.id


def entry(
    uid: str = UID_A,
    phase: ClaimPhase = ClaimPhase.PREPARE_COMPLETED,
    devices: tuple[PreparedDevice, ...] = (DEVICE,),
    state: dict[str, Any] | None = None,
) -> CheckpointEntry:
    return CheckpointEntry(
        claim=ClaimRef("default", uid, f"claim-{uid[:4]}"),
        phase=phase,
        devices=devices,
        state=state if state is not None else {"mps": {"daemon": "mps-1"}, "migCreated": [3]},
    )


def opened(data_dir: Path, boot: Boot | None = None, **kwargs: Any) -> Checkpoint:
    checkpoint = Checkpoint(data_dir, boot_id=boot or Boot(), **kwargs)
    checkpoint.load()
    return checkpoint


def on_disk(data_dir: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((data_dir / "gpu-dra-checkpoint.json").read_text())
    return loaded


def test_missing_checkpoint_loads_empty_and_creates_only_the_boot_marker(tmp_path: Path) -> None:
    result = Checkpoint(tmp_path / "data", boot_id=Boot()).load()
    assert result.entries == {}
    assert result.discarded_boot_id is None
    assert not (tmp_path / "data" / "gpu-dra-checkpoint.json").exists()
    assert (tmp_path / "data" / BOOT_MARKER_FILE).read_text() == "boot-1\n"


def test_entries_survive_a_plugin_restart(tmp_path: Path) -> None:
    first = opened(tmp_path)
    first.put(entry(UID_A))
    first.put(entry(UID_B, ClaimPhase.PREPARE_STARTED, devices=(), state={}))

    restarted = Checkpoint(tmp_path, boot_id=Boot())
    assert restarted.load().entries == {
        UID_A: entry(UID_A),
        UID_B: entry(UID_B, ClaimPhase.PREPARE_STARTED, devices=(), state={}),
    }
    assert restarted.get(UID_A) == entry(UID_A)
    assert restarted.get("unknown") is None


def test_file_records_version_boot_id_phase_devices_and_opaque_state(tmp_path: Path) -> None:
    opened(tmp_path).put(entry(UID_A))
    document = on_disk(tmp_path)
    assert document["version"] == 1  # the oldest version that holds it (see test_schema.py)
    assert document["nodeBootID"] == "boot-1"
    assert document["claims"][UID_A] == {
        "namespace": "default",
        "name": f"claim-{UID_A[:4]}",
        "phase": "PrepareCompleted",
        "devices": [
            {
                "requestNames": ["gpu"],
                "poolName": "node-a",
                "deviceName": "gpu-0",
                "cdiDeviceIDs": [f"k8s.gpu.nvidia.com/claim={UID_A}-gpu-0"],
                "shareID": "share-1",
            }
        ],
        "state": {"mps": {"daemon": "mps-1"}, "migCreated": [3]},
    }
    assert stat.S_IMODE((tmp_path / "gpu-dra-checkpoint.json").stat().st_mode) == 0o600


def test_phase_change_replaces_the_entry(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_A, ClaimPhase.PREPARE_STARTED, devices=()))
    checkpoint.put(replace(entry(UID_A), state={"done": True}))
    stored = checkpoint.get(UID_A)
    assert stored is not None
    assert stored.phase is ClaimPhase.PREPARE_COMPLETED
    assert stored.state == {"done": True}


def test_remove_drops_only_that_claim_and_reports_unknown_uids(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_A))
    checkpoint.put(entry(UID_B))
    assert checkpoint.remove(UID_A) is True
    assert checkpoint.remove(UID_A) is False
    assert set(checkpoint.all()) == {UID_B}


# --- atomicity ------------------------------------------------------------------------


def test_update_replaces_the_file_instead_of_rewriting_it_in_place(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_A))
    path = tmp_path / "gpu-dra-checkpoint.json"
    with path.open("rb") as reader_of_old_version:
        checkpoint.put(entry(UID_B))
        # A reader that opened the file before the update still sees the complete old file.
        old = json.loads(reader_of_old_version.read())
    assert set(old["claims"]) == {UID_A}
    assert set(on_disk(tmp_path)["claims"]) == {UID_A, UID_B}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.lock",
        "gpu-dra-checkpoint.boot",
        "gpu-dra-checkpoint.json",
    ]


def test_failed_update_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_A))
    before = (tmp_path / "gpu-dra-checkpoint.json").read_bytes()
    with pytest.raises(ValueError, match="not JSON"):
        checkpoint.put(entry(UID_B, state={"handle": object()}))
    assert (tmp_path / "gpu-dra-checkpoint.json").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_load_removes_temporary_files_of_checkpoint_writes_that_died_before_their_rename(
    tmp_path: Path,
) -> None:
    opened(tmp_path).put(entry(UID_A))
    left = [".gpu-dra-checkpoint.json.k2j4x9_a.tmp"]
    # Other files' temporaries may be another plugin instance's writes under way (the
    # preparer's recovery removes them under the node lock); other shapes are no temporaries.
    kept = [".simulated-nvml.json.0a1b2c3d.tmp", ".time-slicing.json.x1y2.tmp"]
    kept += [".hidden", "notes.tmp", ".tmp", "..tmp", "gpu-dra-checkpoint.json.abc.tmp"]
    for name in left + kept:
        (tmp_path / name).write_text("half a file")
    (tmp_path / ".a-directory.x1.tmp").mkdir()

    restarted = Checkpoint(tmp_path, boot_id=Boot())
    restarted.load()

    names = {p.name for p in tmp_path.iterdir()}
    assert not names & set(left)
    assert set(kept) | {".a-directory.x1.tmp"} <= names
    assert set(restarted.all()) == {UID_A}


# --- boot ID --------------------------------------------------------------------------


def test_checkpoint_from_an_earlier_boot_is_discarded_and_reported(tmp_path: Path) -> None:
    boot = Boot("boot-1")
    opened(tmp_path, boot).put(entry(UID_A))

    boot.id = "boot-2"
    after_reboot = Checkpoint(tmp_path, boot_id=boot)
    result = after_reboot.load()
    assert result.entries == {}
    assert result.discarded_boot_id == "boot-1"
    assert result.discarded_claims == (UID_A,)
    assert result.boot_id == "boot-2"
    assert after_reboot.all() == {}
    assert on_disk(tmp_path)["nodeBootID"] == "boot-2"
    assert on_disk(tmp_path)["claims"] == {}


def test_same_boot_keeps_all_entries(tmp_path: Path) -> None:
    opened(tmp_path, Boot("boot-1")).put(entry(UID_A))
    result = Checkpoint(tmp_path, boot_id=Boot("boot-1")).load()
    assert set(result.entries) == {UID_A}
    assert result.discarded_boot_id is None


def test_checkpoint_without_boot_id_is_adopted_for_this_boot(tmp_path: Path) -> None:
    (tmp_path / "gpu-dra-checkpoint.json").write_text(
        json.dumps(
            {
                "version": 1,
                "claims": {
                    UID_A: {"namespace": "ns", "name": "c", "phase": "PrepareCompleted"},
                },
            }
        )
    )
    result = Checkpoint(tmp_path, boot_id=Boot("boot-7")).load()
    assert set(result.entries) == {UID_A}
    assert on_disk(tmp_path)["nodeBootID"] == "boot-7"


def test_changes_are_not_fsynced_but_the_boot_marker_is_durable_before_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsynced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    checkpoint = opened(tmp_path, Boot("boot-1"))
    # The marker's temporary file, then the directory that holds its rename.
    assert len(fsynced) == 2
    assert Path(fsynced[0]).name.startswith(f".{BOOT_MARKER_FILE}.")
    assert fsynced[1] == str(tmp_path)
    fsynced.clear()
    checkpoint.put(entry(UID_A))
    checkpoint.put(entry(UID_B))
    assert checkpoint.remove(UID_A)
    assert fsynced == []
    assert set(on_disk(tmp_path)["claims"]) == {UID_B}
    # A second plugin process of the same boot finds the marker set: nothing to make durable.
    assert set(opened(tmp_path, Boot("boot-1")).all()) == {UID_B}
    assert fsynced == []


def tear(path: Path) -> None:
    """What a power loss may leave of a write that was not fsynced: part of the file."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_checkpoint_a_power_loss_tore_is_discarded_on_the_next_boot(tmp_path: Path) -> None:
    boot = Boot("boot-1")
    opened(tmp_path, boot).put(entry(UID_A))
    tear(tmp_path / "gpu-dra-checkpoint.json")

    boot.id = "boot-2"
    after_reboot = Checkpoint(tmp_path, boot_id=boot)
    result = after_reboot.load()
    assert result.entries == {}
    assert result.discarded_boot_id == "boot-1"
    assert result.discarded_claims == ()  # unreadable: which claims it held is not known
    assert on_disk(tmp_path) == {"version": 1, "nodeBootID": "boot-2", "claims": {}}
    assert (tmp_path / BOOT_MARKER_FILE).read_text() == "boot-2\n"
    after_reboot.put(entry(UID_B))
    assert set(Checkpoint(tmp_path, boot_id=boot).load().entries) == {UID_B}


def test_unreadable_checkpoint_of_this_boot_is_corrupt_not_torn(tmp_path: Path) -> None:
    # Within a boot every process reads what the kernel holds, so a write cannot be torn.
    opened(tmp_path, Boot("boot-1")).put(entry(UID_A))
    tear(tmp_path / "gpu-dra-checkpoint.json")
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        Checkpoint(tmp_path, boot_id=Boot("boot-1")).load()


def test_unreadable_checkpoint_without_a_boot_marker_is_corrupt(tmp_path: Path) -> None:
    # No marker: written by a plugin before boot markers, which fsynced every write.
    opened(tmp_path, Boot("boot-1")).put(entry(UID_A))
    (tmp_path / BOOT_MARKER_FILE).unlink()
    tear(tmp_path / "gpu-dra-checkpoint.json")
    torn = (tmp_path / "gpu-dra-checkpoint.json").read_bytes()
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        Checkpoint(tmp_path, boot_id=Boot("boot-2")).load()
    assert (tmp_path / "gpu-dra-checkpoint.json").read_bytes() == torn
    assert not (tmp_path / BOOT_MARKER_FILE).exists()


def test_readable_checkpoint_of_this_boot_is_kept_whatever_the_marker_says(
    tmp_path: Path,
) -> None:
    # A downgrade and upgrade within one boot: the older plugin wrote the file (durably) in
    # boot-2 but left the marker of boot-1.
    opened(tmp_path, Boot("boot-2")).put(entry(UID_A))
    (tmp_path / BOOT_MARKER_FILE).write_text("boot-1\n")
    result = Checkpoint(tmp_path, boot_id=Boot("boot-2")).load()
    assert set(result.entries) == {UID_A}
    assert result.discarded_boot_id is None
    assert (tmp_path / BOOT_MARKER_FILE).read_text() == "boot-2\n"


def test_empty_boot_id_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="boot ID is empty"):
        Checkpoint(tmp_path, boot_id=Boot("")).load()


def test_default_boot_id_comes_from_the_kernel() -> None:
    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("no /proc boot_id here")
    assert len(read_boot_id()) == 36


# --- compatibility --------------------------------------------------------------------


def test_fields_from_a_newer_writer_are_kept_when_rewriting(tmp_path: Path) -> None:
    newer = {
        "version": SCHEMA_VERSION,
        "nodeBootID": "boot-1",
        "futureTopLevel": {"anything": [1, 2]},
        "claims": {
            UID_A: {
                "namespace": "default",
                "name": "train",
                "phase": "PrepareCompleted",
                "devices": [
                    {
                        "requestNames": [],
                        "poolName": "node-a",
                        "deviceName": "gpu-1",
                        "cdiDeviceIDs": [],
                        "futureDeviceField": "x",
                    }
                ],
                "state": {},
                "futureClaimField": {"healthCheck": True},
            }
        },
    }
    (tmp_path / "gpu-dra-checkpoint.json").write_text(json.dumps(newer))
    checkpoint = opened(tmp_path)
    stored = checkpoint.get(UID_A)
    assert stored is not None
    assert stored.devices == (PreparedDevice((), "node-a", "gpu-1", ()),)

    checkpoint.put(entry(UID_B))
    rewritten = on_disk(tmp_path)
    assert rewritten["futureTopLevel"] == {"anything": [1, 2]}
    assert rewritten["claims"][UID_A]["futureClaimField"] == {"healthCheck": True}
    assert set(rewritten["claims"]) == {UID_A, UID_B}


def test_older_checkpoint_without_optional_fields_still_loads(tmp_path: Path) -> None:
    (tmp_path / "gpu-dra-checkpoint.json").write_text(
        json.dumps(
            {
                "version": 1,
                "nodeBootID": "boot-1",
                "claims": {
                    UID_A: {
                        "namespace": "default",
                        "name": "train",
                        "phase": "PrepareStarted",
                        "devices": [{"poolName": "node-a", "deviceName": "gpu-0"}],
                    }
                },
            }
        )
    )
    stored = opened(tmp_path).get(UID_A)
    assert stored == CheckpointEntry(
        claim=ClaimRef("default", UID_A, "train"),
        phase=ClaimPhase.PREPARE_STARTED,
        devices=(PreparedDevice((), "node-a", "gpu-0", ()),),
        state={},
    )


def test_checkpoint_of_a_newer_schema_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "gpu-dra-checkpoint.json").write_text(
        json.dumps({"version": SCHEMA_VERSION + 1, "nodeBootID": "boot-1", "claims": {}})
    )
    with pytest.raises(CheckpointVersionError, match="newer driver"):
        Checkpoint(tmp_path, boot_id=Boot()).load()


# --- corruption -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"version": 1, "claims": {', "not valid JSON"),
        ("", "not valid JSON"),
        ("[]", "not a JSON object"),
        ('{"claims": {}}', "'version'"),
        ('{"version": 1, "claims": []}', "'claims'"),
        (
            '{"version": 1, "claims": {"u": {"namespace": "n", "name": "c", "phase": "Done"}}}',
            "phase 'Done'",
        ),
        (
            '{"version": 1, "claims": {"u": {"namespace": "n", "name": "c", '
            '"phase": "PrepareStarted", "devices": {}}}}',
            "devices is not a list",
        ),
        ('{"version": 1, "claims": {"u": {"name": "c", "phase": "PrepareStarted"}}}', "namespace"),
        (
            '{"version": 1, "claims": {"u": {"namespace": "n", "name": "c", '
            '"phase": "PrepareStarted", "owner": 7}}}',
            "owner must be a string",
        ),
    ],
)
def test_corrupt_checkpoint_raises_a_clear_error_and_is_left_alone(
    tmp_path: Path, content: str, reason: str
) -> None:
    path = tmp_path / "gpu-dra-checkpoint.json"
    path.write_text(content)
    with pytest.raises(CheckpointCorruptError) as failure:
        Checkpoint(tmp_path, boot_id=Boot()).load()
    assert reason in str(failure.value)
    assert str(path) in str(failure.value)
    assert path.read_text() == content


# --- concurrency ----------------------------------------------------------------------


def test_two_plugin_instances_see_and_keep_each_others_entries(tmp_path: Path) -> None:
    old_instance = opened(tmp_path)
    new_instance = opened(tmp_path)
    old_instance.put(entry(UID_A))
    new_instance.put(entry(UID_B))
    assert set(old_instance.all()) == {UID_A, UID_B}
    assert old_instance.remove(UID_B)
    assert set(new_instance.all()) == {UID_A}


def test_concurrent_updates_from_threads_are_all_kept(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    uids = [f"00000000-0000-4000-8000-{n:012d}" for n in range(24)]

    def worker(chunk: list[str]) -> None:
        for uid in chunk:
            checkpoint.put(entry(uid))

    threads = [threading.Thread(target=worker, args=(uids[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(checkpoint.all()) == set(uids)


def test_lock_held_by_another_process_times_out_with_a_clear_error(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path, lock_timeout_s=0.2)
    fd = os.open(tmp_path / "checkpoint.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file description = another instance
        with pytest.raises(CheckpointLockTimeoutError, match=r"checkpoint\.lock"):
            checkpoint.put(entry(UID_A))
    finally:
        os.close(fd)
    checkpoint.put(entry(UID_A))
    assert set(checkpoint.all()) == {UID_A}


def test_using_the_checkpoint_before_load_is_a_programming_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="load"):
        Checkpoint(tmp_path, boot_id=Boot()).put(entry(UID_A))


def test_write_by_a_second_instance_is_seen_by_the_first_after_it_cached_the_file(
    tmp_path: Path,
) -> None:
    first = opened(tmp_path)
    second = opened(tmp_path)
    first.put(entry(UID_A))
    assert set(first.all()) == {UID_A}  # served from memory from here on
    second.put(entry(UID_B, phase=ClaimPhase.PREPARE_STARTED, state={"k": "a"}))
    assert first.get(UID_B) == entry(UID_B, phase=ClaimPhase.PREPARE_STARTED, state={"k": "a"})
    # Same size, likely the same mtime tick: only the new inode tells the files apart.
    size = (tmp_path / "gpu-dra-checkpoint.json").stat().st_size
    second.put(entry(UID_B, phase=ClaimPhase.PREPARE_STARTED, state={"k": "b"}))
    assert (tmp_path / "gpu-dra-checkpoint.json").stat().st_size == size
    assert first.get(UID_B) == entry(UID_B, phase=ClaimPhase.PREPARE_STARTED, state={"k": "b"})
    assert second.remove(UID_A)
    assert set(first.all()) == {UID_B}
    first.put(entry(UID_A))  # keeps the entry the second instance wrote
    assert set(on_disk(tmp_path)["claims"]) == {UID_A, UID_B}
    assert set(second.all()) == {UID_A, UID_B}


def test_file_changed_in_place_or_removed_behind_the_cache_is_read_again(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_A))
    path = tmp_path / "gpu-dra-checkpoint.json"
    document = on_disk(tmp_path)
    document["claims"][UID_B] = document["claims"].pop(UID_A)
    with path.open("r+") as in_place:  # same inode, unlike every writer of the plugin
        in_place.write(json.dumps(document, indent=1))
    assert set(checkpoint.all()) == {UID_B}
    path.unlink()
    assert checkpoint.all() == {}
    path.write_text("{not json")
    with pytest.raises(CheckpointCorruptError):
        checkpoint.get(UID_A)


def test_unchanged_file_is_not_parsed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_A))
    parsed: list[bytes] = []
    real_loads = json.loads

    def counting_loads(raw: Any, **kwargs: Any) -> Any:
        parsed.append(raw)
        return real_loads(raw, **kwargs)

    monkeypatch.setattr(json, "loads", counting_loads)
    for _ in range(3):
        assert checkpoint.get(UID_A) == entry(UID_A)
        assert set(checkpoint.all()) == {UID_A}
    assert not [raw for raw in parsed if isinstance(raw, bytes)]  # no read of the whole file
    checkpoint.put(entry(UID_B))
    assert set(checkpoint.all()) == {UID_A, UID_B}
    assert not [raw for raw in parsed if isinstance(raw, bytes)]


def test_file_is_compact_json_on_one_line(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_A))
    text = (tmp_path / "gpu-dra-checkpoint.json").read_text()
    assert text.endswith("}\n")
    assert text.count("\n") == 1
    assert ": " not in text
    assert ", " not in text
    assert on_disk(tmp_path)["claims"][UID_A]["phase"] == "PrepareCompleted"
    assert opened(tmp_path).get(UID_A) == entry(UID_A)


def test_entries_read_back_with_json_types_whether_cached_or_not(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_A, state={"migCreated": (3, 4)}))
    cached = checkpoint.get(UID_A)
    assert cached is not None
    assert cached.state == {"migCreated": [3, 4]}
    assert opened(tmp_path).get(UID_A) == cached


# --- group commit ---------------------------------------------------------------------


class WriteHook:
    """Wraps the checkpoint's file writes: records them, can hold one open, or fail one.

    ``events`` is the order of what happened: ``("write", n, uids)`` when write ``n`` (of the
    claims ``uids``) is durable (the real write, fsyncs included, returned), ``("fsync",)``
    for every fsync, and whatever the test appends (``("returned", uid)`` after a put).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()
        self.writes = 0
        self.started = threading.Event()
        self.hold: threading.Event | None = None  # write 1 waits for this
        self.fail_write: int | None = None  # this write raises before touching the file
        self.durable: list[bool] = []  # per write, whether it fsyncs
        self._real = checkpoint_module.write_atomically
        self._real_fsync = os.fsync
        monkeypatch.setattr(checkpoint_module, "write_atomically", self)
        monkeypatch.setattr(os, "fsync", self._fsync)

    def _fsync(self, fd: int) -> None:
        self._real_fsync(fd)
        self.record(("fsync",))

    def record(self, event: tuple[Any, ...]) -> None:
        with self.lock:
            self.events.append(event)

    def __call__(
        self,
        path: Path,
        data: bytes,
        *,
        mode: int = 0o600,
        crash_point: str | None = None,
        durable: bool = True,
    ) -> None:
        with self.lock:
            self.writes += 1
            number = self.writes
            self.durable.append(durable)
        self.started.set()
        if number == 1 and self.hold is not None:
            assert self.hold.wait(timeout=10), "test never released the first write"
        if number == self.fail_write:
            raise OSError(errno.EIO, "injected write failure", str(path))
        self._real(path, data, mode=mode, crash_point=crash_point, durable=durable)
        self.record(("write", number, frozenset(json.loads(data)["claims"])))

    def written(self) -> list[frozenset[str]]:
        return [event[2] for event in self.events if event[0] == "write"]


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def pending_changes(checkpoint: Checkpoint) -> int:
    with checkpoint._queue:
        return len(checkpoint._pending)


def test_many_concurrent_puts_from_threads_all_end_up_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = opened(tmp_path)
    hook = WriteHook(monkeypatch)
    uids = [f"00000000-0000-4000-8000-{n:012d}" for n in range(96)]
    start = threading.Barrier(16)
    errors: list[BaseException] = []

    def worker(chunk: list[str]) -> None:
        start.wait()
        try:
            for uid in chunk:
                checkpoint.put(entry(uid, ClaimPhase.PREPARE_STARTED, devices=(), state={}))
                checkpoint.put(entry(uid))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(uids[i::16],)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert set(on_disk(tmp_path)["claims"]) == set(uids)
    assert {c["phase"] for c in on_disk(tmp_path)["claims"].values()} == {"PrepareCompleted"}
    assert opened(tmp_path).all() == {uid: entry(uid) for uid in uids}
    assert 1 <= hook.writes <= 2 * len(uids)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_puts_that_arrive_during_a_write_share_the_next_write_and_return_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = opened(tmp_path)
    hook = WriteHook(monkeypatch)
    hook.hold = threading.Event()

    def put(uid: str) -> None:
        checkpoint.put(entry(uid))
        hook.record(("returned", uid))

    first = threading.Thread(target=put, args=(UID_A,))
    first.start()
    assert hook.started.wait(timeout=10)  # write 1 (UID_A only) is under way, held
    followers = [threading.Thread(target=put, args=(uid,)) for uid in (UID_B, UID_C)]
    for thread in followers:
        thread.start()
    wait_until(lambda: pending_changes(checkpoint) == 2, "both puts are queued")
    time.sleep(0.05)
    assert [e for e in hook.events if e[0] == "returned"] == []  # nobody returned early

    hook.hold.set()
    for thread in (first, *followers):
        thread.join(timeout=10)

    assert hook.written() == [frozenset({UID_A}), frozenset({UID_A, UID_B, UID_C})]
    order = hook.events
    write_1 = order.index(("write", 1, frozenset({UID_A})))
    write_2 = order.index(("write", 2, frozenset({UID_A, UID_B, UID_C})))
    assert order.index(("returned", UID_A)) > write_1
    assert order.index(("returned", UID_B)) > write_2
    assert order.index(("returned", UID_C)) > write_2
    # Durable for the boot: the writes of changes do not fsync (docs/architecture.md).
    assert ("fsync",) not in order
    assert hook.durable == [False, False]
    assert set(on_disk(tmp_path)["claims"]) == {UID_A, UID_B, UID_C}


def test_puts_and_removes_of_one_batch_apply_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_B))
    hook = WriteHook(monkeypatch)
    hook.hold = threading.Event()
    removed: dict[str, bool] = {}

    def remove(uid: str) -> None:
        removed[uid] = checkpoint.remove(uid)

    first = threading.Thread(target=checkpoint.put, args=(entry(UID_A),))
    first.start()
    assert hook.started.wait(timeout=10)
    batch = [
        threading.Thread(target=remove, args=(UID_B,)),
        threading.Thread(target=remove, args=(UID_C,)),  # not recorded: no write for it
    ]
    for queued, thread in enumerate(batch, start=1):
        thread.start()  # one after the other: the batch keeps their order
        wait_until(lambda n=queued: pending_changes(checkpoint) == n, "queued")
    hook.hold.set()
    for thread in (first, *batch):
        thread.join(timeout=10)

    assert removed == {UID_B: True, UID_C: False}
    assert hook.written() == [frozenset({UID_A, UID_B}), frozenset({UID_A})]
    assert set(on_disk(tmp_path)["claims"]) == {UID_A}


def test_failed_group_write_raises_in_every_waiter_and_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = opened(tmp_path)
    hook = WriteHook(monkeypatch)
    hook.hold = threading.Event()
    hook.fail_write = 2
    outcomes: dict[str, BaseException | None] = {}

    def put(uid: str) -> None:
        try:
            checkpoint.put(entry(uid))
        except BaseException as error:
            outcomes[uid] = error
        else:
            outcomes[uid] = None

    first = threading.Thread(target=put, args=(UID_A,))
    first.start()
    assert hook.started.wait(timeout=10)
    followers = [threading.Thread(target=put, args=(uid,)) for uid in (UID_B, UID_C)]
    for thread in followers:
        thread.start()
    wait_until(lambda: pending_changes(checkpoint) == 2, "both puts are queued")
    hook.hold.set()
    for thread in (first, *followers):
        thread.join(timeout=10)

    assert outcomes[UID_A] is None
    for uid in (UID_B, UID_C):
        error = outcomes[uid]
        assert isinstance(error, OSError), error
        assert error.errno == errno.EIO
        assert "injected write failure" in str(error)
    assert outcomes[UID_B] is not outcomes[UID_C]  # each waiter raises its own copy
    assert hook.written() == [frozenset({UID_A})]
    assert set(on_disk(tmp_path)["claims"]) == {UID_A}  # the version before the failed write
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    # Nothing of the failed batch is visible, and the next put writes normally.
    assert set(checkpoint.all()) == {UID_A}
    assert checkpoint.get(UID_B) is None
    checkpoint.put(entry(UID_C))
    assert set(on_disk(tmp_path)["claims"]) == {UID_A, UID_C}
    assert set(opened(tmp_path).all()) == {UID_A, UID_C}


# --- update ---------------------------------------------------------------------------


def test_update_gives_the_entry_on_disk_and_keeps_what_it_returns(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    seen: list[CheckpointEntry | None] = []

    def start(current: CheckpointEntry | None) -> CheckpointEntry:
        seen.append(current)
        return entry(UID_A, ClaimPhase.PREPARE_STARTED, devices=(), state={"step": (1,)})

    kept = checkpoint.update(UID_A, start)

    assert seen == [None]
    assert kept == entry(UID_A, ClaimPhase.PREPARE_STARTED, devices=(), state={"step": [1]})
    assert opened(tmp_path).get(UID_A) == kept

    def complete(current: CheckpointEntry | None) -> CheckpointEntry:
        assert current is not None
        return replace(current, phase=ClaimPhase.PREPARE_COMPLETED, devices=(DEVICE,))

    assert checkpoint.update(UID_A, complete) == replace(
        kept, phase=ClaimPhase.PREPARE_COMPLETED, devices=(DEVICE,)
    )
    assert on_disk(tmp_path)["claims"][UID_A]["phase"] == "PrepareCompleted"
    assert checkpoint.update(UID_A, lambda _: None) is None
    assert on_disk(tmp_path)["claims"] == {}
    assert opened(tmp_path).all() == {}


def test_update_refusing_an_entry_raises_and_changes_nothing(tmp_path: Path) -> None:
    checkpoint = opened(tmp_path)
    checkpoint.put(entry(UID_A))
    before = on_disk(tmp_path)

    with pytest.raises(ValueError, match="not JSON"):
        checkpoint.update(UID_A, lambda _: entry(UID_A, state={"bad": {1, 2}}))
    with pytest.raises(ValueError, match=f"returned the entry of {UID_B}"):
        checkpoint.update(UID_A, lambda _: entry(UID_B))

    def fails(_: CheckpointEntry | None) -> CheckpointEntry | None:
        raise KeyError("mutate failed")

    with pytest.raises(KeyError, match="mutate failed"):
        checkpoint.update(UID_A, fails)
    assert on_disk(tmp_path) == before
    assert checkpoint.get(UID_A) == entry(UID_A)


def test_a_refused_update_fails_alone_and_its_batch_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = opened(tmp_path)
    hook = WriteHook(monkeypatch)
    hook.hold = threading.Event()
    outcomes: dict[str, BaseException | None] = {}

    def update(uid: str, mutate: Callable[[CheckpointEntry | None], CheckpointEntry]) -> None:
        try:
            checkpoint.update(uid, mutate)
        except BaseException as error:
            outcomes[uid] = error
        else:
            outcomes[uid] = None

    def refuse(_: CheckpointEntry | None) -> CheckpointEntry:
        raise RuntimeError("refused")

    first = threading.Thread(target=update, args=(UID_A, lambda _: entry(UID_A)))
    first.start()
    assert hook.started.wait(timeout=10)  # write 1 is under way; the next two queue
    batch = [
        threading.Thread(target=update, args=(UID_B, refuse)),
        threading.Thread(target=update, args=(UID_C, lambda _: entry(UID_C))),
    ]
    for thread in batch:
        thread.start()
    wait_until(lambda: pending_changes(checkpoint) == 2, "both updates are queued")
    hook.hold.set()
    for thread in (first, *batch):
        thread.join(timeout=10)

    assert outcomes[UID_A] is None
    assert outcomes[UID_C] is None
    assert isinstance(outcomes[UID_B], RuntimeError)
    assert hook.written() == [frozenset({UID_A}), frozenset({UID_A, UID_C})]
    assert set(opened(tmp_path).all()) == {UID_A, UID_C}
