"""Advantages and losses against hand-computed values."""

import math

import pytest
import torch

from factory.config import AlgorithmSpec, SpecError, apply_overrides, parse_spec
from factory.core.algorithms import (
    compute_advantages,
    group_advantages,
    grpo_loss,
    gspo_loss,
    keep_informative_groups,
    kl_k3,
    make_loss,
    masked_mean,
    overlong_reward,
    sft_loss,
)
from factory.core.batch import TrainBatch


def test_group_advantages_hand_computed():
    # mean 0.25; deviations .75, -.25 x3; unbiased std sqrt(0.75 / 3) = 0.5
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)


def test_group_advantages_identical_rewards_are_zero_not_nan():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), group_size=3)
    assert torch.equal(adv, torch.zeros(6))


def test_group_advantages_groups_are_independent_and_unscaled_option():
    adv = group_advantages(torch.tensor([2.0, 0.0, 5.0, 5.0]), group_size=2, scale=False)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.ones(4), group_size=3)


def test_on_policy_loss_is_minus_mean_advantage():
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.25]]))
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, m = grpo_loss(logp, logp.clone(), torch.tensor([1.5, -0.5]), mask)
    assert loss.item() == pytest.approx(-0.5)
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)


def test_clipping_hand_computed():
    old = torch.zeros(2, 1)
    new = torch.full((2, 1), math.log(1.5), requires_grad=True)  # ratio 1.5 for both tokens
    mask = torch.ones(2, 1, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    loss, m = grpo_loss(new, old, adv, mask, clip_eps=0.2)
    # A=+1: max(-1.5, -1.2) = -1.2 (clipped); A=-1: max(1.5, 1.2) = 1.5 (unclipped)
    assert loss.item() == pytest.approx((-1.2 + 1.5) / 2)
    loss.backward()
    # The clipped token gets no gradient; the other gets d(1.5 * ratio)/dlogp / 2 = 0.75
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[1, 0].item() == pytest.approx(0.75)
    assert m["clip_frac"] == 1.0


def test_masked_padding_tokens_do_not_matter_even_if_nan():
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-1.0, float("-inf"), float("inf")]])
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, _ = grpo_loss(logp, old, torch.tensor([1.0, 2.0]), mask)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 2)


