"""Fail when a kubelet-plugin module is longer than the project allows: 550 lines (`wc -l`,
docstrings and comments included). Generated code (``kubelet-plugin/_generated/``) is exempt.

Run by `.ci/lint`; it names each module over the limit with its line count. A module that grows
past it is split into modules named for what they hold, not squeezed. An optional argument is
the checkout to check (default: this one).
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_LINES = 550
PACKAGE = "kubelet-plugin"
EXEMPT = "kubelet-plugin/_generated"


def too_long(root: Path) -> list[tuple[str, int]]:
    """The modules of ``root``'s kubelet plugin over `MAX_LINES` (path, lines), in path order."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name.startswith(f"{EXEMPT}/"):
            continue
        lines = path.read_bytes().count(b"\n")  # what `wc -l` counts
        if lines > MAX_LINES:
            found.append((name, lines))
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    found = too_long(root)
    for name, lines in found:
        print(f"{name}: {lines} lines, over the limit of {MAX_LINES}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
