"""`hetrain` command line: run | launch | join | profile | plan | report.

Each subcommand lives in its own module with a `register(subparsers)` function. User errors
(HetrainError) print one line and exit with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from hetrain import __version__
from hetrain.engine.signals import RunInterrupted
from hetrain.errors import HetrainError, ReportedElsewhereError

COMMANDS = ("run", "launch", "join", "profile", "plan", "report")
"""Subcommand modules under hetrain.cli, in the order `--help` lists them."""


class _Parser(argparse.ArgumentParser):
    """Command-line mistakes get the one line every user error gets (not argparse's usage
    block): `hetrain: error: <what>; see '<command> --help'`, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"hetrain: error: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hetrain",
        description="Train PyTorch models across heterogeneous devices faster than DDP: "
                    "profile -> plan -> train -> report.")
    parser.add_argument("--version", action="version", version=f"hetrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"hetrain.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"hetrain.cli.{name}":
                continue  # command not part of this build
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        # `hetrain` alone runs the built-in demo, like `hetrain run` without a config.
        args = parser.parse_args(["run", *(argv or [])])
    try:
        return int(args.func(args) or 0)
    except RunInterrupted as e:  # checkpointed (or said why not); 128 + signal, as a shell would
        print(f"hetrain: {e}", file=sys.stderr)
        return 128 + e.signum
    except ReportedElsewhereError:
        return 2
    except HetrainError as e:
        print(f"hetrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
