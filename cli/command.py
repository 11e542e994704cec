"""What every `gpu-dra` subcommand is built from: the `Subcommand` record, exit statuses, errors
for the user, and the shared argument and output helpers. See docs/config.md#gpu-dra.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TextIO

import yaml

PROG: Final = "gpu-dra"

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_BROKEN_PIPE: Final = 128 + 13
"""Standard output was closed by its reader: the shell's status of a process ended by SIGPIPE."""

OUTPUT_FORMATS: Final = ("table", "json", "yaml")

STDIN: Final = "-"
STDIN_LABEL: Final = "<stdin>"


class CliError(Exception):
    """A failure the user can act on: printed as one line on stderr, never as a traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Streams:
    """Where a subcommand reads and writes; `main` passes the process's streams."""

    out: TextIO
    err: TextIO
    stdin: TextIO


@dataclass(frozen=True)
class Subcommand:
    """One ``gpu-dra <name>`` command."""

    name: str
    summary: str
    """One line in ``gpu-dra --help``."""
    description: str
    """What ``gpu-dra <name> --help`` explains above the arguments."""
    examples: tuple[str, ...]
    """Command lines shown in both help texts."""
    add_arguments: Callable[[argparse.ArgumentParser, Mapping[str, str]], None]
    """Adds the command's arguments; defaults may come from the environment passed."""
    run: Callable[[argparse.Namespace, Streams], int]
    """Runs the command; returns the exit status or raises `CliError`."""


def add_env_argument(
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str],
    *flags: str,
    env: tuple[str, ...],
    metavar: str,
    help: str,
    default: str | None = None,
    shown_default: str | None = None,
) -> None:
    """A string flag whose default is the first non-empty variable of `env`, else `default`."""
    value = next((environ[name] for name in env if environ.get(name)), default)
    shown = shown_default if shown_default is not None else default
    parser.add_argument(
        *flags,
        default=value,
        metavar=metavar,
        help=f"{help} (env {' or '.join(env)}; default: {shown})",
    )


def add_output_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default="table",
        help="output format (default: table)",
    )


def write_table(streams: Streams, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[column]) for row in [headers, *rows]) for column in range(len(headers))]
    for row in [headers, *rows]:
        line = "   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(line.rstrip(), file=streams.out)


def write_data(streams: Streams, data: object, output: str) -> None:
    if output == "json":
        print(json.dumps(data, indent=2), file=streams.out)
    else:
        streams.out.write(yaml.safe_dump(data, sort_keys=False))


def write_blocks(
    streams: Streams, blocks: Sequence[tuple[list[str], list[list[str]]] | str]
) -> None:
    for block in blocks:
        if isinstance(block, str):
            print(block, file=streams.out)
        elif block[1]:
            write_table(streams, block[0], block[1])
        else:
            print("  (none)", file=streams.out)


def print_error(streams: Streams, command: Subcommand, message: str) -> None:
    print(f"{PROG} {command.name}: error: {message}", file=streams.err)
