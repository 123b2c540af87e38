"""The gap between the sampler and the trainer: the engine's log-probs of a batch's tokens against the trainer's own of
the same tokens under the same weights, measured on every batch and corrected as the field does.

Why: the rollout engine computes the policy with its own kernels and precision (bf16 weights, paged attention,
SGLang), the trainer with others (autocast over fp32 weights), so the log-prob of one token under one set of weights
differs between them; a loss that takes the engine's as the behaviour policy is silently off-policy by that much, and
the gap alone has collapsed runs (AReaL #1290, open-instruct #1473; "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", 2025).

With d_t = trainer_t - sampler_t (log-probs, per token) and rho_t = exp(d_t):
- `gap_stats`: mean and max |d_t|, the k3 estimate of KL(sampler || trainer) (tokens are sampled from the sampler:
  E_s[rho - log rho - 1], verl's rollout_corr k3_kl), the share of tokens whose rho_t leaves [1/C, C], and the 95th
  percentile of |sum_t d_t| per sequence (the sequence log-ratio).
- `correct`, per `CorrectionSpec` (verl's rollout_corr_helper.py is the reference its tests match):
  token TIS, a weight min(rho_t, C) per token; sequence TIS, min(prod_t rho_t, C) on every token of the sequence;
  MIS, a sequence whose geometric-mean ratio exp(mean_t d_t) leaves [lo, hi] is masked out of the loss; IcePop, a
  token whose rho_t leaves [alpha, beta] is masked out. Log-ratios are clamped to +-SAFETY_BOUND before exp.
  Weights are data (detached) and multiply each token's policy-gradient term as the buffer's staleness weights do
  (and together with them); a masked token leaves the loss altogether (policy term, KL term and the aggregation's
  denominators), as verl's rejection replaces its response_mask.

Only rows whose generating weights the trainer still holds are measured and corrected (`rows`): a row the trainer can
only score under newer weights mixes staleness into the ratio, and the buffer's staleness weights own that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from factory.config import CorrectionSpec
from factory.core.batch import TrainBatch

SAFETY_BOUND = 20.0  # |log-ratio| before exp (verl's rollout_corr SAFETY_BOUND)
GAP_FIELDS = ("gap_abs_mean", "gap_abs_max", "gap_kl", "gap_out_frac", "gap_seq_p95")


def _log_ratio(trainer: Tensor, sampler: Tensor, mask: Tensor) -> Tensor:
    # Computed in the wider of the two dtypes and at least float32 (a bf16 weight exp(d) keeps 3 digits, and
    # torch.quantile takes no bf16); masked positions are exactly 0 (they may hold anything, even NaN).
    dtype = torch.promote_types(torch.promote_types(trainer.dtype, sampler.dtype), torch.float32)
    d = trainer.detach().to(dtype) - sampler.detach().to(dtype)
    return torch.where(mask, d, torch.zeros_like(d))


def gap_stats(trainer: Tensor, sampler: Tensor, mask: Tensor, cap: float = 2.0) -> dict[str, float | None]:
    """The gap between `trainer` and `sampler` log-probs [B, T] on `mask`: `GAP_FIELDS` as floats, all None when
    the mask holds no token. `cap` is C of the out-of-range share."""
    mask = mask.bool()
    n = int(mask.sum())
    if n == 0:
        return dict.fromkeys(GAP_FIELDS)
    d = _log_ratio(trainer, sampler, mask).double()  # k3 of a tiny gap is below float32's resolution
    dc = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k3 = torch.where(mask, torch.exp(dc) - dc - 1, torch.zeros_like(d))
    log_c = math.log(cap)
    out = mask & ((d > log_c) | (d < -log_c))
    rows = mask.any(dim=-1)
    seq = d.sum(dim=-1)[rows].abs()
    # the share in float64 too: a count divided by an int is float32, 1e-8 off
    figures = torch.stack([d.abs().sum() / n, d.abs().max(), k3.sum() / n, out.sum().to(d.dtype) / n,
                           torch.quantile(seq, 0.95)])
    return dict(zip(GAP_FIELDS, figures.tolist(), strict=True))


@dataclass
class Correction:
    """What `correct` decided for a batch: per-token weights (None: no TIS), the tokens kept in the loss (None: all),
    and its effect as floats (`correction_weight_mean`, `correction_masked_tokens`, `correction_masked_seqs`)."""

    weights: Tensor | None
    keep: Tensor | None
    metrics: dict[str, float] = field(default_factory=dict)


def correct(spec: CorrectionSpec, trainer: Tensor, sampler: Tensor, mask: Tensor, rows: Tensor,
            recompute: bool = True) -> Correction:
    """The corrections `spec` asks for, on the ratio of `trainer` to `sampler` log-probs [B, T] over `mask`, for the
    rows [B] flagged in `rows` (others get weight 1 and stay in the loss). `recompute` resolves `spec.tis`'s default."""
    mask = mask.bool()
    on = mask & rows.bool().unsqueeze(-1)
    d = _log_ratio(trainer, sampler, on)
    tis = spec.tis_mode(recompute)
    weights = keep = None
    if tis == "token":
        weights = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND)).clamp(max=spec.tis_cap)
    elif tis == "sequence":
        log_w = d.sum(dim=-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        weights = torch.exp(log_w).clamp(max=spec.tis_cap).expand_as(d)
    if weights is not None:
        weights = torch.where(on, weights, torch.ones_like(weights))
    if spec.mis is not None:
        lo, hi = spec.mis
        n = on.sum(dim=-1, keepdim=True)
        geo = torch.exp((d.sum(dim=-1, keepdim=True) / n.clamp(min=1)).clamp(-SAFETY_BOUND, SAFETY_BOUND))
        out = (n > 0) & ((geo < lo) | (geo > hi))
        keep = mask & ~out
    if spec.icepop is not None:
        alpha, beta = spec.icepop
        rho = torch.exp(d.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        kept = ~(on & ((rho < alpha) | (rho > beta)))
        keep = (mask if keep is None else keep) & kept
    return Correction(weights, keep, _effect(weights, keep, mask))


def _effect(weights: Tensor | None, keep: Tensor | None, mask: Tensor) -> dict[str, float]:
    if weights is None and keep is None:
        return {}
    kept = mask if keep is None else keep
    has = mask.any(dim=-1)
    figures = {}
    if weights is not None:
        figures["correction_weight_mean"] = (torch.where(kept, weights, torch.zeros_like(weights)).double().sum()
                                             / kept.sum().clamp(min=1))
    if keep is not None:
        figures["correction_masked_tokens"] = (mask & ~keep).sum().double() / mask.sum().clamp(min=1)
        figures["correction_masked_seqs"] = (has & ~keep.any(dim=-1)).sum().double() / has.sum().clamp(min=1)
    values = torch.stack(list(figures.values())).tolist()
    return dict(zip(figures, values, strict=True))


def apply_correction(batch: TrainBatch, correction: Correction) -> None:
    """Multiply the correction's weights into `batch.per_token["is_weights"]` (the staleness weights, if any) and drop
    its masked tokens from `batch.loss_mask`."""
    if correction.weights is not None:
        w = correction.weights.detach()
        old = batch.per_token.get("is_weights")
        batch.per_token["is_weights"] = w if old is None else old * w
    if correction.keep is not None:
        batch.loss_mask = batch.loss_mask & correction.keep
