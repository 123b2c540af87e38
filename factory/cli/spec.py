"""`factory validate`: check a spec."""

from __future__ import annotations

import argparse
import sys

from factory.cli.common import check_model, error, load
from factory.config import ExperimentSpec
from factory.infra.memory import memory_problem
from factory.infra.placement import check_placement
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_OK


def machine_problem(spec: ExperimentSpec) -> tuple[str | None, list[str]]:
    """(the error, []) if this machine cannot hold the spec's cores or GPUs (counted without torch) or one step of it
    in memory (factory/infra/memory.py), else (None, placement notes): what the run's start would refuse or die of,
    said before it starts."""
    try:
        notes = check_placement(spec)
    except ValueError as e:
        return str(e), []
    return memory_problem(spec), notes


def cmd_validate(args: argparse.Namespace) -> int:
    """Check a spec; print the resolved spec (YAML) or one `path: problem` line per error."""
    spec, err = load(args)
    if err is not None:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT
    model, problem = check_model(spec, args)
    notes: list[str] = []
    if problem is None:
        problem, notes = machine_problem(spec)
    if problem is not None:
        error(problem)
        return EXIT_BAD_INPUT
    print(f"{args.spec}: ok (fingerprint {spec.fingerprint()})")
    if (note := spec.model.ignored_preset()) is not None:
        print(note)
    if model is not None:
        print(model)
    for note in notes:
        print(note)
    if args.show:
        print(spec.to_yaml(), end="")
    return EXIT_OK
