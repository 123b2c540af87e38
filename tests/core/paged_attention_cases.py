"""The paged attention kernel's cases, run by `test_paged_attention.py` in a child pytest started with
TRITON_INTERPRET=1 (the interpreter is chosen when triton is first imported, so not in the suite's own process).
Not collected on its own (no `test_` prefix). Tiny shapes: the interpreter runs numpy per program."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

from factory.core.rollout.engines.paged import attention
from factory.core.rollout.engines.paged.runner import PagedRunner

assert os.environ.get("TRITON_INTERPRET") == "1", "run by test_paged_attention.py with TRITON_INTERPRET=1"

PAGES, PAGE, KV_HEADS, DIM = 14, 4, 2, 16
SCRATCH = PAGES - 1


def _store(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pages [PAGES, PAGE, KV_HEADS, DIM], NaN everywhere until `_fill` writes a row's positions: a read
    past a row's length shows as NaN in its output."""
    return (torch.full((PAGES, PAGE, KV_HEADS, DIM), float("nan"), dtype=dtype),
            torch.full((PAGES, PAGE, KV_HEADS, DIM), float("nan"), dtype=dtype))


def _fill(keys: torch.Tensor, values: torch.Tensor, table: list[int], length: int, g: torch.Generator) -> None:
    for p in range(length):
        page, off = table[p // PAGE], p % PAGE
        if torch.isnan(keys[page, off]).any():  # a shared page's positions are written once, by its first row
            keys[page, off] = torch.randn(KV_HEADS, DIM, generator=g).to(keys.dtype)
            values[page, off] = torch.randn(KV_HEADS, DIM, generator=g).to(values.dtype)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
               positions: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA in float32 per query over its row's gathered positions [0, pos] (zeros for pos -1)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        k = keys[tables[b].long()].flatten(0, 1).float()
        v = values[tables[b].long()].flatten(0, 1).float()
        for s in range(q.shape[1]):
            n = int(positions[b, s]) + 1
            if n:
                out[b, s] = F.scaled_dot_product_attention(q[b, s, :, None].float(), k[:n].transpose(0, 1),
                                                           v[:n].transpose(0, 1), scale=scale,
                                                           enable_gqa=True)[:, 0]
    return out


# rows: a prompt of 3 pages, a fork sharing its 2 full pages with its own third, a short row, a row at a page
# boundary; tables padded with the scratch page to 5 columns (wider than any row needs: read at no cost)
TABLES = [[0, 1, 2], [0, 1, 3], [4], [5, 6, 7, 8]]
LENGTHS = [11, 10, 3, 16]


def _case(dtype: torch.dtype, heads: int, queries: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys, values = _store(dtype)
    for t, n in zip(TABLES, LENGTHS, strict=True):
        _fill(keys, values, t, n, g)
    tables = torch.tensor([t + [SCRATCH] * (5 - len(t)) for t in TABLES], dtype=torch.int32)
    # each row's last `queries` positions (a prefill's new tokens over a cached prefix; decode when 1), the
    # short row padded with -1
    positions = torch.tensor([[n - queries + s if n - queries + s >= 0 else -1 for s in range(queries)]
                              for n in LENGTHS])
    q = torch.randn(len(TABLES), queries, heads, DIM, generator=g).to(dtype)
    return q, keys, values, tables, positions


@pytest.mark.parametrize(("heads", "queries"), [(2, 1), (4, 1), (6, 1), (4, 4)])
def test_fp32_equals_sdpa_over_the_gathered_pages(heads, queries):
    """GQA groups of 1, 2 and 3 query heads a KV head (3: padded to a block of 4), decode and multi-query."""
    q, keys, values, tables, positions = _case(torch.float32, heads, queries)
    out = attention.paged_attention(q, keys, values, tables, positions, scale=0.25, block_n=8)
    assert not torch.isnan(out).any()  # nothing past a row's length (NaN there) was read
    torch.testing.assert_close(out, _reference(q, keys, values, tables, positions, 0.25), atol=1e-5, rtol=0)
    padded = positions < 0
    assert padded.any() == (queries > 1) and torch.equal(out[padded], torch.zeros_like(out[padded]))


def test_bf16_within_its_rounding():
    """bf16 K/V and queries, float32 inside: the output differs from float32 SDPA on the same bf16 inputs by the
    output's rounding to bf16 (8 bits: 2^-8 relative), so atol = rtol = 1e-2."""
    q, keys, values, tables, positions = _case(torch.bfloat16, 4, 1, seed=1)
    out = attention.paged_attention(q, keys, values, tables, positions, scale=0.25, block_n=8)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, keys, values, tables, positions, 0.25), atol=1e-2,
                               rtol=1e-2)


def test_block_size_does_not_change_the_result():
    q, keys, values, tables, positions = _case(torch.float32, 4, 2, seed=2)
    a = attention.paged_attention(q, keys, values, tables, positions, scale=0.25, block_n=4)
    b = attention.paged_attention(q, keys, values, tables, positions, scale=0.25, block_n=16)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.fixture
def paged_runner(monkeypatch):
    """Every PagedRunner built in the test takes the Triton kernel (on the CPU: in the interpreter)."""
    monkeypatch.setattr(PagedRunner, "__init__", functools.partialmethod(PagedRunner.__init__, attention="paged"))


def test_runner_on_the_kernel_generates_what_transformers_does(paged_runner):
    """The runner's own tests, on the kernel: greedy tokens equal `generate` and every step's logits the model's
    forward within 1e-5 (stale K/V in every page), forks sharing pages, and a prefill over a cached prefix (its
    new tokens through the kernel)."""
    from tests.core import test_paged_runner as t

    model = t.tiny("llama")
    runner = PagedRunner(model, t.PageStore.for_model(model.config, 4, t.PAGE, torch.float32, "cpu"))
    assert runner.attention == "paged" and runner.reads_real_lengths
    t.test_greedy_decode_matches_generate_and_forward("llama")
    t.test_fork_shares_full_pages_and_matches_unforked_runs()
    t.test_prefill_from_prefix_cache_reads_the_cached_pages()
