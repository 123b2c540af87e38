"""The continuous-batching engine: exact against transformers and the trainer while requests join and leave."""

from __future__ import annotations

import threading

import pytest
import torch

from factory.core.batch import pack
from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.continuous import ContinuousEngine, SlotKVCache
from factory.core.trainer.torch_trainer import token_logprobs
from tests.core.engine_cases import sharp_model

PROMPTS = ["1+2=", "123+456=", "99*9=", "7", "5555+5555=", "1-1=", "2*3*4*5=", "31-4*1="]


def reference_greedy(model, tok, prompt: str, max_new: int) -> list[int]:
    ids = torch.tensor([tok(prompt).input_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def run_staggered(eng: ContinuousEngine, prompts: list[list[int]], params: list[SamplingParams],
                  every: int = 2) -> list:
    """Submit one request every `every` decode steps while earlier ones run; return the completions."""
    futures = []
    for p, sp in zip(prompts, params, strict=True):
        futures.append(eng.submit(p, sp))
        for _ in range(every):
            eng.step()
    while not all(f.done() for f in futures):
        assert eng.step()
    return [f.result() for f in futures]


@pytest.mark.slow
def test_greedy_matches_generate_when_requests_arrive_at_different_times():
    model, tok = sharp_model()
    # 3 slots for 8 requests with different lengths: rows are refilled, prompts shift the layout right,
    # finished rows are compacted away, and a small initial KV width forces growth.
    eng = ContinuousEngine(model, tok, max_batch=3, kv_capacity=8)
    max_new = [20, 6, 14, 25, 3, 18, 9, 12]
    comps = run_staggered(eng, [tok(p).input_ids for p in PROMPTS],
                          [SamplingParams(greedy=True, max_new_tokens=m) for m in max_new])
    reasons = set()
    for prompt, m, c in zip(PROMPTS, max_new, comps, strict=True):
        ref = reference_greedy(model, tok, prompt, m)
        ref = ref[: ref.index(tok.eos_token_id) + 1] if tok.eos_token_id in ref else ref
        assert c.token_ids == ref, prompt
        assert c.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
        reasons.add(c.finish_reason)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert reasons == {"stop", "length"}  # both stop paths were exercised
    assert eng.stats.max_running == 3 and eng.running == 0 and eng._cache.width == 0


def test_logprobs_equal_trainer_logprobs_under_continuous_batching():
    model, tok = sharp_model(seed=1)
    eng = ContinuousEngine(model, tok, max_batch=4)
    params = [SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5 + 3 * (i % 4), seed=i)
              for i in range(len(PROMPTS))]
    comps = run_staggered(eng, [tok(p).input_ids for p in PROMPTS], params, every=1)
    batch = pack([c.prompt_ids for c in comps], [c.token_ids for c in comps], tok.pad_token_id,
                 {"old": [c.logprobs for c in comps]})
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=0.7)
    diff = (logp - batch.per_token["old"]).abs()[batch.loss_mask]
    assert diff.max().item() < 1e-4


@pytest.mark.slow
def test_seeded_samples_do_not_depend_on_batching():
    model, tok = sharp_model()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=11)
    prompts = [tok(p).input_ids for p in PROMPTS[:4]]
    wide = ContinuousEngine(model, tok, max_batch=16).generate(prompts, params)
    narrow = ContinuousEngine(model, tok, max_batch=2).generate(prompts, params)
    assert [[c.token_ids for c in g] for g in wide] == [[c.token_ids for c in g] for g in narrow]
    assert [len(g) for g in wide] == [3, 3, 3, 3]
    samples = [c.token_ids for g in wide for c in g]
    assert len({tuple(s) for s in samples}) > len(prompts)  # samples of one prompt differ
    other = ContinuousEngine(model, tok).generate(prompts, SamplingParams(n=3, max_new_tokens=8, seed=12))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in wide]


def test_tiny_top_p_is_greedy_and_temperature_scales_logprobs():
    model, tok = sharp_model()
    eng = ContinuousEngine(model, tok)
    prompts = [tok(p).input_ids for p in PROMPTS[:3]]
    greedy = eng.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6))
    nucleus = eng.generate(prompts, SamplingParams(n=4, top_p=1e-6, max_new_tokens=6, seed=0))
    for (ref,), group in zip(greedy, nucleus, strict=True):
        assert all(c.token_ids == ref.token_ids for c in group)


