"""Sampling on the device inside the decode step: every row's next token and its logprob from the step's logits and
per-row knobs held in device tensors, with no host sync, no `torch.Generator` and no per-row Python loop, so the
whole function compiles into the step (`torch.compile(fullgraph=True)`, CUDA-graph capture).

The contract is today's (`factory.core.rollout.engines.sampler`): logprobs are those of the temperature-scaled
distribution before top-k / top-p truncation, what `factory.core.trainer.torch_trainer.token_logprobs` computes at that
temperature; a greedy row takes the argmax at temperature 1; an `allowed` mask (constrained decoding) renormalizes
over the tokens it allows, logprobs included. Top-k applies first, then top-p over the renormalized top-k
distribution (as transformers' and vLLM's samplers order them); the most likely token is always kept.

Noise is counter-based: the uniform for (seed, counter) is a pure function of those two integers (`row_uniform`),
so a seeded row draws the same tokens whatever else shares its batch and at whatever row it sits. It is computed
with integer tensor ops that stay exact on every device: all values are kept in [0, 2^32) inside int64 tensors and
every product is below 2^63 (`_mul32`), so nothing relies on signed overflow or on unsigned 64-bit types (which
torch lacks on some devices), and right shifts of non-negative values are logical. The mix is Wellons' lowbias32
finalizer. Per row, two 32-bit keys come from (seed low, seed high, counter) through two chains of the mix, and two
more rounds over a hashed index give the word (`noise_bits`, defined per (seed, counter, index); the sampler takes
index 0), turned into a uniform in (0, 1) with 32 bits at its low end.

Sampling is by inverse CDF with that one uniform per row: the token is the first whose cumulative probability
(in vocabulary order, or in sorted order after top-k / top-p) reaches u times the row's total. That is O(vocab)
work per row (a cumulative sum and a binary search), where a Gumbel race needs a noise word per vocabulary entry
(~40 int64 passes over [rows, vocab]: 49 ms a step of 16 rows over SmolLM2's 49,152 tokens on one CPU thread).
A cumulative sum over a row depends only on that row, so the draw is batch-invariant.

Top-k and top-p take one stable sort of each row (O(V log V)), a softmax and a cumulative sum over the sorted
values; the draw searches the kept probabilities in sorted order and maps the index back through the sort: no
data-dependent shape. It runs only when the caller asks (`truncate=True`, a Python flag the host knows from the
requests' parameters, so a batch without top-k or top-p skips the sort; the two cases are two compiled graphs, not
a recompile per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
# Constants XORed in so the chains (row key 1, row key 2, vocabulary id) are distinct functions (golden-ratio and
# splitmix64 odd constants, cut to 32 bits).
_K1, _K2, _KV = 0x9E3779B9, 0x7F4A7C15, 0xBF58476D
_U_SCALE = 2.0**-32
_U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1


class Knobs(NamedTuple):
    """Per-row sampling knobs, each a [rows] tensor on the logits' device."""

    temperature: Tensor  # float32; ignored (taken as 1) where greedy
    top_p: Tensor  # float32 in (0, 1]; 1 keeps every token
    top_k: Tensor  # int64; 0 (or >= vocab) keeps every token
    greedy: Tensor  # bool
    seed: Tensor  # int64: the request's seed mixed with its sample index (`sequences.mix_seed`)
    counter: Tensor  # int64 >= 0: the index in its completion of the token being sampled (0: the first)


class Sampled(NamedTuple):
    """What `sample` returns, on the device: tokens [rows] int64, their logprobs [rows] float32, and the `k` most
    likely ids [rows, k] int64 and logprobs [rows, k] float32 (k = `top_logprobs`, 0 columns when 0)."""

    tokens: Tensor
    logprobs: Tensor
    top_ids: Tensor
    top_logprobs: Tensor


