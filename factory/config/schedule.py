"""The `schedule` section: steps and how generation overlaps training (sync, one_step_off, async)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from factory.config.bounds import (
    MAX_PASS_K,
    MAX_PROMPTS_PER_STEP,
)
from factory.config.section import _Section


class ScheduleSpec(_Section):
    """How long RL runs and how often it is measured."""

    mode: Literal["sync", "one_step_off", "async"] = "sync"
    wait_timeout_s: float = Field(600.0, gt=0, description="longest the trainer or a producer waits on the other")
    steps: int = Field(60, ge=1)
    eval_every: int = Field(0, ge=0, description="held-out eval every N steps; 0: only start and end")
    checkpoint_every: int = Field(0, ge=0, description="checkpoint every N steps; 0: only the final one")
    eval_pass_k: int = Field(8, ge=1, le=MAX_PASS_K)
    log_rollouts: int = Field(2, ge=0, le=MAX_PROMPTS_PER_STEP,
                              description="prompt groups per step kept in the `rollouts` table")
