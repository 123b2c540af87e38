"""`rollout.round_weights` (core/rollout/engines/rounding.py): the in-process engine samples from the trainer's weights
rounded to bf16/fp16, refreshed at every publish, with and without LoRA; the trainer's weights stay as they are,
and the sampler's log-probs then differ from the trainer's by a measured amount."""

from __future__ import annotations

import pytest
import torch

from factory.config import SpecError, parse_spec
from factory.core.algorithms import masked_mean
from factory.core.batch import pack
from factory.core.rollout.engines.rounding import round_dtype, rounded
from factory.core.trainer.logprobs import token_logprobs
from factory.data.feed import feed_of
from factory.models import lora
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer=str(2 * i), op="add", digits=1) for i in range(4)]


def _spec(mode: str, round_weights: str | None, lora_r: int | None = None):
    trainer = {"threads": 1, **({"lora": {"r": lora_r, "alpha": 2 * lora_r}} if lora_r else {})}
    return parse_spec({"seed": 0, "model": {"preset": "micro"}, "algorithm": {"group_size": 4},
                       "rollout": {"prompts_per_step": 2, "max_new_tokens": 4, "concurrency": 1,
                                   **({"round_weights": round_weights} if round_weights else {})},
                       "trainer": trainer, "schedule": {"mode": mode, "steps": 2, "wait_timeout_s": 60}})


def _producer(spec, model, tok):
    from factory.core.producers.overlapped import OverlappedProducer
    from factory.core.producers.sync import SyncProducer

    cls = SyncProducer if spec.schedule.mode == "sync" else OverlappedProducer
    return cls(spec, model, tok, feed_of(PROBLEMS, 0), 0)


def _trainers_view(model) -> dict[str, torch.Tensor]:
    """The trainer's weights as the engine should hold them: plain HF names, LoRA merged in."""
    state = lora.merged_state(model) if lora.attached(model) else model.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


def _step(model) -> None:
    """Stands in for an optimizer step: every trainable weight moves (with LoRA, the adapters only)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)


@pytest.mark.parametrize(("mode", "dtype", "lora_r"), [("sync", "bf16", None), ("one_step_off", "bf16", None),
                                                       ("sync", "fp16", 4), ("one_step_off", "bf16", 4)])
def test_after_a_publish_the_engine_holds_exactly_the_rounded_trainer_weights_and_the_trainers_are_untouched(
        mode, dtype, lora_r):
    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    spec = _spec(mode, dtype, lora_r)
    if lora_r:
        lora.attach(model, spec.trainer.lora)
        _step(model)  # B off zero: the merged weights differ from the base
    producer = _producer(spec, model, tok)
    try:
        assert producer.engine.model is not model  # its own copy, not the trainer's model object
        to = round_dtype(dtype)
        for version in (0, 1):
            if version:
                _step(model)
                before = {k: v.detach().clone() for k, v in model.state_dict().items()}
                producer.publish(model, version)
                assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # trainer untouched
            want = rounded(_trainers_view(model), to)
            held = producer.engine.model.state_dict()
            assert held.keys() <= want.keys()  # a tied head may be absent from the engine's state dict
            for k, v in held.items():
                assert torch.equal(v, want[k]), k
                assert v.dtype == torch.float32  # computed in fp32: only the values are rounded
            assert any(not torch.equal(want[k], v) for k, v in _trainers_view(model).items())  # rounding did something
        assert producer.engine.weight_version == 1
    finally:
        producer.close()


def _gap(model, completions) -> float:
    """Mean |trainer - sampler| log-prob over the completions' tokens."""
    batch = pack([c.prompt_ids for c in completions], [c.token_ids for c in completions], 0,
                 {"old_logprobs": [c.logprobs for c in completions]})
    with torch.no_grad():
        mine, _ = token_logprobs(model.eval(), batch)
    return masked_mean((mine - batch.per_token["old_logprobs"]).abs(), batch.loss_mask).item()


def test_the_rounded_samplers_logprobs_differ_from_the_trainers_by_a_measured_amount():
    tok = build_tokenizer()
    gaps = {}
    for setting in (None, "bf16", "fp16"):
        model = build_model("micro", tok, seed=0)
        producer = _producer(_spec("sync", setting), model, tok)
        try:
            completions = producer.probe(tok("12+34=").input_ids, 16)
            gaps[setting] = _gap(model, completions)
        finally:
            producer.close()
    assert gaps[None] < 1e-5  # same weights, fp32 both sides
    assert gaps["bf16"] > 1e-4 and gaps["bf16"] > 30 * max(gaps[None], 1e-7)
    assert gaps["fp16"] < gaps["bf16"] / 3  # fp16 keeps 3 more mantissa bits than bf16


def test_round_weights_is_refused_for_engines_that_are_not_in_process_and_is_a_late_field():
    with pytest.raises(SpecError, match=r"rollout.round_weights: rounds the weights of the in-process engine only.*"
                                        r"'server' in mode 'one_step_off'"):
        parse_spec({"rollout": {"engine": "server", "round_weights": "bf16"}, "schedule": {"mode": "one_step_off"}})
    with pytest.raises(SpecError, match=r"rollout.round_weights.*'sglang'"):
        parse_spec({"rollout": {"engine": "sglang", "round_weights": "fp16"}, "schedule": {"mode": "async"}})
    with pytest.raises(SpecError, match=r"rollout.round_weights"):
        parse_spec({"rollout": {"round_weights": "fp8"}})
    assert parse_spec({"rollout": {"engine": "server", "round_weights": "bf16"}}).rollout.round_weights == "bf16"
    assert "round_weights" not in parse_spec({}).model_dump()["rollout"]  # unset: old fingerprints stay


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_a_run_whose_engine_rounds_its_weights_measures_the_gap_and_recomputes_by_default(mode):
    from factory.core.loop import train_rl

    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    records = train_rl(_spec(mode, "bf16"), model, tok, PROBLEMS)
    assert len(records) == 2
    for r in records:  # a clean CPU run measures < 1e-5 (tests/core/test_behaviour.py); bf16 rounding ~2e-4 here
        assert 1e-5 < r.gap_abs_mean < 0.1 and r.gap_kl > 0
        assert r.correction_weight_mean is not None  # behavior unset: recompute, with token TIS by default
