"""`gpu-dra`: the operator's command line, one module of this package per subcommand.

Only ``explain``, ``inventory`` and ``rightsize`` read a cluster. To add a subcommand, write a
module with its `Subcommand` (``COMMAND``: arguments and run function) and list it in
`SUBCOMMANDS`. Exit status: 0 success, 1 the check failed, 2 usage error or unusable input, 141
the reader of the output went away (``gpu-dra devices | head -1``: quietly, the status of a
process ended by SIGPIPE, so a pipeline under ``set -o pipefail`` does not pass a command that
never finished). See docs/config.md#gpu-dra.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Final

from gpu_dra.cli import check_config, devices, explain, inventory, lint, profiles, rightsize
from gpu_dra.cli.command import (
    EXIT_BROKEN_PIPE,
    EXIT_USAGE,
    PROG,
    CliError,
    Streams,
    Subcommand,
    print_error,
)

SUBCOMMANDS: Final[tuple[Subcommand, ...]] = (
    profiles.COMMAND,
    devices.COMMAND,
    check_config.COMMAND,
    lint.COMMAND,
    explain.COMMAND,
    inventory.COMMAND,
    rightsize.COMMAND,
)


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None) -> int:
    """Run ``gpu-dra`` with `argv` (default ``sys.argv[1:]``); the process exit status.

    `environ` (default ``os.environ``) supplies the defaults of the flags with environment twins.
    A closed standard output (the reader of a pipe exited) ends it quietly with `EXIT_BROKEN_PIPE`.
    """
    try:
        code = _main(argv, environ)
        if sys.stdout is not None:  # None: started with stdout closed (`>&-`)
            sys.stdout.flush()  # here, not at exit, where a broken pipe would print a traceback
        return code
    except BrokenPipeError:
        # What the Python documentation advises (library/signal.html, "Note on SIGPIPE"):
        # point stdout at /dev/null so the interpreter's last flush cannot fail again.
        with contextlib.suppress(OSError, ValueError):  # a stdout with no file (tests)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None, environ: Mapping[str, str] | None) -> int:
    streams = Streams(out=sys.stdout, err=sys.stderr, stdin=sys.stdin)
    parser = build_parser(os.environ if environ is None else environ)
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exit_request:  # --help, or a usage error argparse has already printed
        return exit_request.code if isinstance(exit_request.code, int) else EXIT_USAGE
    command: Subcommand | None = getattr(args, "command", None)
    if command is None:
        parser.print_help(streams.err)
        return EXIT_USAGE
    try:
        return command.run(args, streams)
    except CliError as error:
        print_error(streams, command, str(error))
        return error.exit_code


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The ``gpu-dra`` parser with every subcommand of `SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Operator tools of gpu-dra, the Kubernetes DRA driver for NVIDIA GPUs.\n"
        "Only explain, inventory and rightsize read a cluster; `gpu-dra COMMAND --help` explains\n"
        "each.",
        epilog=_examples(SUBCOMMANDS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for command in SUBCOMMANDS:
        subparser = subparsers.add_parser(
            command.name,
            help=command.summary,
            description=command.description,
            epilog=_examples([command]),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(subparser, environ)
        subparser.set_defaults(command=command)
    return parser


def _examples(commands: Sequence[Subcommand]) -> str:
    lines = [f"  {example}" for command in commands for example in command.examples]
    return "examples:\n" + "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
