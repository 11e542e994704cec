"""The time-slicing seam: `NvidiaSmiTimeSlicer` running a fake ``nvidia-smi`` script (success,
"Not Supported" with exit status 3, other failures), `RecordedTimeSlicer` and the checkpoint
state helpers."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin.tiers.state import (
    TIME_SLICE_STATE_KEY,
    time_slices_from_state,
    time_slices_to_state,
)
from gpu_dra.kubelet_plugin.time_slicer import (
    NvidiaSmiTimeSlicer,
    RecordedTimeSlicer,
    TimeSlicingError,
    TimeSlicingNotSupportedError,
    TimeSlicingStateError,
    driver_tool_env,
    interval_name,
)

UUID = "GPU-11111111-2222-3333-4444-555555555555"
OTHER = "GPU-66666666-7777-8888-9999-000000000000"

# Appends its arguments to $CALLS, one line per run; answers as $MODE says.
SCRIPT = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$MODE" in
  ok) echo "Set compute policy"; exit 0 ;;
  unsupported)
    echo "Setting timeslice is Not Supported for GPU 00000000:1B:00.0." ; exit 3 ;;
  unsupported-text) echo "Not Supported" >&2; exit 1 ;;
  unsupported-second)
    case "$*" in *compute-policy*) echo "Not Supported"; exit 3 ;; esac; exit 0 ;;
  fail) echo "Insufficient Permissions" >&2; exit 4 ;;
  hang) exec sleep 5 ;;
esac
"""


