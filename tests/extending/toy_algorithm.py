"""A toy RL objective defined outside factory/: REINFORCE with a leave-one-out baseline (RLOO, Ahmadian et al.
2024), the worked example of docs/extending.md ("Adding an algorithm"). It uses only the public API
(`factory.protocols`) and torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from factory.protocols import AlgorithmDefaults, LossFn

if TYPE_CHECKING:
    from factory.config import AlgorithmSpec
    from factory.core.batch import TrainBatch


@dataclass
class RLOO:
    """loss = -A * logp per token, averaged over every token of the batch, with A = reward - the mean reward of the
    other completions of its group."""

    name: str = "rloo"
    # The meaning of the section's unset fields for this algorithm: token-mean aggregation (the trainer weighs
    # gradients across ranks by it), advantages not divided by the group std.
    defaults: AlgorithmDefaults = AlgorithmDefaults(loss_agg="token_mean", scale_rewards=False)
    losses: list[Tensor] = field(default_factory=list)  # every loss it returned (the test checks the run used them)

    def validate(self, spec: AlgorithmSpec) -> None:
        """Settings it cannot honour are refused when the spec is validated, naming the field."""
        if spec.kl_coef > 0:
            raise ValueError("algorithm.kl_coef: rloo has no KL term; leave it 0")

    def advantages(self, spec: AlgorithmSpec, rewards: Tensor, group_size: int, lengths: Tensor) -> Tensor:
        """Optional: without it the run takes GRPO's group-relative advantages (std-scaled per `defaults`)."""
        r = rewards.view(-1, group_size).to(torch.float64)
        others_mean = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
        return (r - others_mean).reshape(-1)

    def loss(self, spec: AlgorithmSpec, off_policy: bool) -> LossFn:
        def loss_fn(logp: Tensor, batch: TrainBatch) -> tuple[Tensor, dict[str, Tensor]]:
            mask = batch.loss_mask.bool()
            lp = torch.where(mask, logp, torch.zeros_like(logp))  # masked positions may hold anything, even NaN
            adv = batch.per_seq["advantages"].to(lp.dtype).unsqueeze(-1).expand_as(lp)
            per_token = -adv * lp
            if (w := batch.per_token.get("is_weights")) is not None:  # stale samples' importance weights
                per_token = per_token * torch.where(mask, w.to(lp.dtype), torch.ones_like(lp))
            loss = torch.where(mask, per_token, torch.zeros_like(lp)).sum() / mask.sum().clamp(min=1)
            self.losses.append(loss.detach())
            # Every loss reports clip_frac (each step records it); this one clips nothing.
            return loss, {"clip_frac": torch.zeros((), dtype=lp.dtype),
                          "rloo_adv_abs": ((adv.abs() * mask).sum() / mask.sum().clamp(min=1)).detach()}

        return loss_fn


ALGORITHM = RLOO()
