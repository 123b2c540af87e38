"""The continuous engine's KV budget (`kv_budget.py`): the cache and a prefill's K/V stay inside it, requests wait
for room in it and then run as they would without it, one that can never fit is refused naming the setting, and
the default budget follows the memory this process may still take (its rlimits included)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
import torch

from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.engines.kv_budget import SETTING, KVBudget, kv_bytes_per_token
from factory.core.rollout.engines.slot_cache import SlotKVCache
from tests.core.engine_cases import sharp_model

PROMPTS = ["1+2=" * 5, "123+456=" * 3, "99*9=", "7" * 10, "5555+5555=", "1-1=" * 4]
MAX_NEW = 20


def run(budget: int | None, max_batch: int = 4) -> tuple[list, ContinuousEngine, list[int]]:
    """Greedy fixed-length completions of PROMPTS, all submitted at once, stepped to the end; returns them, the
    engine, and the KV bytes held at each prefill's copy (the cache after it, plus the prefill's own K/V)."""
    model, tok = sharp_model()
    eng = ContinuousEngine(model, tok, max_batch=max_batch, kv_capacity=8, kv_budget=budget)
    held: list[int] = []
    insert = SlotKVCache.insert

    def measured(cache, kv, src, lengths, allow):
        insert(cache, kv, src, lengths, allow)
        held.append(cache.allocated_bytes + sum(t.numel() * t.element_size() for pair in kv for t in pair))

    eng._cache.insert = measured.__get__(eng._cache)  # type: ignore[method-assign]
    futures = [eng.submit(tok(p).input_ids, SamplingParams(greedy=True, max_new_tokens=MAX_NEW, ignore_eos=True),
                          sample_index=i) for i, p in enumerate(PROMPTS)]
    steps = []
    while not all(f.done() for f in futures):
        assert eng.step()
        steps.append(eng._cache.allocated_bytes)
    return [f.result() for f in futures], eng, held + steps


def test_requests_wait_for_room_in_the_budget_and_then_run_as_without_it():
    free, eng, _ = run(None)
    assert eng.stats.max_running == 4 and eng.stats.waited_for_kv == 0
    per = eng.kv.per_token
    assert per == kv_bytes_per_token(eng.model.config, torch.float32) == eng._cache.token_bytes  # estimate == real
    longest = max(len(c.prompt_ids) for c in free) + MAX_NEW
    budget = per * (2 * (longest + 1) + longest)  # two sequences at full length and one prefill, no more
    tight, eng, held = run(budget)
    assert max(held) <= budget  # cache and prefill K/V, at every prefill and every step
    assert eng.stats.max_running < 4 and eng.stats.waited_for_kv > 0  # unbounded, 4 ran at once; now some waited
    assert eng._cache.rows < eng.max_batch  # the budget bound the rows allocated, not only those used
    for a, b in zip(free, tight, strict=True):  # the same tokens; logprobs to float32 rounding of other batches
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_a_request_that_can_never_fit_is_refused_naming_the_budget():
    model, tok = sharp_model()
    eng = ContinuousEngine(model, tok, max_batch=4, kv_budget=40 * 512)  # 40 slot-columns of 512 bytes
    assert eng.kv.columns == 40
    ids = tok("1+2=" * 5).input_ids  # 21 tokens: its row (21 + 10 + 1) and its prefill (21) need 53
    with pytest.raises(ValueError) as e:
        eng.check(ids, SamplingParams(max_new_tokens=10))
    assert "--kv-budget-mb" in str(e.value) and "rollout.kv_budget_mb" in str(e.value) and "KV cache" in str(e.value)
    assert eng.max_new_tokens(len(ids)) == 0  # not even one token fits after that prompt
    short = tok("7").input_ids  # 2 tokens: 35 more fit (37 + 1 columns and its 2-token prefill)
    assert eng.max_new_tokens(len(short)) == 35
    eng.check(short, SamplingParams(max_new_tokens=eng.max_new_tokens(len(short))))  # the most that fits, fits
    with pytest.raises(ValueError, match="KV cache"):
        eng.check(short, SamplingParams(max_new_tokens=eng.max_new_tokens(len(short)) + 1))
    with pytest.raises(ValueError, match="kv_budget must be a positive"):
        ContinuousEngine(model, tok, kv_budget=0)


def test_budget_arithmetic():
    b = KVBudget(total_bytes=1000, per_token=10)
    assert b.columns == 100 and b.fits(4, 20, 20) and not b.fits(4, 20, 21)
    assert b.problem(prompt_tokens=30, final_length=60) is None  # 61 + 30 columns
    problem = b.problem(prompt_tokens=40, final_length=60)
    assert problem is not None and SETTING in problem and "0.0 MiB" in problem


def test_the_slot_cache_stays_within_its_allowance():
    """Unbounded, the cache doubles its rows (up to its slots) and its columns (up to the context); bounded, it
    keeps fewer spare rows, then fewer spare columns, compacting first, and never holds more than the allowance."""
    def prefill(n: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        k = torch.arange(n * width, dtype=torch.float32).reshape(n, 1, width, 1)
        return [(k, k.clone())]

    free = SlotKVCache(slots=8, initial_capacity=4, max_columns=10)
    free.insert(prefill(2, 6), torch.tensor([0, 1]), [6, 5])
    assert (free.rows, free.capacity) == (2, 7)  # the rows running, the prompt's columns + the write column
    free.insert(prefill(1, 6), torch.tensor([0]), [6])
    assert (free.rows, free.capacity) == (4, 7)  # rows doubled
    for _ in range(3):
        free.reserve_decode()
        free.width += 1
    assert free.capacity == 10  # doubled, but never past max_columns
    tight = SlotKVCache(slots=8, initial_capacity=4)
    tight.insert(prefill(2, 6), torch.tensor([0, 1]), [6, 5], allow=30)
    assert (tight.rows, tight.capacity) == (2, 7) and tight.rows * tight.capacity <= 30
    for _ in range(5):  # decode steps: the columns grow within the allowance
        tight.reserve_decode(allow=30)
        tight.width += 1
        assert tight.rows * tight.capacity <= 30 and tight.capacity >= tight.width
    tight.remove(0)  # the longer row leaves: room to shrink for a prefill's K/V
    tight.fit(allow=12)
    assert tight.rows * tight.capacity <= 12 and tight.n == 1
    # the remaining row's prompt (prefill row 1's last 5 columns) survived the moves
    assert tight.keys[0][0, 0, tight.start[0]: tight.start[0] + 5, 0].tolist() == [7.0, 8.0, 9.0, 10.0, 11.0]


def test_the_default_budget_follows_the_memory_this_process_may_still_take():
    """Under an RLIMIT_DATA (what `factory serve` under a memory cap meets), the default is half the headroom left
    under it, not half the machine's."""
    code = ("import json, torch\n"
            "from factory.core.rollout.engines.kv_budget import default_kv_budget, host_headroom, _proc_kb\n"
            "print(json.dumps({'budget': default_kv_budget(torch.device('cpu')), 'headroom': host_headroom(),\n"
            "                  'data': _proc_kb('/proc/self/status')['VmData'],\n"
            "                  'available': _proc_kb('/proc/meminfo')['MemAvailable']}))\n")
    free = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     timeout=120).stdout)
    cap = free["data"] + (512 << 20)  # half a GiB over what the interpreter with torch holds

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    capped = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       timeout=120, preexec_fn=limit).stdout)
    assert 0 < capped["headroom"] <= (512 + 64 << 20) and capped["headroom"] < free["available"]
    assert abs(capped["budget"] - capped["headroom"] // 2) < 16 << 20 and capped["budget"] < free["budget"]
