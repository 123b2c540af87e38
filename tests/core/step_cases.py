"""What the step tests of both torch trainers share: GRPO-shaped batches, a loss that turns NaN, and a count of the
host reads inside a trainer's minibatch loop."""

from __future__ import annotations

import os

import torch

from factory.config import AlgorithmSpec
from factory.core.algorithms import make_loss
from factory.core.batch import TrainBatch, pack
from tests.core.host_sync import HostReads

GRPO = make_loss(AlgorithmSpec(name="grpo", kl_coef=0.05))

# transformers' mask builder reads the forward's inputs: whether a padded batch's mask can be dropped
# (`_ignore_causal_mask_sdpa`, two reads of the padding mask) or, packed, whether the position ids hold several
# sequences (`find_packed_sequence_indices`, one read). Those are the forward's, not the step's; every other read
# inside the loop counts.
MASK_BUILDER = f"transformers{os.sep}masking_utils.py"


def rl_batch(tok, rows: int, longest: int, seed: int) -> TrainBatch:
    """GRPO-shaped rows of different lengths (right-padded), with old / reference logprobs and advantages."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(tok) - 1

    def seq(lo: int) -> list[int]:
        n = int(torch.randint(lo, longest, (1,), generator=g))
        return torch.randint(4, vocab, (n,), generator=g).tolist()

    prompts, completions = [seq(2) for _ in range(rows)], [seq(1) for _ in range(rows)]
    batch = pack(prompts, completions, tok.pad_token_id)
    shape = batch.loss_mask.shape
    batch.per_token["old_logprobs"] = -torch.rand(shape, generator=g) - 1.0
    batch.per_token["ref_logprobs"] = -torch.rand(shape, generator=g) - 1.0
    batch.per_seq["advantages"] = torch.randn(rows, generator=g)
    return batch


def nan_after(n_ok: int):
    """GRPO's loss, NaN from the (n_ok + 1)-th call on."""
    calls = []

    def loss_fn(logp, batch):
        calls.append(1)
        loss, metrics = GRPO(logp, batch)
        return (loss * float("nan") if len(calls) > n_ok else loss), metrics

    return loss_fn


def step_reads(reads: list[list[str]], allowed: tuple[str, ...] = ()) -> list[list[str]]:
    """`reads` without the mask builder's and those made in the `allowed` functions."""
    ends = tuple(f" in {name}" for name in allowed)
    return [[r for r in mb if MASK_BUILDER not in r and not (ends and r.endswith(ends))] for mb in reads]


def count_reads(trainer) -> list[list[str]]:
    """Record the host reads of each minibatch of `trainer` (the loop inside `step`, not the one read after it)."""
    per_minibatch: list[list[str]] = []
    inner = trainer._minibatch

    def counted(mb, loss_fn):
        with HostReads() as reads:
            out = inner(mb, loss_fn)
        per_minibatch.append(reads.seen)
        return out

    trainer._minibatch = counted
    return per_minibatch
