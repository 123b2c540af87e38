"""The `factory` command: the parser assembled from one module per command group, and `main`.

Each subcommand is a `cmd_<name>(args) -> int` its group registers (`register(sub)`). Exit codes
(`runs/exit_codes.py`): 0 ok, 1 failure while doing the work, 2 bad input (bad SQL, unknown table, bad
arguments), with a one-line `factory: error: ...` on stderr. The home directory is --home, else $FACTORY_HOME.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from factory.cli import deploy, lake, models, preflight, run, serve
from factory.runs.exit_codes import EXIT_BAD_INPUT

GROUPS = (run, lake, serve, models, preflight, deploy)  # in the order `factory --help` lists their commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="factory", description="RL post-training experiment factory")
    parser.add_argument("--home", help="state directory (default: $FACTORY_HOME, else ./.factory)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and on usage errors (2)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to start the same command as torchrun ranks
    return int(args.func(args))
