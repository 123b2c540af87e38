"""The `task` section: the task family and its splits, and the environment, sandbox, latency and multi-turn
settings of its episodes. `task.name` is checked against the task-family registry (factory/protocols/task.py)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from factory.config.bounds import (
    MAX_HELD_OUT,
    MAX_TASK_PROBLEMS,
)
from factory.config.section import _Section
from factory.protocols.task import TASK_FAMILIES

Operation = Literal["add", "sub", "mul"]

MULTI_TURN_BUILTINS = ("calculator_tool", "python_tool")  # envs/registry.py BUILTINS that run episodes
MIN_N_TRAIN = 16


class TaskSpec(_Section):
    """What the model is asked and how its answers are scored: the task family (`name`) and the sizes of its
    disjoint train / held-out splits; the arithmetic family's settings (`operations`; `digits`, its difficulty
    levels, operand lengths; the reversed writing); a multi-turn or user `environment` and its timeouts; the
    verifier's simulated latency; and the sandbox pool that runs generated code (workers, isolation, cores)."""

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("sandbox_cpus",)

    name: str = Field(
        "arithmetic", description="the task family: generated arithmetic, or a shipped set of word problems or "
        "code problems (envs/families/; their models use an ASCII character tokenizer), or a registered one: "
        "a plugin's entry point (group factory.task_families) or an import path package.module:attr")
    operations: list[Operation] = Field(default_factory=lambda: ["add"], min_length=1)
    digits: list[int] = Field(default_factory=lambda: [2, 3], min_length=1)
    reverse_answer: bool = True
    reverse_operands: bool = False
    n_train: int = Field(20000, ge=MIN_N_TRAIN, le=MAX_TASK_PROBLEMS)
    n_eval: int = Field(500, ge=8, le=MAX_HELD_OUT)
    simulated_latency_s: float = Field(
        0.0, ge=0, description="unit of a heavy-tailed simulated verifier latency per episode (40% 1x, 50% 3x, "
        "10% 20x; see envs/latency.py); 0 disables it")
    environment: str | None = Field(
        None, description="a multi-turn environment (built-in name, e.g. calculator_tool, or an import path "
        "package.module:attr) that runs each episode against the rollout server; unset: the task's verifier "
        "scores single completions")
    episode_timeout_s: float = Field(300.0, gt=0, description="a multi-turn episode running longer scores 0")
    reward_timeout_s: float = Field(30.0, gt=0, description="a single-turn reward function (verifier or environment) "
                                    "running longer on one completion scores it 0, with the reason recorded")
    sandbox_workers: int = Field(4, ge=1, le=256, description="warm sandbox workers per scoring process (code "
                                 "rewards, tools); each execution takes milliseconds, so a few serve many rollouts")
    sandbox_isolation: Literal["bwrap", "none"] = Field(
        "bwrap", description="bwrap: generated code runs in bubblewrap namespaces, and the pool refuses to start "
        "without them; none: NOT isolated (rlimits and timeouts only), for trusted code, logged loudly")
    sandbox_cpus: list[int] | None = Field(
        None, min_length=1, description="placement: the CPU cores the sandbox workers (generated code) run on; "
        "unset: any")

    @field_validator("name")
    @classmethod
    def _known_family(cls, v: str) -> str:
        return TASK_FAMILIES.spec_name(v)

    @field_validator("digits")
    @classmethod
    def _digits_range(cls, v: list[int]) -> list[int]:
        for d in v:
            if not 1 <= d <= 6:
                raise ValueError(f"each digit length must be between 1 and 6, got {d}")
        return sorted(set(v))