def test_per_sequence_then_batch_averaging():
    # seq 0 has one token with A=1, seq 1 three tokens with A=-1; on-policy per-token loss = -A.
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    loss, _ = grpo_loss(logp, logp, torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == pytest.approx((-1.0 + 1.0) / 2)


def test_kl_k3_is_zero_at_reference_and_positive_elsewhere():
    p = torch.log(torch.tensor([0.2, 0.5]))
    assert torch.allclose(kl_k3(p, p), torch.zeros(2))
    # ref/p = 2: exp(log 2) - log 2 - 1 = 1 - log 2
    assert kl_k3(torch.tensor([0.0]), torch.tensor([math.log(2)])).item() == pytest.approx(1 - math.log(2))


def test_kl_term_enters_loss_with_coefficient():
    logp = torch.zeros(1, 1)
    ref = torch.full((1, 1), math.log(2))
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, m = grpo_loss(logp, logp, torch.tensor([0.0]), mask, ref_logprobs=ref, kl_coef=0.5)
    assert loss.item() == pytest.approx(0.5 * (1 - math.log(2)))
    assert m["kl"] == pytest.approx(1 - math.log(2))


def test_sft_loss_and_masked_mean():
    logp = torch.tensor([[-1.0, -3.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    assert sft_loss(logp, mask)[0].item() == pytest.approx(2.0)
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool)).item() == 0.0


# ---------------------------------------------------------------- the algorithms beyond GRPO


def batch_of(logp_like: torch.Tensor, old, adv, mask, **per_token) -> TrainBatch:
    """A TrainBatch carrying just what the losses read (input ids are unused by them)."""
    b, t = logp_like.shape
    pt = {"old_logprobs": old, **per_token}
    per_seq = {"advantages": adv} if adv.dim() == 1 else {}
    if adv.dim() == 2:
        pt["advantages"] = adv
    return TrainBatch(torch.zeros(b, t + 1, dtype=torch.long), torch.ones(b, t + 1, dtype=torch.long),
                      mask, pt, per_seq)


def one_token_each(values):
    return torch.tensor(values, dtype=torch.float32).unsqueeze(-1)


def test_make_loss_default_spec_is_the_old_grpo_loss():
    torch.manual_seed(0)
    logp, old = -torch.rand(3, 4), -torch.rand(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0])
    loss, m = make_loss(AlgorithmSpec())(logp, batch_of(logp, old, adv, mask))
    ref, ref_m = grpo_loss(logp, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(ref.item()) and m["clip_frac"] == ref_m["clip_frac"]


def test_dr_grpo_advantages_are_not_std_scaled():
    spec = AlgorithmSpec(name="dr_grpo")
    # mean 0.25 -> deviations only; GRPO would divide by the std 0.5.
    adv = compute_advantages(spec, torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert torch.allclose(compute_advantages(AlgorithmSpec(), torch.tensor([1.0, 0.0, 0.0, 0.0]), 4),
                          torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)


def test_dr_grpo_normalizes_by_a_constant_length_not_per_sequence():
    # seq 0: one token with A=+1; seq 1: three tokens with A=-1; on-policy, so per-token loss = -A.
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = torch.tensor([1.0, -1.0])
    loss, _ = make_loss(AlgorithmSpec(name="dr_grpo", max_len_norm=4))(logp, batch_of(logp, logp.detach(), adv, mask))
    # token sums -1 and +3, each / 4, mean over 2 sequences: (-0.25 + 0.75) / 2 = 0.25
    assert loss.item() == pytest.approx(0.25)
    loss.backward()
    # Every token weighs 1 / (4 * 2) whatever its sequence's length: -A / 8.
    assert logp.grad[0, 0].item() == pytest.approx(-1 / 8)
    assert torch.allclose(logp.grad[1], torch.full((3,), 1 / 8))
    # GRPO instead weighs a token by 1 / (|o_i| * 2): 1/2 in the short sequence, 1/6 in the long one.
    logp.grad = None
    grpo, _ = make_loss(AlgorithmSpec())(logp, batch_of(logp, logp.detach(), adv, mask))
    grpo.backward()
    assert grpo.item() == pytest.approx(0.0)
    assert logp.grad[0, 0].item() == pytest.approx(-1 / 2) and logp.grad[1, 0].item() == pytest.approx(1 / 6)


def test_dr_grpo_max_len_defaults_to_the_generation_budget_and_is_required():
    logp = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    b = batch_of(logp, logp, torch.tensor([1.0]), mask)
    # token sum -2 over max_new_tokens 8
    assert make_loss(AlgorithmSpec(name="dr_grpo").for_rollout(8))(logp, b)[0].item() == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="algorithm.max_len_norm"):
        make_loss(AlgorithmSpec(name="dr_grpo"))


def test_dapo_clip_higher_is_asymmetric_and_token_level():
    # Three one-token sequences: ratios 1.25, 1.3, 0.75 with advantages +1, +1, -1.
    old = torch.zeros(3, 1)
    logp = torch.log(one_token_each([1.25, 1.3, 0.75])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0])
    mask = torch.ones(3, 1, dtype=torch.bool)
    loss, m = make_loss(AlgorithmSpec(name="dapo"))(logp, batch_of(logp, old, adv, mask))
    # clip range [0.8, 1.28]: -1.25 (inside), -1.28 (clipped above), max(0.75, 0.8) = 0.8 (clipped below)
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8) / 3)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # ratio 1.25 still learns under clip-higher: d(-ratio)/dlogp / 3 = -1.25 / 3; clipped tokens get 0
    assert logp.grad.squeeze(-1).tolist() == pytest.approx([-1.25 / 3, 0.0, 0.0])
    # Symmetric GRPO clips the 1.25 token at 1.2 and silences it.
    logp.grad = None
    grpo, _ = make_loss(AlgorithmSpec(name="grpo"))(logp, batch_of(logp, old, adv, mask))
    grpo.backward()
    assert grpo.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3)
    assert logp.grad.abs().sum().item() == 0.0


