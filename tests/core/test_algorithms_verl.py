"""The five policy losses against verl's formulas at extreme log-ratios: values, gradients and the dual clip.

The reference is verl's policy losses restated as plain torch in `tests/core/verl_reference.py` (which file, function
and commit it transcribes, there):

- vanilla (GRPO, Dr.GRPO, DAPO): log-ratio clamped to [-20, 20], PPO clip, then for A < 0 the dual clip
  min(-A * clip_ratio_c, .); verl always applies it (default 3.0), so "off" is clip_ratio_c = +inf here;
- gspo: token-form log-ratio sg(seq mean) + logp - sg(logp), clamped above at 10 (no lower clamp), PPO clip,
  always aggregated seq-mean-token-mean;
- cispo: log-ratio clamped to [-20, 20], weight sg(clip(ratio, 1 - low, 1 + high)), loss -w * A * logp
  (factory's "no lower bound" is verl's clip_ratio_low = 1, a clamp at 0 that never binds).

A torch.clamp passes no gradient where it binds, so in verl a clamped ratio passes none; factory must match:
values within 1e-6 relative, gradients within 1e-6 relative and exactly zero wherever verl's are.
"""

import math

import pytest
import torch

from factory.config import AlgorithmSpec, SpecError, parse_spec
from factory.core.algorithms import gspo_loss, make_loss
from factory.core.batch import TrainBatch
from tests.core.verl_reference import verl_loss

torch.set_num_threads(1)


# ---------------------------------------------------------------- the comparison


ALGORITHMS = ["grpo", "dr_grpo", "dapo", "cispo", "gspo"]
T = 3


def batch_of(logp: torch.Tensor, old, adv, mask, **per_token) -> TrainBatch:
    b, t = logp.shape
    return TrainBatch(torch.zeros(b, t + 1, dtype=torch.long), torch.ones(b, t + 1, dtype=torch.long), mask,
                      {"old_logprobs": old, **per_token}, {"advantages": adv})


def extreme_batch(d: float, sign: float, dtype: torch.dtype, seed: int = 0):
    """Four sequences of T tokens: row 0 off-policy by `d` nats on every token (a whole far-off sequence),
    row 1 on one token only, rows 2-3 ordinary; row 3's last token is padding (finite garbage)."""
    g = torch.Generator().manual_seed(seed)
    old = -0.2 - torch.rand(4, T, generator=g)
    shift = 0.05 * torch.randn(4, T, generator=g)
    shift[0] = d
    shift[1, 1] = d
    logp = old + shift
    ref = old + 0.1 * torch.randn(4, T, generator=g)
    mask = torch.ones(4, T, dtype=torch.bool)
    mask[3, -1] = False
    adv = torch.tensor([sign, -sign, 0.7, -1.3])
    is_w = 0.5 + torch.rand(4, T, generator=g)
    return tuple(x if x.dtype == torch.bool else x.to(dtype) for x in (logp, old, ref, mask, adv, is_w))


def assert_matches_verl(ours: torch.Tensor, verl: torch.Tensor, what: str) -> None:
    """Within 1e-6 relative, and exactly zero wherever verl's value is zero."""
    zero = verl == 0
    assert (ours[zero] == 0).all(), f"{what}: verl has exact zeros at {zero.nonzero().tolist()}, ours {ours[zero]}"
    torch.testing.assert_close(ours, verl, rtol=1e-6, atol=0, msg=lambda m: f"{what}: {m}")


