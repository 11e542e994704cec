"""The wheel holds every package: pyproject.toml lists each folder with an ``__init__.py``.

An editable install finds unlisted packages, a wheel (the image) silently drops them, so a new
subpackage missing from ``[tool.setuptools] packages`` would pass every test here and fail in the
image only.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def packages_on_disk(package_dirs: dict[str, str]) -> set[str]:
    """The import names of the folders holding ``__init__.py`` under each mapped folder."""
    found = set()
    for prefix, folder in package_dirs.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join((prefix, *parts)))
    return found


def test_pyproject_lists_exactly_the_packages_on_disk() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]

    assert set(setuptools["packages"]) == packages_on_disk(setuptools["package-dir"])
