"""Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO's clip without its two length and
difficulty biases: each sequence's token *sum* is divided by a constant max length (`algorithm.max_len_norm`, unset:
the rollout's max_new_tokens, resolved when the spec is validated) instead of its own length, and advantages are
not divided by the group's std."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from factory.core.algorithms.base import PPOClip
from factory.protocols.algorithm import AlgorithmDefaults

if TYPE_CHECKING:
    from factory.config import AlgorithmSpec


@dataclass(frozen=True)
class DrGRPO(PPOClip):
    """PPO-clip, refusing std-scaled advantages."""

    def validate(self, spec: AlgorithmSpec) -> None:
        if spec.scale_rewards:
            raise ValueError("algorithm.scale_rewards: dr_grpo does not divide advantages by the reward std (that is "
                             "its point); leave it unset or set false")


ALGORITHM = DrGRPO("dr_grpo", AlgorithmDefaults(clip_eps_low="clip_eps", clip_eps_high="clip_eps",
                                                loss_agg="seq_mean_token_sum_norm", scale_rewards=False,
                                                auto_dual_clip=True))