@pytest.fixture
def smi(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "nvidia-smi"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    path.chmod(0o755)
    return path


def slicer(smi: Path, mode: str, tmp_path: Path, timeout_s: float = 5.0) -> NvidiaSmiTimeSlicer:
    env = {**os.environ, "MODE": mode, "CALLS": str(tmp_path / "calls.txt")}
    return NvidiaSmiTimeSlicer(smi, base_env=env, timeout_s=timeout_s)


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


# ---- NvidiaSmiTimeSlicer -------------------------------------------------------------------


@pytest.mark.parametrize("interval", [0, 1, 2, 3])
def test_set_interval_sets_compute_mode_default_then_the_time_slice(
    smi: Path, tmp_path: Path, interval: int
) -> None:
    slicer(smi, "ok", tmp_path).set_interval(UUID, interval)

    assert calls(tmp_path) == [
        f"-i {UUID} -c DEFAULT",
        f"compute-policy -i {UUID} --set-timeslice {interval}",
    ]


def test_reset_sets_the_time_slice_back_to_default(smi: Path, tmp_path: Path) -> None:
    slicer(smi, "ok", tmp_path).reset(UUID)

    assert calls(tmp_path) == [f"compute-policy -i {UUID} --set-timeslice 0"]


def test_exit_status_3_is_not_supported_with_a_clear_message(smi: Path, tmp_path: Path) -> None:
    with pytest.raises(TimeSlicingNotSupportedError) as raised:
        slicer(smi, "unsupported", tmp_path).set_interval(UUID, 3)

    error = raised.value
    assert error.uuid == UUID
    assert not error.retryable
    assert str(error).startswith(
        f"GPU {UUID} does not support time-slice intervals; remove timeSlicingConfig or use Default"
    )
    assert "Not Supported" in error.detail
    named = error.for_product("Tesla P4")
    assert str(named).startswith(f"GPU {UUID} (Tesla P4) does not support time-slice intervals")
    assert isinstance(named, TimeSlicingNotSupportedError)


def test_not_supported_text_with_another_exit_status_is_not_supported(
    smi: Path, tmp_path: Path
) -> None:
    with pytest.raises(TimeSlicingNotSupportedError):
        slicer(smi, "unsupported-text", tmp_path).set_interval(UUID, 1)


def test_not_supported_on_the_compute_policy_step_stops_there(smi: Path, tmp_path: Path) -> None:
    with pytest.raises(TimeSlicingNotSupportedError):
        slicer(smi, "unsupported-second", tmp_path).set_interval(UUID, 2)

    assert len(calls(tmp_path)) == 2


def test_other_failures_are_retryable_and_carry_stderr(smi: Path, tmp_path: Path) -> None:
    with pytest.raises(TimeSlicingError) as raised:
        slicer(smi, "fail", tmp_path).set_interval(UUID, 1)

    error = raised.value
    assert not isinstance(error, TimeSlicingNotSupportedError)
    assert error.retryable
    assert "exited with 4" in str(error)
    assert "Insufficient Permissions" in str(error)
    assert calls(tmp_path) == [f"-i {UUID} -c DEFAULT"]  # stopped at the first step


def test_a_hanging_nvidia_smi_times_out_retryably(smi: Path, tmp_path: Path) -> None:
    with pytest.raises(TimeSlicingError, match=r"no answer in 0\.2s") as raised:
        slicer(smi, "hang", tmp_path, timeout_s=0.2).reset(UUID)

    assert raised.value.retryable


def test_a_missing_program_is_retryable(tmp_path: Path) -> None:
    with pytest.raises(TimeSlicingError, match="cannot run") as raised:
        NvidiaSmiTimeSlicer(tmp_path / "nope").reset(UUID)

    assert raised.value.retryable


@pytest.mark.parametrize("interval", [-1, 4, True])
def test_intervals_outside_0_to_3_are_a_bug(smi: Path, tmp_path: Path, interval: int) -> None:
    with pytest.raises(ValueError, match="0, 1, 2 or 3"):
        slicer(smi, "ok", tmp_path).set_interval(UUID, interval)

    assert calls(tmp_path) == []


# ---- RecordedTimeSlicer --------------------------------------------------------------------


def test_the_fake_records_calls_and_intervals_in_its_json_file(tmp_path: Path) -> None:
    path = tmp_path / "data" / "time-slicing.json"
    fake = RecordedTimeSlicer(path)

    fake.set_interval(UUID, 3)
    fake.set_interval(OTHER, 1)
    fake.reset(UUID)

    record = json.loads(path.read_text())
    assert record["intervals"] == {UUID: 0, OTHER: 1}
    assert record["calls"] == [
        {"call": "set_interval", "uuid": UUID, "interval": 3},
        {"call": "set_interval", "uuid": OTHER, "interval": 1},
        {"call": "reset", "uuid": UUID},
    ]
    assert RecordedTimeSlicer(path).intervals() == {UUID: 0, OTHER: 1}  # survives restarts


def test_the_fake_answers_not_supported_for_the_gpus_it_is_told(tmp_path: Path) -> None:
    fake = RecordedTimeSlicer(tmp_path / "t.json", not_supported={UUID})

    with pytest.raises(TimeSlicingNotSupportedError):
        fake.set_interval(UUID, 2)
    with pytest.raises(TimeSlicingNotSupportedError):
        fake.reset(UUID)

    record = fake.read()
    assert record["intervals"] == {}
    assert [c["result"] for c in record["calls"]] == ["Not Supported", "Not Supported"]


def test_the_fake_starts_afresh_from_an_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("{not json")

    RecordedTimeSlicer(path).set_interval(UUID, 2)

    assert RecordedTimeSlicer(path).intervals() == {UUID: 2}


# ---- checkpoint state ----------------------------------------------------------------------


def test_state_round_trips_and_names_intervals() -> None:
    state = {TIME_SLICE_STATE_KEY: time_slices_to_state({OTHER: 1, UUID: 3})}

    assert time_slices_from_state(state) == {OTHER: 1, UUID: 3}
    assert time_slices_from_state({}) == {}
    assert [interval_name(v) for v in range(4)] == ["Default", "Short", "Medium", "Long"]


@pytest.mark.parametrize("raw", [[UUID], {UUID: "Long"}, {UUID: 7}, {UUID: True}])
def test_unusable_state_is_an_error(raw: object) -> None:
    with pytest.raises(TimeSlicingStateError) as raised:
        time_slices_from_state({TIME_SLICE_STATE_KEY: raw})  # type: ignore[dict-item]

    assert not raised.value.retryable


# ---- driver_tool_env: nvidia-smi from the driver root -------------------------------------

PRELOAD_SCRIPT = "#!/bin/sh\nexit 0\n"


def driver_root_with_smi(root: Path, *, nvml: bool = True) -> Path:
    smi = root / "usr" / "bin" / "nvidia-smi"
    smi.parent.mkdir(parents=True)
    smi.write_text(PRELOAD_SCRIPT)  # only its path matters
    smi.chmod(0o755)
    if nvml:
        libs = root / "usr" / "lib" / "x86_64-linux-gnu"
        libs.mkdir(parents=True)
        (libs / "libnvidia-ml.so.580.95.05").write_bytes(b"\x7fELF")
        (libs / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.95.05")
    return smi


def test_nvidia_smi_from_a_driver_root_runs_with_that_roots_nvml_preloaded(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run" / "nvidia" / "driver"
    smi = driver_root_with_smi(root)

    env = driver_tool_env(smi, root, {"PATH": "/usr/bin:/bin", "LD_PRELOAD": "/opt/other.so"})

    library = root / "usr" / "lib" / "x86_64-linux-gnu" / "libnvidia-ml.so.580.95.05"
    assert env["LD_PRELOAD"] == f"{library}:/opt/other.so"
    assert env["PATH"] == "/usr/bin:/bin"


def test_a_tool_outside_the_driver_root_or_root_slash_gets_the_environment_unchanged(
    tmp_path: Path,
) -> None:
    root = tmp_path / "driver"
    smi = driver_root_with_smi(root)
    base = {"PATH": "/usr/bin"}

    assert driver_tool_env(Path("/usr/bin/nvidia-smi"), root, base) == base
    assert driver_tool_env(smi, Path("/"), base) == base


def test_a_driver_root_without_nvml_is_an_error_naming_the_root(tmp_path: Path) -> None:
    root = tmp_path / "driver"
    smi = driver_root_with_smi(root, nvml=False)

    with pytest.raises(FileNotFoundError, match=f"driver root {root}, which has no libnvidia-ml"):
        driver_tool_env(smi, root, {})


def test_two_plugin_instances_recording_at_once_keep_every_interval(tmp_path: Path) -> None:
    path = tmp_path / "time-slicing.json"
    instances = [RecordedTimeSlicer(path), RecordedTimeSlicer(path)]
    gpus = [f"GPU-{i:08x}-0000-0000-0000-000000000000" for i in range(16)]

    def record(slicer: RecordedTimeSlicer, mine: list[str]) -> None:
        for uuid in mine:
            slicer.set_interval(uuid, 2)

    threads = [
        threading.Thread(target=record, args=(slicer, gpus[i::2]))
        for i, slicer in enumerate(instances)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert instances[0].intervals() == dict.fromkeys(gpus, 2)
    assert len(instances[1].read()["calls"]) == len(gpus)
