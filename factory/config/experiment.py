"""`ExperimentSpec`: a whole experiment, its sections, the checks across them, its fingerprints and dumps."""

from __future__ import annotations

import hashlib
import json
from typing import ClassVar

import yaml
from pydantic import Field, PrivateAttr, model_validator

from factory.config.algorithm import AlgorithmSpec
from factory.config.bounds import MAX_STEP_SAMPLES
from factory.config.buffer import BufferSpec
from factory.config.data import DataSpec
from factory.config.model import ModelSpec
from factory.config.ops import OpsSpec
from factory.config.resolved import Resolved, resolve
from factory.config.rollout import RolloutSpec
from factory.config.schedule import ScheduleSpec
from factory.config.section import _Section
from factory.config.sft import SFTSpec
from factory.config.task import MULTI_TURN_BUILTINS, TaskSpec
from factory.config.trainer import TrainerSpec
from factory.digest import model_dir_digest
from factory.model_source import source_files
from factory.source_spec import Seed


class ExperimentSpec(_Section):
    """A whole experiment: model, task, SFT warm start, algorithm, rollout, trainer, schedule, ops, data, seed,
    and the device it computes on."""

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("device",)

    name: str = Field("experiment", min_length=1, max_length=80, pattern=r"^[A-Za-z0-9_.-]+$")
    seed: Seed = 0
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="where the run computes: SFT, the trainer, the "
        "in-process rollout engines, evals, the KL reference and the rollout server (factory/infra/device.py). auto: "
        "the current CUDA device when torch sees one, else the CPU; cpu; cuda (the current CUDA device); cuda:N. "
        "trainer.devices still places the ranks of a multi-process trainer")
    model: ModelSpec = Field(default_factory=ModelSpec)
    task: TaskSpec = Field(default_factory=TaskSpec)
    sft: SFTSpec = Field(default_factory=SFTSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    buffer: BufferSpec = Field(default_factory=BufferSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    ops: OpsSpec = Field(default_factory=OpsSpec)
    data: DataSpec | None = Field(None, description="GRPO's prompt blend; unset: the task's training split")
    # The cross-section defaults (config/resolved.py), worked out by the validator: not a field, so not in dumps.
    _resolved: Resolved | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _fits_together(self) -> ExperimentSpec:
        self.algorithm.resolve_lengths(self.rollout.max_new_tokens)  # Dr.GRPO's divisor, DAPO's L_max: once, here
        b, per_step = self.buffer, self.rollout.prompts_per_step
        if b.policy == "bound" and b.depth is not None and b.depth > b.max_staleness * per_step:
            raise ValueError(
                f"buffer.depth: with policy 'bound' must be <= buffer.max_staleness * rollout.prompts_per_step "
                f"= {b.max_staleness * per_step} (deeper lets groups grow staler than allowed), got {b.depth}"
            )
        # Built-in multi-turn environments are known here; one named by import path is checked when the run
        # starts (importing user code while validating a spec would run it).
        if self.task.environment in MULTI_TURN_BUILTINS and (self.rollout.engine != "server"
                                                             or self.schedule.mode == "sync"):
            raise ValueError(
                f"task.environment: a multi-turn environment talks to the rollout server, so it needs "
                f"rollout.engine: server and schedule.mode one_step_off or async (got engine "
                f"{self.rollout.engine!r}, mode {self.schedule.mode!r})")
        text = [s["name"] for s in (self.data.sources if self.data else [])
                if s["kind"] in ("suite", "reasoning_gym", "humaneval")]
        if text and self.task.name == "arithmetic" and getattr(self.model, "path", None) is None:
            raise ValueError(f"data.sources: {text} hold text prompts, but the model's tokenizer is task arithmetic's "
                             f"(digits and + - * =): use task.name word_problems or code (an ASCII tokenizer, which "
                             f"also reads arithmetic)")
        if self.sft.examples is not None and self.sft.examples > self.task.n_train:
            raise ValueError(f"sft.examples: must be <= task.n_train = {self.task.n_train} (the demonstrations are "
                             f"the first training problems), got {self.sft.examples}")
        if self.trainer.lora is not None and self.rollout.engine == "sglang":
            raise ValueError("trainer.lora: not wired to rollout.engine sglang yet (it would load each version's "
                             "adapter through SGLang's /load_lora_adapter); use engine embedded or server")
        if self.trainer.lora is not None and self.rollout.weight_transport == "shared":
            raise ValueError("rollout.weight_transport: 'shared' carries whole weights, but with trainer.lora the "
                             "rollout server merges each version's adapters; use codec or auto")
        r = self.rollout
        if r.round_weights is not None and r.engine != "embedded" and self.schedule.mode != "sync":
            raise ValueError(f"rollout.round_weights: rounds the weights of the in-process engine only (rollout.engine "
                             f"embedded, or schedule.mode sync), got engine {self.rollout.engine!r} in mode "
                             f"{self.schedule.mode!r}; a rollout server or SGLang serves the weights it is sent")
        batch = self.rollout.prompts_per_step * self.algorithm.group_size
        if batch > MAX_STEP_SAMPLES:
            raise ValueError(
                f"rollout.prompts_per_step * algorithm.group_size: a step's samples must be <= {MAX_STEP_SAMPLES} "
                f"(a step's batch is held whole; factory/config/bounds.py), got {self.rollout.prompts_per_step} * "
                f"{self.algorithm.group_size} = {batch}")
        if batch % self.trainer.minibatches:
            raise ValueError(
                f"trainer.minibatches: must divide rollout.prompts_per_step * algorithm.group_size "
                f"= {batch}, got {self.trainer.minibatches}"
            )
        self._resolved = resolve(self)  # last: every section checked on its own and together first
        return self

    @property
    def resolved(self) -> Resolved:
        """The settings one section's default takes from others (device, precision, engine numerics), resolved
        at validation (config/resolved.py)."""
        if self._resolved is None:  # built without validation (model_construct)
            self._resolved = resolve(self)
        return self._resolved

    def fingerprint(self) -> str:
        """Stable short hash of the spec's content (key order and formatting do not matter)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def warm_start_fingerprint(self) -> str:
        """What the SFT warm start depends on (model, task, SFT settings, seed, generation budget, and a
        `model.path` directory's contents): runs that differ only in RL settings share one warm start."""
        parts = {"model": self.model.model_dump(mode="json"), "task": self.task.model_dump(mode="json"),
                 "sft": self.sft.model_dump(mode="json"), "seed": self.seed,
                 "max_new_tokens": self.rollout.max_new_tokens}
        if self.model.path is not None:  # a path names where a model is, not its weights: key by what is there
            files = source_files(self.model.path)  # the directory, the GGUF file or the hub id's cached snapshot
            parts["model_dir_sha256"] = model_dir_digest(files) if files is not None else None
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
