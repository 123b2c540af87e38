"""`main`: parse the command line, then import the module of the command given and run it.

Exit codes (`runs/exit_codes.py`): 0 ok, 1 failure while doing the work, 2 bad input (bad SQL, unknown table, bad
arguments), with a one-line `factory: error: ...` on stderr. The home directory is --home, else $FACTORY_HOME.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from factory.cli.parser import build_parser
from factory.runs.exit_codes import EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and on usage errors (2)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to start the same command as torchrun ranks
    module, name = args.func.split(":")
    # Only the command's own module: its imports (torch, pyiceberg, uvicorn) cost only the commands that use them.
    command = getattr(importlib.import_module(f"factory.cli.{module}"), name)
    return int(command(args))
