"""The table of common selector mistakes in docs/cel.md ("Common mistakes, and what `gpu-dra
lint` suggests"), read as data: `tests/cli/test_lint_mistakes.py` lints each row, and
`e2e/test_cel_conformance.py` asks the apiserver about each selector and suggestion."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

DOC: Final = Path(__file__).resolve().parent.parent / "docs" / "cel.md"
HEADING: Final = "### Common mistakes, and what `gpu-dra lint` suggests"
COLUMNS: Final = (
    "Mistake",
    "Selector",
    "Kubernetes says",
    "`gpu-dra lint` suggests",
    "Which selects",
)


@dataclass(frozen=True)
class Mistake:
    mistake: str
    selector: str
    outcome: str
    """``compile error`` or ``runtime error``."""
    message: str
    """The fragment of the apiserver's (compile) or scheduler's (runtime) message."""
    suggestion: str
    selects: str
    """``123 of 487 devices: 16x ...``."""


def _code(cell: str) -> str:
    cell = cell.strip()
    assert cell.startswith("`"), cell
    assert cell.endswith("`"), cell
    return cell[1:-1]


def mistakes() -> list[Mistake]:
    lines = DOC.read_text().splitlines()
    start = lines.index(HEADING)
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("| Mistake |"))
    cells = [c.strip() for c in lines[header].strip("|").split("|")]
    assert tuple(cells) == COLUMNS, cells
    rows = []
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        mistake, selector, says, suggestion, selects = (
            c.strip() for c in line.strip().strip("|").split(" | ")
        )
        outcome, _, message = says.partition(": ")
        rows.append(
            Mistake(mistake, _code(selector), outcome, _code(message), _code(suggestion), selects)
        )
    return rows