def knobs(temperature: Sequence[float], top_p: Sequence[float], top_k: Sequence[int], greedy: Sequence[bool],
          seed: Sequence[int], counter: Sequence[int], device: torch.device | str = "cpu") -> Knobs:
    """`Knobs` from host lists (outside the step: a captured step reads knobs from buffers the host fills)."""
    return Knobs(torch.tensor(temperature, dtype=torch.float32, device=device),
                 torch.tensor(top_p, dtype=torch.float32, device=device),
                 torch.tensor(top_k, dtype=torch.long, device=device),
                 torch.tensor(greedy, dtype=torch.bool, device=device),
                 torch.tensor(seed, dtype=torch.long, device=device),
                 torch.tensor(counter, dtype=torch.long, device=device))


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) and an odd constant c < 2^32, with every intermediate below 2^63: the
    top bit of c contributes (x * 2^31) mod 2^32 = (x & 1) << 31."""
    out = x * (c & 0x7FFFFFFF)
    if c >> 31:
        out = out + ((x & 1) << 31)
    return out & _M32


def _mix32(x: Tensor) -> Tensor:
    """Wellons' lowbias32 finalizer on values in [0, 2^32): a bijection with strong avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def noise_bits(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """[rows, vocab] int64 in [0, 2^32): the noise word of each (seed, counter, vocabulary id), a pure function of
    the three integers (rows are independent of each other)."""
    lo, hi, ctr = (seed & _M32)[:, None], ((seed >> 32) & _M32)[:, None], (counter & _M32)[:, None]
    k1 = _mix32(_mix32(_mix32(lo ^ _K1) ^ hi) ^ ctr)
    k2 = _mix32(_mix32(_mix32(hi ^ _K2) ^ ctr) ^ lo)
    ids = _mix32(torch.arange(vocab, dtype=torch.long, device=seed.device) ^ _KV)
    return _mix32(_mix32(ids ^ k1) ^ k2)


def uniforms(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """[rows, vocab] float32 uniforms in (0, 1) from `noise_bits`: (bits + 1/2) / 2^32, capped at 1 - 2^-24."""
    return ((noise_bits(seed, counter, vocab).float() + 0.5) * _U_SCALE).clamp(max=_U_MAX)


def row_uniform(seed: Tensor, counter: Tensor) -> Tensor:
    """[rows] float32 uniforms in (0, 1): each row's one draw, `uniforms` at index 0."""
    return uniforms(seed, counter, 1)[:, 0]


def _kept_sorted(scaled: Tensor, top_p: Tensor, top_k: Tensor) -> tuple[Tensor, Tensor]:
    """The probabilities top-k then top-p keep, in each row's descending order (0 where cut; the most likely is
    always kept), and that order: [rows, vocab] float32 and int64, by one stable sort per row."""
    vocab = scaled.shape[-1]
    values, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(values, dim=-1)
    rank = torch.arange(vocab, device=scaled.device)
    in_k = rank < torch.where(top_k > 0, top_k, vocab)[:, None]
    probs = torch.where(in_k, probs, torch.zeros_like(probs))
    renorm = probs / probs.sum(dim=-1, keepdim=True)
    in_p = (renorm.cumsum(dim=-1) - renorm < top_p[:, None]) | (top_p[:, None] >= 1)
    keep = (in_k & in_p) | (rank == 0)
    return torch.where(keep, probs, torch.zeros_like(probs)), order


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """[rows] int64: the first index whose cumulative probability reaches u times the row's total (u in (0, 1)).
    An entry of probability 0 is never taken: its cumulative value equals the one before it, which reaches the
    target first, and the target is above 0 (the first entry's value when that is 0) and at most the total (the
    last value), even where u * total rounds up to the total in float32."""
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1)


def sample(logits: Tensor, knobs: Knobs, *, truncate: bool = True, allowed: Tensor | None = None,
           top_logprobs: int = 0) -> Sampled:
    """Each row's next token from `logits` [rows, vocab] (any float dtype; computed in float32) with its own knobs.

    `truncate`: apply top-k / top-p (False skips the sort: only right when no row has them). `allowed` [rows, vocab]
    bool: tokens a row may sample (constrained decoding), or None for all. `top_logprobs`: how many alternatives to
    return. Both are static to a compiled graph. Makes no host sync."""
    temperature = torch.where(knobs.greedy, torch.ones_like(knobs.temperature), knobs.temperature)
    scaled = logits.float() / temperature[:, None]
    if allowed is not None:
        scaled = scaled.masked_fill(~allowed, float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)
    u = row_uniform(knobs.seed, knobs.counter)
    if truncate:
        kept, order = _kept_sorted(scaled, knobs.top_p, knobs.top_k)
        drawn = order.gather(-1, _inverse_cdf(kept, u)[:, None]).squeeze(-1)
    else:
        drawn = _inverse_cdf(logp.exp(), u)
    tokens = torch.where(knobs.greedy, logp.argmax(dim=-1), drawn)
    top = logp.topk(top_logprobs, dim=-1)
    return Sampled(tokens, logp.gather(-1, tokens[:, None]).squeeze(-1), top.indices, top.values)
