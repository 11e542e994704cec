"""`gpu-dra` itself: help, usage errors, a closed output pipe."""

from __future__ import annotations

import subprocess
import sys

from gpu_dra.cli.command import EXIT_BROKEN_PIPE, EXIT_OK, EXIT_USAGE
from tests.cli.support import run


def test_help_lists_every_command_with_examples(capsys):
    code, out, _ = run(capsys, "--help")

    assert code == EXIT_OK
    for command in ("profiles", "devices", "check-config"):
        assert command in out
    assert "examples:" in out
    assert "gpu-dra devices --simulate hgx-h100" in out


def test_no_command_prints_usage_and_exits_two(capsys):
    code, out, err = run(capsys)

    assert code == EXIT_USAGE
    assert out == ""
    assert err.startswith("usage: gpu-dra")


def test_bad_output_format_is_a_usage_error(capsys):
    code, _, err = run(capsys, "devices", "--simulate", "t4", "-o", "xml")

    assert code == EXIT_USAGE
    assert "invalid choice: 'xml'" in err


def test_a_reader_that_goes_away_ends_the_command_quietly_with_the_sigpipe_status():
    # `gpu-dra devices -o json | head -1`: 190 kB of output, more than the pipe holds, so the
    # command is still writing when the reader closes its end.
    command = [sys.executable, "-m", "gpu_dra.cli", "devices", "--simulate", "hgx-h100"]
    command += ["--node", "n", "--dynamic-mig", "-o", "json"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None
        assert process.stderr is not None
        assert process.stdout.readline() == b"[\n"
        process.stdout.close()
        err = process.stderr.read().decode()
        code = process.wait(timeout=60)

    assert err == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
    assert code == EXIT_BROKEN_PIPE == 141


def test_a_command_started_with_stdout_closed_prints_no_traceback():
    command = f"'{sys.executable}' -m gpu_dra.cli devices --simulate t4 --node n >&-"
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False)

    assert "Traceback" not in done.stderr
    assert done.returncode == EXIT_OK
