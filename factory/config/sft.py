"""The `sft` section: the supervised warm start before RL."""

from __future__ import annotations

from pydantic import Field

from factory.config.bounds import (
    MAX_SFT_BATCH,
)
from factory.config.section import LR_HELP, _Section


class SFTSpec(_Section):
    """Supervised warm start that teaches the answer format."""

    steps: int = Field(300, ge=0, description="maximum number of steps")
    batch_size: int = Field(64, ge=1, le=MAX_SFT_BATCH)
    lr: float = Field(3e-3, gt=0, le=1e30, description=LR_HELP)
    stop_at_accuracy: float | None = Field(
        None, gt=0, le=1,
        description="stop early once greedy accuracy on a sample of *train* problems reaches this",
    )
    check_every: int = Field(50, ge=1, description="steps between stop_at_accuracy checks")
    examples: int | None = Field(
        None, ge=1, description="labeled demonstrations SFT may use: the first N training problems (the warm start "
        "and the more-SFT control both see only these; GRPO prompts come from the whole training split, scored by "
        "the verifier, no labels needed); unset: every training problem")