def test_dapo_token_mean_weighs_long_sequences_more():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    loss, _ = make_loss(AlgorithmSpec(name="dapo"))(logp, batch_of(logp, logp, torch.tensor([1.0, -1.0]), mask))
    assert loss.item() == pytest.approx((-1 + 3) / 4)  # all 4 tokens, not per sequence


def test_overlong_reward_hand_computed():
    # L_max 20, L_cache 4: no penalty up to 16 tokens, then (16 - len) / 4, and -1 from 20 on.
    pen = overlong_reward(torch.tensor([10, 16, 17, 18, 20, 25]), max_len=20, cache_len=4)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_len"):
        overlong_reward(torch.tensor([1]), max_len=4, cache_len=4)


def test_dapo_advantages_apply_overlong_shaping_before_normalizing():
    spec = AlgorithmSpec(name="dapo", overlong_max_len=20, overlong_buffer=4)
    # Both right (reward 1) but the second is 18 tokens long: shaped 1.0 and 0.5; mean 0.75,
    # std sqrt(2 * 0.25**2 / 1) = 0.35355, so advantages +-0.25 / 0.35355 = +-0.70711.
    adv = compute_advantages(spec, torch.tensor([1.0, 1.0]), 2, lengths=torch.tensor([10, 18]))
    assert adv.tolist() == pytest.approx([0.70711, -0.70711], abs=1e-4)
    # Default DAPO buffer: a fifth of the budget (8 // 5 = 1 token), so only a length of 8 is punished.
    assert AlgorithmSpec(name="dapo").for_rollout(8).overlong() == (8, 1)
    dapo = AlgorithmSpec(name="dapo").for_rollout(8)
    adv = compute_advantages(dapo, torch.tensor([1.0, 1.0]), 2, torch.tensor([7, 8]))
    assert adv[0] > 0 > adv[1]
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages(spec, torch.tensor([1.0, 1.0]), 2)
    # GRPO does no shaping: lengths are ignored.
    assert AlgorithmSpec().for_rollout(8).overlong() is None


def test_keep_informative_groups():
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5])
    assert keep_informative_groups(rewards, 3).tolist() == [False, True, False, False]
    with pytest.raises(ValueError, match="group_size=5"):
        keep_informative_groups(rewards, 5)


def test_cispo_keeps_gradient_on_clipped_tokens():
    # ratios 1.5 (A=+1) and 0.5 (A=-1); CISPO's weight: min(1.5, 1.28) = 1.28, and 0.5 (no lower bound).
    old = torch.log(one_token_each([0.5, 0.5]))
    logp = torch.log(one_token_each([0.75, 0.25])).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, m = make_loss(AlgorithmSpec(name="cispo"))(logp, batch_of(logp, old, adv, mask))
    # token mean of -w * A * logp: (-1.28 * log .75 + 0.5 * log .25) / 2
    assert loss.item() == pytest.approx((-1.28 * math.log(0.75) + 0.5 * math.log(0.25)) / 2)
    assert m["clip_frac"] == pytest.approx(0.5)  # only the upper clip exists
    loss.backward()
    # d/dlogp = -w * A / 2: both tokens learn, the clipped one at the capped weight.
    assert logp.grad.squeeze(-1).tolist() == pytest.approx([-0.64, 0.25])
    # PPO-clip gives both tokens zero gradient (1.5 clipped above with A>0, 0.5 clipped below with A<0).
    logp.grad = None
    ppo, _ = grpo_loss(logp, old, adv, mask, clip_eps=0.2)
    ppo.backward()
    assert logp.grad.abs().sum().item() == 0.0