def test_stop_strings_stop_tokens_ignore_eos_and_top_logprobs():
    model, tok = sharp_model()
    eng = ContinuousEngine(model, tok)
    prompt = tok("5555+5555=").input_ids
    free = eng.generate([prompt], SamplingParams(greedy=True, max_new_tokens=20, ignore_eos=True))[0][0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    text = tok.decode(free.token_ids, skip_special_tokens=True)
    stop = text[3:5]
    cut = eng.generate([prompt], SamplingParams(greedy=True, max_new_tokens=20, ignore_eos=True,
                                                stop=(stop,)))[0][0]
    assert cut.finish_reason == "stop" and cut.meta["stop_reason"] == stop
    assert cut.text == text[: text.find(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]  # the tokens that completed the stop string stay
    stop_id = free.token_ids[2]
    by_id = eng.generate([prompt], SamplingParams(greedy=True, max_new_tokens=20, ignore_eos=True,
                                                  stop_token_ids=(stop_id,)))[0][0]
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop" and by_id.meta["stop_reason"] == stop_id
    top = eng.generate([prompt], SamplingParams(greedy=True, max_new_tokens=4, top_logprobs=3))[0][0]
    assert len(top.top_logprobs) == len(top.token_ids)
    for tid, lp, alts in zip(top.token_ids, top.logprobs, top.top_logprobs, strict=True):
        assert len(alts) == 3 and alts[0] == (tid, pytest.approx(lp))  # greedy: the sampled token is the top one


def test_requests_that_cannot_run_are_refused():
    model, tok = sharp_model()
    eng = ContinuousEngine(model, tok)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        eng.submit([1, 4], SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="maximum context length is 64"):
        eng.submit([1] * 60, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        eng.submit([], SamplingParams())
    with pytest.raises(ValueError, match="mode must be one of"):
        eng.update_weights({}, 1, mode="sometime")


def test_finish_old_update_drains_running_requests_first():
    old, tok = sharp_model(seed=0)
    new_state = sharp_model(seed=3)[0].state_dict()
    ref_old = ContinuousEngine(sharp_model(seed=0)[0], tok)
    ref_new = ContinuousEngine(sharp_model(seed=3)[0], tok)
    eng = ContinuousEngine(old, tok, weight_version=4)
    params = SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True)
    a = eng.submit(tok(PROMPTS[1]).input_ids, params)
    for _ in range(3):
        eng.step()
    update = eng.update_weights(new_state, 5, mode="finish_old")
    b = eng.submit(tok(PROMPTS[2]).input_ids, params)
    while not (a.done() and b.done() and update.done()):
        assert eng.step()
    ca, cb = a.result(), b.result()
    assert update.result() == 5 and eng.weight_version == 5
    assert ca.token_versions == [4] * 12 and ca.weight_version == 4
    assert cb.token_versions == [5] * 12 and cb.weight_version == 5
    assert ca.token_ids == ref_old.generate([ca.prompt_ids], params)[0][0].token_ids
    assert cb.token_ids == ref_new.generate([cb.prompt_ids], params)[0][0].token_ids


def test_in_flight_update_switches_weights_mid_sequence():
    old, tok = sharp_model(seed=0)
    new_state = sharp_model(seed=3)[0].state_dict()
    ref_old = ContinuousEngine(sharp_model(seed=0)[0], tok)
    eng = ContinuousEngine(old, tok, weight_version=0)
    params = SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True)
    prompt = tok(PROMPTS[1]).input_ids
    fut = eng.submit(prompt, params)
    eng.step()  # prefill (token 1) + one decode step (token 2)
    eng.step()  # token 3
    update = eng.update_weights(new_state, 1, mode="in_flight")
    while not fut.done():
        assert eng.step()
    c = fut.result()
    assert update.result() == 1
    assert c.token_versions == [0, 0, 0] + [1] * 9
    assert c.weight_version == 0  # the oldest version that contributed
    old_only = ref_old.generate([prompt], params)[0][0]
    assert c.token_ids[:3] == old_only.token_ids[:3]
    assert c.logprobs[3:] != old_only.logprobs[3:]


def test_load_weights_checks_the_state_dict():
    model, tok = sharp_model()
    eng = ContinuousEngine(model, tok)
    with pytest.raises(ValueError, match="does not fit"):
        eng.load_weights({"nonsense": torch.zeros(1)}, 3)
    assert eng.weight_version == 0
    eng.load_weights(sharp_model(seed=2)[0].state_dict(), 3)
    c = eng.generate([tok("1+2=").input_ids], SamplingParams(greedy=True, max_new_tokens=3))[0][0]
    assert c.weight_version == 3 and c.token_versions == [3] * len(c.token_ids)


@pytest.mark.slow
def test_background_thread_batches_concurrent_callers_and_honours_pause_and_cancel():
    model, tok = sharp_model()
    eng = ContinuousEngine(model, tok, max_batch=8).start()
    try:
        eng.pause("drain")
        params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=0)
        futures = [eng.submit(tok(p).input_ids, params) for p in PROMPTS[:6]]
        doomed = eng.submit(tok(PROMPTS[6]).input_ids, params)
        assert eng.wait_until(lambda: eng.queued == 7, timeout=5)
        assert eng.running == 0 and eng.stats.prefills == 0  # paused: nothing admitted
        doomed.cancel()
        eng.resume()
        results = [f.result(timeout=30) for f in futures]
        assert all(len(c.token_ids) == 10 for c in results)
        assert eng.stats.prefills == 1 and eng.stats.max_running == 6  # all six joined in one step
        # in_place pause freezes running rows; they resume where they were
        long = eng.submit(tok(PROMPTS[0]).input_ids, SamplingParams(greedy=True, max_new_tokens=55,
                                                                    ignore_eos=True))
        assert eng.wait_until(lambda: eng.running == 1, timeout=5)
        eng.pause("in_place")
        with eng._step_lock:  # a step that began before the pause has ended
            steps = eng.stats.steps
        assert not eng.wait_until(lambda: eng.stats.steps > steps, timeout=0.3)
        assert not long.done() and eng.running == 1
        eng.resume()
        assert len(long.result(timeout=30).token_ids) == 55
        # generate() from another thread goes through the running loop
        out: list = []
        t = threading.Thread(target=lambda: out.append(eng.generate([tok("7").input_ids],
                                                                    SamplingParams(max_new_tokens=3))))
        t.start()
        t.join(30)
        assert len(out[0][0][0].token_ids) <= 3
        assert eng.flush_cache() and eng._cache.capacity == 0
        eng.pause("drain")
        orphan = eng.submit(tok("7").input_ids, SamplingParams(max_new_tokens=3))
    finally:
        eng.stop()
    with pytest.raises(RuntimeError, match="engine stopped"):
        orphan.result(timeout=1)


