"""GRPO (Shao et al. 2024, DeepSeekMath): PPO's clipped surrogate with a symmetric clip `clip_eps`, averaged over
each sequence's tokens then over sequences, on advantages that are each reward minus its group's mean, divided by
the group's std."""

from __future__ import annotations

from torch import Tensor

from factory.core.algorithms.shared import PPOClip, ppo_clip_loss
from factory.protocols.algorithm import AlgorithmDefaults

ALGORITHM = PPOClip("grpo", AlgorithmDefaults(clip_eps_low="clip_eps", clip_eps_high="clip_eps",
                                              loss_agg="seq_mean_token_mean", scale_rewards=True, auto_dual_clip=True))


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's clipped surrogate, token-level, averaged per sequence then over sequences."""
    return ppo_clip_loss(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps, "seq_mean_token_mean",
                         ref_logprobs=ref_logprobs, kl_coef=kl_coef, is_weights=is_weights)


