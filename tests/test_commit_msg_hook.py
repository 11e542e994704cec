"""The commit-msg hook (.githooks/commit-msg, docs/development.md): subjects `area: imperative
summary` of at most 72 characters, a blank line before any body; merges and reverts pass."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[1] / ".githooks" / "commit-msg"


def run_hook(message: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run([str(HOOK), str(path)], capture_output=True, text=True, check=False)


@pytest.mark.parametrize(
    "message",
    [
        "kubelet-plugin/mps: unmount the shm through a linked data dir\n",
        "README: status of real nodes\n\nBody with details and numbers.\n",
        "e2e, docs: one subject for two areas\n",
        "Merge branch 'helm-chart'\n",
        "docs: " + "x" * 66 + "\n# a comment line git strips\n",
    ],
)
def test_messages_that_follow_the_rule_pass(message: str, tmp_path: Path) -> None:
    done = run_hook(message, tmp_path)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("message", "complaint"),
    [
        ("Fix stuff\n", "area: imperative summary"),
        ("docs: " + "x" * 67 + "\n", "73 characters; at most 72"),
        ("e2e: subject\nbody right under it\n", "blank line"),
        ("\n", "empty subject"),
    ],
)
def test_messages_that_break_the_rule_are_refused_with_the_reason(
    message: str, complaint: str, tmp_path: Path
) -> None:
    done = run_hook(message, tmp_path)
    assert done.returncode == 1
    assert complaint in done.stderr
