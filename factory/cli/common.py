"""What the `factory` command's groups share: one-line errors, the home directory, printing a rendered result,
loading a spec with its --set overrides, checking its `model.path` resolves."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from factory.config import FILE_SOURCE_KINDS, ExperimentSpec, SpecError, parse_overrides
from factory.data.source_check import check_sources
from factory.envs.spec_check import load_checked_spec
from factory.home import DEFAULT_HOME, FactoryPaths, factory_home
from factory.model_source import ModelPathError
from factory.models.gguf import GGUFError
from factory.models.hf import ModelDirError
from factory.models.resolve import check_model_path
from factory.source_spec import SourceError


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
        spec = load_checked_spec(args.spec, parse_overrides(args.overrides))
    except SpecError as e:
        return None, e if e.source else SpecError(e.errors, args.spec)
    if spec.data is not None and any(s["kind"] in FILE_SOURCE_KINDS for s in spec.data.sources):
        # What opening the files would refuse, said now: not after the run's first attempt died of it.
        try:
            check_sources(spec)  # paths from the file are absolute (load_spec); from --set, the working directory's
        except SourceError as e:
            return None, SpecError([str(e)], args.spec)
    # LoRA target modules need the model's module names (its skeleton, no weights): checked before any work starts.
    if spec.trainer.lora is not None:
        from factory.models.lora import spec_targets_problem  # noqa: PLC0415 heavy: torch, transformers; LoRA only

        if (problem := spec_targets_problem(spec.trainer.lora, spec.model)) is not None:
            return None, SpecError([problem], args.spec)
    return spec, None


def check_model(spec: ExperimentSpec, args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(what `model.path` resolves to, None) or (None, the error naming the field), checked cheaply: no GGUF is
    converted and no weights are read (models/resolve.py). (None, None) for a preset model."""
    if spec.model.path is None:
        return None, None
    # The home is only looked in (for a finished GGUF conversion), not created: validating leaves no trace.
    home = FactoryPaths(Path(getattr(args, "home", None) or os.environ.get("FACTORY_HOME") or DEFAULT_HOME)
                        .expanduser().resolve())
    try:
        return check_model_path(spec.model.path, home), None
    except (ModelDirError, GGUFError, ModelPathError) as e:
        return None, str(e)
