"""The `Algorithm` classes the built-ins are instances of, torch-free at import: the spec's validation reads the
built-ins' defaults and `validate` (`factory validate`, the Dagster resources and the eval client run without
torch); the maths (`shared.py`) is imported when a run builds its loss.

- `PPOClip`: `ppo_clip_loss` with the section's clips, aggregation, length divisor, KL coefficient and dual clip
  (grpo, dr_grpo and dapo differ only in their defaults, and dr_grpo in its validation);
- `RatioClip`: a loss of `shared.py` that clips the ratio its own way (cispo_loss, gspo_loss), with the section's
  clips, aggregation, length divisor and KL coefficient, and no dual clip."""

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
    """An `Algorithm` whose loss is PPO's clipped surrogate (`shared.ppo_clip_loss`)."""

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


@dataclass(frozen=True)
class RatioClip:
    """An `Algorithm` whose loss is the function `formula` of shared.py, called as
    `formula(logp, old, adv, mask, eps_low=, eps_high=, agg=, max_len=, kl_coef=, ref_logprobs=, is_weights=)`."""

    name: str
    defaults: AlgorithmDefaults
    formula: str

    def validate(self, spec: AlgorithmSpec) -> None:
        if spec.dual_clip not in (None, "off"):  # it bounds PPO-clip's surrogate only
            raise ValueError(f"algorithm.dual_clip: the dual clip bounds the PPO-clip losses (grpo, dr_grpo, dapo), "
                             f"not {spec.name}; leave it unset")

    def loss(self, spec: AlgorithmSpec, off_policy: bool) -> LossFn:
        from factory.core.algorithms import shared  # noqa: PLC0415 torch, for a run only

        formula = getattr(shared, self.formula)
        eps_low, eps_high = spec.clip_bounds()
        agg, max_len, kl_coef = spec.aggregation(), spec.length_norm(), spec.kl_coef

        def loss_fn(logp: Tensor, batch: TrainBatch) -> tuple[Tensor, dict[str, Tensor]]:
            old, adv, mask, extra = shared.batch_inputs(batch)
            return formula(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, agg=agg, max_len=max_len,
                           kl_coef=kl_coef, **extra)

        return loss_fn
