"""DAPO (Yu et al. 2025): PPO-clip with clip-higher (eps_low `clip_eps`, eps_high 0.28), a token-level mean over
the whole batch, soft overlong shaping of rewards (L_max: `algorithm.overlong_max_len`, unset: the rollout's
max_new_tokens, resolved when the spec is validated; L_cache a fifth of it) and dynamic sampling (groups whose
rewards are all equal are dropped and the batch refilled: `keep_informative_groups`, the loop's)."""

from __future__ import annotations

from factory.core.algorithms.base import PPOClip
from factory.protocols.algorithm import AlgorithmDefaults

ALGORITHM = PPOClip("dapo", AlgorithmDefaults(clip_eps_low="clip_eps", clip_eps_high=0.28, loss_agg="token_mean",
                                              scale_rewards=True, dynamic_sampling=True, overlong=True,
                                              auto_dual_clip=True))
