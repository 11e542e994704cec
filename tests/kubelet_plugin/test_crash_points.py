"""The test-only crash points: one hook, named points each placed in the plugin's code, armed
only by a test (or ``GPU_DRA_TEST_CRASH_AT`` on simulated nodes), SIGKILL when reached."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_dra.kubelet_plugin import crash_points

PLUGIN = Path(crash_points.__file__).resolve().parent


def test_every_point_is_placed_in_the_plugins_code() -> None:
    constants = {
        value: name
        for name, value in vars(crash_points).items()
        if isinstance(value, str) and value in crash_points.POINTS
    }
    assert set(constants) == crash_points.POINTS
    sources = "\n".join(
        path.read_text()
        for path in PLUGIN.rglob("*.py")
        if path.name != "crash_points.py" and "_generated" not in path.parts
    )
    unplaced = [
        point for point, name in constants.items() if not re.search(rf"\b{name}\b", sources)
    ]
    assert unplaced == []
    assert len(crash_points.POINTS) >= 20


def test_reached_calls_the_armed_point_only_while_armed() -> None:
    seen: list[str] = []
    crash_points.reached(crash_points.PREPARE_AFTER_STARTED)  # not armed: nothing
    crash_points.arm(seen.append)
    crash_points.reached(crash_points.PREPARE_AFTER_STARTED)
    crash_points.arm(None)
    crash_points.reached(crash_points.UNPREPARE_AFTER_STARTED)

    assert seen == [crash_points.PREPARE_AFTER_STARTED]


def test_the_environment_arms_known_points_on_simulated_nodes_only() -> None:
    env = {crash_points.TEST_CRASH_ENV: crash_points.TIMESLICE_AFTER_SET}
    assert crash_points.crash_point_from_env(env, simulated=False) is None
    assert crash_points.crash_point_from_env({}, simulated=True) is None
    with pytest.raises(ValueError, match="names no fault injection point"):
        crash_points.arm_from_env({crash_points.TEST_CRASH_ENV: "nowhere"}, simulated=True)


def test_an_armed_point_kills_the_process_with_sigkill_when_reached() -> None:
    code = (
        "from gpu_dra.kubelet_plugin import crash_points as c\n"
        "c.arm_from_env({'GPU_DRA_TEST_CRASH_AT': 'unprepare-after-started'}, simulated=True)\n"
        "c.reached('prepare-after-started')\n"
        "print('passed another point', flush=True)\n"
        "c.reached('unprepare-after-started')\n"
        "print('survived')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )

    assert done.returncode == -signal.SIGKILL
    assert done.stdout == "passed another point\n"
