"""CISPO (MiniMax-M1, 2025): the importance weight is clipped, never the gradient: -sg(clip(ratio, max=1 +
eps_high)) * A * logp per token (no lower bound by default, eps_high 0.28), token mean over the batch; so the rare
tokens PPO-clip would silence keep learning, with a bounded weight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from factory.core.algorithms.shared import (
    Aggregation,
    batch_inputs,
    clean,
    clip_metrics,
    finish,
    log_ratio,
    per_token_advantages,
    refuse_dual_clip,
)
from factory.protocols.algorithm import AlgorithmDefaults, LossFn

if TYPE_CHECKING:
    from factory.config import AlgorithmSpec
    from factory.core.batch import TrainBatch


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_high: float = 0.28,
    eps_low: float | None = None,
    agg: Aggregation = "token_mean",
    max_len: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * logp per token.

    The weight is a constant, so d/dlogp = -w * A on every token, clipped or not: the rare
    "fork" tokens PPO-clip would silence keep contributing. No lower bound unless `eps_low`.
    """
    mask = mask.bool()
    lp = clean(mask, logprobs)
    ratio = torch.exp(log_ratio(lp.detach(), clean(mask, old_logprobs.to(lp.dtype))))
    weight = ratio.clamp(min=None if eps_low is None else 1 - eps_low, max=1 + eps_high)
    adv = per_token_advantages(advantages, lp, mask)
    per_token = -weight * adv * lp
    metrics = clip_metrics(ratio, mask, eps_low, eps_high)
    return finish(per_token, lp, mask, agg, max_len, ref_logprobs, kl_coef, is_weights, metrics)



@dataclass(frozen=True)
class CISPO:
    """The `Algorithm`: `cispo_loss` with the section's clips; no dual clip (the weight is bounded already)."""

    name: str = "cispo"
    defaults: AlgorithmDefaults = AlgorithmDefaults(clip_eps_low=None, clip_eps_high=0.28, loss_agg="token_mean",
                                                    scale_rewards=True)

    def validate(self, spec: AlgorithmSpec) -> None:
        refuse_dual_clip(spec)

    def loss(self, spec: AlgorithmSpec, off_policy: bool) -> LossFn:
        eps_low, eps_high = spec.clip_bounds()
        agg, max_len, kl_coef = spec.aggregation(), spec.length_norm(), spec.kl_coef

        def loss_fn(logp: Tensor, batch: TrainBatch) -> tuple[Tensor, dict[str, Tensor]]:
            old, adv, mask, extra = batch_inputs(batch)
            return cispo_loss(logp, old, adv, mask, eps_high=eps_high, eps_low=eps_low, agg=agg, max_len=max_len,
                              kl_coef=kl_coef, **extra)

        return loss_fn


ALGORITHM = CISPO()
