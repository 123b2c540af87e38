"""The paged engine's model runner: a Llama-family transformers model's own modules, attention over the page store.

The runner calls the model's embedding, decoder norms, q/k/v/o projections (Qwen3's q_norm / k_norm), rotary
embedding, MLP, final norm and lm_head, and does attention itself: each step's new K/V go into the page store
through the slot mapping (slot = block_table[pos // page_size] * page_size + pos % page_size, computed on the
device), then every query attends over its sequence's K/V (GQA: the KV heads are never repeated).

Prefill is packed: the batch's new tokens are one row of T tokens through every linear layer, norm and MLP (no
padding); only attention pads them into [B, longest, heads, head_dim] queries. Decode is the same path with one
query per row, at fixed shapes: B rows and the block tables' W columns (rows past the live ones feed token 0 at
position 0 with a table of the scratch page, so their write lands there).

Attention, per step (`attention`): a prefill with nothing cached attends over its own new tokens with SDPA
`is_causal` (no mask, no page read; the flash kernel on CUDA in bf16). Otherwise, on CUDA (triton installed) the
Triton kernel `attention.paged_attention` reads each query's positions <= its own through the block table: no mask,
no gather (`reads_real_lengths`). Elsewhere the reference path gathers each row's pages per layer and masks keys
past each query's position with one boolean mask built per step and shared by every layer.

`supports(model)` names why a model cannot take it, for the engine's fallback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from factory.core.rollout.engines.paged import attention as paged_kernel
from factory.core.rollout.engines.paged.pages import PageStore

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
ATTENTIONS = ("paged", "gather")  # the Triton kernel (`attention.py`), the gather + SDPA reference
# one layer's attention in a step: packed q [T, heads, dim] and new k, v [T, kv_heads, dim] -> [T, heads, dim]
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]
# rotary variants whose frequencies depend on the longest position in the call: a packed batch would change them
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def supports(model: Any) -> str | None:
    """Why `model` cannot run on the paged runner (one line for the engine's fallback log), or None."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r} is not one of the paged runner's architectures {', '.join(ARCHITECTURES)}"
    if getattr(config, "sliding_window", None) is not None and kind == "mistral":
        return (f"sliding-window attention (config.sliding_window={config.sliding_window}) is not on the paged "
                f"runner: it attends over every cached position")
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"config.layer_types has {sorted(set(layer_types) - {'full_attention'})}: only full attention is paged"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not hasattr(model, "lm_head") or any(not hasattr(inner, n) for n in needed):
        return f"{type(model).__name__} lacks model.{{{', '.join(needed)}}} or lm_head"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if rope in _LENGTH_DEPENDENT_ROPE:
        return f"rope_type {rope!r} depends on the sequence length, which a packed batch does not have"
    return None


class PagedRunner:
    """Runs `model` (see `supports`) with its K/V in `store` (shaped for it: `PageStore.for_model`)."""

    def __init__(self, model: Any, store: PageStore, attention: str | None = None):
        if (why := supports(model)) is not None:
            raise ValueError(f"the paged runner cannot run this model: {why}")
        if attention is None:
            attention = "paged" if store.device.type == "cuda" and paged_kernel.available() else "gather"
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        self.attention = attention
        self.model, self.store = model, store
        self.inner = model.model
        self.layers = list(self.inner.layers)
        if len(self.layers) != store.kv.shape[0]:
            raise ValueError(f"the page store has {store.kv.shape[0]} layers, the model {len(self.layers)}")
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        # the model's own rotary application (rotate_half convention), from its modeling module
        self._rotate: Callable[..., tuple[Tensor, Tensor]] = sys.modules[type(attn).__module__].apply_rotary_pos_emb

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], tables: Sequence[Sequence[int]],
                starts: Sequence[int] | None = None) -> Tensor:
        """Compute positions [starts[i], len(prompts[i])) of each prompt (`starts`: positions already in its pages,
        the prefix cache's `cached_tokens`; default 0), write their K/V into the pages of `tables[i]` (its block
        table), and return each prompt's last-token logits, [len(prompts), vocab]."""
        if not prompts or len(prompts) != len(tables) or (starts is not None and len(starts) != len(prompts)):
            raise ValueError(f"prefill got {len(prompts)} prompts, {len(tables)} block tables and "
                             f"{'no' if starts is None else len(starts)} starts")
        starts = [0] * len(prompts) if starts is None else list(starts)
        ids, pos, row, col = [], [], [], []
        for i, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
            if not 0 <= start < len(prompt) or len(prompt) > len(tables[i]) * self.store.page_size:
                raise ValueError(f"prompt {i}: start {start} of {len(prompt)} tokens in {len(tables[i])} pages")
            ids += prompt[start:]
            pos += range(start, len(prompt))
            row += [i] * (len(prompt) - start)
            col += range(len(prompt) - start)
        width = max(len(t) for t in tables)
        table = torch.full((len(tables), width), self.store.scratch, dtype=torch.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.as_tensor(t, dtype=torch.int64)
        new = [len(p) - s for p, s in zip(prompts, starts, strict=True)]
        packed = torch.tensor([ids, pos, row, col], dtype=torch.int64).to(self.store.device)
        table = table.to(self.store.device)
        span = max(new)
        if not any(starts):  # nothing cached: the new tokens attend only over themselves
            attend = self._causal(packed[2], packed[3], len(prompts), span)
        else:
            attend = self._paged_or_gathered(packed[1], packed[2], packed[3], table, span)
        hidden = self._forward(packed[0], packed[1], packed[2], packed[3], table, attend)
        last = torch.tensor(new, device=self.store.device).cumsum(0) - 1
        return self._logits(hidden[last])

    @torch.no_grad()
    def decode(self, tokens: Tensor, positions: Tensor, tables: Tensor) -> Tensor:
        """One step of B running sequences: row b feeds `tokens[b]` at position `positions[b]` (the positions its
        pages already hold), writes its K/V there and attends over positions [0, positions[b]]; `tables` [B, W] are
        their block tables padded with the scratch page. Returns [B, vocab] logits. No host sync."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        cols = torch.zeros_like(rows)
        table = tables.long()
        attend = self._paged_or_gathered(positions, rows, cols, table, 1)
        return self._logits(self._forward(tokens, positions, rows, cols, table, attend))

    @property
    def reads_real_lengths(self) -> bool:
        """Whether attention reads only each row's positions <= its own (the paged kernel: a block table wider
        than the longest row costs nothing) rather than every position of every block-table column given (the
        gather path: keep tables narrow)."""
        return self.attention == "paged"

    # -- the model
    def _forward(self, ids: Tensor, pos: Tensor, row: Tensor, col: Tensor, table: Tensor, attend: Attend) -> Tensor:
        """Packed tokens `ids` at positions `pos`, token t being query `col[t]` of batch row `row[t]`; returns their
        final hidden states [T, hidden] (before the final norm). `attend(layer, q, k, v)` is the step's attention
        over packed [T, heads or kv_heads, head_dim] tensors, built once per step."""
        ps = self.store.page_size
        slots = table[row, pos // ps] * ps + pos % ps
        h = self.inner.embed_tokens(ids[None])  # [1, T, hidden]
        cos, sin = self.inner.rotary_emb(h, pos[None])
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            h = h + self._attention(i, layer.self_attn, x, cos, sin, slots, attend)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h[0]

    def _attention(self, i: int, attn: Any, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor,
                   attend: Attend) -> Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)  # [1, T, heads, head_dim]
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self._rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [1, heads, T, head_dim]
        k = k[0].transpose(0, 1)
        self.store.write(i, slots, k, v[0])
        out = attend(i, q[0].transpose(0, 1), k, v[0])
        return attn.o_proj(out.flatten(1)[None])

    # -- the step's attention, one of three
    def _causal(self, row: Tensor, col: Tensor, b: int, span: int) -> Attend:
        """A prefill with nothing cached: each prompt's new tokens over themselves, padded at the end to [B, span]
        (`attention.causal_attention`: SDPA is_causal, no mask, no page read)."""

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            def pad(x: Tensor) -> Tensor:
                out = x.new_zeros(b, span, *x.shape[1:])
                out[row, col] = x
                return out.transpose(1, 2)  # [B, heads, span, head_dim]

            out = paged_kernel.causal_attention(pad(q), pad(k), pad(v), self.scaling)
            return out.transpose(1, 2)[row, col]

        return attend

    def _paged_or_gathered(self, pos: Tensor, row: Tensor, col: Tensor, table: Tensor, span: int) -> Attend:
        """Queries over their rows' pages up to their own positions: the Triton kernel (`attention.paged_attention`,
        no mask, reads only real lengths) or the gather reference (every column of `table`, one mask per step)."""
        b = table.shape[0]

        def pad(q: Tensor) -> Tensor:  # packed [T, heads, dim] -> [B, span, heads, dim]
            if span == 1:  # decode, or one new token a row: token t is row t's, a view
                return q[:, None]
            padded = q.new_zeros(b, span, *q.shape[1:])
            padded[row, col] = q
            return padded

        if self.attention == "paged":
            qpos = pos.new_full((b, span), -1)  # padding queries read nothing
            qpos[row, col] = pos

            def paged(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                out = paged_kernel.paged_attention(pad(q), self.store.keys(i), self.store.values(i), table, qpos,
                                                   self.scaling)
                return out[:, 0] if span == 1 else out[row, col]

            return paged
        # query positions padded to [B, span]; padding sits at position 0, so no row is fully masked
        qpos = pos.new_zeros(b, span)
        qpos[row, col] = pos
        keys = torch.arange(table.shape[1] * self.store.page_size, device=pos.device)
        mask = keys[None, None, None, :] <= qpos[:, None, :, None]  # [B, 1, span, W * page_size], once per step

        def gathered(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            keys = self.store.keys(i)[table].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [B, kv_heads, W*ps, dim]
            values = self.store.values(i)[table].flatten(1, 2).transpose(1, 2).to(q.dtype)
            out = F.scaled_dot_product_attention(pad(q).transpose(1, 2), keys, values, attn_mask=mask,
                                                 scale=self.scaling, enable_gqa=True)  # [B, heads, span, dim]
            return out[:, :, 0] if span == 1 else out.transpose(1, 2)[row, col]

        return gathered

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(self.inner.norm(hidden)).float()
