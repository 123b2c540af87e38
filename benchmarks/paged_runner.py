"""The paged model runner's reference path (factory/core/rollout/engines/paged/runner.py) against transformers' own
decode with its DynamicCache, on the CPU: a Qwen3-shaped random model (fp32, 8 layers, hidden 512, 8 heads, 2 KV heads,
vocab 4096), 16 sequences of 128 prompt tokens, 32 greedy decode steps; per-step and prefill wall time, median of
the steps, and whether both paths pick the same tokens. Prints a table, then one JSON line."""

from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

from factory.core.rollout.engines.kv_budget import KVBudget, kv_bytes_per_token
from factory.core.rollout.engines.paged.blocks import BlockManager
from factory.core.rollout.engines.paged.pages import BlockTables, PageStore
from factory.core.rollout.engines.paged.runner import PagedRunner

ROWS, PROMPT, STEPS, PAGE = 16, 128, 32, 16


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, initializer_range=0.2)
    return AutoModelForCausalLM.from_config(cfg).eval()


@torch.no_grad()
def paged(m, prompts: torch.Tensor) -> tuple[list[float], float, torch.Tensor]:
    per = kv_bytes_per_token(m.config, torch.float32)
    mgr = BlockManager(KVBudget(ROWS * (PROMPT + STEPS) * per * 2, per), PAGE)
    store = PageStore.for_model(m.config, mgr.num_pages, PAGE, torch.float32, "cpu")
    tables = BlockTables(ROWS, mgr.pages_for(PROMPT + STEPS), store.scratch, "cpu")
    runner = PagedRunner(m, store)
    for r in range(ROWS):
        mgr.admit(r, PROMPT, PROMPT + STEPS)
        tables.set(r, mgr.block_table(r))
    t0 = time.perf_counter()
    logits = runner.prefill(prompts.tolist(), [mgr.block_table(r) for r in range(ROWS)])
    prefill = time.perf_counter() - t0
    out, times = [logits.argmax(-1)], []
    for _ in range(STEPS - 1):
        positions = torch.tensor([mgr.tokens(r) for r in range(ROWS)])
        for r in range(ROWS):
            mgr.append(r)
            tables.set(r, mgr.block_table(r))
        t0 = time.perf_counter()
        logits = runner.decode(out[-1], positions, tables.sync())
        times.append(time.perf_counter() - t0)
        out.append(logits.argmax(-1))
    return times, prefill, torch.stack(out, 1)


@torch.no_grad()
def hf(m, prompts: torch.Tensor) -> tuple[list[float], float, torch.Tensor]:
    cache = DynamicCache(config=m.config)
    t0 = time.perf_counter()
    logits = m(prompts, cache=cache, use_cache=True).logits[:, -1]
    prefill = time.perf_counter() - t0
    out, times = [logits.argmax(-1)], []
    for _ in range(STEPS - 1):
        t0 = time.perf_counter()
        logits = m(out[-1][:, None], cache=cache, use_cache=True).logits[:, -1]
        times.append(time.perf_counter() - t0)
        out.append(logits.argmax(-1))
    return times, prefill, torch.stack(out, 1)


def main() -> None:
    torch.set_num_threads(2)
    m = model()
    prompts = torch.randint(1, 4096, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    hf(m, prompts[:2, :8])  # warm-up
    rows = {}
    for name, run in (("paged runner", paged), ("transformers + DynamicCache", hf)):
        times, prefill, tokens = run(m, prompts)
        rows[name] = {"step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
                      "step_ms_max": 1e3 * max(times), "prefill_ms": 1e3 * prefill, "tokens": tokens}
    same = bool(torch.equal(rows["paged runner"].pop("tokens"), rows["transformers + DynamicCache"].pop("tokens")))
    print(f"{'path':>28} {'decode step ms median [min, max]':>34} {'prefill ms':>11}")
    for name, r in rows.items():
        print(f"{name:>28} {r['step_ms_median']:>14.1f} [{r['step_ms_min']:.1f}, {r['step_ms_max']:.1f}] "
              f"{r['prefill_ms']:>17.0f}")
    print(json.dumps({"rows": ROWS, "prompt": PROMPT, "steps": STEPS, "same_tokens": same, **rows}))


if __name__ == "__main__":
    main()