def test_cispo_optional_lower_bound():
    old = torch.zeros(1, 1)
    logp = torch.log(one_token_each([0.5])).requires_grad_()
    loss, _ = make_loss(AlgorithmSpec(name="cispo", clip_eps_low=0.2))(
        logp, batch_of(logp, old, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool)))
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.8)  # weight raised to 1 - 0.2


def test_gspo_sequence_ratio_and_its_clipping():
    # seq 0: logp - old = [0.1, 0.3], s = exp(0.2) = 1.2214 > 1 + 4e-4: clipped, no gradient.
    # seq 1: logp - old = [1e-4, 3e-4], s = exp(2e-4) = 1.0002, inside [1 - 3e-4, 1 + 4e-4].
    old = torch.full((2, 2), -1.0)
    logp = (old + torch.tensor([[0.1, 0.3], [1e-4, 3e-4]])).requires_grad_()
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, m = make_loss(AlgorithmSpec(name="gspo"))(logp, batch_of(logp, old, torch.tensor([1.0, 1.0]), mask))
    s1 = math.exp(2e-4)
    assert loss.item() == pytest.approx((-(1 + 4e-4) - s1) / 2, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5)  # the whole first sequence is out
    assert m["seq_ratio_mean"] == pytest.approx((math.exp(0.2) + s1) / 2, abs=1e-6)
    loss.backward()
    assert logp.grad[0].tolist() == [0.0, 0.0]
    # Token form: each token's gradient is -A * s / (2 tokens * 2 sequences).
    assert logp.grad[1].tolist() == pytest.approx([-s1 / 4, -s1 / 4], abs=1e-6)


def test_gspo_token_form_equals_sequence_form_gradient():
    torch.manual_seed(1)
    old = -torch.rand(3, 5)
    logp = (old + 0.05 * torch.randn(3, 5)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 2.0])
    loss, _ = gspo_loss(logp, old, adv, mask, eps_low=10.0, eps_high=10.0)  # clipping off
    (g_token,) = torch.autograd.grad(loss, logp)
    # Sequence form: J = mean_i s_i(theta) * A_i with s_i = exp(mean_t(logp - old)) fully differentiable.
    s = torch.exp(masked_mean(logp - old, mask, dim=-1))
    (g_seq,) = torch.autograd.grad(-(s * adv).mean(), logp)
    assert torch.allclose(g_token, g_seq, atol=1e-6)
    assert loss.item() == pytest.approx(-(s * adv).mean().item(), abs=1e-6)


def test_is_weights_scale_each_tokens_loss():
    logp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    w = torch.tensor([[0.5, 2.0, float("nan")]])  # the padding weight never matters
    loss, m = make_loss(AlgorithmSpec())(logp, batch_of(logp, logp.detach(), torch.tensor([1.0]), mask, is_weights=w))
    # on-policy per-token loss -A = -1, weighted: (-0.5 - 2.0) / 2 tokens
    assert loss.item() == pytest.approx(-1.25)
    assert m["is_weight_mean"] == pytest.approx(1.25)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.25, -1.0, 0.0])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "cispo", "gspo"])
def test_padding_with_nan_and_inf_never_leaks(name):
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([[-1.0, -2.0, nan], [-0.5, -inf, inf]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, nan], [-0.4, inf, nan]])
    ref = torch.tensor([[-1.0, -2.5, nan], [-0.5, nan, -inf]])
    isw = torch.tensor([[1.0, 1.5, nan], [0.5, inf, nan]])
    adv = torch.tensor([[1.0, 1.0, nan], [-2.0, nan, inf]])  # per-token advantages, also garbage in padding
    mask = torch.tensor([[True, True, False], [True, False, False]])
    spec = AlgorithmSpec(name=name, kl_coef=0.1)
    loss, m = make_loss(spec.for_rollout(4))(logp, batch_of(logp, old, adv, mask, ref_logprobs=ref, is_weights=isw))
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in m.values())
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[~mask].abs().sum().item() == 0.0
    assert logp.grad[mask].abs().sum().item() > 0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "cispo", "gspo"])
