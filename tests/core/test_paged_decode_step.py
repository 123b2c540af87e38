"""The paged engine's decode step (`factory/core/rollout/engines/paged/decode_step.py`) and the overlap of step t+1 with
reading step t (`engine.py`): the same completions with and without overlap, capture readiness on the CPU (one
`fullgraph` graph per bucket, never a recompile, no host sync inside a step), and in-place weight updates seen by
the compiled step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.paged.decode_step import RowInput, encode, top_columns
from tests.core.host_sync import NoHostCopy, NoHostSync
from tests.core.paged_models import EOS, generate, paged_engine, perturbed, prompts, tiny, until_eos, word_tokenizer


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()

# seeded, hot and truncated: sequences stop at different steps on stop tokens, so rows join and leave
SAMPLED = SamplingParams(n=2, temperature=1.3, top_p=0.9, max_new_tokens=14, seed=11, stop_token_ids=[5, 17, 40, 99],
                         top_logprobs=3)
GREEDY = SamplingParams(greedy=True, max_new_tokens=10, top_logprobs=2)


def _as_records(groups):
    """What must be identical: tokens, top ids, stops, versions (logprobs: `_assert_logprobs_close`)."""
    return [[(c.token_ids, [[t for t, _ in top] for top in c.top_logprobs or []], c.finish_reason,
              c.meta["stop_reason"], c.token_versions) for c in g] for g in groups]


def _assert_logprobs_close(got, want):
    """Within 1e-5: a row's logits depend on its batch's shape in the last float bits (another bucket, another
    width, another SDPA blocking), and overlap changes which rows share a step."""
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
            if b.top_logprobs:
                np.testing.assert_allclose([[lp for _, lp in t] for t in a.top_logprobs],
                                           [[lp for _, lp in t] for t in b.top_logprobs], atol=1e-5, rtol=0)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_overlap_gives_the_same_completions_stops_and_pages(params, tok):
    model = tiny("qwen3")
    ps = prompts(5, 9, 14, 7, 11, 6, 3, 12)
    # 16 pages of 4 and 4 rows: groups wait for rows and pages, and join as others leave
    plain = paged_engine(model, tok, pages=16, max_batch=4, overlap=False)
    want = plain.generate(ps, params)
    eng = paged_engine(model, tok, pages=16, max_batch=4, overlap=True)
    got = eng.generate(ps, params)
    assert _as_records(got) == _as_records(want)
    _assert_logprobs_close(got, want)
    assert eng.stats.overlapped > 0.8 * eng.stats.steps  # nearly every decode step ran ahead of the host
    assert eng.stats.generated_tokens == plain.stats.generated_tokens == sum(len(c.token_ids) for g in got for c in g)
    assert eng.scheduler.blocks.used_pages == 0 and eng.scheduler.blocks.reserved == 0
    assert not eng.scheduler.has_work() and all(r is None for r in eng.scheduler.rows)
    assert plain.stats.max_running == eng.stats.max_running >= 3 and eng.stats.waited_for_kv > 0
    if params is SAMPLED:  # the stops happened, at different lengths
        reasons = [c.finish_reason for g in got for c in g]
        assert reasons.count("stop") >= 3 and reasons.count("length") >= 1
        stops = (*params.stop_token_ids, EOS)
        assert all(c.token_ids[-1] in stops for g in got for c in g if c.finish_reason == "stop")
        assert all(len(c.top_logprobs) == len(c.token_ids) and len(c.top_logprobs[0]) == 3 for g in got for c in g)
    else:
        for p, g in zip(ps, got, strict=True):
            assert g[0].token_ids == until_eos(generate(model, p, 10))


def test_a_stop_seen_one_step_late_writes_inside_its_reservation(tok):
    """With overlap the step after a stop token still feeds it: its K/V land in the sequence's own reserved pages
    (`BlockManager.append` raises past the final length), and the extra token is dropped."""
    model = tiny("llama")
    p = prompts(8)[0]
    greedy = until_eos(generate(model, p, 6))
    # stop on the 4th greedy token (a page boundary: prompt 8 + 4 fed positions), the 6th is the length limit
    params = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=[greedy[3]])
    # exactly the pages of 8 + 6 positions, and the scratch page (inside the budget too)
    eng = paged_engine(model, tok, pages=5, max_batch=1, overlap=True)
    out = eng.generate([p], params)[0][0]
    assert out.token_ids == greedy[: greedy.index(greedy[3]) + 1] and out.finish_reason == "stop"
    assert eng.stats.steps == len(out.token_ids)  # one decode step past the stop token's, whose sample is dropped
    assert eng.scheduler.blocks.used_pages == 0


def _trace_keys(eng) -> list:
    keys, run = [], eng.decode_step.run

    def traced(key, rows, *rest):
        keys.append(key)
        return run(key, rows, *rest)

    eng.decode_step.run = traced
    return keys


def test_the_compiled_step_has_one_graph_per_bucket_and_no_recompile_over_50_steps(tok):
    """Also: an in-place weight update reaches the compiled step (weights are read by address, not baked in)."""
    model, fresh = tiny("qwen2"), perturbed("qwen2")
    ps = prompts(5, 9, 14, 7, 11, 6, 3, 12, 4, 10)
    calls = [(ps[:1], GREEDY), (ps, SAMPLED), (ps[3:5], GREEDY)]  # 1, 2 and 4 rows; with and without top-p
    eager = paged_engine(model, tok, pages=32, max_batch=4)
    want = [eager.generate(p, params) for p, params in calls]
    torch._dynamo.reset()
    counters.clear()
    eng = paged_engine(model, tok, pages=32, max_batch=4, overlap=True)
    eng.decode_step.compile("aot_eager")  # functionalized by AOT autograd, as Inductor and capture trace it
    keys = _trace_keys(eng)
    with torch._dynamo.config.patch(recompile_limit=64):
        got = [eng.generate(p, params) for p, params in calls]
    assert eng.stats.steps >= 50 and eng.stats.prefills >= 6  # requests joined while others decoded
    assert [_as_records(g) for g in got] == [_as_records(w) for w in want]
    for g, w in zip(got, want, strict=True):
        _assert_logprobs_close(g, w)
    assert {k.rows for k in keys} == {1, 2, 4} and {k.truncate for k in keys} == {False, True}
    # a graph per bucket met, each compiled once: a bucket met again (joins, leaves, other rows) reuses its graph
    assert len(set(keys)) >= 3 and len(keys) > 3 * len(set(keys))
    assert counters["stats"]["unique_graphs"] == len(set(keys))
    assert not counters["graph_break"]

    weights = [p.data_ptr() for p in model.parameters()]
    eng.load_weights(fresh.state_dict(), 3)
    assert [p.data_ptr() for p in model.parameters()] == weights  # copied in place: a graph's addresses hold
    seen = len(keys)
    with torch._dynamo.config.patch(recompile_limit=64):
        after = eng.generate(ps[3:5], GREEDY)
    assert set(keys[seen:]) <= set(keys[:seen])  # the buckets met before...
    assert counters["stats"]["unique_graphs"] == len(set(keys))  # ...and no recompile for the new weights
    assert [g[0].token_ids for g in after] == [until_eos(generate(fresh, p, 10)) for p in ps[3:5]]
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in got[2]]
    torch._dynamo.reset()


def test_nothing_in_a_step_reads_the_device_on_the_host(tok, monkeypatch):
    eng = paged_engine(tiny("llama"), tok, pages=32, max_batch=4, overlap=True)
    forward, steps = eng.decode_step.forward, []

    def guarded(key):
        with NoHostSync(), NoHostCopy():
            out = forward(key)
        steps.append(key)
        return out

    monkeypatch.setattr(eng.decode_step, "forward", guarded)
    eng.generate(prompts(5, 9, 14, 7, 11), SAMPLED)
    assert len(steps) == eng.stats.steps > 20
    # the guard fails a step that syncs (an .item() slipped into the model's forward)
    decode = eng.runner.decode
    monkeypatch.setattr(eng.runner, "decode", lambda t, p, tb: decode(t, p, tb) * (t.sum().item() >= 0))
    with pytest.raises(AssertionError, match="host sync"):
        eng.generate(prompts(5), SAMPLED)


def test_inputs_encode_floats_exactly_and_idle_rows_neutrally():
    rows = [RowInput(2, 17, 3, 2**62 + 5, 7, False, 0.7, 0.95, 4, 33), RowInput(0, 4, 0, -3, 0, True, 1.0, 1.0)]
    block = encode(rows, 4)
    assert block[:, 0].tolist() == [1, 0, 1, 0]
    assert block[2, 1:6].tolist() == [17, 3, 2**62 + 5, 7, 0] and block[2, 8:].tolist() == [4, 33]
    floats = block[:, 6:8].astype(np.int32).view(np.float32)
    assert floats.tolist() == [[1.0, 1.0], [1.0, 1.0], [np.float32(0.7), np.float32(0.95)], [1.0, 1.0]]
    assert block[[1, 3], 8].tolist() == [-1, -1]
    assert [top_columns(k) for k in (0, 1, 2, 3, 5, 20)] == [0, 1, 2, 4, 8, 32]
