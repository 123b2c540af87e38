"""What every command group of the `factory` command shares: one-line errors, the home directory, printing a
rendered result, loading a spec with its --set overrides, and the arguments several commands take."""

from __future__ import annotations

import argparse
import sys

from factory.config import ExperimentSpec, SpecError, apply_overrides, load_spec, parse_overrides
from factory.home import FactoryPaths, factory_home


def error(msg: str) -> None:
    """One line on stderr, the way argparse reports usage errors."""
    print(f"factory: error: {msg}", file=sys.stderr)


def home_from(args: argparse.Namespace) -> FactoryPaths:
    return factory_home(getattr(args, "home", None))


def emit(text: str) -> None:
    """Print a rendered result; CSV already ends in a newline, and a blank last line would be read as a row."""
    print(text, end="" if text.endswith("\n") else "\n")


def load(args: argparse.Namespace) -> tuple[ExperimentSpec | None, SpecError | None]:
    """The spec of `args.spec` with `args.overrides` applied, or the error naming each bad field."""
    try:
        return apply_overrides(load_spec(args.spec), parse_overrides(args.overrides)), None
    except SpecError as e:
        return None, e if e.source else SpecError(e.errors, args.spec)


def add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", "-f", choices=("table", "csv", "json"), default="table",
                   help="output format (default: table)")


def add_spec(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("spec", nargs="?" if optional else None, help="path to an experiment spec (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a spec field, e.g. --set algorithm.lr=1e-4 (repeatable; values are YAML)")


def add_max_body(p: argparse.ArgumentParser, flag: str = "--max-body-mb", default: float = 8.0,
                 what: str = "a JSON request body") -> None:
    def megabytes(text: str) -> int:
        try:
            mb = float(text)
        except ValueError:
            mb = float("nan")
        if not 0 < mb < float("inf"):
            raise argparse.ArgumentTypeError(f"want a number of MiB > 0, got {text!r}")
        return max(1, int(mb * (1 << 20)))

    p.add_argument(flag, type=megabytes, default=int(default * (1 << 20)), metavar="MIB",
                   help=f"{what} over this many MiB gets a 413 (default: {default:g})")
