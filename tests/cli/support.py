"""Running `gpu-dra` in tests: `main(argv, environ={})` directly, so no subprocess, no cluster, no
GPU, and no GPU_DRA_* variable of the caller's shell leaks in."""

from __future__ import annotations

import re

import pytest

from gpu_dra.cli.__main__ import main


def run(capsys: pytest.CaptureFixture[str], *argv: str, **environ: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `gpu-dra argv...` with only `environ` set."""
    code = main(list(argv), environ=environ)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table(text: str) -> list[list[str]]:
    """Rows of a table printed by the CLI (columns are separated by at least two spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