def test_on_policy_gradient_direction_agrees_across_algorithms(name):
    # At ratio 1 every algorithm's gradient is -A * grad(logp) up to a positive per-token weight.
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.25]])).requires_grad_()
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    loss, m = make_loss(AlgorithmSpec(name=name).for_rollout(2))(logp, batch_of(logp, logp.detach(), adv, mask))
    loss.backward()
    assert (logp.grad[0] < 0).all() and (logp.grad[1] > 0).all()
    assert m["clip_frac"] == 0.0


def test_algorithm_defaults_and_field_named_errors():
    assert AlgorithmSpec(name="dapo").clip_bounds() == (0.2, 0.28)
    assert AlgorithmSpec(name="dapo", clip_eps=0.1).clip_bounds() == (0.1, 0.28)
    assert AlgorithmSpec(name="cispo").clip_bounds() == (None, 0.28)
    assert AlgorithmSpec(name="gspo").clip_bounds() == (3e-4, 4e-4)
    assert AlgorithmSpec(name="grpo", clip_eps_high=0.3).clip_bounds() == (0.2, 0.3)
    assert AlgorithmSpec(name="dapo").uses_dynamic_sampling() and not AlgorithmSpec().uses_dynamic_sampling()
    assert [AlgorithmSpec(name=n).aggregation() for n in ("grpo", "dr_grpo", "dapo")] == [
        "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_mean"]
    with pytest.raises(SpecError, match="algorithm.scale_rewards: dr_grpo does not divide"):
        parse_spec({"algorithm": {"name": "dr_grpo", "scale_rewards": True}})
    with pytest.raises(SpecError, match="algorithm.name: unknown algorithm 'ppo'; one of grpo, dr_grpo, dapo, cispo, "
                                        "gspo, or an import path 'package.module:attr'"):
        parse_spec({"algorithm": {"name": "ppo"}})
    with pytest.raises(SpecError, match="algorithm.overlong_buffer: must be < overlong_max_len = 8, got 8"):
        parse_spec({"algorithm": {"overlong_max_len": 8, "overlong_buffer": 8}})
    with pytest.raises(SpecError, match="algorithm.clip_eps_low: must be < 1"):
        parse_spec({"algorithm": {"clip_eps_low": 1.5}})
    # Switching algorithm by override keeps working: unset fields resolve per algorithm.
    spec = apply_overrides(parse_spec({}), {"algorithm.name": "dr_grpo"})
    assert not spec.algorithm.scales_rewards()


def test_buffer_spec_errors_name_the_field():
    from pydantic import ValidationError

    from factory.config import BufferSpec

    assert BufferSpec().policy == "bound" and BufferSpec().max_staleness == 1
    with pytest.raises(ValidationError, match="max_staleness"):
        BufferSpec(policy="bound", max_staleness=0)
    assert BufferSpec(policy="reject", max_staleness=0).max_staleness == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "cispo", "gspo"])
