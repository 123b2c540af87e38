"""The algorithms' maths, over tensors: the numeric clamps, masked means and aggregations, group-relative advantages
and DAPO's overlong shaping, the PPO-clip loss (grpo, dr_grpo and dapo are it with different settings), CISPO's and
GSPO's losses, and the SFT loss. The algorithm modules (grpo.py, ...) import this module when a run builds its loss,
not when a spec is validated: validation stays torch-free. The package docstring (factory/core/algorithms/__init__.py)
has the shapes and the numerics, docs/algorithms.md the formulas and papers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from factory.config import AlgorithmSpec
    from factory.core.batch import TrainBatch

Aggregation = str  # "seq_mean_token_mean" | "token_mean" | "seq_mean_token_sum_norm"

LOG_RATIO_BOUND = 20.0  # |log ratio| before exp: e^20 ~ 4.9e8, finite and far outside any clip (verl: 20)
GSPO_LOG_RATIO_MAX = 10.0  # GSPO's sequence log-ratio, upper side only (verl's compute_policy_loss_gspo: 10)
KL_BOUND = 10.0  # |k3 estimate| per token (verl's low_var_kl: 10)


# ---------------------------------------------------------------- advantages and reward shaping


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's std when `scale`.

    `rewards` is [N * group_size], groups contiguous. A group whose rewards are all equal gets
    zero advantage (no NaN), so it contributes no gradient. Computed in the rewards' own precision
    (`reward_dtype`): float64 rewards give float64 advantages, as verl's estimator gives on them; a cast
    to float32 first was 1e-7 off it.
    """
    check_groups(rewards, group_size)
    r = rewards.view(-1, group_size).to(reward_dtype(rewards))
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def reward_dtype(rewards: Tensor) -> torch.dtype:
    """The precision advantages of `rewards` are computed in: their own floating dtype; integer (or bool) rewards,
    exact as they are, in float64."""
    return rewards.dtype if rewards.is_floating_point() else torch.float64


