"""GSPO (Zheng et al. 2025): PPO-clip on the length-normalized sequence ratio s = exp(mean_t(logp - old)), clipped
with tiny bounds [1 - 3e-4, 1 + 4e-4], per-sequence token mean: a whole response is in or out of the clip."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from factory.core.algorithms.shared import (
    GSPO_LOG_RATIO_MAX,
    Aggregation,
    batch_inputs,
    clean,
    clip_metrics,
    finish,
    masked_mean,
    per_token_advantages,
    refuse_dual_clip,
)
from factory.protocols.algorithm import AlgorithmDefaults, LossFn

if TYPE_CHECKING:
    from factory.config import AlgorithmSpec
    from factory.core.batch import TrainBatch


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    agg: Aggregation = "seq_mean_token_mean",
    max_len: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO-clip on the sequence ratio s_i = exp(mean_t(logp - old)) (length-normalized).

    Written in the paper's GSPO-token form s_i,t = sg(s_i) * exp(logp_t - sg(logp_t)): its value is
    s_i on every token and its gradient is s_i * A_i * grad(logp_t), so with a per-sequence
    advantage and the per-sequence token mean it equals sequence-level GSPO exactly. Clipping is
    decided per sequence: a whole response is in or out.

    The token-form log-ratio is clamped above at GSPO_LOG_RATIO_MAX *with* its gradient term, as verl
    does: a sequence whose ratio is clamped passes no gradient. (Clamping only the detached sequence
    mean would keep exp(bound) * grad(logp), about 1.2e8 per token of a 4-token sequence at A = -1.)
    """
    mask = mask.bool()
    lp = clean(mask, logprobs)
    log_s = masked_mean(lp.detach() - clean(mask, old_logprobs.to(lp.dtype)), mask, dim=-1)  # [B], detached
    # lp - sg(lp) first: it is exactly 0, so the value is log_s itself, not log_s + lp - lp rounded.
    log_s_tok = torch.clamp(lp - lp.detach() + log_s.unsqueeze(-1), max=GSPO_LOG_RATIO_MAX)
    s_tok = torch.exp(log_s_tok)  # value s_i, gradient s_i * grad(logp), none where clamped
    adv = per_token_advantages(advantages, lp, mask)
    clipped = torch.clamp(s_tok, 1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(-adv * s_tok, -adv * clipped)
    has_tokens = mask.any(dim=-1)
    s = torch.clamp(log_s, max=GSPO_LOG_RATIO_MAX).exp()
    metrics = clip_metrics(s.unsqueeze(-1).expand_as(lp), mask, eps_low, eps_high)
    metrics["seq_ratio_mean"] = masked_mean(s, has_tokens)
    return finish(per_token, lp, mask, agg, max_len, ref_logprobs, kl_coef, is_weights, metrics)



@dataclass(frozen=True)
class GSPO:
    """The `Algorithm`: `gspo_loss` with the section's (sequence-level) clips; no dual clip."""

    name: str = "gspo"
    defaults: AlgorithmDefaults = AlgorithmDefaults(clip_eps_low=3e-4, clip_eps_high=4e-4,
                                                    loss_agg="seq_mean_token_mean", scale_rewards=True)

    def validate(self, spec: AlgorithmSpec) -> None:
        refuse_dual_clip(spec)

    def loss(self, spec: AlgorithmSpec, off_policy: bool) -> LossFn:
        eps_low, eps_high = spec.clip_bounds()
        assert eps_low is not None, "gspo needs a lower clip"
        agg, max_len, kl_coef = spec.aggregation(), spec.length_norm(), spec.kl_coef

        def loss_fn(logp: Tensor, batch: TrainBatch) -> tuple[Tensor, dict[str, Tensor]]:
            old, adv, mask, extra = batch_inputs(batch)
            return gspo_loss(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, agg=agg, max_len=max_len,
                             kl_coef=kl_coef, **extra)

        return loss_fn


ALGORITHM = GSPO()
