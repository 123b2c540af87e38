"""verl's policy losses and its rollout correction, restated as plain torch: the reference the loss and correction
tests match (verl is not installed here, so the formulas are written out again, step for step).

Transcribed from volcengine/verl:
- the losses, `verl/trainer/ppo/core_algos.py` at commit b178a3cd56f58b2d502255daba591e92833930a7 (main,
  2026-01-29, version 0.8.0.dev; the same formulas as at tag v0.7.0): `compute_policy_loss_vanilla`,
  `compute_policy_loss_gspo`, `compute_policy_loss_cispo`, `agg_loss`, `kl_penalty_forward("low_var_kl")`, and the
  way `verl/workers/actor/dp_actor.py` (`update_policy`) combines them: `pg_losses * rollout_is_weights`, aggregated
  over the (rejection-modified) `response_mask`, plus `kl_loss_coef * agg_loss(kld, response_mask)` with the same
  mask and mode, unweighted;
- the rollout correction, `verl/trainer/ppo/rollout_corr_helper.py`: `compute_rollout_correction_weights` and
  `compute_offpolicy_metrics` / `compute_is_metrics` at b178a3cd (the same at the commit below);
  `compute_rollout_rejection_mask` both at 518bada2192c27268a787b280767e0c0f34acb0b (2025-12-15; modes "token",
  "sequence", "geometric" with [lower, upper] bounds on the ratio) and at b178a3cd (options "token_k1",
  "seq_mean_k1", ... with "lower_upper" bounds on k1 = -log ratio, several options AND-ed);
  `compute_rollout_correction_and_rejection_mask` (log_ratio = old_log_prob - rollout_log_prob: the trainer's
  recomputed log-probs against the sampler's).
- `verl/utils/torch_functional.py` `masked_sum`, `masked_mean` (a 1e-8 guard in the denominator).

One liberty, named where it is taken (`guard`): verl's `n + 1e-8` denominators of a sequence's token mean shift a
value by a relative 1e-8 / n, which is above the 1e-9 the correction tests hold to; the guard only exists for n = 0,
where the sequence leaves the mean either way, so `guard=0` divides by n (and by 1 where n = 0), as factory does.
"""

from __future__ import annotations

import math

import torch

SAFETY_BOUND = 20.0  # rollout_corr_helper.SAFETY_BOUND
GUARD = 1e-8  # torch_functional.masked_mean's, agg_loss's seq-mean-token-mean's


# ---------------------------------------------------------------- torch_functional


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    valid = torch.where(mask.bool(), values, 0.0) * mask
    return valid.sum() if axis is None else valid.sum(axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    n = mask.sum() if axis is None else mask.sum(axis)
    return masked_sum(values, mask, axis) / (n + GUARD)


# ---------------------------------------------------------------- core_algos: the losses


def verl_agg(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, scale: float | None = None,
             guard: float = GUARD) -> torch.Tensor:
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    if mode == "seq-mean-token-mean":
        n = m.sum(-1)
        per_seq = (loss_mat * m).sum(-1) / (n + guard if guard else n.clamp(min=1))
        keep = (n > 0).to(loss_mat.dtype)
        return (per_seq * keep).sum() / keep.sum()
    if mode == "seq-mean-token-sum-norm":
        assert scale is not None
        return (loss_mat * m).sum(-1).sum() / scale
    raise AssertionError(mode)


def verl_vanilla(old, logp, adv, mask, low, high, c=math.inf, mode="token-mean", is_w=None, scale=None,
                 guard=GUARD):
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(loss1, loss2)
    clip2 = torch.min(-adv * c, clip1)
    pg = torch.where(adv < 0, clip2, clip1)
    if is_w is not None:
        pg = pg * is_w
    return verl_agg(pg, mask, mode, scale, guard)


def verl_gspo(old, logp, adv, mask, low, high, is_w=None, guard=GUARD):
    m = mask.to(logp.dtype)
    seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = torch.clamp(logp - logp.detach() + seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    pg = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - low, 1 + high))
    if is_w is not None:
        pg = pg * is_w
    return verl_agg(pg, mask, "seq-mean-token-mean", guard=guard)


def verl_cispo(old, logp, adv, mask, low, high, mode="token-mean", is_w=None):
    ratio = torch.exp(torch.clamp(logp - old, min=-20.0, max=20.0))
    weight = torch.clamp(ratio, 1 - low, 1 + high).detach()
    pg = -weight * adv * logp
    if is_w is not None:
        pg = pg * is_w
    return verl_agg(pg, mask, mode)


