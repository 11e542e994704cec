"""`gpu-dra` itself: help, usage errors."""

from __future__ import annotations

from gpu_dra.cli.command import EXIT_OK, EXIT_USAGE
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
