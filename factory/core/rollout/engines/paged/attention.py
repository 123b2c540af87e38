"""Paged attention without a mask: a Triton kernel that reads each query's keys through its block table, and the
SDPA causal call for a prefill that has no cached prefix.

`paged_attention(q, keys, values, tables, positions, scale)`: queries [B, S, heads, head_dim] (S = 1 in decode;
a prefill's new tokens padded to S), query (b, s) at position `positions[b, s]` attends over positions
[0, positions[b, s]] of row b, whose K/V live in the page store's `keys` / `values` [pages, page_size, kv_heads,
head_dim] at the pages `tables[b]` lists. One program per (row, KV head, query) handles the KV head's group of
query heads (GQA: the K/V are read once for the group, never repeated), loops over the row's positions in blocks
of `block_n` through its block table (a position's page is `tables[b, pos // page_size]`: any page size, shared and
forked pages alike) and keeps an online softmax in float32 (exp2, the scale folded with log2 e). It reads only
positions <= the query's: no mask, no gather, nothing past a row's length (stale K/V or a page never written), so a
block table may be wider than any row needs at no cost. Launch shapes depend only on the tensors' shapes, and the
loop bound is read on the device: no host sync, capturable in a CUDA graph. A query at position -1 (padding) reads
nothing and gets zeros.

CUDA tensors run the compiled kernel. In a process started with `TRITON_INTERPRET=1` (set before triton is first
imported: the choice is process-wide), CPU tensors run the same kernel in Triton's interpreter, the tests' way to
prove it without a GPU; the interpreter is numpy per program, so tiny shapes only.

`causal_attention(q, k, v, scale)`: a prefill without a cached prefix attends only over its own new tokens, so it
needs no page read at all: `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` over the new tokens
padded at the end to [B, heads, S, head_dim], which on CUDA in bf16 / fp16 takes the flash kernel (no mask to
materialise; the padding sits after every real token, so no real query sees it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without triton: the runner keeps its gather path
    triton = None


def available() -> bool:
    """Whether triton is installed (the kernel's one requirement; CPU tensors run in its interpreter)."""
    return triton is not None


def _kernel_source(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr,
                   stride_qb, stride_qs, stride_qh, stride_kp, stride_kt, stride_kh, stride_tb, stride_pb,
                   stride_ob, stride_os, stride_oh, scale_log2,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    b, kvh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos = tl.load(pos_ptr + b * stride_pb + s)  # keys [0, pos]; -1 (padding): the loop runs no block
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + s * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # a while loop, not range(0, pos + 1, BLOCK_N): the interpreter cannot take a loaded value as a range bound
    # under numpy 2 (its scalars are 1-element arrays), and both compile to the same loop
    start = 0
    while start <= pos:
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t <= pos  # every block holds position `start` <= pos, so its max below is finite
        page = tl.load(table_ptr + b * stride_tb + t // PAGE_SIZE, mask=t_ok, other=0).to(tl.int64)
        where = page * stride_kp + (t % PAGE_SIZE) * stride_kt + kvh * stride_kh
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + where[:, None] + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)  # [N, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2  # [G, N], log2 units
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        v = tl.load(v_ptr + where[:, None] + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
        start += BLOCK_N
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + s * stride_os + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


# decorated once at import: triton's interpreter (TRITON_INTERPRET=1) is a process-wide choice made when triton is
# imported (its standard library's own functions are jitted then), not per call
_kernel = triton.jit(_kernel_source) if triton is not None else None


def _interpreting() -> bool:
    return triton is not None and bool(triton.knobs.runtime.interpret)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def paged_attention(q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, positions: Tensor, scale: float,
                    block_n: int = 32) -> Tensor:
    """Attention of queries `q` [B, S, heads, head_dim] over their rows' paged K/V (see the module docstring):
    `keys` / `values` [pages, page_size, kv_heads, head_dim], `tables` [B, W] page ids, `positions` [B, S] each
    query's position (-1: padding). Returns [B, S, heads, head_dim] in q's dtype. No host sync."""
    if triton is None:
        raise RuntimeError("paged_attention needs triton (pip install triton; the CPU runs its interpreter)")
    b, s, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = keys.shape
    if heads % kv_heads or keys.shape != values.shape or keys.shape[-1] != head_dim:
        raise ValueError(f"paged_attention: {heads} query heads of {head_dim} over K {tuple(keys.shape)} and V "
                         f"{tuple(values.shape)}: need the same K/V shape, head_dim and a whole group per KV head")
    if tables.shape[0] != b or tuple(positions.shape) != (b, s):
        raise ValueError(f"paged_attention: {b} rows of {s} queries with tables {tuple(tables.shape)} and positions "
                         f"{tuple(positions.shape)}")
    # the kernel indexes the last dim contiguously and a page's positions by stride
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    if keys.stride() != values.stride():
        values = values.contiguous()
        keys = keys.contiguous()
    tables = tables.contiguous()
    positions = positions.contiguous()
    out = torch.empty_like(q)
    group = heads // kv_heads
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"paged_attention: {q.device.type} tensors run only in Triton's interpreter; set "
                         f"TRITON_INTERPRET=1 before triton is first imported")
    _kernel[(b, kv_heads, s)](
        q, keys, values, tables, positions, out,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2), tables.stride(0),
        positions.stride(0), out.stride(0), out.stride(1), out.stride(2), scale * math.log2(math.e),
        GROUP=group, BLOCK_G=_pow2(group), HEAD_DIM=head_dim, BLOCK_D=_pow2(head_dim), PAGE_SIZE=page_size,
        BLOCK_N=block_n)
    return out


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """SDPA over a batch of prompts' own new tokens, padded at the end: q [B, heads, S, head_dim], k / v [B,
    kv_heads, S, head_dim]; query s attends keys [0, s] of its row. Returns [B, heads, S, head_dim]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
