"""Advantages and losses against hand-computed values."""

import math

import pytest
import torch

from factory.core.algorithms import group_advantages, grpo_loss, kl_k3, masked_mean, sft_loss


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
