"""The trainer's own log-probs of every batch (core/behaviour.py), the gap measured on it, the corrections and the
streak stop, through the real loop on the micro model."""

import copy

import pytest
import torch

from factory.config import parse_spec
from factory.core.batch import pack
from factory.core.behaviour import BehaviourScorer
from factory.core.loop import LogprobGapError, train_rl
from factory.core.producers.sync import SyncProducer
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.data.feed import make_feed
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(10)]


def spec(steps: int = 3, mode: str = "sync", algorithm: dict | None = None, ops: dict | None = None):
    return parse_spec({"seed": 0, "model": {"preset": "micro"},
                       "algorithm": {"group_size": 4, "lr": 0.01, **(algorithm or {})},
                       "rollout": {"prompts_per_step": 4, "max_new_tokens": 3}, "trainer": {"threads": 1},
                       "schedule": {"steps": steps, "mode": mode, "wait_timeout_s": 120}, "ops": ops or {}})


@pytest.fixture
def model_and_tok():
    tok = build_tokenizer()
    return build_model("micro", tok, seed=0), tok


def _batch(tok, n: int = 4):
    g = torch.Generator().manual_seed(0)
    prompts = [[tok.bos_token_id, 5 + i, 6] for i in range(n)]  # the character vocabulary has 17 ids
    completions = [torch.randint(4, 17, (3,), generator=g).tolist() for _ in range(n)]
    return pack(prompts, completions, tok.pad_token_id, {"old_logprobs": [[-1.0] * 3 for _ in range(n)]})


def test_rows_are_scored_under_the_weights_that_generated_them(model_and_tok):
    model, tok = model_and_tok
    trainer = TorchTrainer(model, lr=0.0)
    scorer = BehaviourScorer(trainer, model, keep_previous=True, temperature=1.0)
    batch = _batch(tok)
    before = copy.deepcopy(model)
    scorer.remember(7)
    with torch.no_grad():  # the update of step 7: version 8 differs from 7
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    scored = scorer.score(batch, [8, 7, 6, None], current=8)
    under_7 = TorchTrainer(before, lr=0.0).logprobs(batch)
    under_8 = trainer.logprobs(batch)
    assert scored.at_hand.tolist() == [True, True, False, False]
    assert torch.equal(scored.own[1], under_7[1])  # one version old: the kept copy
    assert torch.equal(scored.own[0], under_8[0])
    # Too old, or generated across an update: the proximal (current) policy.
    assert torch.equal(scored.own[2:], under_8[2:]) and torch.equal(scored.current[2:], under_8[2:])
    assert not torch.allclose(under_7[1][batch.loss_mask[1]], under_8[1][batch.loss_mask[1]])
    # A row at hand under the previous weights is not scored under the current ones unless asked.
    assert torch.equal(scored.current[1], batch.per_token["old_logprobs"][1])
    asked = scorer.score(batch, [8, 7, 6, None], current=8, needs_current=torch.tensor([False, True, False, False]))
    assert torch.equal(asked.current[1], under_8[1]) and torch.equal(asked.own[1], under_7[1])
    # Only measuring: the rows asked for are scored, the others keep the sampler's log-probs and are not at hand.
    some = scorer.score(batch, [8, 7, 8, 8], current=8, rows=torch.tensor([True, True, False, False]))
    assert some.at_hand.tolist() == [True, True, False, False]
    assert torch.equal(some.own[0], under_8[0]) and torch.equal(some.own[1], under_7[1])
    assert torch.equal(some.own[2:], batch.per_token["old_logprobs"][2:])


def test_without_a_kept_copy_only_the_current_version_is_at_hand(model_and_tok):
    model, tok = model_and_tok
    scorer = BehaviourScorer(TorchTrainer(model, lr=0.0), model, keep_previous=False, temperature=1.0)
    scorer.remember(3)
    assert scorer.score(_batch(tok), [4, 3, 4, 4], current=4).at_hand.tolist() == [True, False, True, True]
    with pytest.raises(ValueError, match="3 row versions for a batch of 4 rows"):
        scorer.score(_batch(tok), [4, 4, 4], current=4)


def test_sync_cpu_run_measures_a_float_noise_gap_and_corrects_nothing(model_and_tok):
    model, tok = model_and_tok
    records = train_rl(spec(), model, tok, PROBLEMS)
    for r in records:
        assert r.gap_rows == 0.25 and 0 <= r.gap_abs_mean <= r.gap_abs_max < 1e-5  # behavior rollout: 1 row in G
        assert 0 <= r.gap_kl < 1e-9 and r.gap_out_frac == 0.0 and r.gap_seq_p95 < 1e-5
        assert r.recompute_s > 0
        assert r.correction_weight_mean is None and r.correction_masked_tokens is None  # behavior rollout: none
        assert [s["gap_abs_mean"] for s in r.sources] == [r.gap_abs_mean]  # one source: the same figure


