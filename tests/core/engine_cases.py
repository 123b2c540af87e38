"""Fixed-seed completions of both embedded engines on the CPU, and the file they were recorded in.

`engine_golden.json` holds what these cases gave on main before the engines learned about devices (commit
ace65ae); `test_engine_devices.py` asserts the engines still give exactly that on the CPU. Rerecord only on
purpose: `python -m tests.core.engine_cases` (from the repository root).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer

GOLDEN = Path(__file__).with_name("engine_golden.json")
PROMPTS = ["1+2=", "123+456=", "99*9=", "7", "5555+5555=", "1-1="]


def sharp_model(seed: int = 0, attn: str = "sdpa"):
    """The micro model with large weights, so tokens depend on the context and sequences end at different steps."""
    tok = build_tokenizer()
    model = build_model("micro", tok, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3, generator=g)
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model.eval(), tok


def _rows(groups) -> list[dict]:
    return [{"tokens": c.token_ids, "logprobs": c.logprobs, "finish": c.finish_reason,
             "top": c.top_logprobs} for g in groups for c in g]


def embedded_cases(model, tok) -> dict[str, list[dict]]:
    eng = EmbeddedEngine(model, tok, max_batch=4)  # 4 rows: two batches of one generator
    ids = eng.encode(PROMPTS)
    return {
        "greedy": _rows(eng.generate(ids, SamplingParams(greedy=True, max_new_tokens=10))),
        "sampled": _rows(eng.generate(ids, SamplingParams(n=2, temperature=0.8, max_new_tokens=10, seed=5))),
        "top_p": _rows(eng.generate(ids, SamplingParams(n=2, temperature=1.2, top_p=0.7, max_new_tokens=10,
                                                        seed=7))),
    }


def continuous_params() -> list[SamplingParams]:
    return [SamplingParams(greedy=True, max_new_tokens=12),
            SamplingParams(temperature=0.8, max_new_tokens=9, seed=1, top_logprobs=2),
            SamplingParams(temperature=1.1, top_p=0.8, max_new_tokens=14, seed=2),
            SamplingParams(greedy=True, max_new_tokens=5, top_logprobs=3),
            SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=11, seed=3),
            SamplingParams(temperature=1.0, max_new_tokens=7, seed=4)]


def continuous_cases(model, tok) -> list[dict]:
    """Requests joining every other decode step on 3 rows with a KV buffer of 8 columns: rows are refilled, the
    layout shifts, compacts and grows while greedy, sampled and top-p requests decode together."""
    eng = ContinuousEngine(model, tok, max_batch=3, kv_capacity=8)
    futures = []
    for i, (prompt, params) in enumerate(zip(PROMPTS, continuous_params(), strict=True)):
        futures.append(eng.submit(tok(prompt).input_ids, params, sample_index=i))
        for _ in range(2):
            eng.step()
    while not all(f.done() for f in futures):
        assert eng.step()
    return _rows([[f.result()] for f in futures])


def all_cases() -> dict:
    out: dict = {}
    for attn in ("sdpa", "eager"):
        model, tok = sharp_model(seed=0, attn=attn)
        out[f"embedded_{attn}"] = embedded_cases(model, tok)
        out[f"continuous_{attn}"] = continuous_cases(model, tok)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    GOLDEN.write_text(json.dumps(all_cases()) + "\n")
    print(f"wrote {GOLDEN}")
