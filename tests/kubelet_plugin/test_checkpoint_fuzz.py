"""Fuzzing the checkpoint loader (Hypothesis; profiles in tests/fuzzing.py, docs/development.md).

Read-only: whatever ``gpu-dra-checkpoint.json`` holds, `Checkpoint.load` returns the claims or
raises a `CheckpointError` that names the file, never another exception. Three defects of the
loader are known (`KNOWN_DEFECTS`, with a strict-xfail reproducer each): the fuzz test counts
them as events instead of failing, until checkpoint.py is fixed and the reproducers pass.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from gpu_dra.kubelet_plugin.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointEntry,
    CheckpointError,
    LoadResult,
)
from tests.fuzzing import (
    attempt,
    cases,
    deep_text,
    huge_integer_text,
    json_values,
    mutated,
    texts,
)

BOOT = "boot-1"

names = st.sampled_from(["default", "team-a", "claim-a", ""]) | texts
devices = st.fixed_dictionaries(
    {
        "requestNames": st.lists(names, max_size=2),
        "poolName": names,
        "deviceName": st.sampled_from(["gpu-0", "gpu-1-mig-1g10gb-19-0"]),
        "cdiDeviceIDs": st.lists(names, max_size=2),
    },
    optional={"shareID": names},
)
entries = st.fixed_dictionaries(
    {
        "namespace": names,
        "name": names,
        "phase": st.sampled_from(["PrepareStarted", "PrepareCompleted"]),
    },
    optional={
        "devices": st.lists(devices, max_size=3),
        "state": st.dictionaries(
            st.sampled_from(["mps", "mig", "timeSliceApplied"]), json_values()
        ),
        "future": json_values(),
    },
)
documents = st.fixed_dictionaries(
    {
        "version": st.just(1),
        "claims": st.dictionaries(st.uuids().map(str), entries, max_size=3),
    },
    optional={"nodeBootID": st.sampled_from([BOOT, "boot-0", ""]), "extra": json_values()},
)


def encoded(value: Any) -> bytes | None:
    try:
        return json.dumps(value).encode()
    except (RecursionError, ValueError):  # too deep for json.dumps, an integer of 4301+ digits
        return None


def cut(data: bytes, at: int) -> bytes:
    return data[: at % (len(data) + 1)]


def with_value(data: bytes, value: str) -> bytes:
    """A document with ``value`` (JSON text) as an unknown top-level field."""
    return data[:1] + b'"x": ' + value.encode() + b", " + data[1:]


values = st.one_of(
    st.builds(deep_text, st.integers(500, 5000), st.just("1"), st.booleans()),
    st.integers(4000, 6000).map(huge_integer_text),
)
contents = st.one_of(
    documents.map(encoded),
    st.builds(with_value, documents.map(encoded).filter(bool), values),
    mutated(documents, max_depth=300).map(lambda change: encoded(change[0])),
    st.builds(cut, documents.map(encoded).filter(bool), st.integers()),  # a torn write
    json_values().map(encoded),
    st.binary(max_size=64),
).filter(lambda data: data is not None)


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gpu-dra-checkpoint-fuzz-") as directory:
        yield Path(directory)


# Defects of checkpoint.py found by this fuzz test (not fixed here: another change owns the
# file). Each is (exception type, text in its message); see the xfail reproducers below.
KNOWN_DEFECTS: dict[str, tuple[type[BaseException], str]] = {
    "deep nesting: RecursionError from json.loads": (RecursionError, ""),
    "integer over 4300 digits: ValueError from json.loads": (ValueError, "Exceeds the limit"),
    "NaN/Infinity: ValueError when load() rewrites the file": (ValueError, "is not JSON"),
}


def known_defect(error: BaseException) -> str | None:
    for name, (kind, text) in KNOWN_DEFECTS.items():
        if type(error) is kind and text in str(error):
            return name
    return None


def load(data_dir: Path, content: bytes) -> LoadResult | CheckpointError | None:
    """The load's result or error; None (and an event) for a known defect."""
    (data_dir / CHECKPOINT_FILE).write_bytes(content)
    try:
        return attempt(Checkpoint(data_dir, boot_id=lambda: BOOT).load, CheckpointError)
    except (RecursionError, ValueError) as error:
        name = known_defect(error)
        if name is None:
            raise
        event(f"known defect: {name}")
        return None


@cases(ci=60, full=5_000)
@given(content=contents)
def test_any_checkpoint_file_loads_or_fails_with_a_checkpoint_error(
    data_dir: Path, content: bytes
) -> None:
    loaded = load(data_dir, content)
    if loaded is None:
        return
    if isinstance(loaded, CheckpointError):
        assert str(data_dir / CHECKPOINT_FILE) in str(loaded)
        return
    for uid, entry in loaded.entries.items():
        assert isinstance(entry, CheckpointEntry)
        assert entry.uid == uid
        assert all(isinstance(d.device_name, str) for d in entry.devices)


# ---- the known defects, reproduced (strict xfail: a fix makes them pass, then drop the marker
# and the KNOWN_DEFECTS entry) --------------------------------------------------------------
DEFECT = "checkpoint.py _parse catches only UnicodeDecodeError and JSONDecodeError (fix there)"


def write(tmp_path: Path, text: str) -> Checkpoint:
    (tmp_path / CHECKPOINT_FILE).write_text(text)
    return Checkpoint(tmp_path, boot_id=lambda: BOOT)


@pytest.mark.xfail(strict=True, raises=RecursionError, reason=DEFECT)
def test_a_deeply_nested_file_is_reported_corrupt(tmp_path: Path) -> None:
    checkpoint = write(tmp_path, '{"version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointCorruptError):
        checkpoint.load()


@pytest.mark.xfail(strict=True, raises=ValueError, reason=DEFECT)
def test_a_file_with_a_huge_integer_is_reported_corrupt(tmp_path: Path) -> None:
    checkpoint = write(tmp_path, '{"version": 1, "x": ' + "9" * 5000 + "}")
    with pytest.raises(CheckpointCorruptError):
        checkpoint.load()


@pytest.mark.xfail(
    strict=True, raises=ValueError, reason="Python's json reads NaN; the rewrite refuses it"
)
def test_a_file_with_nan_is_reported_corrupt(tmp_path: Path) -> None:
    checkpoint = write(tmp_path, '{"version": 1, "claims": {}, "x": NaN}')  # no boot ID: rewritten
    with pytest.raises(CheckpointCorruptError):
        checkpoint.load()
