"""The paged engine against transformers and the trainer: tiny random-init models (seed 0, fp32, initializer_range
0.2 so tokens depend on the context) must generate what `generate` does, with the trainer's logprobs, whatever the
batching, the budget or the weights."""

from __future__ import annotations

import logging

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedTokenizerFast

from factory.core.batch import pack
from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.engines.kv_budget import mib
from factory.core.rollout.engines.paged import sampling
from factory.core.rollout.engines.paged.engine import PagedEngine, make_engine
from factory.core.rollout.engines.sequences import mix_seed
from factory.core.trainer.torch_trainer import token_logprobs
from tests.core.paged_models import (
    EOS,
    PAGE,
    generate,
    hf_logits,
    paged_engine,
    perturbed,
    prompts,
    tiny,
    until_eos,
    word_tokenizer,
)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return word_tokenizer()



ARCHS = ["llama", "qwen2", "qwen3", "mistral"]  # every architecture of the paged path



def trainer_logprobs(model, comps, temperature: float) -> torch.Tensor:
    batch = pack([c.prompt_ids for c in comps], [c.token_ids for c in comps], 0, {"old": [c.logprobs for c in comps]})
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=temperature)
    return (logp - batch.per_token["old"]).abs()[batch.loss_mask]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_generate_and_trainer_logprobs(arch, overlap, tok):
    model = tiny(arch)
    ps = prompts(3, 9, 17, 6)
    eng = paged_engine(model, tok, max_batch=4, overlap=overlap)
    out = eng.generate(ps, SamplingParams(greedy=True, max_new_tokens=12))
    comps = [g[0] for g in out]
    for p, c in zip(ps, comps, strict=True):
        assert c.token_ids == until_eos(generate(model, p, 12))
        assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS else "length")
        assert c.token_versions == [0] * len(c.token_ids)
    assert trainer_logprobs(model, comps, 1.0).max().item() < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_samples_same_alone_and_batched(arch, tok):
    model = tiny(arch)
    p, *others = prompts(10, 5, 13)
    params = SamplingParams(n=4, temperature=0.9, top_p=0.8, max_new_tokens=10, seed=3)
    alone = paged_engine(model, tok).generate([p], params)[0]
    batched = paged_engine(model, tok, max_batch=12).generate([p, *others], params)
    assert [c.token_ids for c in alone] == [c.token_ids for c in batched[0]]
    assert len({tuple(c.token_ids) for c in alone}) > 1  # the forks sample on their own
    comps = [c for g in batched for c in g]
    assert trainer_logprobs(model, comps, 0.9).max().item() < 1e-5
    # the contract: sample j draws with seed mix_seed(seed, j) and counter = tokens so far, from the model's logits
    for j, c in enumerate(alone):
        for t, token in enumerate(c.token_ids):
            k = sampling.knobs([0.9], [0.8], [0], [False], [mix_seed(3, j)], [t])
            assert int(sampling.sample(hf_logits(model, p + c.token_ids[:t])[None], k).tokens[0]) == token


def test_more_requests_than_the_budget_wait_and_match_one_at_a_time(tok):
    model = tiny("llama")
    ps = prompts(5, 9, 14, 7, 11)
    params = SamplingParams(n=2, greedy=True, max_new_tokens=8)
    # 16 pages of 4; a group of two samples needs 7 to 9 of them: at most two groups run at once
    small = paged_engine(model, tok, pages=16)
    together = small.generate(ps, params)
    assert small.stats.waited_for_kv > 0 and small.stats.max_running == 4
    assert small.scheduler.blocks.used_pages == 0 and not small.scheduler.has_work()
    one = paged_engine(model, tok, pages=16)
    for p, group in zip(ps, together, strict=True):
        want = until_eos(generate(model, p, 8))
        assert [c.token_ids for c in one.generate([p], params)[0]] == [c.token_ids for c in group] == [want] * 2


def test_load_weights_changes_outputs_and_version(tok):
    model, fresh = tiny("qwen2"), perturbed("qwen2")
    ps = prompts(9, 13)  # full pages: the prefix cache holds them across calls
    eng = paged_engine(model, tok)
    params = SamplingParams(greedy=True, max_new_tokens=8)
    before = [g[0].token_ids for g in eng.generate(ps, params)]
    want = [until_eos(generate(fresh, p, 8)) for p in ps]
    assert before != want
    eng.load_weights(fresh.state_dict(), 7)
    after = eng.generate(ps, params)
    assert [g[0].token_ids for g in after] == want
    assert eng.weight_version == 7 and all(g[0].weight_version == 7 for g in after)


