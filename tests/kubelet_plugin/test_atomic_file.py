"""Atomic file writes: durable ones rename and fsync; the others swap the files, or rename
where a swap is not available, and never fsync."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin import atomic_file
from gpu_dra.kubelet_plugin.atomic_file import write_atomically


class Renameat2:
    """Stands in for the C library's ``renameat2``: records the calls, then answers ``errno``
    (as the C function does: -1 and errno) or calls the real one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, errno_: int | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.errno = errno_
        self._real = atomic_file._renameat2
        monkeypatch.setattr(atomic_file, "_renameat2", self)

    def __call__(self, fd1: int, first: bytes, fd2: int, second: bytes, flags: int) -> int:
        self.calls.append((os.fsdecode(first), os.fsdecode(second)))
        if self.errno is not None:
            ctypes.set_errno(self.errno)
            return -1
        assert self._real is not None
        return self._real(fd1, first, fd2, second, flags)


def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def old_file(directory: Path) -> Path:
    """``state.json`` in ``directory``, holding ``old``: the file a write replaces."""
    target = directory / "state.json"
    target.write_bytes(b"old")
    return target


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.skipif(atomic_file._renameat2 is None, reason="no renameat2 in this C library")
def test_a_write_that_is_not_durable_swaps_the_files_and_removes_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = old_file(tmp_path)
    synced = fsyncs(monkeypatch)
    swaps = Renameat2(monkeypatch)
    with target.open("rb") as reader_of_old_version:
        write_atomically(target, b"new", mode=0o640, durable=False)
        assert reader_of_old_version.read() == b"old"
    assert target.read_bytes() == b"new"
    assert target.stat().st_mode & 0o777 == 0o640
    assert [second for _, second in swaps.calls] == [str(target)]
    assert names(tmp_path) == ["state.json"]  # the old content, swapped out, is gone
    assert synced == []


def test_a_first_write_that_is_not_durable_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.json"
    synced = fsyncs(monkeypatch)
    write_atomically(target, b"first", durable=False)
    assert target.read_bytes() == b"first"
    assert names(tmp_path) == ["state.json"]
    assert synced == []


@pytest.mark.parametrize("answer", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_file_system_without_the_swap_gets_a_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: int
) -> None:
    target = old_file(tmp_path)
    swaps = Renameat2(monkeypatch, answer)
    write_atomically(target, b"new", durable=False)
    assert len(swaps.calls) == 1
    assert target.read_bytes() == b"new"
    assert names(tmp_path) == ["state.json"]


def test_a_c_library_without_renameat2_gets_a_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic_file, "_renameat2", None)
    target = old_file(tmp_path)
    write_atomically(target, b"new", durable=False)
    assert target.read_bytes() == b"new"
    assert names(tmp_path) == ["state.json"]


def test_a_failed_swap_leaves_the_old_file_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = old_file(tmp_path)
    Renameat2(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match="Input/output error") as failure:
        write_atomically(target, b"new", durable=False)
    assert failure.value.errno == errno.EIO
    assert target.read_bytes() == b"old"
    assert names(tmp_path) == ["state.json"]


@pytest.mark.skipif(atomic_file._renameat2 is None, reason="no renameat2 in this C library")
def test_a_swap_whose_old_content_cannot_be_removed_is_still_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target = old_file(tmp_path)
    real_unlink = os.unlink

    def unlink(path: str | Path, *args: object, **kwargs: object) -> None:
        if Path(path).name.endswith(".tmp"):
            raise OSError(errno.EIO, "injected", str(path))
        real_unlink(path)

    monkeypatch.setattr(os, "unlink", unlink)
    with caplog.at_level(logging.WARNING):
        write_atomically(target, b"new", durable=False)
    assert target.read_bytes() == b"new"
    (left,) = [p for p in tmp_path.iterdir() if p.name != "state.json"]
    assert left.read_bytes() == b"old"
    assert atomic_file.temporary_target(left.name) == "state.json"  # removed at the next start
    assert "old content of a replaced file left" in caplog.text


def test_a_durable_write_renames_and_fsyncs_the_file_and_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = old_file(tmp_path)
    synced = fsyncs(monkeypatch)
    swaps = Renameat2(monkeypatch)
    write_atomically(target, b"new")
    assert swaps.calls == []
    assert len(synced) == 2
    assert target.read_bytes() == b"new"
    assert names(tmp_path) == ["state.json"]
