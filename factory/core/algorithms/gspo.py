"""GSPO (Zheng et al. 2025): PPO-clip on the length-normalized sequence ratio s = exp(mean_t(logp - old)), clipped
with tiny bounds [1 - 3e-4, 1 + 4e-4], per-sequence token mean: a whole response is in or out of the clip. The
formula: `shared.gspo_loss`; no dual clip (it clips whole sequences)."""

from __future__ import annotations

from factory.core.algorithms.base import RatioClip
from factory.protocols.algorithm import AlgorithmDefaults

ALGORITHM = RatioClip("gspo", AlgorithmDefaults(clip_eps_low=3e-4, clip_eps_high=4e-4, loss_agg="seq_mean_token_mean",
                                                scale_rewards=True), formula="gspo_loss")
