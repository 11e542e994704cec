"""Go builds of the test bed keep their output in a log file and report progress instead."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from e2e.cluster import toolchain


def test_output_goes_to_the_log_and_the_console_gets_the_duration(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=toolchain.__name__)
    toolchain.run_go(
        ["sh", "-c", "echo 'go: downloading example.com/a v1.0.0'"],
        cwd=tmp_path,
        env=os.environ,
        what="kubernetes",
        logs=tmp_path / "logs",
    )
    assert "go: downloading example.com/a" in (tmp_path / "logs/kubernetes.log").read_text()
    assert "downloading" not in caplog.text
    assert "built kubernetes in" in caplog.text


def test_a_long_build_reports_a_heartbeat_with_modules_downloaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger=toolchain.__name__)
    monkeypatch.setattr(toolchain, "HEARTBEAT_S", 0.1)
    script = "echo 'go: downloading a v1'; echo 'go: downloading b v2'; sleep 0.5"
    toolchain.run_go(["sh", "-c", script], cwd=tmp_path, env=os.environ, what="helm", logs=tmp_path)
    beats = [r.getMessage() for r in caplog.records if "still building helm" in r.getMessage()]
    assert beats, caplog.text
    assert "2 modules downloaded" in beats[-1]


def test_a_failed_build_raises_with_the_tail_of_its_log(tmp_path: Path) -> None:
    script = "for i in $(seq 1 100); do echo line-$i; done; echo 'undefined: nvml.Foo' >&2; exit 2"
    with pytest.raises(toolchain.GoBuildError) as raised:
        toolchain.run_go(
            ["sh", "-c", script], cwd=tmp_path, env=os.environ, what="nvml-mock", logs=tmp_path
        )
    message = str(raised.value)
    assert "building nvml-mock failed (exit 2)" in message
    assert "undefined: nvml.Foo" in message
    assert "line-100" in message
    assert "line-10\n" not in message  # only the tail
