"""The trainer's own log-probs of a training batch before the update, under the weights that generated each row.

A row (one sample) sampled by version v is scored by the trainer under v where it still holds v: the current weights
(version `current`: sync mode, and fresh rows of the overlapped modes), or the previous version's, kept as a copy in
one_step_off and async runs (`keep_previous`), where most rows are one version old. A row older than that, or one whose
tokens came from several versions (an in-flight weight update), is not "at hand": it is scored under the current
weights, the proximal policy, as the buffer's importance policy does for staleness. Rows are scored in subsets, so a
batch costs at most one forward per weight version it needs; a caller that only measures the gap (the loss takes the
sampler's log-probs) scores a share of the rows.

The copy of the previous weights is not part of a resume point: after a resume, rows of the version before it are
scored under the proximal policy for one step.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from factory.core.batch import TrainBatch
from factory.core.trainer.torch_trainer import TorchTrainer


@dataclass
class Scored:
    """A batch's trainer log-probs: `own` [B, T] under each row's generating weights where `at_hand` [B], else under
    the current weights (`current`, [B, T], computed on the rows that needed it, the sampler's elsewhere: see
    `needs_current`; rows left out of `rows` keep the sampler's in both); `seconds` the time the passes took."""

    own: Tensor
    at_hand: Tensor
    current: Tensor
    seconds: float


class BehaviourScorer:
    """Scores batches with the trainer's weights of the version that generated them (see the module docstring)."""

    def __init__(self, trainer, model: PreTrainedModel, keep_previous: bool, temperature: float,
                 precision: str = "fp32"):
        self.trainer = trainer
        self.model = model
        self._previous: TorchTrainer | None = None
        self._previous_version: int | None = None
        if keep_previous:
            # The same speed-up switches as the trainer's would change nothing a forward computes here but its speed.
            self._previous = TorchTrainer(copy.deepcopy(model).eval(), lr=0.0,
                                          temperature=temperature, precision=precision)

    def remember(self, version: int) -> None:
        """Copy the current weights as `version`'s, before they are updated (no-op without `keep_previous`)."""
        if self._previous is None:
            return
        with torch.no_grad():
            for dst, src in zip(self._previous.model.state_dict().values(), self.model.state_dict().values(),
                                strict=True):
                dst.copy_(src)
        self._previous_version = version

    def score(self, batch: TrainBatch, row_versions: list[int | None], current: int,
              needs_current: Tensor | None = None, rows: Tensor | None = None) -> Scored:
        """Trainer log-probs of `batch`, row i under version `row_versions[i]` (None: several versions) where that is
        `current` or the kept previous one; `needs_current` [B] bool: rows also wanted under the current weights
        (e.g. stale rows the buffer corrects), whatever their version. `rows` [B] bool: score only these (the others
        are not at hand and keep the sampler's log-probs, unless `needs_current` asks for them); default all."""
        t0 = time.perf_counter()
        b = len(batch)
        if len(row_versions) != b:
            raise ValueError(f"{len(row_versions)} row versions for a batch of {b} rows")
        wanted = torch.ones(b, dtype=torch.bool) if rows is None else rows.bool()
        versions = torch.tensor([-1 if v is None else v for v in row_versions])
        on_current = (versions == current) & wanted
        on_previous = torch.zeros(b, dtype=torch.bool)
        if self._previous_version is not None and self._previous_version != current:
            on_previous = (versions == self._previous_version) & wanted
        at_hand = on_current | on_previous
        want_current = on_current | (wanted & ~at_hand)
        if needs_current is not None:
            want_current = want_current | needs_current.bool()
        sampler = batch.per_token["old_logprobs"]
        current_lp = sampler.clone()
        if bool(want_current.any()):
            current_lp[want_current] = self._subset(self.trainer, batch, want_current)
        own = current_lp.clone()
        if bool(on_previous.any()):
            assert self._previous is not None
            own[on_previous] = self._subset(self._previous, batch, on_previous)
        return Scored(own, at_hand, current_lp, time.perf_counter() - t0)

    @staticmethod
    def _subset(trainer, batch: TrainBatch, rows: Tensor) -> Tensor:
        if bool(rows.all()):
            return trainer.logprobs(batch)
        return trainer.logprobs(batch.select(rows.nonzero().squeeze(-1)))
