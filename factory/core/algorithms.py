"""Advantages and policy losses as pure functions over tensors.

Shapes: `logprobs`, `old_logprobs`, `ref_logprobs`, `mask` are [B, T] over target tokens (mask is
True on tokens the policy produced and should learn from); `advantages` is [B] per sequence or
[B, T] per token. Masked positions may hold any value, even inf/NaN: they never reach the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's std when `scale`.

    `rewards` is [N * group_size], groups contiguous. A group whose rewards are all equal gets
    zero advantage (no NaN), so it contributes no gradient.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.view(-1, group_size).float()
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` where `mask`; positions outside the mask are ignored even if non-finite."""
    m = mask.to(x.dtype)
    x = torch.where(mask, x, torch.zeros_like(x))
    if dim is None:
        return x.sum() / m.sum().clamp(min=1)
    return x.sum(dim) / m.sum(dim).clamp(min=1)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(r - p) - (r - p) - 1 >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO's clipped surrogate, token-level, averaged per sequence then over sequences.

    `old_logprobs` are the sampler's logprobs of the same tokens, so the ratio is 1 when the
    trainer's weights equal the sampler's and the first minibatch is exactly on-policy.
    """
    mask = mask.bool()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    adv = adv.to(logprobs.dtype)
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    per_token = torch.maximum(-adv * ratio, -adv * clipped)
    kl = None
    if ref_logprobs is not None and kl_coef > 0:
        safe_ref = torch.where(mask, ref_logprobs, logprobs.detach())
        kl = kl_k3(logprobs, safe_ref)
        per_token = per_token + kl_coef * kl
    loss = masked_mean(masked_mean(per_token, mask, dim=-1), mask.any(dim=-1))
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(((ratio - 1).abs() > clip_eps).float(), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "kl": masked_mean(kl, mask).item() if kl is not None else 0.0,
        }
    return loss, metrics


def sft_loss(logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Negative log-likelihood of the target tokens, averaged over all of them."""
    loss = -masked_mean(logprobs, mask.bool())
    return loss, {}
