"""Rollout throughput: the continuous-batching engine vs `model.generate` the way a simple trainer calls it.

Workload (the same for every engine): R prompts of random length, each with its own max_tokens drawn from a
log-normal distribution (heavy right tail, as RL completion lengths are), sampling at temperature 1 with EOS as a
natural stop. The model is the `small` preset (~6M parameters) with its declared context raised to 1024 (RoPE has
no position table, so only the declared limit changes), over a 98-character tokenizer so that EOS (~1% a step
under random weights) trims some completions but the max_tokens tail dominates.

Engines:
- generate: `model.generate` on consecutive batches of B prompts, left-padded, max_new_tokens = the largest
  max_tokens in the batch (each row is cut to its own max_tokens afterwards): every batch runs as long as its
  longest request.
- embedded: the static-batch KV-cache engine (`embedded.py`) called the same way (it stops when all rows are done).
- continuous: `ContinuousEngine` with B slots; each request carries its own max_tokens, and a finished request's
  slot is refilled at the next decode step.

Throughput counts useful tokens only: per request, up to its first EOS or its max_tokens. torch runs on
`--threads` threads (default 1: on a machine shared with other jobs, two OpenMP threads on two busy cores were
~50x slower than one in our measurements). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from factory.core.rollout.base import SamplingParams  # noqa: E402
from factory.core.rollout.engines.continuous import ContinuousEngine  # noqa: E402
from factory.core.rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from factory.models.build import build_model  # noqa: E402
from factory.models.tokenizer import build_tokenizer  # noqa: E402

ALPHABET = string.ascii_letters + string.digits + string.punctuation + " "


def workload(n: int, median: float, sigma: float, cap: int, seed: int) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    prompts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(5, 40))) for _ in range(n)]
    lengths = [max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]
    return prompts, lengths


def useful(tokens: list[int], limit: int, eos: int) -> int:
    """Tokens a trainer keeps: up to and including the first EOS, at most `limit`."""
    tokens = tokens[:limit]
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


def left_padded(chunk: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of prompts left-padded to the longest: the batch `model.generate` takes."""
    width = max(len(p) for p in chunk)
    ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(chunk):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    return ids, attn


def run_generate(model, tok, prompts: list[list[int]], limits: list[int], batch: int) -> int:
    total = 0
    for s in range(0, len(prompts), batch):
        chunk, lim = prompts[s : s + batch], limits[s : s + batch]
        ids, attn = left_padded(chunk, tok.pad_token_id)
        width = ids.shape[1]
        out = model.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=max(lim), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        total += sum(useful(row[width:].tolist(), m, tok.eos_token_id) for row, m in zip(out, lim, strict=True))
    return total


def run_embedded(model, tok, prompts: list[list[int]], limits: list[int], batch: int) -> int:
    eng = EmbeddedEngine(model, tok, max_batch=batch)
    total = 0
    for s in range(0, len(prompts), batch):
        chunk, lim = prompts[s : s + batch], limits[s : s + batch]
        groups = eng.generate(chunk, SamplingParams(max_new_tokens=max(lim), seed=s))
        total += sum(useful(g[0].token_ids, m, tok.eos_token_id) for g, m in zip(groups, lim, strict=True))
    return total


def run_continuous(model, tok, prompts: list[list[int]], limits: list[int], batch: int) -> tuple[int, dict]:
    eng = ContinuousEngine(model, tok, max_batch=batch)
    futures = [eng.submit(p, SamplingParams(max_new_tokens=m, seed=i)) for i, (p, m) in enumerate(zip(prompts, limits,
                                                                                                        strict=True))]
    while not all(f.done() for f in futures):
        eng.step()
    total = sum(useful(f.result().token_ids, m, tok.eos_token_id) for f, m in zip(futures, limits, strict=True))
    return total, eng.info()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (about a minute)")
    ap.add_argument("--requests", type=int, help="number of requests (default 256, --quick 96)")
    ap.add_argument("--batch", type=int, default=32, help="batch size / engine slots")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--median-tokens", type=float, default=32.0, help="median of the per-request max_tokens")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of max_tokens (tail weight)")
    ap.add_argument("--cap", type=int, default=768, help="largest max_tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-embedded", action="store_true")
    args = ap.parse_args(argv)
    n = args.requests or (96 if args.quick else 256)
    torch.set_num_threads(args.threads)

    tok = build_tokenizer(ALPHABET)
    model = build_model(args.preset, tok, seed=args.seed).eval()
    model.config.max_position_embeddings = 1024
    texts, limits = workload(n, args.median_tokens, args.sigma, args.cap, args.seed)
    prompts = [tok(t).input_ids for t in texts]
    # Warm up allocator and kernels once so that no engine pays first-call costs.
    with torch.no_grad():
        run_continuous(model, tok, prompts[:4], [4] * 4, 4)

    rows = []
    t0 = time.perf_counter()
    with torch.no_grad():
        gen_tokens = run_generate(model, tok, prompts, limits, args.batch)
    rows.append(("model.generate (padded batches)", gen_tokens, time.perf_counter() - t0))
    if not args.skip_embedded:
        t0 = time.perf_counter()
        emb_tokens = run_embedded(model, tok, prompts, limits, args.batch)
        rows.append(("embedded (static batches)", emb_tokens, time.perf_counter() - t0))
    t0 = time.perf_counter()
    cont_tokens, info = run_continuous(model, tok, prompts, limits, args.batch)
    rows.append(("continuous (refills slots)", cont_tokens, time.perf_counter() - t0))

    rates = {name: tokens / wall for name, tokens, wall in rows}
    base = rates[rows[0][0]]
    print(f"{n} requests, batch {args.batch}, preset {args.preset}, max_tokens log-normal(median "
          f"{args.median_tokens:g}, sigma {args.sigma:g}) capped at {args.cap}: mean {sum(limits) / n:.1f}, "
          f"max {max(limits)}; torch threads {args.threads}")
    print(f"{'engine':34} {'tokens':>8} {'wall s':>8} {'tokens/s':>9} {'vs generate':>11}")
    for name, tokens, wall in rows:
        print(f"{name:34} {tokens:8d} {wall:8.2f} {tokens / wall:9.1f} {tokens / wall / base:10.2f}x")
    result = {
        "benchmark": "rollout_engine",
        "requests": n, "batch": args.batch, "preset": args.preset, "threads": args.threads,
        "max_tokens_mean": sum(limits) / n, "max_tokens_max": max(limits),
        "generate_tokens_per_s": round(base, 1),
        "continuous_tokens_per_s": round(rates[rows[-1][0]], 1),
        "speedup_vs_generate": round(rates[rows[-1][0]] / base, 2),
        "decode_steps": info["steps"], "prefills": info["prefills"],
    }
    if not args.skip_embedded:
        result["embedded_tokens_per_s"] = round(rates[rows[1][0]], 1)
        result["speedup_vs_embedded"] = round(rates[rows[-1][0]] / rates[rows[1][0]], 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
