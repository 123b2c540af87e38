"""The spec's algorithm, looked up in `ALGORITHMS`: its loss (`make_loss`) and its advantages
(`compute_advantages`). Neither knows which algorithm it runs: no branch on a name."""

from __future__ import annotations

from torch import Tensor

from factory.config import AlgorithmSpec
from factory.core.algorithms.shared import shaped_group_advantages
from factory.protocols.algorithm import ALGORITHMS, LossFn


def make_loss(spec: AlgorithmSpec, off_policy: bool = False) -> LossFn:
    """The trainer's loss function for `spec`: `(logp [B, T], batch) -> (loss, metrics)`, the named algorithm's
    (`Algorithm.loss`, which documents what it reads from the batch).

    Dr.GRPO's constant divisor is `spec.length_norm()`: `max_len_norm`, else the rollout's max_new_tokens as the
    ExperimentSpec's validation resolved it (a bare section: `AlgorithmSpec.for_rollout`). `off_policy`: staleness or
    a sampler/trainer gap can occur in this run (it resolves the dual clip's default:
    `AlgorithmSpec.resolved_dual_clip`).
    """
    if spec.aggregation() == "seq_mean_token_sum_norm" and spec.length_norm() is None:
        raise ValueError(f"algorithm.max_len_norm: {spec.name} normalizes by a constant length; set it, or validate "
                         "the section within a spec (it takes rollout.max_new_tokens)")
    return ALGORITHMS.get(spec.name).loss(spec, off_policy)


def compute_advantages(spec: AlgorithmSpec, rewards: Tensor, group_size: int, lengths: Tensor | None = None) -> Tensor:
    """Per-sequence advantages [N * group_size] for `spec`'s algorithm: its own `advantages` where it has one, else
    the group-relative default (`shared.shaped_group_advantages`: DAPO's overlong shaping where enabled, then the
    group mean subtracted and, unless the algorithm or `scale_rewards` says not to, the group std divided)."""
    own = getattr(ALGORITHMS.get(spec.name), "advantages", None)
    if own is not None:
        if lengths is None:
            raise ValueError(f"algorithm {spec.name!r} computes its own advantages: pass the completion lengths")
        return own(spec, rewards, group_size, lengths)
    return shaped_group_advantages(spec, rewards, group_size, lengths)
