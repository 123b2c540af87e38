"""Training batches: (prompt, completion) token sequences packed right-padded, with per-token tensors.

Per-token tensors are aligned with targets: column t holds the value for the token at input
position t + 1, i.e. the token predicted from position t.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class TrainBatch:
    input_ids: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    loss_mask: Tensor  # [B, T-1] bool: targets the loss learns from (completion tokens)
    per_token: dict[str, Tensor] = field(default_factory=dict)  # [B, T-1] each
    per_seq: dict[str, Tensor] = field(default_factory=dict)  # [B] each

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def select(self, idx: Tensor) -> TrainBatch:
        return TrainBatch(
            self.input_ids[idx], self.attention_mask[idx], self.loss_mask[idx],
            {k: v[idx] for k, v in self.per_token.items()}, {k: v[idx] for k, v in self.per_seq.items()},
        )


def pack(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    completion_values: dict[str, list[list[float]]] | None = None,
    per_seq: dict[str, list[float]] | None = None,
    completion_masks: list[list[int]] | None = None,
) -> TrainBatch:
    """Concatenate each prompt with its completion; completion tokens get loss_mask=True, except where
    `completion_masks[i]` is 0 (tokens of a multi-turn episode that the environment inserted).

    `completion_values[name][i]` has one value per completion token of sequence i (e.g. the
    sampler's logprobs) and lands at those tokens' target positions; elsewhere it is 0.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    b = len(prompts)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.bool)
    values = {k: torch.zeros((b, width - 1)) for k in (completion_values or {})}
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = list(p) + list(c)
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        lo, hi = len(p) - 1, len(p) - 1 + len(c)
        if completion_masks is None:
            mask[i, lo:hi] = True
        else:
            if len(completion_masks[i]) != len(c):
                raise ValueError(f"completion_masks[{i}] has {len(completion_masks[i])} values for {len(c)} tokens")
            mask[i, lo:hi] = torch.tensor(completion_masks[i], dtype=torch.bool)
        for k, v in (completion_values or {}).items():
            if len(v[i]) != len(c):
                raise ValueError(f"{k}[{i}] has {len(v[i])} values for {len(c)} completion tokens")
            values[k][i, lo:hi] = torch.tensor(v[i], dtype=torch.float32)
    seq_t = {k: torch.tensor(v, dtype=torch.float32) for k, v in (per_seq or {}).items()}
    return TrainBatch(ids, attn, mask, values, seq_t)
