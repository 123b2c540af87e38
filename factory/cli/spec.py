"""`factory validate`: check a spec."""

from __future__ import annotations

import argparse
import sys

from factory.cli.common import check_model, error, load
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    """Check a spec; print the resolved spec (YAML) or one `path: problem` line per error."""
    spec, err = load(args)
    if err is not None:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT
    model, problem = check_model(spec, args)
    if problem is not None:
        error(problem)
        return EXIT_BAD_INPUT
    print(f"{args.spec}: ok (fingerprint {spec.fingerprint()})")
    if (note := spec.model.ignored_preset()) is not None:
        print(note)
    if model is not None:
        print(model)
    if args.show:
        print(spec.to_yaml(), end="")
    return EXIT_OK
