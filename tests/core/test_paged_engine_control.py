"""The paged engine's control surface (engine_control.py), against ContinuousEngine on the same tiny model: submit /
futures with the background thread, cancellation, both weight-update modes with per-token versions, pause modes,
constrained decoding, a failing step, and what `info` says about pages."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.continuous import ContinuousEngine
from tests.core.paged_models import PAGE, generate, paged_engine, perturbed, prompts, tiny, word_tokenizer

GREEDY = SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return word_tokenizer()



def other_weights(arch: str) -> dict:
    return perturbed(arch).state_dict()


@pytest.mark.parametrize("overlap", [False, True])
def test_thread_submit_groups_separate_samples_and_cancel_drops(tok, overlap):
    model = tiny("llama")
    p, q = prompts(9, 6)
    eng = paged_engine(model, tok, max_batch=8, overlap=overlap).start()
    try:
        eng.pause("drain")
        params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=4)
        futures = [eng.submit(p, params, sample_index=j) for j in range(3)]  # one prompt's samples, one by one
        futures.append(eng.submit(q, GREEDY))
        doomed = eng.submit(q, SamplingParams(max_new_tokens=5))
        assert eng.wait_until(lambda: eng.queued == 5, timeout=30)
        assert eng.running == 0 and eng.stats.prefills == 0  # paused: nothing admitted
        doomed.cancel()
        eng.resume()
        results = [f.result(timeout=60) for f in futures]
    finally:
        eng.stop()
    assert all(len(c.token_ids) == 10 for c in results[:3]) and len(results[3].token_ids) == 12
    # the three samples of p were prefilled once (forked), q once: one prefill of both prompts' tokens
    assert eng.stats.prefills == 1 and eng.stats.prefill_tokens == len(p) + len(q)
    assert len({tuple(c.token_ids) for c in results[:3]}) == 3
    assert results[3].token_ids == generate(model, q, 12)
    # seeded samples are those generate() gives (sample j: seed mix_seed(4, j)), alone and without the thread
    again = paged_engine(model, tok).generate([p], SamplingParams(n=3, temperature=1.0, max_new_tokens=10,
                                                           ignore_eos=True, seed=4))[0]
    assert [c.token_ids for c in again] == [c.token_ids for c in results[:3]]
    assert eng.scheduler.blocks.used_pages == 0 and eng.queued == 0 and eng.running == 0


def test_stop_fails_what_is_queued(tok):
    eng = paged_engine(tiny("llama"), tok).start()
    eng.pause("drain")
    orphan = eng.submit(prompts(5)[0], SamplingParams(max_new_tokens=3))
    eng.stop()
    with pytest.raises(RuntimeError, match="engine stopped"):
        orphan.result(timeout=1)


def staggered(eng, prompt: list[int], update: dict, mode: str):
    """Run `prompt` three tokens, queue a weight update in `mode` and a second request, run both to the end."""
    a = eng.submit(prompt, GREEDY)
    eng.step()  # prefill (token 1) + one decode step (token 2)
    eng.step()  # token 3
    upd = eng.update_weights(update, 1, mode=mode)
    b = eng.submit(prompt, GREEDY)
    while not (a.done() and b.done() and upd.done()):
        assert eng.step()
    assert upd.result() == 1 and eng.weight_version == 1
    return a.result(), b.result()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("overlap", [False, True])
def test_in_flight_update_matches_continuous_engine_and_keeps_parameter_tensors(arch, tok, overlap):
    new = other_weights(arch)
    model = tiny(arch)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    pa, pb = staggered(paged_engine(model, tok, overlap=overlap), prompts(9)[0], new, "in_flight")
    ca, cb = staggered(ContinuousEngine(tiny(arch), tok), prompts(9)[0], new, "in_flight")
    assert pa.token_versions == ca.token_versions == [0, 0, 0] + [1] * 9  # later tokens carry the new version
    assert pa.weight_version == 0 and pb.token_versions == [1] * 12
    assert pa.token_ids == ca.token_ids and pb.token_ids == cb.token_ids
    assert max(abs(x - y) for x, y in zip(pa.logprobs, ca.logprobs, strict=True)) < 1e-4
    assert pa.token_ids[:3] == generate(tiny(arch), prompts(9)[0], 3)
    # copied into the same tensors (captured graphs keep reading them), and the weights are the new ones
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert all(torch.equal(p, new[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("overlap", [False, True])
def test_finish_old_update_drains_first_and_flushes_the_prefix_cache(tok, overlap):
    new = other_weights("llama")
    eng = paged_engine(tiny("llama"), tok, overlap=overlap)
    prompt = prompts(9)[0]  # two full pages: the second request would find them in the prefix cache
    a, b = staggered(eng, prompt, new, "finish_old")
    assert a.token_versions == [0] * 12 and b.token_versions == [1] * 12
    assert a.token_ids == generate(tiny("llama"), prompt, 12)
    fresh = tiny("llama")
    fresh.load_state_dict(new)
    assert b.token_ids == generate(fresh, prompt, 12)  # not the old weights' cached K/V
    assert eng.stats.prefill_tokens == 2 * len(prompt)


def test_pause_in_place_freezes_and_drain_holds_admissions(tok):
    model = tiny("llama")
    p, q = prompts(7, 5)
    eng = paged_engine(model, tok)
    a = eng.submit(p, GREEDY)
    eng.step()
    eng.pause("in_place")
    steps = eng.stats.steps
    assert not eng.step() and eng.stats.steps == steps and eng.running == 1  # no decoding, rows and pages kept
    with pytest.raises(RuntimeError, match="paused in place"):
        eng.load_weights(other_weights("llama"), 3)  # finish_old cannot drain a frozen row
    eng._updates.clear()
    eng.pause("drain")
    b = eng.submit(q, GREEDY)
    assert eng.step() and eng.running == 1 and eng.queued == 1  # a decodes, b waits
    eng.resume()
    while not (a.done() and b.done()):
        assert eng.step()
    assert a.result().token_ids == generate(model, p, 12) and b.result().token_ids == generate(model, q, 12)


@pytest.mark.parametrize("overlap", [False, True])
def test_choices_greedy_and_logprobs_equal_continuous_engine(tok, overlap):
    p, q = prompts(6, 11)
    choices = ((5, 9, 14), (5, 9, 30, 2), (77,), (5, 60))
    params = SamplingParams(greedy=True, max_new_tokens=6, choices=choices)
    sampled = SamplingParams(n=4, temperature=1.3, max_new_tokens=6, choices=choices, seed=2)
    out = paged_engine(tiny("qwen2"), tok, overlap=overlap).generate([p, q], params)
    want = ContinuousEngine(tiny("qwen2"), tok).generate([p, q], params)
    for (c,), (w,) in zip(out, want, strict=True):
        assert tuple(c.token_ids) in choices and c.token_ids == w.token_ids and c.finish_reason == "stop"
        assert max(abs(x - y) for x, y in zip(c.logprobs, w.logprobs, strict=True)) < 1e-5
    # sampled: every completion is a choice; a choice's first token's logprob is over the allowed tokens only
    eng = paged_engine(tiny("qwen2"), tok, overlap=overlap)
    comps = eng.generate([p], sampled)[0]
    assert all(tuple(c.token_ids) in choices for c in comps)
    with torch.no_grad():
        logits = tiny("qwen2")(torch.tensor([p])).logits[0, -1] / 1.3
    allowed = torch.tensor([5, 77])
    renorm = torch.log_softmax(logits[allowed], dim=-1)
    for c in comps:
        assert c.logprobs[0] == pytest.approx(renorm[allowed.tolist().index(c.token_ids[0])].item(), abs=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tok, overlap):
    model = tiny("llama")
    p = prompts(9)[0]
    eng = paged_engine(model, tok, overlap=overlap)
    decode, calls = eng.runner.decode, []

    def flaky(*args, **kwargs):  # the third decode step raises
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return decode(*args, **kwargs)

    eng.runner.decode = flaky
    doomed = [eng.submit(p, GREEDY, sample_index=j) for j in range(2)]
    with pytest.raises(RuntimeError, match="injected failure"):
        while True:
            eng.step()
    for f in doomed:
        with pytest.raises(RuntimeError, match="injected failure"):
            f.result(timeout=0)
    assert eng.running == 0 and eng.scheduler.blocks.used_pages == 0
    assert len(eng.scheduler.blocks.prefix or ()) == 0  # half-written pages are not found again
    ok = eng.generate([p], GREEDY)[0][0]
    assert ok.token_ids == generate(model, p, 12)


def test_info_reports_pages_and_max_new_tokens_the_budget(tok):
    eng = paged_engine(tiny("llama"), tok, pages=17, max_batch=2)  # 16 pages and the scratch page
    a = eng.submit(prompts(9)[0], SamplingParams(greedy=True, max_new_tokens=7))  # 16 positions: 4 pages
    eng.step()
    info = eng.info()
    assert info["engine"] == "paged" and info["page_size"] == PAGE and info["pages_total"] == 16
    assert info["pages_used"] == 3 and info["pages_committed"] == 4 and info["pages_free"] == 13
    assert info["running"] == 1 and info["kv_budget_bytes"] == eng.kv.total_bytes
    assert info["kv_allocated_bytes"] == eng.store.nbytes == info["kv_budget_bytes"]  # the scratch page inside
    assert eng.max_new_tokens(10) == 16 * PAGE - 10
    while not a.done():
        eng.step()
    assert eng.flush_cache() and eng.info()["prefix_cache_pages"] == 0
