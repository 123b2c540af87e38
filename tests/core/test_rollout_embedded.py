"""The embedded engine: KV-cached batched sampling that agrees with transformers and the trainer."""

import torch

from factory.core.batch import pack
from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.core.trainer.torch_trainer import token_logprobs
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer

PROMPTS = ["1+2=", "123+456=", "99*9="]


def engine(seed=0):
    tok = build_tokenizer()
    return EmbeddedEngine(build_model("micro", tok, seed=seed), tok), tok


def test_greedy_matches_transformers_generate_on_ragged_batch():
    eng, tok = engine()
    outs = eng.generate(eng.encode(PROMPTS), SamplingParams(greedy=True, max_new_tokens=6))
    for prompt, (c,) in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([tok(prompt).input_ids])
        ref = eng.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        ref_new = ref[0, ids.shape[1]:].tolist()
        assert c.token_ids == ref_new[: len(c.token_ids)]
        assert c.finish_reason == ("stop" if c.token_ids[-1] == tok.eos_token_id else "length")


def test_sampler_logprobs_equal_trainer_logprobs():
    eng, tok = engine(seed=1)
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=6, seed=3)
    comps = [c for g in eng.generate(eng.encode(PROMPTS), params) for c in g]
    batch = pack([c.prompt_ids for c in comps], [c.token_ids for c in comps], tok.pad_token_id,
                 {"old": [c.logprobs for c in comps]})
    with torch.no_grad():
        logp, _ = token_logprobs(eng.model, batch, temperature=0.7)
    diff = (logp - batch.per_token["old"]).abs()[batch.loss_mask]
    assert diff.max().item() < 1e-4


def test_sampling_is_seeded_and_returns_n_per_prompt():
    eng, _ = engine()
    params = SamplingParams(n=5, temperature=1.0, max_new_tokens=5, seed=11)
    a = eng.generate(eng.encode(PROMPTS), params)
    b = eng.generate(eng.encode(PROMPTS), params)
    assert [len(g) for g in a] == [5, 5, 5]
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    other = eng.generate(eng.encode(PROMPTS), SamplingParams(n=5, max_new_tokens=5, seed=12))
    assert [[c.token_ids for c in g] for g in a] != [[c.token_ids for c in g] for g in other]
    assert all(len(c.token_ids) == len(c.logprobs) <= 5 for g in a for c in g)


def test_top_p_keeps_only_the_nucleus():
    eng, _ = engine()
    tiny_p = SamplingParams(n=8, temperature=1.0, top_p=1e-6, max_new_tokens=4, seed=0)
    greedy = eng.generate(eng.encode(PROMPTS), SamplingParams(greedy=True, max_new_tokens=4))
    for g, (ref,) in zip(eng.generate(eng.encode(PROMPTS), tiny_p), greedy, strict=True):
        assert all(c.token_ids == ref.token_ids for c in g)


def test_weight_version_is_tagged_and_load_weights_changes_outputs():
    eng, tok = engine(seed=0)
    other = build_model("micro", tok, seed=5).state_dict()
    before = eng.generate(eng.encode(PROMPTS), SamplingParams(greedy=True, max_new_tokens=6))
    eng.load_weights(other, version=7)
    after = eng.generate(eng.encode(PROMPTS), SamplingParams(greedy=True, max_new_tokens=6))
    assert {c.weight_version for g in after for c in g} == {7}
    # random-init models may agree on the argmax; their probabilities cannot
    assert [g[0].logprobs for g in before] != [g[0].logprobs for g in after]
