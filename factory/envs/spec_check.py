"""The checks of an `ExperimentSpec` that need the task families: the task must have enough distinct problems
for its disjoint splits, a reasoning-gym source's task and config must be ones reasoning-gym accepts, its
longest prompt plus the completion must fit the model's positions, and a `model.path` directory's architecture
must be one the rollout engines can run (read from its config.json, no weights loaded).

`check_spec` runs after the schema's own validation (factory/config.py) wherever a spec is loaded: `factory
validate` / `run`, the Dagster spec resource, sweeps, the deploy target. Its errors are `SpecError`s worded
as the schema's, so a spec that fails here reads the same as one that fails there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from factory.architectures import architecture_problem
from factory.config import MIN_N_TRAIN, ExperimentSpec, apply_overrides, load_spec, spec_error
from factory.envs.arithmetic import prompt_tokens
from factory.envs.reasoning_gym_tasks import rg_config_problem
from factory.envs.tasks import family, longest_prompt_tokens, task_capacity
from factory.model_source import source_files
from factory.presets import PRESETS


def check_spec(spec: ExperimentSpec, source: str | None = None) -> ExperimentSpec:
    """`spec`, if its task fits; else a SpecError (naming `source`, e.g. the spec file) with one line."""
    problem = (_task_size_problem(spec) or _sources_problem(spec) or _positions_problem(spec)
               or _architecture_problem(spec))
    if problem is not None:
        raise spec_error(problem, source)
    return spec


def load_checked_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> ExperimentSpec:
    """The spec file at `path` checked, then with `overrides` applied (`apply_overrides`) and checked again: an
    error in the file names the file, one that only the overrides make names none."""
    spec = check_spec(load_spec(path), str(Path(path)))
    return check_spec(apply_overrides(spec, overrides)) if overrides is not None else spec


def _task_size_problem(spec: ExperimentSpec) -> str | None:
    """The error if n_train + n_eval exceed the problems the task can make (its splits are disjoint), else
    None: found when the spec is loaded, not after the run has started."""
    t = spec.task
    space, most = task_capacity(t)
    what = family(t).describe(t)
    share = "at most half of them" if most < space else "all of them"
    n_train_min = MIN_N_TRAIN
    if t.n_eval > most - n_train_min:
        return (f"task.n_eval: must be <= {max(0, most - n_train_min)} ({what} has {space} distinct "
                f"problems; n_train + n_eval may use {share}, and n_train needs at least "
                f"{n_train_min}), got {t.n_eval}")
    if t.n_train + t.n_eval > most:
        return (f"task.n_train: must be <= {most - t.n_eval} ({what} has {space} distinct problems; "
                f"n_train + n_eval may use {share}, and n_eval = {t.n_eval}), got {t.n_train}")
    return None


def _sources_problem(spec: ExperimentSpec) -> str | None:
    """The error if a reasoning-gym source names an unknown task or a config its dataset refuses (field
    `data.sources[i].task` / `.config.<key>`), else None. Only specs with such a source import reasoning-gym."""
    for i, s in enumerate(spec.data.sources if spec.data is not None else []):
        if s["kind"] != "reasoning_gym":
            continue
        try:
            problem = rg_config_problem(s["task"], s["config"])
        except ImportError as e:
            return f"data.sources[{i}]: {e}"
        if problem is not None:
            return f"data.sources[{i}].{problem}"
    return None


def _positions_problem(spec: ExperimentSpec) -> str | None:
    """The error if the longest prompt plus max_new_tokens exceed the model's positions, else None (the engines
    size buffers by them: far past it, sampling tries to allocate terabytes)."""
    if spec.model.path is not None:  # its tokenizer is only known when it loads: models/build.py checks then
        return None
    positions = spec.model.max_positions or PRESETS[spec.model.preset].max_positions
    where = ("model.max_positions" if spec.model.max_positions
             else f"model.max_positions, unset: preset {spec.model.preset}'s")
    prompt, new = longest_prompt_tokens(spec.task), spec.rollout.max_new_tokens
    if spec.data is not None:  # generated sources' longest prompts are known here; files are checked as read
        digits = [s["digits"] for s in spec.data.sources if s["kind"] == "arithmetic"]
        prompt = max([prompt, *(prompt_tokens([d]) for d in digits)])
    if prompt >= positions:
        return (f"model.max_positions: must be >= {prompt + new} to hold the longest prompt ({prompt} "
                f"tokens, task {spec.task.name}) and rollout.max_new_tokens = {new}, got {positions} "
                f"({where})")
    if prompt + new > positions:
        return (f"rollout.max_new_tokens: must be <= {positions - prompt} so that the longest prompt "
                f"({prompt} tokens, task {spec.task.name}) plus the completion fit the model's "
                f"{positions} positions ({where}), got {new}")
    return None


def _architecture_problem(spec: ExperimentSpec) -> str | None:
    """The error if `model.path` is a directory whose config.json names an architecture the engines cannot run
    (`factory.architectures.architecture_problem`), else None. Paths that are not such a directory are left to
    the loader (factory/models/hf.py), which names what is missing."""
    if spec.model.path is None:
        return None
    files = source_files(spec.model.path)  # the directory, or a hub id's cached snapshot (a GGUF file has none)
    config_file = files / "config.json" if files is not None else None
    if config_file is None or not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        return f"model.path: cannot read {config_file}: {e}"
    if not isinstance(config, dict):
        return f"model.path: {config_file} must hold a JSON object, got {type(config).__name__}"
    problem = architecture_problem(config)
    return None if problem is None else f"model.path: {config_file.parent}: {problem}"