def overlong_reward(lengths: Tensor, max_len: int, cache_len: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """DAPO's soft overlong punishment (its eq. 13), a penalty in [-1, 0] per response length, in `dtype`.

    0 up to `max_len - cache_len` tokens, then falling linearly to -1 at `max_len`, and -1 beyond.
    """
    if not 0 < cache_len < max_len:
        raise ValueError(f"need 0 < cache_len < max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = lengths.to(dtype)
    soft = max_len - cache_len
    penalty = (soft - lengths) / cache_len
    return torch.where(lengths <= soft, torch.zeros_like(lengths), penalty.clamp(min=-1.0))


def keep_informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: a bool per group, False where all its rewards are equal.

    Such a group (all right or all wrong) has zero advantage everywhere and gives no gradient; DAPO
    drops it and samples more prompts until the batch is full. Pass the task rewards, before any
    overlong shaping, as DAPO filters on accuracy.
    """
    check_groups(rewards, group_size)
    r = rewards.view(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def shaped_group_advantages(spec: AlgorithmSpec, rewards: Tensor, group_size: int,
                            lengths: Tensor | None = None) -> Tensor:
    """The default advantages: DAPO's overlong shaping first where the section enables it (then `lengths`, the
    generated token counts, are required; its L_max is resolved at validation: `AlgorithmSpec.overlong`), then
    group-relative advantages, divided by the group std unless the algorithm (Dr.GRPO) or `scale_rewards` says
    not to."""
    overlong = spec.overlong()
    if overlong is not None:
        if lengths is None:
            raise ValueError(f"algorithm {spec.name!r} shapes overlong rewards: pass the completion lengths")
        dtype = reward_dtype(rewards)
        rewards = rewards.to(dtype) + spec.overlong_penalty * overlong_reward(lengths, *overlong, dtype=dtype)
    return group_advantages(rewards, group_size, scale=spec.scales_rewards())


def check_groups(rewards: Tensor, group_size: int) -> None:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")


# ---------------------------------------------------------------- building blocks


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` where `mask`; positions outside the mask are ignored even if non-finite."""
    m = mask.to(x.dtype)
    x = torch.where(mask, x, torch.zeros_like(x))
    if dim is None:
        return x.sum() / m.sum().clamp(min=1)
    return x.sum(dim) / m.sum(dim).clamp(min=1)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(r - p) - (r - p) - 1 >= 0, with r - p clamped to
    +-LOG_RATIO_BOUND and the estimate to KL_BOUND (verl's low_var_kl)."""
    d = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(d) - d - 1, -KL_BOUND, KL_BOUND)


def log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """logp - old, clamped to +-LOG_RATIO_BOUND so that its exp is finite."""
    return torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def aggregate(per_token: Tensor, mask: Tensor, agg: Aggregation, max_len: int | None = None) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    - seq_mean_token_mean: mean over each sequence's tokens, then over sequences (GRPO, GSPO);
    - token_mean: mean over every token of the batch, so long sequences weigh more (DAPO, CISPO);
    - seq_mean_token_sum_norm: each sequence's token sum / `max_len`, then mean over sequences (Dr.GRPO).
    Sequences with no unmasked token are left out of the sequence mean.
    """
    has_tokens = mask.any(dim=-1)
    if agg == "seq_mean_token_mean":
        return masked_mean(masked_mean(per_token, mask, dim=-1), has_tokens)
    if agg == "token_mean":
        return masked_mean(per_token, mask)
    if agg == "seq_mean_token_sum_norm":
        if max_len is None or max_len < 1:
            raise ValueError("seq_mean_token_sum_norm needs a constant max_len >= 1 (algorithm.max_len_norm)")
        sums = torch.where(mask, per_token, torch.zeros_like(per_token)).sum(dim=-1)
        return masked_mean(sums / max_len, has_tokens)
    raise ValueError(f"unknown loss aggregation {agg!r}")


def clean(mask: Tensor, x: Tensor, fill: float = 0.0) -> Tensor:
    # Replace masked positions before any arithmetic: NaN * 0 is NaN, in values and in gradients.
    return torch.where(mask, x, torch.full_like(x, fill))


def per_token_advantages(advantages: Tensor, like: Tensor, mask: Tensor) -> Tensor:
    adv = advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages
    return clean(mask, adv.to(like.dtype))


def finish(policy_term: Tensor, logprobs: Tensor, mask: Tensor, agg: Aggregation, max_len: int | None,
            ref_logprobs: Tensor | None, kl_coef: float, is_weights: Tensor | None,
            metrics: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Apply importance weights to the policy term, add the KL penalty (unweighted: see the module docstring),
    aggregate, and finish the metrics."""
    per_token = policy_term
    if is_weights is not None:
        # Truncated IS weights of stale samples (the buffer's `importance` policy): data, not parameters.
        per_token = per_token * clean(mask, is_weights.to(per_token.dtype).detach(), 1.0)
    kl = None
    if ref_logprobs is not None and kl_coef > 0:
        # `logprobs` is already 0 on masked positions; a 0 reference there makes their KL exactly 0.
        kl = kl_k3(logprobs, clean(mask, ref_logprobs.to(logprobs.dtype)))
        per_token = per_token + kl_coef * kl
    loss = aggregate(per_token, mask, agg, max_len)
    with torch.no_grad():
        if kl is not None:  # not computed (kl_coef 0, no reference): no metric, never a 0 that reads as measured
            metrics["kl"] = masked_mean(kl, mask)
        if is_weights is not None:
            metrics["is_weight_mean"] = masked_mean(is_weights.float(), mask)
    return loss, metrics


def clip_metrics(ratio: Tensor, mask: Tensor, eps_low: float | None, eps_high: float) -> dict[str, Tensor]:
    with torch.no_grad():
        out = ratio > 1 + eps_high
        if eps_low is not None:
            out = out | (ratio < 1 - eps_low)
        return {"clip_frac": masked_mean(out.float(), mask), "ratio_mean": masked_mean(ratio, mask)}


# ---------------------------------------------------------------- policy losses


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    agg: Aggregation = "seq_mean_token_mean",
    max_len: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: Tensor | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)) per token, aggregated by `agg`.

    GRPO, Dr.GRPO and DAPO are this loss with different clips and aggregations. `old_logprobs` are
    the sampler's logprobs of the same tokens, so the ratio is 1 on the first on-policy minibatch.
    `dual_clip` c > 1 (dual-clip PPO): where A < 0 the token's loss is at most -A * c, a constant, so
    past it the token passes no gradient; `dual_clip_frac` is the share of tokens it bounds.
    """
    mask = mask.bool()
    lp = clean(mask, logprobs)
    ratio = torch.exp(log_ratio(lp, clean(mask, old_logprobs.to(lp.dtype))))
    adv = per_token_advantages(advantages, lp, mask)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    metrics = clip_metrics(ratio, mask, eps_low, eps_high)
    if dual_clip is not None:
        if not dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (a bound on the ratio), got {dual_clip}")
        bound = -adv * dual_clip
        bounded = (adv < 0) & (per_token > bound)
        per_token = torch.where(bounded, bound, per_token)
        with torch.no_grad():
            metrics["dual_clip_frac"] = masked_mean(bounded.float(), mask)
    return finish(per_token, lp, mask, agg, max_len, ref_logprobs, kl_coef, is_weights, metrics)


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


def sft_loss(logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the target tokens, averaged over all of them."""
    loss = -masked_mean(logprobs, mask.bool())
    return loss, {}



# ---------------------------------------------------------------- what every built-in loss reads


def batch_inputs(batch: TrainBatch) -> tuple[Tensor, Tensor, Tensor, dict[str, Any]]:
    """(old_logprobs, advantages, loss mask, {ref_logprobs, is_weights}) of a batch: what a policy loss reads
    (advantages per token where the batch has them, per sequence otherwise)."""
    adv = batch.per_token.get("advantages")
    if adv is None:
        adv = batch.per_seq["advantages"]
    extra = {"ref_logprobs": batch.per_token.get("ref_logprobs"), "is_weights": batch.per_token.get("is_weights")}
    return batch.per_token["old_logprobs"], adv, batch.loss_mask, extra