def verl_low_var_kl(logp, ref):
    kl = torch.clamp(ref - logp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_loss(name: str, old, logp, adv_seq, mask, ref, kl_coef, is_w, dual_clip, max_len, guard=GUARD):
    """verl's actor loss for factory's algorithm `name`, on factory's inputs (advantages per sequence); `mask` is
    verl's response_mask (after rejection, where a correction rejects), `is_w` its rollout_is_weights."""
    adv = adv_seq.unsqueeze(-1).expand_as(logp)
    c = math.inf if dual_clip is None else dual_clip
    g = {"guard": guard}
    if name == "grpo":
        mode = "seq-mean-token-mean"
        pg = verl_vanilla(old, logp, adv, mask, 0.2, 0.2, c, mode, is_w, **g)
    elif name == "dr_grpo":
        mode = "seq-mean-token-sum-norm"
        pg = verl_vanilla(old, logp, adv, mask, 0.2, 0.2, c, mode, is_w, scale=max_len)
    elif name == "dapo":
        mode, pg = "token-mean", verl_vanilla(old, logp, adv, mask, 0.2, 0.28, c, "token-mean", is_w)
    elif name == "cispo":
        mode, pg = "token-mean", verl_cispo(old, logp, adv, mask, 1.0, 0.28, "token-mean", is_w)
    else:
        mode, pg = "seq-mean-token-mean", verl_gspo(old, logp, adv, mask, 3e-4, 4e-4, is_w, **g)
    loss = pg + kl_coef * verl_agg(verl_low_var_kl(logp, ref), mask, mode, scale=max_len, **g)
    if name == "dr_grpo":
        # verl's agg_loss sums the sequences' token sums of a micro-batch (its actor rescales by micro-batch
        # count, a constant); factory takes their mean over the sequences that have a token: the same objective up
        # to this divisor, which differs where a correction empties a sequence (tests/core/test_correction.py).
        loss = loss / mask.any(-1).sum()
    return loss


# ---------------------------------------------------------------- rollout_corr_helper: the correction


def rollout_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_is: str,
                       threshold: float) -> torch.Tensor:
    """`compute_rollout_correction_weights` (no batch normalization): exp of the safety-clamped token log-ratio
    ("token") or of the clamped masked sum ("sequence"), zeroed on padding, truncated at `threshold`, detached."""
    if rollout_is == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    elif rollout_is == "sequence":
        log_ratio_sum = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise AssertionError(rollout_is)
    weights = weights * response_mask
    return weights.clamp(max=threshold).detach()


def rejection_mask_518(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str, upper: float,
                       lower: float | None = None) -> torch.Tensor:
    """`compute_rollout_rejection_mask` at 518bada: the token ratio ("token"), the sequence's product ("sequence")
    or its geometric mean exp(masked mean of log ratios) ("geometric"), safety-clamped in log space; kept where
    in [lower, upper] (lower defaults to 1 / upper); returns response_mask * keep."""
    lower = 1.0 / upper if lower is None else lower
    if rollout_rs == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    elif rollout_rs == "sequence":
        log_ratio_sum = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(log_ratio_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    elif rollout_rs == "geometric":
        log_ratio_mean = masked_mean(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(log_ratio_mean, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise AssertionError(rollout_rs)
    keep = ((weights >= lower) & (weights <= upper)).to(log_ratio.dtype)
    return response_mask * keep


def rejection_mask_k1(log_ratio: torch.Tensor, response_mask: torch.Tensor, options: dict[str, str]) -> torch.Tensor:
    """`compute_rollout_rejection_mask` at b178a3cd for its k1 options, `options` {option: "lower_upper"}: the
    statistic is k1 = -clamp(log ratio) per token ("token_k1") or its masked mean per sequence ("seq_mean_k1"),
    kept where in [log lower, log upper]; every option must pass. Since k1 is log(pi_rollout / pi_train), factory's
    ratio bounds [lo, hi] are verl's "1/hi_1/lo" here."""
    k1 = -torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    for option, spec in options.items():
        lower_str, upper_str = spec.split("_", 1)
        lower_log, upper_log = math.log(float(lower_str)), math.log(float(upper_str))
        if option == "token_k1":
            stat = k1
        elif option == "seq_mean_k1":
            stat = masked_mean(k1, response_mask, axis=-1).unsqueeze(-1).expand_as(k1)
        else:
            raise AssertionError(option)
        combined = combined * ((stat >= lower_log) & (stat <= upper_log)).to(log_ratio.dtype)
    return (response_mask * combined).to(response_mask.dtype)


def rs_masked_fraction(response_mask: torch.Tensor, modified: torch.Tensor) -> float:
    """`rollout_rs_masked_fraction`, masked_mean(1 - keep, response_mask): where response_mask is 1, keep is the
    modified mask."""
    return masked_mean(1 - modified.to(torch.float64), response_mask).item()


def offpolicy_k3_kl(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                    response_mask: torch.Tensor) -> float:
    """`compute_offpolicy_metrics`'s k3_kl: masked mean of exp(r) - r - 1, r = old - rollout (no clamp)."""
    log_ratio = old_log_prob - rollout_log_prob
    return masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()


def is_ratio_fractions(log_ratio: torch.Tensor, response_mask: torch.Tensor, threshold: float) -> tuple[float, float]:
    """`compute_is_metrics` (token level) on the weights before truncation: the shares of tokens whose ratio is
    above `threshold` and below 1 / threshold (`rollout_is_ratio_fraction_high`, `..._low`)."""
    weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)) * response_mask
    high = masked_mean((weights > threshold).to(log_ratio.dtype), response_mask).item()
    low = masked_mean((weights < 1.0 / threshold).to(log_ratio.dtype), response_mask).item()
    return high, low
