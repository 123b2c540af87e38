"""GSPO (Zheng et al. 2025): PPO-clip on the length-normalized sequence ratio s = exp(mean_t(logp - old)), clipped
with tiny bounds [1 - 3e-4, 1 + 4e-4], per-sequence token mean: a whole response is in or out of the clip. The
formula: `shared.gspo_loss`."""

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
class GSPO:
    """The `Algorithm`: `gspo_loss` with the section's (sequence-level) clips; no dual clip."""

    name: str = "gspo"
    defaults: AlgorithmDefaults = AlgorithmDefaults(clip_eps_low=3e-4, clip_eps_high=4e-4,
                                                    loss_agg="seq_mean_token_mean", scale_rewards=True)

    def validate(self, spec: AlgorithmSpec) -> None:
        refuse_dual_clip(spec)

    def loss(self, spec: AlgorithmSpec, off_policy: bool) -> LossFn:
        from factory.core.algorithms.shared import batch_inputs, gspo_loss  # noqa: PLC0415 torch, for a run only

        eps_low, eps_high = spec.clip_bounds()
        assert eps_low is not None, "gspo needs a lower clip"
        agg, max_len, kl_coef = spec.aggregation(), spec.length_norm(), spec.kl_coef

        def loss_fn(logp: Tensor, batch: TrainBatch) -> tuple[Tensor, dict[str, Tensor]]:
            old, adv, mask, extra = batch_inputs(batch)
            return gspo_loss(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, agg=agg, max_len=max_len,
                             kl_coef=kl_coef, **extra)

        return loss_fn


ALGORITHM = GSPO()
