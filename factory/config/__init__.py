"""Experiment specs: pydantic models, YAML in and out, and error messages that name the field.

An `ExperimentSpec` is the whole description of a run. Everything that trains (the CLI, the
Dagster assets, a notebook) takes one; nothing else carries hyperparameters.

This package checks what the schema alone can tell. What only the task families know (how many distinct
problems a task has, how long its longest prompt is) is checked by `factory.envs.spec_check.check_spec`,
which the loaders (the CLI, the Dagster spec resource, sweeps, the deploy target) call after `load_spec` /
`parse_spec` / `apply_overrides`; whether the machine can hold a spec's step is `factory.infra.memory`'s check.

Modules, by concern: `yaml_io` (the YAML loader), `errors` (SpecError and how errors are worded), `bounds` (the
sane maxima of sizes), `section` (what every section shares), one module per section (`model`, `task`, `sft`,
`buffer`, `rollout`, `trainer` with LoRA, `schedule`, `ops`, `algorithm` with its corrections, `data` with the
curriculum and the prompt filter), `experiment` (ExperimentSpec), `resolved` (the defaults one section takes from
others, worked out once at validation: `spec.resolved`), `loading` (parse, load, overrides). Every name is importable
from `factory.config` itself.
"""

from factory.config.algorithm import AlgorithmSpec, CorrectionSpec
from factory.config.buffer import BufferSpec
from factory.config.data import CurriculumSpec, DataSpec, PromptFilterSpec
from factory.config.errors import SpecError, spec_error
from factory.config.experiment import ExperimentSpec
from factory.config.loading import (
    FILE_SOURCE_KINDS,
    anchor_source_paths,
    apply_overrides,
    load_spec,
    parse_overrides,
    parse_spec,
)
from factory.config.model import ModelSpec
from factory.config.ops import OpsSpec
from factory.config.resolved import Blend, Resolved
from factory.config.rollout import RolloutSpec, SGLangSpec
from factory.config.schedule import ScheduleSpec
from factory.config.section import LR_HELP
from factory.config.sft import SFTSpec
from factory.config.task import MIN_N_TRAIN, MULTI_TURN_BUILTINS, Operation, TaskSpec
from factory.config.trainer import LoraSpec, TrainerSpec
from factory.config.yaml_io import MAX_YAML_NODES, DuplicateKeyError, YAMLBombError, load_yaml

__all__ = [
    "FILE_SOURCE_KINDS", "LR_HELP", "MAX_YAML_NODES", "MIN_N_TRAIN", "MULTI_TURN_BUILTINS", "AlgorithmSpec",
    "Blend", "CorrectionSpec",
    "BufferSpec", "CurriculumSpec", "DataSpec", "DuplicateKeyError", "ExperimentSpec", "LoraSpec", "ModelSpec",
    "Operation", "OpsSpec", "PromptFilterSpec", "Resolved", "RolloutSpec", "SFTSpec", "SGLangSpec", "ScheduleSpec",
    "SpecError",
    "TaskSpec", "TrainerSpec", "YAMLBombError", "anchor_source_paths", "apply_overrides", "load_spec", "load_yaml",
    "parse_overrides", "parse_spec", "spec_error",
]