def test_slot_cache_compaction_keeps_rows_and_drops_dead_columns():
    cache = SlotKVCache(slots=4, initial_capacity=4)
    k = torch.arange(2 * 1 * 3 * 1, dtype=torch.float32).reshape(2, 1, 3, 1)  # 2 prompts, padded to 3
    cache.insert([(k, k.clone())], torch.tensor([0, 1]), [3, 2])
    assert cache.n == 2 and cache.width == 3 and cache.start[:2] == [0, 1]
    cache.reserve_decode()
    cache.update(torch.full((2, 1, 1, 1), 9.0), torch.full((2, 1, 1, 1), 9.0), 0)
    cache.width += 1
    cache.remove(0)  # row 1 moves into row 0
    assert cache.n == 1 and cache.start[0] == 1
    cache.compact()
    assert cache.width == 3 and cache.start[0] == 0
    assert cache.keys[0][0, 0, :3, 0].tolist() == [4.0, 5.0, 9.0]


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on():
    model, tok = sharp_model()
    eng = ContinuousEngine(model, tok).start()
    forward, calls = model.forward, []

    def flaky(*args, **kwargs):  # the third forward call (a decode step) raises
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    model.forward = flaky
    try:
        doomed = eng.submit(tok("1+2=").input_ids, SamplingParams(max_new_tokens=10, ignore_eos=True))
        with pytest.raises(RuntimeError, match="injected failure"):
            doomed.result(timeout=30)
        ok = eng.submit(tok("1+2=").input_ids, SamplingParams(max_new_tokens=10, ignore_eos=True))
        assert len(ok.result(timeout=30).token_ids) == 10
    finally:
        eng.stop()


SMOLLM2_QUESTIONS = ["What is 17 + 25? Answer with just the number.", "Name a primary colour.",
                     "Write a haiku about the sea.", "Is 91 a prime number?"]


@pytest.mark.slow
def test_smollm2_greedy_equals_generate_token_for_token(smollm2_dir):
    """The real SmolLM2-135M-Instruct (Llama, ChatML): prompts rendered with its chat template, requests
    joining while others decode, each completion equal to transformers `generate`'s."""
    from factory.models.hf import load_model_dir
    from factory.models.prompting import prompt_ids

    model, tok = load_model_dir(smollm2_dir)
    model.eval()
    prompts = [prompt_ids(tok, q) for q in SMOLLM2_QUESTIONS]
    assert all(tok.decode(p).startswith("<|im_start|>") for p in prompts)  # the template was applied
    eng = ContinuousEngine(model, tok, max_batch=3, kv_capacity=16)
    max_new = [24, 16, 24, 20]
    futures = []
    for p, m in zip(prompts, max_new, strict=True):
        futures.append(eng.submit(p, SamplingParams(greedy=True, max_new_tokens=m)))
        eng.step()
    while not all(f.done() for f in futures):
        assert eng.step()
    for p, m, f in zip(prompts, max_new, futures, strict=True):
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        assert f.result().token_ids == out[0, len(p):].tolist(), tok.decode(p)
    assert eng.stats.max_running == 3