class NoisySampler(SyncProducer):
    """An engine that reports log-probs off by a fixed amount per token (a broken engine, as a wrong dtype gives)."""

    shift = 0.3
    from_step = 0

    def next_batch(self, step: int):
        groups = super().next_batch(step)
        for grp in groups if step >= self.from_step else ():
            for i, s in enumerate(grp.samples):
                s.logprobs = [lp + (self.shift if (i + t) % 2 else -self.shift) for t, lp in enumerate(s.logprobs)]
        return groups


def _noisy(s, model, tok, from_step: int = 0):
    producer = NoisySampler(s, model, tok, make_feed(s.resolved.blend, PROBLEMS), 0)
    producer.from_step = from_step
    return producer


class Saver:
    """Resume points kept in memory, one every step."""

    def __init__(self):
        self.states = {}

    def due(self, done: int) -> bool:
        return True

    def stopping(self) -> bool:
        return False

    def save(self, make_state, wait: bool = False) -> None:
        state = make_state()
        self.states[state.step] = state


def test_a_gap_past_the_bound_stops_the_run_after_max_gap_steps(model_and_tok):
    model, tok = model_and_tok
    s = spec(steps=6, ops={"max_logprob_gap": 0.1, "max_gap_steps": 2})
    seen = []
    with pytest.raises(LogprobGapError, match=r"ops.max_logprob_gap = 0.1 .* for 2 steps in a row \(up to step 2") as e:
        train_rl(s, model, tok, PROBLEMS, producer=_noisy(s, model, tok), on_step=seen.append)
    assert len(seen) == 2 and e.value.bound == 0.1
    assert e.value.figures["gap_abs_mean"] == pytest.approx(0.3, abs=1e-4)  # the shift, measured
    assert seen[0].gap_out_frac == 0.0 and 0.0408 < seen[0].gap_kl < 0.0499  # between e^-.3+.3-1 and e^.3-.3-1


def test_a_run_the_gap_stops_keeps_only_the_resume_points_from_before_it(model_and_tok):
    model, tok = model_and_tok
    s = spec(steps=8, ops={"max_logprob_gap": 0.1, "max_gap_steps": 2})
    saver = Saver()
    with pytest.raises(LogprobGapError, match=r"up to step 4"):
        train_rl(s, model, tok, PROBLEMS, producer=_noisy(s, model, tok, from_step=2), checkpoints=saver)
    assert sorted(saver.states) == [1, 2]  # steps 3 and 4 trained past the bound: not resumed from
    assert saver.states[2].loop["gap_streak"] == 0


def test_recompute_anchors_on_the_trainers_log_probs_and_icepop_masks_what_the_gap_pushes_out(model_and_tok):
    model, tok = model_and_tok
    # Ratios e^{+-0.3} = 1.35 / 0.74: IcePop [0.8, 1.2] masks every token; token TIS (C=2) weighs them 1.35 / 0.74.
    s = spec(steps=2, algorithm={"behavior": "recompute", "correction": {"icepop": [0.8, 1.2], "tis": "off"}},
             ops={"max_logprob_gap": 1.0})
    records = train_rl(s, model, tok, PROBLEMS, producer=_noisy(s, model, tok))
    assert all(r.correction_masked_tokens == 1.0 and r.correction_masked_seqs == 1.0 for r in records)
    assert all(r.grad_norm == 0.0 for r in records)  # nothing left to learn from
    s = spec(steps=2, algorithm={"behavior": "recompute"}, ops={"max_logprob_gap": 1.0})
    model2 = build_model("micro", tok, seed=0)
    records = train_rl(s, model2, tok, PROBLEMS, producer=_noisy(s, model2, tok))
    for r in records:
        assert r.correction_masked_tokens is None
        assert r.correction_weight_mean == pytest.approx((1.3499 + 0.7408) / 2, abs=0.03)  # about half each way
        assert r.clip_frac == 0.0  # anchored on the trainer's own log-probs: ratio 1 at the first minibatch
        assert r.gap_rows == 1.0  # recompute scores every row


def test_rollout_behaviour_trains_on_the_engines_log_probs_as_reported(model_and_tok):
    model, tok = model_and_tok
    s = spec(steps=1, algorithm={"behavior": "rollout"}, ops={"max_logprob_gap": 1.0})
    r = train_rl(s, model, tok, PROBLEMS, producer=_noisy(s, model, tok))[0]
    assert r.clip_frac > 0.9  # ratios e^{+-0.3} leave [0.8, 1.2] at once: the gap goes straight into the clip
