"""Fuzzing the checkpoint loader (Hypothesis; profiles in tests/fuzzing.py, docs/development.md).

Read-only: whatever ``gpu-dra-checkpoint.json`` holds, `Checkpoint.load` returns the claims or
raises a `CheckpointError` that names the file, never another exception: a file nested too
deeply, with an integer Python does not read or with NaN is corrupt, and the message says why.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
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


def load(data_dir: Path, content: bytes) -> LoadResult | CheckpointError:
    """The load's result or error."""
    (data_dir / CHECKPOINT_FILE).write_bytes(content)
    return attempt(Checkpoint(data_dir, boot_id=lambda: BOOT).load, CheckpointError)


@cases(ci=60, full=5_000)
@given(content=contents)
def test_any_checkpoint_file_loads_or_fails_with_a_checkpoint_error(
    data_dir: Path, content: bytes
) -> None:
    loaded = load(data_dir, content)
    if isinstance(loaded, CheckpointError):
        assert str(data_dir / CHECKPOINT_FILE) in str(loaded)
        return
    for uid, entry in loaded.entries.items():
        assert isinstance(entry, CheckpointEntry)
        assert entry.uid == uid
        assert all(isinstance(d.device_name, str) for d in entry.devices)


# ---- JSON beyond the bounds: corrupt, saying why (these raised RecursionError or ValueError) ----
def write(tmp_path: Path, text: str) -> Checkpoint:
    (tmp_path / CHECKPOINT_FILE).write_text(text)
    return Checkpoint(tmp_path, boot_id=lambda: BOOT)


@pytest.mark.parametrize(
    ("text", "cause"),
    [
        (
            '{"version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "nested too deeply: more than 100 levels of objects and arrays",
        ),
        ('{"version": 1, "x": ' + "9" * 5000 + "}", "an integer with more than 4300 digits"),
        # no boot ID: load() rewrites the file, and json.dumps refused the NaN it had read
        ('{"version": 1, "claims": {}, "x": NaN}', "NaN is not a JSON number"),
    ],
    ids=["deep", "huge-integer", "nan"],
)
def test_json_beyond_the_bounds_is_reported_corrupt_naming_the_cause(
    tmp_path: Path, text: str, cause: str
) -> None:
    checkpoint = write(tmp_path, text)
    with pytest.raises(CheckpointCorruptError) as error:
        checkpoint.load()
    message = str(error.value)
    assert message.startswith(f"checkpoint {tmp_path / CHECKPOINT_FILE} is corrupt: ")
    assert f"JSON beyond the bounds of a checkpoint ({cause})" in message
    assert (tmp_path / CHECKPOINT_FILE).read_text() == text  # never replaced


def test_a_torn_deeply_nested_file_is_reported_as_invalid_json(tmp_path: Path) -> None:
    checkpoint = write(tmp_path, '{"version": 1, "x": ' + "[" * 5000)
    with pytest.raises(CheckpointCorruptError, match="is corrupt: not valid JSON"):
        checkpoint.load()
