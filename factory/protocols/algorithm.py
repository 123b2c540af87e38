"""The `Algorithm` extension point: an RL objective (its defaults, its validation of the `algorithm` section, its
policy loss and, where it differs from the group-relative default, its advantages) and `ALGORITHMS`, the registry
`algorithm.name` is looked up in. The five built-ins are one module each under factory/core/algorithms/;
docs/extending.md walks through adding one (tests/extending/test_algorithm.py runs it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from factory.protocols.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

    from factory.config import AlgorithmSpec
    from factory.core.batch import TrainBatch

# `(logp [B, T], batch) -> (loss, metrics)`: what the trainer applies each minibatch; metrics are 0-dim tensors,
# detached (the trainer reads them on the host once per step and they land in the step's metrics).
LossFn = Callable[["Tensor", "TrainBatch"], tuple["Tensor", dict[str, "Tensor"]]]

Aggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]


@dataclass(frozen=True)
class AlgorithmDefaults:
    """What the `algorithm` section's unset (None) fields mean for one algorithm: its published defaults.

    `clip_eps_low` / `clip_eps_high`: a number, "clip_eps" (the section's symmetric `clip_eps`), or (low only) None
    for no lower bound. `loss_agg` is also what a multi-rank trainer weighs its gradient by. `overlong`: DAPO's soft
    overlong shaping of rewards. `auto_dual_clip`: a PPO-clip loss, whose dual clip (`algorithm.dual_clip`) is on
    by default where staleness or a sampler/trainer gap can occur."""

    clip_eps_low: float | Literal["clip_eps"] | None = "clip_eps"
    clip_eps_high: float | Literal["clip_eps"] = "clip_eps"
    loss_agg: Aggregation = "seq_mean_token_mean"
    scale_rewards: bool = True
    dynamic_sampling: bool = False
    overlong: bool = False
    auto_dual_clip: bool = False


@runtime_checkable
class Algorithm(Protocol):
    """An RL objective. Required: `name`, `defaults`, `loss`. Optional, looked up with getattr:

    - `validate(spec: AlgorithmSpec) -> None`: refuse settings this algorithm cannot take, with a ValueError whose
      message starts with the field, e.g. "algorithm.scale_rewards: ..." (run when the spec is validated);
    - `advantages(spec: AlgorithmSpec, rewards: Tensor, group_size: int, lengths: Tensor) -> Tensor`: per-sequence
      advantages [N * group_size] from the task rewards (groups contiguous) and the completions' token counts;
      without it, group-relative advantages (std-scaled per `defaults.scale_rewards`, DAPO's overlong shaping per
      `defaults.overlong`).

    `loss(spec, off_policy)` is called once per run, on the validated section (`spec.clip_bounds()`,
    `spec.aggregation()`, `spec.length_norm()`, `spec.resolved_dual_clip(off_policy)` read its settings with the
    defaults applied); `off_policy` says staleness or a sampler/trainer gap can occur in this run. The function it
    returns reads `batch.per_token["old_logprobs"]`, `batch.per_seq["advantages"]` (or per-token
    `batch.per_token["advantages"]`), `batch.loss_mask`, and the optional `batch.per_token["ref_logprobs"]` (KL)
    and `batch.per_token["is_weights"]` (importance weights of stale samples, to scale the policy-gradient term).
    Its metrics (0-dim tensors, detached) must hold `clip_frac`, which every step records (0 for a loss that clips
    nothing); `kl` where it computes one; other keys are free."""

    name: str
    defaults: AlgorithmDefaults

    def loss(self, spec: AlgorithmSpec, off_policy: bool) -> LossFn: ...


def _check(name: str, obj: object) -> Algorithm:
    """An object named as an algorithm must have what the spec and the loop ask of it: said when it is named."""
    if isinstance(obj, type):
        raise ValueError(f"algorithm.name {name!r}: {obj.__qualname__} is a class; register an instance of it")
    missing = [a for a in ("name", "defaults", "loss") if not hasattr(obj, a)]
    if missing:
        raise ValueError(f"algorithm.name {name!r}: {obj!r} is not an Algorithm (no {', '.join(missing)}); see "
                         "factory.protocols.Algorithm")
    if not isinstance(obj.defaults, AlgorithmDefaults):  # type: ignore[attr-defined]
        raise ValueError(f"algorithm.name {name!r}: its defaults must be a factory.protocols.AlgorithmDefaults, got "
                         f"{type(obj.defaults).__name__}")  # type: ignore[attr-defined]
    for method in ("loss", "validate", "advantages"):
        if hasattr(obj, method) and not callable(getattr(obj, method)):
            raise ValueError(f"algorithm.name {name!r}: its {method} must be callable")
    return obj  # type: ignore[return-value]


ALGORITHMS: Registry[Algorithm] = Registry(
    "algorithm", "algorithm.name",
    {name: f"factory.core.algorithms.{name}:ALGORITHM" for name in ("grpo", "dr_grpo", "dapo", "cispo", "gspo")},
    group="factory.algorithms", check=_check)