def test_make_engine_falls_back_with_a_log_line(tok, caplog):
    assert isinstance(make_engine(tiny("llama"), tok, page_size=PAGE, kv_budget=1 << 20), PagedEngine)
    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128))
    with caplog.at_level(logging.INFO, logger="factory.core.rollout.engines.paged.engine"):
        eng = make_engine(gpt2, tok, page_size=PAGE, kv_budget=1 << 20)
    assert isinstance(eng, ContinuousEngine)
    lines = [r.getMessage() for r in caplog.records if r.name == "factory.core.rollout.engines.paged.engine"]
    assert len(lines) == 1 and "model_type 'gpt2'" in lines[0]


def test_check_names_what_cannot_run(tok):
    eng = paged_engine(tiny("llama"), tok, pages=4, max_batch=2)
    with pytest.raises(ValueError, match="KV cache budget") as refused:
        eng.check(prompts(10)[0], SamplingParams(max_new_tokens=10))
    assert mib(eng.kv.total_bytes) in str(refused.value)  # the whole budget the user set, scratch page included
    blocks = eng.scheduler.blocks
    assert blocks.budget.total_bytes == eng.kv.total_bytes and blocks.num_pages == 3  # 4 pages, one the scratch
    with pytest.raises(ValueError, match="max_batch of 2"):
        eng.check(prompts(3)[0], SamplingParams(n=3))


def test_prefix_cache_reuses_pages_within_and_across_calls(tok):
    model = tiny("llama")
    a, b = prompts(10, 13)
    ps = [a, b, a, b[:9] + a[:3]]  # a twice in one prefill; b's first two pages again under another tail
    eng = paged_engine(model, tok)
    params = SamplingParams(greedy=True, max_new_tokens=6)
    first = eng.generate(ps, params)
    computed = eng.stats.prefill_tokens
    # the repeated a joins the first a's group (forked, not prefilled); b's head skips two pages of 4
    assert computed == sum(map(len, ps)) - 10 - 2 * 4
    second = eng.generate(ps, params)
    # each prompt computes only its last token's page: a 2 (of 10), b 1 (of 13), the last 4 (a full page)
    assert eng.stats.prefill_tokens - computed == 2 + 1 + 4
    for p, g1, g2 in zip(ps, first, second, strict=True):
        assert g1[0].token_ids == g2[0].token_ids == until_eos(generate(model, p, 6))


def test_ignore_eos_runs_past_eos_to_max_new_tokens_in_both_engines():
    model = tiny("qwen2")
    p = prompts(9)[0]
    want = generate(model, p, 12)
    eos = want[2]  # a tokenizer whose EOS the model emits third
    vocab = {f"t{i}": i for i in range(128)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  eos_token=f"t{eos}", pad_token="t0")
    for eng in (paged_engine(model, tok), ContinuousEngine(model, tok, max_batch=2)):
        stopped = eng.generate([p], SamplingParams(greedy=True, max_new_tokens=12))[0][0]
        assert stopped.token_ids == want[:3] and stopped.finish_reason == "stop", type(eng).__name__
        full = eng.generate([p], SamplingParams(greedy=True, max_new_tokens=12, ignore_eos=True))[0][0]
        assert full.token_ids == want and full.finish_reason == "length", type(eng).__name__


def test_one_sampling_params_per_prompt_run_together(tok):
    model = tiny("llama")
    ps = prompts(5, 9, 14)
    lengths = [3, 11, 6]
    eng = paged_engine(model, tok)
    out = eng.generate(ps, [SamplingParams(greedy=True, max_new_tokens=m, ignore_eos=True) for m in lengths])
    assert [g[0].token_ids for g in out] == [generate(model, p, m) for p, m in zip(ps, lengths, strict=True)]
    assert eng.stats.max_running == 3  # one batch, not one call per request
    seeded = [SamplingParams(n=2, temperature=0.8, max_new_tokens=5, seed=4)] * 3
    assert ([[c.token_ids for c in g] for g in eng.generate(ps, seeded)]
            == [[c.token_ids for c in g] for g in eng.generate(ps, seeded[0])])  # a list of one params is that params
    with pytest.raises(ValueError, match=r"params: expected one SamplingParams or one per prompt \(3\), got 2"):
        eng.generate(ps, seeded[:2])
