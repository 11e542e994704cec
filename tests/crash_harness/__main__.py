"""``python -m tests.crash_harness [--cycles N] [--seed S]``: the full crash-injection run."""

from __future__ import annotations

import argparse
import sys

from tests.crash_harness.driver import run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.crash_harness")
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="list the refused prepares")
    args = parser.parse_args()
    result = run(args.cycles, args.seed)
    for name, count in sorted(result.kills.items()):
        print(f"kill point {name}: {count}")
    if args.verbose:
        for refusal in result.refusals:
            print(f"refused: {refusal}")
    for problem in result.problems:
        print(f"PROBLEM: {problem}")
    for crash in result.crashes:
        print(f"CRASH: {crash}")
    print(result.summary())
    return 1 if result.problems or result.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
