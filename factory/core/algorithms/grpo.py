"""GRPO (Shao et al. 2024, DeepSeekMath): PPO's clipped surrogate with a symmetric clip `clip_eps`, averaged over
each sequence's tokens then over sequences, on advantages that are each reward minus its group's mean, divided by
the group's std. `PPOClip` is the family: dr_grpo and dapo are the same loss with other defaults.

Torch-free at import, as every algorithm module here: the spec's validation reads `ALGORITHM`'s defaults and
`validate` (`factory validate`, the Dagster resources and the eval client run without torch); the maths
(`shared.py`) is imported when a run builds its loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from factory.protocols.algorithm import AlgorithmDefaults, LossFn

if TYPE_CHECKING:
    from torch import Tensor

    from factory.config import AlgorithmSpec
    from factory.core.batch import TrainBatch


@dataclass(frozen=True)
class PPOClip:
    """An `Algorithm` whose loss is `ppo_clip_loss` with the section's clips, aggregation, length divisor, KL
    coefficient and dual clip: grpo, dr_grpo and dapo differ only in their defaults (and dr_grpo's validation)."""

    name: str
    defaults: AlgorithmDefaults

    def loss(self, spec: AlgorithmSpec, off_policy: bool) -> LossFn:
        from factory.core.algorithms.shared import batch_inputs, ppo_clip_loss  # noqa: PLC0415 torch, for a run only

        eps_low, eps_high = spec.clip_bounds()
        assert eps_low is not None, f"{self.name} needs a lower clip"
        agg, max_len, kl_coef = spec.aggregation(), spec.length_norm(), spec.kl_coef
        dual_clip = spec.resolved_dual_clip(off_policy)

        def loss_fn(logp: Tensor, batch: TrainBatch) -> tuple[Tensor, dict[str, Tensor]]:
            old, adv, mask, extra = batch_inputs(batch)
            return ppo_clip_loss(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
                                 agg=agg, max_len=max_len, kl_coef=kl_coef, **extra)

        return loss_fn


def refuse_dual_clip(spec: AlgorithmSpec) -> None:
    """The `validate` of a loss that is not PPO-clip: the dual clip bounds PPO-clip's surrogate only."""
    if spec.dual_clip not in (None, "off"):
        raise ValueError(f"algorithm.dual_clip: the dual clip bounds the PPO-clip losses (grpo, dr_grpo, dapo), "
                         f"not {spec.name}; leave it unset")


ALGORITHM = PPOClip("grpo", AlgorithmDefaults(clip_eps_low="clip_eps", clip_eps_high="clip_eps",
                                              loss_agg="seq_mean_token_mean", scale_rewards=True, auto_dual_clip=True))
