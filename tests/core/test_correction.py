"""The sampler/trainer corrections and gap statistics of `factory/core/correction.py` against verl's rollout correction,
in float64, held to 1e-9 in values and in gradients w.r.t. the trainer's current log-probs.

The reference is `tests/core/verl_reference.py` (verl's `rollout_corr_helper.py` and `core_algos.py` restated as
plain torch; file, function and commit there). verl's decoupled mode has three policies, as factory's
`behavior: recompute` does: the sampler's log-probs (rollout_log_probs), the trainer's own recomputed before the
update (old_log_probs, the PPO ratio's denominator) and the current ones (log_prob). Its correction weighs the first
two: log_ratio = old - rollout; `rollout_is_weights` multiply each token's policy-gradient term, and rejection
replaces `response_mask`, which then masks the policy term, its aggregation and the KL term's (dp_actor.py passes
the same response_mask to both `agg_loss` calls). Each correction below maps to verl's configuration:

- token TIS, min(rho_t, C)                      = rollout_is "token", rollout_is_threshold C;
- sequence TIS, min(prod_t rho_t, C)            = rollout_is "sequence", rollout_is_threshold C;
- MIS [lo, hi] on exp(mean_t log rho_t)         = rollout_rs "geometric" with lower lo, upper hi (518bada), and
                                                  rollout_rs "seq_mean_k1" with "1/hi_1/lo" (b178a3cd);
- IcePop [alpha, beta] on rho_t, tokens masked  = rollout_rs "token" with lower alpha, upper beta (518bada), and
                                                  "token_k1" with "1/beta_1/alpha" (b178a3cd).

IcePop as its paper defines it (Ling Team, "Small Leak Can Sink a Great Ship: Boost RL Training on MoE with IcePop",
2025, used for Ring-1T): each token's PPO term is multiplied by M(k; alpha, beta) with k = pi_train / pi_infer of the
token under the sampling weights, M(k) = k for k in [alpha, beta] and 0 outside (alpha 0.5, beta 5). Its mask is the
same rule as verl's token rejection (keep iff alpha <= k <= beta, bounds inclusive); its in-range weight k is token
TIS with a cap >= beta, so `icepop: [0.5, 5]` with `tis: token, tis_cap: 5` is the paper's M (the "icepop_paper"
case). One difference, verl's and factory's alike: the paper's M zeroes a token's term but leaves the token in
1/|y_i|; rejection removes it from the denominators too.

Where factory differs from verl on purpose, a test says so by name: a ratio beyond the safety bound in the gap's k3
(verl's k3_kl has no clamp), the share of sequences masked (verl counts sequences with any token masked), and
Dr.GRPO's divisor when a correction empties a sequence (verl's is a constant).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from factory.config import AlgorithmSpec, CorrectionSpec
from factory.core.algorithms import make_loss
from factory.core.correction import apply_correction, correct, gap_stats
from tests.core import verl_reference as verl
from tests.core.test_algorithms_verl import batch_of

torch.set_num_threads(1)

TOL = 1e-9
ALGORITHMS = ["grpo", "dr_grpo", "dapo", "cispo", "gspo"]
PPO_CLIP = ("grpo", "dr_grpo", "dapo")
B, T = 7, 5
ALL_ROWS = torch.ones(B, dtype=torch.bool)  # every row's generating weights at hand


# ---------------------------------------------------------------- the batch


def gap_batch(seed: int) -> dict[str, torch.Tensor]:
    """Seven sequences of T tokens in float64, built so every correction binds somewhere:
    row 0: one token 3.3x likelier under the trainer (token TIS truncates it at C = 2), one 0.37x (IcePop masks it);
    row 1: every token 1.35x (sequence ratio 4.5: sequence TIS truncates; its geometric mean stays inside MIS's);
    row 2: every token 7.4x (IcePop masks the whole sequence; MIS masks it);
    row 3: every token 0.37x (MIS masks it below; IcePop masks every token);
    row 4: one token 30 nats off (past the safety bound of 20), its last two tokens padding;
    row 5: ordinary; row 6: no completion token at all.
    The current log-probs drift from the trainer's (row 0's third token by +2: a PPO ratio of 7.4 with A < 0, where
    the dual clip binds). Positions outside the mask hold NaN and +-inf in every input: none may leak."""
    g = torch.Generator().manual_seed(seed)
    sampler = -0.3 - torch.rand(B, T, generator=g, dtype=torch.float64)
    d = 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    d[0, 1], d[0, 3] = 1.2, -1.0
    d[1] += 0.3
    d[2] += 2.0
    d[3] -= 1.0
    d[4, 1] = 30.0
    trainer = sampler + d
    logp = trainer + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    logp[0, 2] += 2.0
    ref = trainer + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    stale = 0.5 + torch.rand(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[4, -2:] = False
    mask[6] = False
    adv = torch.tensor([-1.0, 0.8, -0.5, 1.2, -1.3, 0.4, 0.9], dtype=torch.float64)
    clean = {"sampler": sampler, "trainer": trainer, "logp": logp, "ref": ref, "stale": stale}
    garbage = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
    fill = garbage[torch.arange(B * T).remainder(3)].view(B, T)
    dirty = {k: torch.where(mask, v, fill) for k, v in clean.items()}
    clean = {k: torch.where(mask, v, torch.zeros_like(v)) for k, v in clean.items()}  # verl's padding holds 0
    return {"mask": mask, "adv": adv, **{f"{k}_clean": v for k, v in clean.items()}, **dirty}


# ---------------------------------------------------------------- the corrections and verl's configuration of each


CORRECTIONS: dict[str, tuple[CorrectionSpec, dict]] = {
    # factory's spec: verl's {rollout_is, threshold, rs_518: (mode, lower, upper), rs_k1: {option: "lower_upper"}}
    "tis_token": (CorrectionSpec(tis="token"), {"is": ("token", 2.0)}),
    "tis_default": (CorrectionSpec(), {"is": ("token", 2.0)}),  # unset: token, C = 2, where the run recomputes
    "tis_sequence": (CorrectionSpec(tis="sequence"), {"is": ("sequence", 2.0)}),
    "tis_token_cap5": (CorrectionSpec(tis="token", tis_cap=5.0), {"is": ("token", 5.0)}),
    "mis": (CorrectionSpec(tis="off", mis=(0.6, 1.5)),
            {"rs_518": [("geometric", 0.6, 1.5)], "rs_k1": {"seq_mean_k1": f"{1 / 1.5}_{1 / 0.6}"}}),
    "icepop": (CorrectionSpec(tis="off", icepop=(0.5, 5.0)),
               {"rs_518": [("token", 0.5, 5.0)], "rs_k1": {"token_k1": "0.2_2.0"}}),
    "icepop_paper": (CorrectionSpec(tis="token", tis_cap=5.0, icepop=(0.5, 5.0)),
                     {"is": ("token", 5.0), "rs_518": [("token", 0.5, 5.0)], "rs_k1": {"token_k1": "0.2_2.0"}}),
    "mis_tis_token": (CorrectionSpec(tis="token", mis=(0.6, 1.5)),
                      {"is": ("token", 2.0), "rs_518": [("geometric", 0.6, 1.5)]}),
    "all_three": (CorrectionSpec(tis="sequence", mis=(0.6, 1.5), icepop=(0.5, 5.0)),
                  {"is": ("sequence", 2.0), "rs_518": [("geometric", 0.6, 1.5), ("token", 0.5, 5.0)],
                   "rs_k1": {"token_k1": "0.2_2.0", "seq_mean_k1": f"{1 / 1.5}_{1 / 0.6}"}}),
}


def verl_correction(config: dict, x: dict) -> tuple[torch.Tensor | None, torch.Tensor]:
    """verl's rollout_is_weights and modified response_mask (`compute_rollout_correction_and_rejection_mask`) for
    `config`, on the clean inputs; both rejection transcriptions (518bada's modes, b178a3cd's k1 options) must agree."""
    response_mask = x["mask"].to(torch.float64)
    log_ratio = x["trainer_clean"] - x["sampler_clean"]
    weights = None
    if "is" in config:
        weights = verl.rollout_is_weights(log_ratio, response_mask, *config["is"])
    modified = response_mask
    for mode, lower, upper in config.get("rs_518", []):  # one mode per run at 518bada: several chain as AND
        modified = modified * verl.rejection_mask_518(log_ratio, response_mask, mode, upper, lower)
    if "rs_k1" in config:
        k1 = verl.rejection_mask_k1(log_ratio, response_mask, config["rs_k1"])
        assert torch.equal(k1, modified), "verl's two rejection APIs disagree on this batch"
    return weights, modified


def compare(correction: str, name: str, stale: bool, kl_coef: float, off_policy: bool, seed: int,
            guard: float = 0.0) -> tuple[float, float]:
    """Factory's loss and gradient against verl's for one case: (max abs diff of the value, of the gradient)."""
    spec, config = CORRECTIONS[correction]
    x = gap_batch(seed)
    mask = x["mask"]
    ours_in = x["logp"].clone().requires_grad_()
    per_token = {"ref_logprobs": x["ref"], **({"is_weights": x["stale"]} if stale else {})}
    batch = batch_of(ours_in, x["trainer"], x["adv"], mask, **per_token)
    fix = correct(spec, x["trainer"], x["sampler"], mask, rows=ALL_ROWS, recompute=True)
    apply_correction(batch, fix)
    algorithm = AlgorithmSpec(name=name, kl_coef=kl_coef)
    ours, _ = make_loss(algorithm.for_rollout(T), off_policy=off_policy)(ours_in, batch)
    (g_ours,) = torch.autograd.grad(ours, ours_in)

    weights, modified = verl_correction(config, x)
    is_w = weights
    if stale:  # the buffer's staleness weights multiply verl's rollout_is_weights, as apply_correction multiplies them
        is_w = x["stale_clean"] if weights is None else x["stale_clean"] * weights
    dual_clip = 3.0 if off_policy and name in PPO_CLIP else None  # verl's clip_ratio_c; the auto default
    verl_in = x["logp_clean"].clone().requires_grad_()
    want = verl.verl_loss(name, x["trainer_clean"], verl_in, x["adv"], modified, x["ref_clean"], kl_coef, is_w,
                          dual_clip, T, guard=guard)
    (g_want,) = torch.autograd.grad(want, verl_in)
    value_diff = (ours.detach() - want.detach()).abs().item()
    grad_diff = (g_ours - g_want).abs().max().item()
    return value_diff, grad_diff


def sweep(correction: str, seeds=(0, 1), guard: float = 0.0) -> tuple[int, float, float]:
    """Every loss x staleness weights on/off x KL on/off x dual clip auto (off_policy) or off, over `seeds`:
    (cases, max value diff, max gradient diff); NaN anywhere makes the maxima NaN."""
    diffs = []
    for name in ALGORITHMS:
        for stale in (False, True):
            for kl_coef in (0.0, 0.1):
                for off_policy in (False, True):
                    for seed in seeds:
                        diffs.append(compare(correction, name, stale, kl_coef, off_policy, seed, guard))
    d = torch.tensor(diffs, dtype=torch.float64)
    worst = d.max(dim=0).values if not d.isnan().any() else torch.tensor([math.nan, math.nan])
    return len(diffs), worst[0].item(), worst[1].item()


@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_correction_composed_with_every_loss_matches_verl(correction):
    n, value_diff, grad_diff = sweep(correction)
    assert n == 80
    assert value_diff <= TOL and grad_diff <= TOL, (correction, value_diff, grad_diff)


def test_every_correction_binds_on_the_batch():
    # The comparison above means something only where the corrections change the loss: each one must.
    x = gap_batch(0)

    def fix(key):
        return correct(CORRECTIONS[key][0], x["trainer"], x["sampler"], x["mask"], ALL_ROWS)

    token = fix("tis_token").weights
    assert token[0, 1].item() == 2.0 and token[4, 1].item() == 2.0  # truncated at C, also past the safety bound
    seq = fix("tis_sequence").weights
    assert (seq[1] == 2.0).all() and (seq[3] < 0.1).all()
    mis = fix("mis").keep
    assert mis.any(-1).tolist() == [True, True, False, False, False, True, False]  # row 4: its 30-nat token
    ice = fix("icepop").keep
    assert not ice[0, 3] and ice[0, 1] and not ice[2].any() and not ice[3].any() and not ice[4, 1]
    batch = batch_of(x["logp"], x["trainer"], x["adv"], x["mask"])
    for name in PPO_CLIP:  # and the dual clip, where it applies
        off, _ = make_loss(AlgorithmSpec(name=name).for_rollout(T))(x["logp"], batch)
        on, m = make_loss(AlgorithmSpec(name=name).for_rollout(T), off_policy=True)(x["logp"], batch)
        assert m["dual_clip_frac"].item() > 0 and abs(on.item() - off.item()) > 0.1, name


def test_verls_own_denominator_guard_is_the_only_difference_left():
    # With verl's n + 1e-8 in a sequence's token mean (its masked_mean), the values move by a relative 1e-8 / n
    # (1.3e-9 here, above the 1e-9 the comparison holds to, hence guard=0 there); that guard is the whole difference.
    n, value_diff, grad_diff = sweep("all_three", seeds=(0,), guard=1e-8)
    assert n == 40
    assert 0 < value_diff <= 1e-8 and grad_diff <= 1e-8


# ---------------------------------------------------------------- the parts no loss shows


def test_rows_the_trainer_cannot_score_get_weight_one_and_stay_in_the_loss():
    x = gap_batch(0)
    rows = torch.tensor([False, True, False, True, True, True, False])
    fix = correct(CORRECTIONS["all_three"][0], x["trainer"], x["sampler"], x["mask"], rows)
    for i in (0, 2):  # unflagged: weight 1, every token kept, though their ratios would bind
        assert (fix.weights[i] == 1).all() and torch.equal(fix.keep[i], x["mask"][i])
    full = correct(CORRECTIONS["all_three"][0], x["trainer"], x["sampler"], x["mask"], ALL_ROWS)
    for i in (1, 3, 4, 5):  # flagged: as if every row were flagged
        assert torch.equal(fix.weights[i], full.weights[i]) and torch.equal(fix.keep[i], full.keep[i])


def test_no_correction_leaves_the_batch_as_it_was():
    x = gap_batch(0)
    fix = correct(CorrectionSpec(), x["trainer"], x["sampler"], x["mask"], ALL_ROWS,
                  recompute=False)
    assert fix.weights is None and fix.keep is None and fix.metrics == {}
    batch = batch_of(x["logp"], x["trainer"], x["adv"], x["mask"])
    apply_correction(batch, fix)
    assert "is_weights" not in batch.per_token and torch.equal(batch.loss_mask, x["mask"])


def test_masked_token_share_equals_verls_rs_masked_fraction():
    x = gap_batch(1)
    rows = ALL_ROWS
    for key in ("mis", "icepop", "all_three"):
        spec, config = CORRECTIONS[key]
        fix = correct(spec, x["trainer"], x["sampler"], x["mask"], rows)
        _, modified = verl_correction(config, x)
        want = verl.rs_masked_fraction(x["mask"].to(torch.float64), modified)
        assert abs(fix.metrics["correction_masked_tokens"] - want) <= TOL, key


def test_masked_sequence_share_counts_emptied_sequences_where_verl_counts_touched_ones():
    # On purpose: factory's correction_masked_seqs is the share of sequences (with a token) that left the loss
    # whole; verl's rollout_rs_seq_masked_fraction is the share of all rows with any token masked. IcePop on this
    # batch empties rows 2 and 3 of 6 with tokens, and touches rows 0, 2, 3, 4 of 7.
    x = gap_batch(0)
    fix = correct(CORRECTIONS["icepop"][0], x["trainer"], x["sampler"], x["mask"], ALL_ROWS)
    assert fix.metrics["correction_masked_seqs"] == pytest.approx(2 / 6, abs=TOL)
    touched = (x["mask"] & ~fix.keep).any(-1).double().mean().item()
    assert touched == pytest.approx(4 / 7, abs=TOL)


def test_mean_weight_is_the_applied_weights_mean_over_kept_tokens():
    # verl's rollout_is_mean is the mean of the weights before truncation, over every token; factory's
    # correction_weight_mean is the mean of what multiplies the loss: truncated, over the tokens left in it.
    x = gap_batch(0)
    fix = correct(CORRECTIONS["icepop_paper"][0], x["trainer"], x["sampler"], x["mask"], ALL_ROWS)
    d = (x["trainer_clean"] - x["sampler_clean"]).clamp(-20, 20)
    kept = x["mask"] & (d.exp() >= 0.5) & (d.exp() <= 5.0)
    want = d.exp().clamp(max=5.0)[kept].mean().item()
    assert fix.metrics["correction_weight_mean"] == pytest.approx(want, abs=TOL)


def test_dr_grpo_divides_by_the_sequences_left_where_verls_divisor_is_constant():
    # On purpose: Dr.GRPO's sequence sums are divided by a constant length and then, in factory, averaged over the
    # sequences left in the loss; verl sums them over its micro-batch (its actor rescales by the constant number of
    # micro-batches). When MIS empties rows 2, 3 and 4 (3 of 6 with tokens), factory divides verl's sum by 3, where
    # it divides it by 6 unmasked: the sequences left weigh twice as much as in verl.
    x = gap_batch(0)
    spec, config = CORRECTIONS["mis"]
    fix = correct(spec, x["trainer"], x["sampler"], x["mask"], ALL_ROWS)
    batch = batch_of(x["logp"], x["trainer"], x["adv"], x["mask"])
    apply_correction(batch, fix)
    ours, _ = make_loss(AlgorithmSpec(name="dr_grpo").for_rollout(T))(x["logp"], batch)
    _, modified = verl_correction(config, x)
    adv = x["adv"].unsqueeze(-1).expand(B, T)
    verl_sum = verl.verl_vanilla(x["trainer_clean"], x["logp_clean"], adv, modified, 0.2, 0.2, math.inf,
                                 "seq-mean-token-sum-norm", scale=T)
    assert abs(ours.item() - verl_sum.item() / 3) <= TOL  # unmasked, it would be verl's / 6


# ---------------------------------------------------------------- the gap's statistics


def test_gap_k3_equals_verls_k3_kl_and_the_rest_their_definitions():
    for seed in range(4):
        x = gap_batch(seed)
        x["trainer"][4, 1] = x["trainer_clean"][4, 1] = x["sampler"][4, 1] + 3.0  # verl's k3 has no clamp: stay < 20
        mask = x["mask"]
        stats = gap_stats(x["trainer"], x["sampler"], mask, cap=2.0)
        d = (x["trainer_clean"] - x["sampler_clean"])[mask]
        assert abs(stats["gap_kl"] - verl.offpolicy_k3_kl(x["trainer_clean"], x["sampler_clean"],
                                                         mask.double())) <= TOL
        high, low = verl.is_ratio_fractions(x["trainer_clean"] - x["sampler_clean"], mask.double(), 2.0)
        assert abs(stats["gap_out_frac"] - (high + low)) <= TOL
        assert abs(stats["gap_abs_mean"] - d.abs().mean().item()) <= TOL
        assert stats["gap_abs_max"] == d.abs().max().item()
        seq = (x["trainer_clean"] - x["sampler_clean"]).sum(-1)[mask.any(-1)].abs().numpy()
        assert abs(stats["gap_seq_p95"] - float(np.percentile(seq, 95))) <= TOL


def test_gap_k3_is_finite_past_the_safety_bound_where_verls_overflows_on_purpose():
    # A token 30 nats off (row 4): verl's k3_kl takes exp(30) unclamped; factory clamps the log-ratio at +-20 first
    # (verl's own SAFETY_BOUND for its weights), so one wild token gives a large finite figure, not 1e13.
    x = gap_batch(0)
    stats = gap_stats(x["trainer"], x["sampler"], x["mask"])
    theirs = verl.offpolicy_k3_kl(x["trainer_clean"], x["sampler_clean"], x["mask"].double())
    n = int(x["mask"].sum())
    assert theirs > math.exp(30) / n * 0.99
    assert math.exp(20) / n * 0.99 < stats["gap_kl"] < math.exp(20) / n * 1.01
    assert stats["gap_abs_max"] == pytest.approx(30.0, abs=1e-9)


def test_gap_of_an_empty_mask_is_unmeasured():
    x = gap_batch(0)
    stats = gap_stats(x["trainer"], x["sampler"], torch.zeros(B, T, dtype=torch.bool))
    assert set(stats.values()) == {None}


# ---------------------------------------------------------------- why the dual clip is on where the gap can be


def test_far_off_policy_negative_advantage_token_gradient_without_and_with_the_dual_clip():
    # One token whose ratio to the behaviour policy is 1e3 (the policy now likes it 1000x more than the sampler
    # did, e.g. the sampler's bf16 gave it 1e-4 and the trainer 0.1) with A = -1: the PPO term -A * ratio is not
    # clipped (clipping binds only on the A > 0 side above 1 + eps), so its gradient is ratio * |A| = 1e3; the dual
    # clip (c = 3, the default where staleness or a gap can occur) bounds the loss by -A * c, a constant: none.
    old = torch.tensor([[-math.log(1e4)]], dtype=torch.float64)
    logp = torch.tensor([[-math.log(10.0)]], dtype=torch.float64, requires_grad=True)
    batch = batch_of(logp, old, torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool))
    grads = {}
    for off_policy in (False, True):
        loss, metrics = make_loss(AlgorithmSpec(name="grpo"), off_policy=off_policy)(logp, batch)
        (grads[off_policy],) = torch.autograd.grad(loss, logp)
    assert grads[False].item() == pytest.approx(1e3, rel=1e-12)
    assert grads[True].item() == 0.0 and metrics["dual_clip_frac"].item() == 1.0


def test_bf16_log_probs_are_measured_and_weighted_in_float32():
    # An engine or trainer that hands over bf16 log-probs: exp(d) in bf16 keeps 3 significant digits (a weight of
    # 1.0049 reads 1.0), and torch.quantile takes no bf16; the ratio is formed in float32 at least.
    x = gap_batch(0)
    trainer, sampler = x["trainer"].to(torch.bfloat16), x["sampler"].to(torch.bfloat16)
    stats = gap_stats(trainer, sampler, x["mask"])
    assert all(math.isfinite(v) for v in stats.values())
    fix = correct(CorrectionSpec(tis="token"), trainer, sampler, x["mask"], ALL_ROWS)
    assert fix.weights.dtype == torch.float32
    d = trainer.float() - sampler.float()
    want = torch.where(x["mask"], d.clamp(-20, 20).exp().clamp(max=2.0), torch.ones_like(d))
    assert torch.equal(fix.weights, want)