def run_both(name: str, d: float, sign: float, dual_clip: float | None, kl_coef: float, weighted: bool,
             dtype: torch.dtype = torch.float64):
    # float64 by default: the comparison is of formulas, and float32 rounding of a loss that is a near-cancelling
    # sum of O(1) terms (0.0098 from terms of 1) is already ~1e-6 relative of it, whoever computes it.
    logp, old, ref, mask, adv, is_w = extreme_batch(d, sign, dtype)
    extra = {"is_weights": is_w} if weighted else {}
    clip = {} if dual_clip is None else {"dual_clip": dual_clip}  # the spec's default when None
    spec = AlgorithmSpec(name=name, kl_coef=kl_coef, **clip)
    ours_in = logp.clone().requires_grad_()
    ours, _ = make_loss(spec.for_rollout(T))(ours_in, batch_of(ours_in, old, adv, mask, ref_logprobs=ref, **extra))
    (g_ours,) = torch.autograd.grad(ours, ours_in)
    verl_in = logp.clone().requires_grad_()
    verl = verl_loss(name, old, verl_in, adv, mask, ref, kl_coef, is_w if weighted else None, dual_clip, T)
    (g_verl,) = torch.autograd.grad(verl, verl_in)
    return ours, verl, g_ours * mask, g_verl * mask


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("d", [50.0, -50.0, 1e3, -1e3, 0.0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_values_and_gradients_equal_verls_at_extreme_log_ratios(name, d, sign):
    ours, verl, g_ours, g_verl = run_both(name, d, sign, dual_clip=None, kl_coef=0.0, weighted=False)
    assert torch.isfinite(ours) and torch.isfinite(g_ours).all()
    assert_matches_verl(ours.detach(), verl.detach(), f"{name} loss")
    assert_matches_verl(g_ours, g_verl, f"{name} gradient")


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("d", [50.0, -1e3])
def test_with_kl_and_importance_weights_still_verls(name, d):
    ours, verl, g_ours, g_verl = run_both(name, d, -1.0, dual_clip=None, kl_coef=0.1, weighted=True)
    assert_matches_verl(ours.detach(), verl.detach(), f"{name} loss")
    assert_matches_verl(g_ours, g_verl, f"{name} gradient")


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("d", [50.0, -50.0, 1e3, 2.0, 0.0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_dual_clip_equals_verls(name, d, sign):
    ours, verl, g_ours, g_verl = run_both(name, d, sign, dual_clip=3.0, kl_coef=0.0, weighted=True)
    assert_matches_verl(ours.detach(), verl.detach(), f"{name} loss")
    assert_matches_verl(g_ours, g_verl, f"{name} gradient")


# ---------------------------------------------------------------- clamped means no gradient, case by case


def test_gspo_clamped_sequence_with_negative_advantage_passes_no_gradient():
    # One sequence of 4 tokens, 50 nats off-policy on each: its ratio is clamped. With A < 0 the unclipped
    # branch -A * s is the max, and before the fix its gradient was e^20 / 4 = 1.2e8 per token.
    old = torch.full((1, 4), -60.0)
    logp = torch.full((1, 4), -10.0, requires_grad=True)
    loss, _ = gspo_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 4, dtype=torch.bool))
    loss.backward()
    assert torch.isfinite(loss)
    assert logp.grad.abs().max().item() == 0.0, logp.grad


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo"])
@pytest.mark.parametrize("d", [50.0, 1e3])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_clamped_ratio_passes_no_gradient(name, d, sign):
    # Row 0 is off-policy by d on every token: its (token or sequence) ratio is clamped, whatever A's sign.
    _, _, g_ours, _ = run_both(name, d, sign, dual_clip=None, kl_coef=0.0, weighted=False, dtype=torch.float32)
    assert g_ours[0].abs().max().item() == 0.0, g_ours[0]
    assert g_ours[2].abs().sum().item() > 0  # the ordinary rows still learn


@pytest.mark.parametrize("d", [50.0, -50.0, 1e3, -1e3])
def test_cispo_clamped_token_keeps_its_clipped_weight_gradient_as_verl(d):
    # CISPO's ratio is a detached weight: the clamp never sits on the gradient path, and the weight is clipped to
    # at most 1 + eps_high, so a far-off token learns like any clipped token, -w * A, bounded (verl does the same).
    _, _, g_ours, g_verl = run_both("cispo", d, -1.0, dual_clip=None, kl_coef=0.0, weighted=False)
    n_tokens = 4 * T - 1
    w = 1.28 if d > 0 else math.exp(-20.0)
    assert g_ours[0].tolist() == pytest.approx([w / n_tokens] * T, rel=1e-6)  # -w * A / tokens, A = -1
    assert_matches_verl(g_ours, g_verl, "cispo gradient")


# ---------------------------------------------------------------- the dual clip: behaviour and spec


def test_dual_clip_bounds_negative_advantage_loss_and_stops_its_gradient():
    # ratio e^2 = 7.39 > c = 3 with A = -1: the loss is -A * c = 3, constant, so no gradient; A > 0 is untouched.
    old = torch.zeros(2, 1)
    logp = torch.full((2, 1), 2.0, requires_grad=True)
    mask = torch.ones(2, 1, dtype=torch.bool)
    adv = torch.tensor([-1.0, 1.0])
    off, _ = make_loss(AlgorithmSpec())(logp, batch_of(logp, old, adv, mask))
    (g_off,) = torch.autograd.grad(off, logp)
    on, m = make_loss(AlgorithmSpec(dual_clip=3.0))(logp, batch_of(logp, old, adv, mask))
    (g_on,) = torch.autograd.grad(on, logp)
    assert off.item() == pytest.approx((math.exp(2) - 1.2) / 2)
    assert on.item() == pytest.approx((3.0 - 1.2) / 2)
    assert g_off[0].item() == pytest.approx(math.exp(2) / 2) and g_on[0].item() == 0.0
    assert g_on[1].item() == g_off[1].item() == 0.0  # A > 0 beyond 1 + eps: clipped either way
    assert m["dual_clip_frac"] == pytest.approx(0.5)


def test_dual_clip_is_a_late_field_off_by_default():
    spec = parse_spec({})
    assert spec.algorithm.dual_clip is None
    assert "dual_clip" not in spec.algorithm.model_dump()  # older specs' dumps and fingerprints unchanged
    on = parse_spec({"algorithm": {"dual_clip": 3.0}})
    assert on.algorithm.model_dump()["dual_clip"] == 3.0


@pytest.mark.parametrize("algorithm,match", [
    ({"dual_clip": 1.0}, "algorithm.dual_clip"),
    ({"dual_clip": 0.5}, "algorithm.dual_clip: must be > 1"),
    ({"name": "gspo", "dual_clip": 3.0}, "algorithm.dual_clip: .*grpo, dr_grpo, dapo.*gspo"),
    ({"name": "cispo", "dual_clip": 3.0}, "algorithm.dual_clip: .*cispo"),
])
def test_dual_clip_errors_name_the_field(algorithm, match):
    with pytest.raises(SpecError, match=match):
        parse_spec({"algorithm": algorithm})


# ---------------------------------------------------------------- GRPO advantages, verl's estimator in float64


def verl_grpo_advantages(scores: torch.Tensor, index: list[int], norm_by_std: bool = True,
                         epsilon: float = 1e-6) -> torch.Tensor:
    """verl's `compute_grpo_outcome_advantage` (core_algos.py at the commit above), per sequence: each score minus its
    group's mean, divided by the group's std (torch.std, unbiased) + epsilon; a group of one gets mean 0, std 1."""
    scores = scores.clone()
    groups: dict[int, list[torch.Tensor]] = {}
    for i, idx in enumerate(index):
        groups.setdefault(idx, []).append(scores[i])
    mean, std = {}, {}
    for idx, members in groups.items():
        if len(members) == 1:
            mean[idx], std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(members)
            mean[idx], std[idx] = torch.mean(stacked), torch.std(stacked)
    for i, idx in enumerate(index):
        scores[i] = (scores[i] - mean[idx]) / (std[idx] + epsilon) if norm_by_std else scores[i] - mean[idx]
    return scores


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_of_float64_rewards_equal_verls_in_float64(scale):
    from factory.core.algorithms import group_advantages

    g = torch.Generator().manual_seed(0)
    # fractional rewards (a code reward is tests passed / tests): not exact in float32
    rewards = torch.randint(0, 7, (6 * 8,), generator=g).double() / 7 + 1e-9 * torch.rand(48, generator=g).double()
    ours = group_advantages(rewards, 8, scale=scale)
    want = verl_grpo_advantages(rewards, [i // 8 for i in range(48)], norm_by_std=scale)
    assert ours.dtype == torch.float64
    assert (ours - want).abs().max().item() <= 1e-12  # float32 arithmetic was 1e-7 off
    # float32 rewards keep float32 advantages (the rewards' precision), integer rewards get float64 (exact)
    assert group_advantages(rewards.float(), 8).dtype == torch.float32
    assert group_advantages(torch.tensor([1, 0, 0, 1]), 2).dtype == torch.float64


def test_dapo_overlong_shaping_keeps_the_rewards_precision():
    from factory.core.algorithms import compute_advantages, overlong_reward

    spec = AlgorithmSpec(name="dapo", group_size=4)
    rewards = torch.tensor([1.0, 0.0, 1.0 / 3, 2.0 / 3], dtype=torch.float64)
    lengths = torch.tensor([4, 7, 8, 2])
    adv = compute_advantages(spec.for_rollout(8), rewards, 4, lengths)
    shaped = rewards + overlong_reward(lengths, 8, 1, dtype=torch.float64)  # L_max 8, L_cache max(1, 8 // 5)
    assert adv.dtype == torch.float64
    assert (adv - verl_grpo_advantages(shaped, [0, 0, 0, 0])).abs().max().item() <= 1e-12
