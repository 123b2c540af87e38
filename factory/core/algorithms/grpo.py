"""GRPO (Shao et al. 2024, DeepSeekMath): PPO's clipped surrogate with a symmetric clip `clip_eps`, averaged over
each sequence's tokens then over sequences, on advantages that are each reward minus its group's mean, divided by
the group's std."""

from __future__ import annotations

from factory.core.algorithms.base import PPOClip
from factory.protocols.algorithm import AlgorithmDefaults

ALGORITHM = PPOClip("grpo", AlgorithmDefaults(clip_eps_low="clip_eps", clip_eps_high="clip_eps",
                                              loss_agg="seq_mean_token_mean", scale_rewards=True, auto_dual_clip=True))