def test_each_algorithm_learns_in_the_sync_loop(name):
    # The loop's eos task (tests/core/test_loop.py): a completion is right when it stops at once.
    from factory.core.loop import train_rl
    from factory.models.build import build_model
    from factory.models.tokenizer import build_tokenizer
    from factory.problem import Problem

    problems = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(10)]
    spec = parse_spec({"seed": 0, "model": {"preset": "micro"},
                       "algorithm": {"name": name, "group_size": 8, "lr": 0.01},
                       "rollout": {"prompts_per_step": 8, "max_new_tokens": 3}, "trainer": {"threads": 1},
                       "schedule": {"steps": 20}})
    tok = build_tokenizer()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a micro model: more threads only contend on a shared machine
    try:
        records = train_rl(spec, build_model("micro", tok, seed=0), tok, problems)
    finally:
        torch.set_num_threads(threads)
    first, last = records[0].reward_mean, sum(r.reward_mean for r in records[-5:]) / 5
    assert first < 0.5 and last > first + 0.3, (first, last)


# ---------------------------------------------------------------- numerics: one extreme token, stale-sample weights

ALGORITHMS = ["grpo", "dr_grpo", "dapo", "cispo", "gspo"]


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("old,new", [(-1e4, -0.1), (-0.1, -1e4)])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_extreme_token_leaves_loss_and_gradients_finite(name, old, new, sign):
    # Token 0 of row 0: the sampler and the policy disagree by ~1e4 nats (ratio e^(+-1e4)), and so does the
    # reference; every other token is ordinary. Advantages of both signs reach the unclipped PPO branch.
    logp = torch.tensor([[new, -1.0, -0.3], [-0.5, -0.7, -2.0]], requires_grad=True)
    olds = torch.tensor([[old, -1.1, -0.3], [-0.5, -0.6, -2.1]])
    ref = torch.tensor([[old, -1.2, -0.2], [-0.4, -0.7, -2.0]])
    isw = torch.tensor([[1.5, 1.0, 0.8], [0.5, 1.0, 2.0]])
    adv = torch.tensor([sign, -sign])
    mask = torch.ones(2, 3, dtype=torch.bool)
    spec = AlgorithmSpec(name=name, kl_coef=0.1)
    loss, m = make_loss(spec.for_rollout(3))(logp, batch_of(logp, olds, adv, mask, ref_logprobs=ref,
                                                              is_weights=isw))
    loss.backward()
    assert torch.isfinite(loss), loss
    assert all(math.isfinite(v) for v in m.values()), m
    assert torch.isfinite(logp.grad).all(), logp.grad
    assert logp.grad[1].abs().sum() > 0  # the ordinary tokens still learn


def test_k3_is_bounded_as_verl_bounds_it():
    # ref - logp clamped to +-20 before exp, the estimate to [-10, 10] (verl's kl_penalty "low_var_kl").
    assert kl_k3(torch.tensor([-1e4]), torch.tensor([-0.1])).item() == 10.0
    assert kl_k3(torch.tensor([-0.1]), torch.tensor([-1e4])).item() == 10.0  # d = -20: e^-20 + 20 - 1 > 10
    assert kl_k3(torch.tensor([0.0]), torch.tensor([math.log(2)])).item() == pytest.approx(1 - math.log(2))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_is_weights_scale_the_policy_term_only_not_the_kl(name):
    # Zero advantages: the policy term is 0, so the loss is the KL term alone, whatever the IS weights.
    logp = torch.tensor([[-1.0, -0.5], [-0.2, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.1], [-0.9, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    spec = AlgorithmSpec(name=name, kl_coef=0.5)
    fn = make_loss(spec.for_rollout(2))
    plain, _ = fn(logp, batch_of(logp, logp.detach(), torch.zeros(2), mask, ref_logprobs=ref))
    (g_plain,) = torch.autograd.grad(plain, logp)
    weighted, m = fn(logp, batch_of(logp, logp.detach(), torch.zeros(2), mask, ref_logprobs=ref,
                                    is_weights=torch.tensor([[2.0, 0.5], [1.5, 1.5]])))
    (g_weighted,) = torch.autograd.grad(weighted, logp)
    assert plain.item() > 0 and weighted.item() == pytest.approx(plain.item())
    assert torch.allclose(g_weighted, g_plain)
    assert m["is_weight_mean"] == pytest.approx(1.375)
