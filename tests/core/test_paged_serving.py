"""The paged engine's weights in the serving dtype (factory/core/rollout/engines/paged/serving.py): bf16 only for bf16
on CUDA; a bf16 model runs on the CPU's bf16 as transformers does; fp32 updates land in bf16 parameters in place; a
model shared with a trainer is never cast, its serving copy follows it."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.paged import engine as engine_module
from factory.core.rollout.engines.paged.engine import PagedEngine
from factory.core.rollout.engines.paged.serving import cast_parameters, copy_weights, serving_copy, serving_dtype
from tests.core.paged_models import paged_engine, prompts, tiny, word_tokenizer

BF16 = torch.bfloat16
# bf16 keeps 8 bits of mantissa: the engine's packed, paged attention and transformers' own forward round in other
# orders. Measured on these tiny models (4 prompts x 24 tokens each): engine vs transformers in bf16 differ by at
# most 0.03 in a token's logprob, transformers bf16 vs fp32 by up to 0.11.
BF16_LOGPROB_TOL = 0.05


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return word_tokenizer()


def engine(model, tok, dtype=torch.float32, pages: int = 64, **kw) -> PagedEngine:
    return paged_engine(model, tok, pages, dtype, **kw)


@torch.no_grad()
def teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probabilities [len(tokens), vocab] of the model's own forward over prompt + tokens."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1)


def test_serving_dtype_is_bf16_only_for_bf16_on_cuda():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert serving_dtype(cuda, "bf16", torch.float32) == BF16
    assert serving_dtype(cuda, "fp32", torch.float32) == torch.float32
    assert serving_dtype(cpu, "bf16", torch.float32) == torch.float32  # the CPU stays fp32
    assert serving_dtype(cpu, "fp32", BF16) == BF16  # a model handed over in bf16 runs as it is
    with pytest.raises(ValueError, match="precision: expected one of fp32, bf16, got 'fp16'"):
        serving_dtype(cpu, "fp16", torch.float32)


def test_serving_copy_casts_parameters_keeps_buffers_ties_and_the_source():
    source = tiny("qwen2", tie_word_embeddings=True)
    before = {k: v.clone() for k, v in source.state_dict().items()}
    served = serving_copy(source, BF16)
    assert all(p.dtype == BF16 and not p.requires_grad for p in served.parameters())
    assert served.lm_head.weight is served.model.embed_tokens.weight  # still tied: one tensor
    assert served.model.rotary_emb.inv_freq.dtype == torch.float32  # as transformers keeps it in a bf16 model
    assert all(p.dtype == torch.float32 for p in source.parameters())  # the source is untouched
    assert all(torch.equal(v, before[k]) for k, v in source.state_dict().items())
    mine, theirs = dict(served.named_parameters()), dict(source.named_parameters())
    assert all(torch.equal(p, theirs[k].to(BF16)) and p.data_ptr() != theirs[k].data_ptr() for k, p in mine.items())


def test_a_bf16_model_decodes_on_the_cpu_as_transformers_does_in_bf16(tok):
    for arch in ("llama", "qwen2", "qwen3"):
        model = cast_parameters(tiny(arch), BF16)
        eng = engine(model, tok, BF16)
        assert eng.model is model and eng.source is None and eng.store.kv.dtype == BF16
        ps = prompts(3, 9, 17, 6)
        out = eng.generate(ps, SamplingParams(greedy=True, max_new_tokens=24, ignore_eos=True))
        for p, (c,) in zip(ps, out, strict=True):
            ref = teacher_forced(model, p, c.token_ids)
            mine = ref.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert (torch.tensor(c.logprobs) - mine).abs().max().item() < BF16_LOGPROB_TOL, arch
            # greedy under transformers' bf16 logits, up to a near-tie within the tolerance
            assert (ref.max(1).values - mine).max().item() < BF16_LOGPROB_TOL, arch


def test_fp32_updates_copy_into_bf16_parameters_in_place(tok):
    model = cast_parameters(tiny("qwen2"), BF16)
    eng = engine(model, tok, BF16)
    params = dict(eng.model.named_parameters())
    ptrs = {k: p.data_ptr() for k, p in params.items()}
    update = {k: v + 0.01 for k, v in tiny("qwen2").state_dict().items()}  # a trainer's fp32 state
    eng.load_weights(update, 3)
    after = dict(eng.model.named_parameters())
    assert all(after[k] is p and p.data_ptr() == ptrs[k] and p.dtype == BF16 for k, p in params.items())
    assert all(torch.equal(p, update[k].to(BF16)) for k, p in after.items())
    assert eng.weight_version == 3


def test_a_model_in_another_dtype_is_served_from_a_copy_that_follows_it(tok, monkeypatch):
    # the CUDA decision (bf16 for precision bf16) on the CPU: what is tested is what the engine does with it
    monkeypatch.setattr(engine_module, "serving_dtype", lambda device, precision, model_dtype: BF16)
    trainer_model = tiny("qwen2")
    eng = engine(trainer_model, tok, BF16, precision="bf16")
    assert eng.source is trainer_model and eng.model is not trainer_model and eng.store.kv.dtype == BF16
    assert all(p.dtype == torch.float32 for p in trainer_model.parameters())  # the trainer's weights stay fp32
    served = {k: (p, p.data_ptr()) for k, p in eng.model.named_parameters()}
    ps = prompts(9, 13)
    params = SamplingParams(greedy=True, max_new_tokens=8, ignore_eos=True)
    before = [g[0].token_ids for g in eng.generate(ps, params)]

    torch.manual_seed(1)
    with torch.no_grad():  # a trainer step changes its model in place; the caller then names the new version
        for p in trainer_model.parameters():
            p.normal_(0, 0.2)
    eng.weight_version = 1
    assert all(p is served[k][0] and p.data_ptr() == served[k][1] for k, p in eng.model.named_parameters())
    want = engine(serving_copy(trainer_model, BF16), tok, BF16).generate(ps, params)
    after = eng.generate(ps, params)
    assert [g[0].token_ids for g in after] == [g[0].token_ids for g in want] != before
    assert all(g[0].weight_version == 1 for g in after)


def test_copy_weights_names_a_mismatch():
    a, b = tiny("qwen2"), tiny("qwen2", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="lm_head.weight"):
        copy_weights(a, b)
    c = copy.deepcopy(a)
    with torch.no_grad():
        a.model.norm.weight.add_(1.0)
    copy_weights(c, a)
    assert torch.equal(c.model.norm.weight, a.model.norm.weight)


def test_a_model_handed_over_is_cast_in_place_not_copied(monkeypatch, tok):
    """`owns_model=True` (factory serve, the producer's merged copy): the engine casts the model's parameters to the
    serving dtype itself and keeps no second copy."""
    monkeypatch.setattr(engine_module, "serving_dtype", lambda device, precision, dtype: torch.bfloat16)
    model = tiny("llama")
    params = {n: id(p) for n, p in model.named_parameters()}
    eng = engine(model, tok, torch.bfloat16, owns_model=True)
    assert eng.model is model and eng.source is None
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert {n: id(p) for n, p in model.named_parameters()} == params  # the same Parameter objects
