"""The `buffer` section: the rollout buffer between producers and the trainer (depth, staleness, its policy)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from factory.config.bounds import (
    MAX_IN_FLIGHT,
)
from factory.config.section import _Section


class BufferSpec(_Section):
    """The rollout buffer between producers (rollouts) and the trainer; see `factory/core/buffer.py`.

    `max_staleness` is in weight versions (trainer steps). `policy`: `reject` drops groups staler than
    that (counted); `bound` trains every group within it and drops none: producers wait for room
    (depth <= max_staleness x groups per step) and the trainer waits for an episode that reaches its
    limit; `importance` keeps stale groups and corrects them with truncated IS weights
    (`algorithm.is_cap`). `depth` is in prompt groups (buffered + in flight); unset: max(max_staleness,
    1) x groups per step. The trainer takes groups from the oldest weights first.
    """

    policy: Literal["reject", "bound", "importance"] = "bound"
    max_staleness: int = Field(1, ge=0)
    depth: int | None = Field(None, ge=1, le=MAX_IN_FLIGHT,
                              description="capacity in prompt groups (buffered + reserved)")
    correct_stale: bool = Field(
        False, description="also apply the truncated IS correction (decoupled PPO) to stale groups under "
        "'reject' and 'bound'; 'importance' always does")

    @field_validator("max_staleness")
    @classmethod
    def _bound_needs_overlap(cls, v: int, info: ValidationInfo) -> int:
        if v < 1 and info.data.get("policy") == "bound":
            raise ValueError("policy 'bound' needs >= 1 (0 allows no overlap at all: use schedule.mode sync), "
                             f"got {v}")
        return v
