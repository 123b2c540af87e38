"""CISPO (MiniMax-M1, 2025): the importance weight is clipped, never the gradient: -sg(clip(ratio, max=1 +
eps_high)) * A * logp per token (no lower bound by default, eps_high 0.28), token mean over the batch; so the rare
tokens PPO-clip would silence keep learning, with a bounded weight. The formula: `shared.cispo_loss`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from factory.core.algorithms.grpo import refuse_dual_clip
from factory.protocols.algorithm import AlgorithmDefaults, LossFn

if TYPE_CHECKING:
    from torch import Tensor

    from factory.config import AlgorithmSpec
    from factory.core.batch import TrainBatch


@dataclass(frozen=True)
class CISPO:
    """The `Algorithm`: `cispo_loss` with the section's clips; no dual clip (the weight is bounded already)."""

    name: str = "cispo"
    defaults: AlgorithmDefaults = AlgorithmDefaults(clip_eps_low=None, clip_eps_high=0.28, loss_agg="token_mean",
                                                    scale_rewards=True)

    def validate(self, spec: AlgorithmSpec) -> None:
        refuse_dual_clip(spec)

    def loss(self, spec: AlgorithmSpec, off_policy: bool) -> LossFn:
        from factory.core.algorithms.shared import batch_inputs, cispo_loss  # noqa: PLC0415 torch, for a run only

        eps_low, eps_high = spec.clip_bounds()
        agg, max_len, kl_coef = spec.aggregation(), spec.length_norm(), spec.kl_coef

        def loss_fn(logp: Tensor, batch: TrainBatch) -> tuple[Tensor, dict[str, Tensor]]:
            old, adv, mask, extra = batch_inputs(batch)
            return cispo_loss(logp, old, adv, mask, eps_high=eps_high, eps_low=eps_low, agg=agg, max_len=max_len,
                              kl_coef=kl_coef, **extra)

        return loss_fn


ALGORITHM = CISPO()
