"""A toy trainer backend, written outside factory/ as a newcomer's would be: plain SGD on the policy in one process.

docs/extending.md ("Adding a trainer backend") walks through it; tests/extending/test_trainer_backend.py registers
it and trains the quickstart's micro model with it. It implements `factory.protocols.Trainer`: `step` (the
algorithm's loss on each minibatch, one SGD update each, a non-finite one skipped by the house rule), `logprobs`,
`version` and `optimizer`; `build` is the builder a registration names.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from factory.core.trainer.step import guarded_step  # the non-finite rule every trainer applies

BUILT: list[SGDTrainer] = []  # every trainer `build` made in this process (the test's proof it was used)


class SGDTrainer:
    """Trains `model` in place with SGD, so the model the run publishes is the trained one."""

    def __init__(self, model: torch.nn.Module, lr: float, grad_clip: float, temperature: float):
        self.model = model
        self.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.grad_clip, self.temperature = grad_clip, temperature
        self.version = 0  # updates applied: the weight version the run publishes

    def _forward(self, batch):
        """Log-probs of the target tokens [B, T-1] and the policy's entropy there (detached)."""
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1].float() / self.temperature, dim=-1)
        target = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        return target, -(logp.exp() * logp).sum(-1).detach()

    @torch.no_grad()
    def logprobs(self, batch) -> torch.Tensor:
        self.model.eval()
        return self._forward(_on(batch, _device(self.model)))[0].cpu()

    def step(self, batch, loss_fn, minibatches: int = 1, generator: torch.Generator | None = None) -> dict[str, float]:
        self.model.train()
        t0 = time.perf_counter()
        order = torch.randperm(len(batch), generator=generator) if minibatches > 1 else torch.arange(len(batch))
        sums: dict[str, float] = {}
        skipped = 0
        for rows in order.chunk(minibatches):
            mb = _on(batch.select(rows), _device(self.model))
            logp, entropy = self._forward(mb)
            loss, metrics = loss_fn(logp, mb)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            applied = guarded_step(self.optimizer, loss, grad_norm, on_device=False)
            skipped += not applied
            self.version += bool(applied)
            mask = mb.loss_mask
            ent = (entropy * mask).sum() / mask.sum().clamp(min=1)
            for k, v in {**metrics, "loss": loss.detach(), "grad_norm": grad_norm, "entropy": ent}.items():
                sums[k] = sums.get(k, 0.0) + float(v) / minibatches
        n = len(order.chunk(minibatches))
        return {**sums, "nonfinite": skipped / n, "train_s": time.perf_counter() - t0, "tokens": float(batch.n_tokens)}


def build(spec, model) -> SGDTrainer:
    """The builder a registration names: the run's spec and its policy (already on the run's device) in."""
    trainer = SGDTrainer(model, lr=spec.algorithm.lr, grad_clip=spec.trainer.grad_clip,
                         temperature=spec.rollout.temperature)
    BUILT.append(trainer)
    return trainer


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _on(batch, device: torch.device):
    """`batch` with its tensors on `device` (the loop's batches arrive on the CPU)."""
    if batch.input_ids.device == device:
        return batch
    to = {k: v.to(device) for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    return dataclasses.replace(batch, **to, per_token={k: v.to(device) for k, v in batch.per_token.items()},
                               per_seq={k: v.to(device) for k, v in batch.per_seq.items()})
