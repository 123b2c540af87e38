"""The paged block manager's bookkeeping cost (factory/core/rollout/engines/paged/blocks.py), host only: a GRPO step's
groups (32 prompts of 300 tokens x 8 samples, 512 new tokens each, pages of 16) admitted and forked, decoded token
by token, freed; with and without the prefix cache. Prints a table, then one JSON line."""

from __future__ import annotations

import json
import time

from factory.core.rollout.engines.kv_budget import KVBudget
from factory.core.rollout.engines.paged.blocks import BlockManager

PROMPTS, SAMPLES, PROMPT, NEW, PAGE = 32, 8, 300, 512, 16


def measure(prefix: bool) -> dict:
    mgr = BlockManager(KVBudget(20000 * PAGE, 1), PAGE, prefix_cache=prefix)
    t0 = time.perf_counter()
    for g in range(PROMPTS):
        mgr.admit((g, 0), PROMPT, PROMPT + NEW, token_ids=[g] * PROMPT if prefix else None)
        for k in range(1, SAMPLES):
            mgr.fork((g, 0), (g, k))
    t1 = time.perf_counter()
    seqs = mgr.sequences()
    for step in range(NEW):
        for s in seqs:
            mgr.append(s, step if prefix else None)
    t2 = time.perf_counter()
    for s in seqs:
        mgr.free(s)
    t3 = time.perf_counter()
    n = len(seqs)
    return {"prefix_cache": prefix, "admit_fork_us_per_seq": 1e6 * (t1 - t0) / n,
            "append_ns": 1e9 * (t2 - t1) / (n * NEW), "step_ms": 1e3 * (t2 - t1) / NEW,
            "free_us_per_seq": 1e6 * (t3 - t2) / n}


def main() -> None:
    rows = [measure(False), measure(True)]
    print(f"{'prefix cache':>12} {'admit+fork us/seq':>18} {'append ns':>10} {'ms per 256-seq step':>20} "
          f"{'free us/seq':>12}")
    for r in rows:
        print(f"{r['prefix_cache']!s:>12} {r['admit_fork_us_per_seq']:>18.1f} {r['append_ns']:>10.0f} "
              f"{r['step_ms']:>20.2f} {r['free_us_per_seq']:>12.1f}")
    print(json.dumps({"paged_blocks": rows}))


if __name__ == "__main__":
    main()
