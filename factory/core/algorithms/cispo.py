"""CISPO (MiniMax-M1, 2025): the importance weight is clipped, never the gradient: -sg(clip(ratio, max=1 +
eps_high)) * A * logp per token (no lower bound by default, eps_high 0.28), token mean over the batch; so the rare
tokens PPO-clip would silence keep learning, with a bounded weight. The formula: `shared.cispo_loss`; no dual clip
(the weight is bounded already)."""

from __future__ import annotations

from factory.core.algorithms.base import RatioClip
from factory.protocols.algorithm import AlgorithmDefaults

ALGORITHM = RatioClip("cispo", AlgorithmDefaults(clip_eps_low=None, clip_eps_high=0.28, loss_agg="token_mean",
                                                 scale_rewards=True), formula="cispo_loss")
