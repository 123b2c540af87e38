"""Advantages and policy losses as pure functions over tensors: GRPO, Dr.GRPO, DAPO, CISPO, GSPO, one module each
(`grpo`, `dr_grpo`, `dapo`, `cispo`, `gspo`: each an `Algorithm`, factory/protocols/algorithm.py, registered in
`ALGORITHMS` by name, instances of the classes in `base`), the maths in `shared`, the spec -> loss and advantages in
`select`. Every name this module had as one file is importable from here, imported on first use: the algorithm
modules are torch-free at import (the spec's validation reads them), `shared` and `select` import torch.

Shapes: `logprobs`, `old_logprobs`, `ref_logprobs`, `is_weights`, `mask` are [B, T] over target tokens
(mask is True on tokens the policy produced and should learn from); `advantages` is [B] per sequence
or [B, T] per token. Masked positions may hold any value, even inf/NaN: they never reach the loss
or its gradient.

`make_loss(spec)` turns an `AlgorithmSpec` into the `(logp, TrainBatch) -> (loss, metrics)` function the
trainer applies (the named algorithm's `loss`), so the trainer never knows which algorithm it runs.
`compute_advantages(spec, ...)` is the matching advantage estimator (with DAPO's overlong shaping), and
`keep_informative_groups` is DAPO's dynamic-sampling filter; the loop refills the batch with it. The length
constants (Dr.GRPO's divisor, DAPO's L_max) default to the rollout's max_new_tokens, resolved once when the spec
is validated (`AlgorithmSpec.length_norm`, `AlgorithmSpec.overlong`).

Every policy loss below is `-A * f(ratio)` per token, then an aggregation over tokens:
- grpo:    PPO clip, ratio in [1 - eps, 1 + eps], per-sequence token mean, then mean over sequences.
- dr_grpo: the same clip; each sequence's token *sum* is divided by a constant max length (no 1/|o|
           length bias, Liu et al. 2025), and advantages are not divided by the group std.
- dapo:    PPO clip with eps_high > eps_low ("clip-higher"), mean over all tokens of the batch.
- cispo:   -sg(clip(ratio, max=1 + eps_high)) * A * logp: the IS weight is clipped, never the gradient,
           so tokens beyond the clip still learn (unlike PPO-clip, which zeroes them); token mean.
- gspo:    a sequence-level ratio s = exp(mean_t(logp - old)), clipped with tiny eps, in the token form
           s_t = sg(s) * exp(logp - sg(logp)) (same value and gradient as the sequence form).

Numerics, as verl does them (verl/trainer/ppo/core_algos.py): every token log-ratio logp - old is clamped to
+-LOG_RATIO_BOUND before exp; GSPO's token-form log-ratio sg(sequence mean) + logp - sg(logp) is clamped
above at GSPO_LOG_RATIO_MAX (below it needs none: exp of a very negative number is 0, finite); the k3 KL
estimate is clamped to +-KL_BOUND after clamping its own log-ratio. So one token on which the sampler and the
policy (or the reference) disagree by thousands of nats gives a finite loss and finite gradients instead of
inf/NaN for the whole batch. Each clamp sits on the gradient path, and a clamp that binds passes no gradient:
in grpo, dr_grpo, dapo a token whose ratio is clamped, in gspo a sequence whose ratio is clamped, contributes
none, so one far-off-policy token or sequence cannot steer the update. CISPO's ratio is a detached weight,
clipped to at most 1 + eps_high: a clamped token learns with that bounded weight like any clipped token (that
is CISPO's point, and verl's CISPO does the same). The optional dual clip (`AlgorithmSpec.dual_clip`, verl's
clip_ratio_c) bounds a PPO-clip token's loss by -A * c where A < 0, so a negative-advantage token far above
its clip adds at most c * |A| and no gradient. The KL penalty is added after the importance weights of
stale samples: they scale the policy-gradient term only (verl's rollout_is_weights multiply pg_losses; its
kl_loss is aggregated unweighted). The weights correct the policy gradient's estimate for samples drawn by
older weights; the KL term is a regularizer of the current policy towards the reference, evaluated on
whatever tokens the batch holds, and weighting it would let a stale row's truncated weight (up to is_cap)
scale how hard that row is pulled to the reference.
"""


import importlib
from typing import TYPE_CHECKING

from factory.protocols.algorithm import LossFn

_SHARED = ("GSPO_LOG_RATIO_MAX", "KL_BOUND", "LOG_RATIO_BOUND", "Aggregation", "aggregate", "cispo_loss",
           "group_advantages", "grpo_loss", "gspo_loss", "keep_informative_groups", "kl_k3", "log_ratio", "masked_mean",
           "overlong_reward", "ppo_clip_loss", "reward_dtype", "sft_loss")
_WHERE = {**dict.fromkeys(_SHARED, "shared"), "make_loss": "select", "compute_advantages": "select"}

__all__ = ["GSPO_LOG_RATIO_MAX", "KL_BOUND", "LOG_RATIO_BOUND", "Aggregation", "LossFn", "aggregate", "cispo_loss",
           "compute_advantages", "group_advantages", "grpo_loss", "gspo_loss", "keep_informative_groups", "kl_k3",
           "log_ratio", "make_loss", "masked_mean", "overlong_reward", "ppo_clip_loss", "reward_dtype", "sft_loss"]

if TYPE_CHECKING:
    from factory.core.algorithms.select import compute_advantages, make_loss
    from factory.core.algorithms.shared import (
        GSPO_LOG_RATIO_MAX,
        KL_BOUND,
        LOG_RATIO_BOUND,
        Aggregation,
        aggregate,
        cispo_loss,
        group_advantages,
        grpo_loss,
        gspo_loss,
        keep_informative_groups,
        kl_k3,
        log_ratio,
        masked_mean,
        overlong_reward,
        ppo_clip_loss,
        reward_dtype,
        sft_loss,
    )


def __getattr__(name: str) -> object:
    # PEP 562: the maths (torch) is imported when a name of it is first asked for, not with the package.
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
