"""The continuous engine's sampler: the next token of every running row in one batched pass, each row with its own
temperature, top-p, generator and (optionally) constrained choices, and the step's one device-to-host copy.

Logprobs are those of the temperature-scaled distribution before top-p truncation — what
`factory.core.trainer.torch_trainer.token_logprobs` computes at that temperature (greedy: temperature 1). A row
with `SamplingParams.choices` samples among the tokens that continue one of its choices; its logprobs are of that
renormalized distribution (the tokens outside it have probability 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from factory.core.rollout.engines.sequences import Sequence


def knobs(rows: list[Sequence], device: torch.device) -> Tensor:
    """[3, rows] float32 (as torch.tensor makes Python floats) on the device, in one copy: each row's temperature
    (1 for greedy), top-p and greedy flag."""
    return torch.tensor([[1.0 if r.params.greedy else r.params.temperature for r in rows],
                         [r.params.top_p for r in rows], [float(r.params.greedy) for r in rows]], device=device)


def allowed_tokens(rows: list[Sequence]) -> list[list[int] | None]:
    """Per row, the tokens that continue one of its choices (None: any token)."""
    out: list[list[int] | None] = []
    for r in rows:
        if not r.params.choices:
            out.append(None)
            continue
        k, done = len(r.tokens), tuple(r.tokens)
        nxt = sorted({c[k] for c in r.params.choices if len(c) > k and c[:k] == done})
        out.append(nxt or None)  # none left: the row is complete (`Sequence.check_stop` ends it)
    return out


def choice_mask(allowed: list[list[int] | None], vocab: int, device: torch.device) -> Tensor:
    """[rows, vocab] bool, True where a row may sample: one copy of the (row, token) pairs to the device."""
    free = [i for i, a in enumerate(allowed) if a is None]
    pairs = [(i, t) for i, a in enumerate(allowed) if a is not None for t in a]
    mask = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=device)
    index = torch.tensor([[i for i, _ in pairs] + free, [t for _, t in pairs] + [0] * len(free)],
                         dtype=torch.long, device=device)
    mask[index[0, : len(pairs)], index[1, : len(pairs)]] = True
    mask[index[0, len(pairs):]] = True
    return mask


def sample(logits: Tensor, rows: list[Sequence], row_knobs: Tensor, device: torch.device) -> list[list[float]]:
    """Pick each row's next token with its own parameters (`row_knobs`, from `knobs(rows)`) and generator, making
    tensors on `device` (the engine's: where the model computes). Returns,
    per row, from the step's one device-to-host copy (as float64: exact for token ids and float32 logprobs): the
    token, its logprob, then k alternative ids and k logprobs (k: the rows' largest `top_logprobs`)."""
    temps, top_p, greedy = row_knobs[0, :, None], row_knobs[1], row_knobs[2] > 0
    scaled = logits.float() / temps
    if any(r.params.choices for r in rows):
        scaled = scaled.masked_fill(~choice_mask(allowed_tokens(rows), scaled.shape[-1], device), float("-inf"))
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if any(r.params.top_p < 1 for r in rows):
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p < top_p[:, None]) | (top_p[:, None] >= 1)  # top token always kept
        probs = torch.zeros_like(probs).scatter(-1, idx, torch.where(keep, sorted_p, torch.zeros_like(sorted_p)))
    # Inverse-CDF sampling with one uniform per row from that row's generator (on the device, so nothing
    # waits): batched, yet per-request seeded.
    u = torch.cat([torch.rand(1, generator=r.generator, device=device) for r in rows])
    cdf = probs.cumsum(-1)
    sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    sampled = sampled.clamp(max=probs.shape[-1] - 1)
    tok = torch.where(greedy, logp.argmax(-1), sampled)
    tok_logp = logp.gather(-1, tok[:, None]).squeeze(-1)
    k = max(r.params.top_logprobs for r in rows)
    cols = [tok[:, None].double(), tok_logp[:, None].double()]
    if k:
        top = logp.topk(k, dim=-1)
        cols += [top.indices.double(), top.values.double()]
    return torch.cat(cols, dim=1).tolist()
