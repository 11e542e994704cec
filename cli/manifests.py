"""Reading Kubernetes manifests for `gpu-dra check-config` and `gpu-dra lint`: files or standard
input, several YAML documents, ``kind: List`` objects opened.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import yaml

from gpu_dra.cli.command import EXIT_USAGE, STDIN, STDIN_LABEL, CliError


def load_documents(file: str, stdin: TextIO) -> list[Mapping[str, Any]]:
    """The objects in `file` (non-empty YAML documents, Lists opened); `CliError` (usage) if it
    cannot be used."""
    label = STDIN_LABEL if file == STDIN else file
    try:
        text = stdin.read() if file == STDIN else Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"cannot read {label}: {error}", EXIT_USAGE) from error
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        raise CliError(f"{label}: not valid YAML: {_yaml_message(error)}", EXIT_USAGE) from error
    for number, document in enumerate(documents, start=1):
        if document is not None and not isinstance(document, Mapping):
            raise CliError(
                f"{label}: document {number} is not a Kubernetes object (a YAML mapping)",
                EXIT_USAGE,
            )
    return [obj for document in documents if document is not None for obj in _objects(document)]


def _objects(document: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The objects of a document: itself, or the items of a `kind: List` (nested ones too)."""
    items = document.get("items")
    if document.get("kind") == "List" and isinstance(items, list):
        for item in items:
            if isinstance(item, Mapping):
                yield from _objects(item)
    else:
        yield document


def _yaml_message(error: yaml.YAMLError) -> str:
    """The parser's message on one line, with the position of the problem."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        text = ", ".join(part for part in (error.context, error.problem) if part)
        return f"line {mark.line + 1}, column {mark.column + 1}: {text}"
    return " ".join(str(error).split())
