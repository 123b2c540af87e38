"""The torch trainer: computes token logprobs, applies a loss function it is given, steps AdamW.

It knows nothing of the algorithm: the loss function receives the new logprobs and the batch
(with whatever per-token tensors the algorithm put there) and returns (loss, metrics).

Device and precision: it computes on the device of the model it is given (the run placed it there: nothing here
moves the model, so the rollout engines and evals that share it keep finding it where they left it). Batches
arrive as CPU tensors and are moved to that device per minibatch; `logprobs` comes back on the CPU. `precision`
"bf16" runs the forward under bf16 autocast over the float32 master weights (`factory.infra.device.autocast`);
the log-softmax and the loss are taken in float32.

A minibatch whose loss or gradient norm is NaN/inf is not applied: its gradients are dropped and the
optimizer is not stepped, so the parameters and the AdamW state stay exactly as they were (one bad batch
would otherwise poison the moments for good). `step` reports the share of such minibatches as `nonfinite`;
the loop decides when too many in a row stop a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from factory.core.batch import TrainBatch
from factory.core.trainer.logprobs import token_logprobs as chunked_token_logprobs
from factory.core.trainer.packing import Packer, PackPlan
from factory.infra.device import autocast, model_device
from factory.infra.liveness import pulse_from_layers

LossFn = Callable[[Tensor, TrainBatch], tuple[Tensor, dict[str, float]]]


def token_logprobs(model: PreTrainedModel, batch: TrainBatch, temperature: float = 1.0,
                   with_entropy: bool = False, fused: bool = False) -> tuple[Tensor, Tensor | None]:
    """Logprob of each target token [B, T-1] (and the policy entropy there, detached: a metric) under `model`,
    chunked over tokens so no full-vocabulary float32 tensor is kept through backward (`trainer/logprobs.py`);
    `fused`: the head as one fused op (`trainer/fused_head.py`, trainer.fused_head)."""
    return chunked_token_logprobs(model, batch, temperature, with_entropy, fused=fused)


def toggle_on(field: str, value: str, device: torch.device) -> bool:
    """Whether a trainer speed-up switch is on: "on" / "off", or "auto" (on where the trainer computes on CUDA, so
    the CPU path keeps its numbers bit for bit)."""
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{field}: expected 'auto', 'on' or 'off', got {value!r}")
    return value == "on" or (value == "auto" and device.type == "cuda")


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """`batch` with every tensor on `device` (itself when it is there already: no copy on the CPU)."""
    if batch.input_ids.device == device:
        return batch
    return TrainBatch(batch.input_ids.to(device), batch.attention_mask.to(device), batch.loss_mask.to(device),
                      {k: v.to(device) for k, v in batch.per_token.items()},
                      {k: v.to(device) for k, v in batch.per_seq.items()})


MinibatchFn = Callable[[TrainBatch], tuple[dict[str, float], bool]]


def over_minibatches(batch: TrainBatch, minibatches: int, generator: torch.Generator | None,
                     one: MinibatchFn) -> dict[str, float]:
    """What every trainer's `step` shares: split `batch` into `minibatches` shuffled by `generator`, run `one` on
    each (its metrics, and whether the update was applied), and return the mean metrics with `nonfinite` (the
    share not applied), `train_s` and `tokens`."""
    t0 = time.perf_counter()
    order = torch.randperm(len(batch), generator=generator) if minibatches > 1 else torch.arange(len(batch))
    chunks = order.chunk(minibatches)
    sums: dict[str, float] = {}
    skipped = 0
    for chunk in chunks:
        metrics, applied = one(batch.select(chunk))
        skipped += not applied
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v / minibatches
    sums["nonfinite"] = skipped / len(chunks)
    sums["train_s"] = time.perf_counter() - t0
    sums["tokens"] = float(batch.n_tokens)
    return sums


class TorchTrainer:
    """Owns the model being trained and its optimizer; computes on the model's device."""

    def __init__(self, model: PreTrainedModel, lr: float, grad_clip: float = 1.0,
                 weight_decay: float = 0.0, temperature: float = 1.0, precision: str = "fp32",
                 packing: str = "auto", fused_head: str = "auto", compile: str = "auto",
                 fused_optimizer: str = "auto"):
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"trainer.precision: expected 'fp32' or 'bf16', got {precision!r}")
        self.model = model
        # The speed-ups (trainer.packing / fused_head / compile / fused_optimizer): "auto" is resolved on the device
        # the model is on when they are used (a KL reference is moved to the policy's device after it is built).
        self.toggles = {"packing": packing, "fused_head": fused_head, "compile": compile,
                        "fused_optimizer": fused_optimizer}
        for name, value in self.toggles.items():
            toggle_on(f"trainer.{name}", value, torch.device("cpu"))  # a bad value fails here, not mid-run
        pulse_from_layers(model)  # a long forward and backward beats block by block (infra/liveness.py)
        self.precision = precision
        self.temperature = temperature
        self.grad_clip = grad_clip
        # Only what trains: with LoRA adapters attached (models/lora.py) the frozen base weights stay out of AdamW.
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=weight_decay, betas=(0.9, 0.99))
        self.version = 0  # number of optimizer steps taken: the weight version it would publish
        self.packer = Packer()

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def uses(self, name: str) -> bool:
        """Whether the speed-up `name` (a key of `toggles`) is on where the model is now."""
        return toggle_on(f"trainer.{name}", self.toggles[name], self.device)

    def _logprobs(self, batch: TrainBatch, with_entropy: bool = False,
                  plan: PackPlan | None = None) -> tuple[Tensor, Tensor | None]:
        """`token_logprobs` on the model's device, under the trainer's precision (logprobs in float32). With
        packing, `plan` (`self.packer.plan` of the batch while it is on the CPU) saves a host read of its mask."""
        with autocast(self.device, self.precision):
            fused = self.uses("fused_head")
            if self.uses("packing"):  # real tokens only, back in the padded layout (trainer/packing.py)
                logp, entropy = self.packer.token_logprobs(self.model, batch, self.temperature, with_entropy, plan,
                                                           fused=fused)
            else:
                logp, entropy = token_logprobs(self.model, batch, self.temperature, with_entropy=with_entropy,
                                               fused=fused)
        return logp.float(), None if entropy is None else entropy.float()

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> Tensor:
        """Target-token logprobs [B, T-1], on the CPU (where the loop's batches live)."""
        self.model.eval()
        plan = self.packer.plan(self.model, batch, self.device) if self.uses("packing") else None
        return self._logprobs(batch_to(batch, self.device), plan=plan)[0].cpu()

    def step(self, batch: TrainBatch, loss_fn: LossFn, minibatches: int = 1,
             generator: torch.Generator | None = None) -> dict[str, float]:
        """One optimizer step per minibatch over a shuffled split of `batch`; returns mean metrics.

        A minibatch with a non-finite loss or gradient norm is skipped (gradients dropped, no optimizer step,
        `version` not advanced); `nonfinite` is the fraction of minibatches skipped (0.0 or 1.0 with one), and
        `loss` / `grad_norm` are the values observed, NaN or inf included."""
        self.model.train()
        return over_minibatches(batch, minibatches, generator, lambda mb: self._minibatch(mb, loss_fn))

    def _minibatch(self, mb: TrainBatch, loss_fn: LossFn) -> tuple[dict[str, float], bool]:
        plan = self.packer.plan(self.model, mb, self.device) if self.uses("packing") else None  # from the CPU mask
        mb = batch_to(mb, self.device)
        logp, entropy = self._logprobs(mb, with_entropy=True, plan=plan)
        loss, metrics = loss_fn(logp, mb)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # The total norm before clipping: NaN/inf if any gradient element is (clipping cannot repair it).
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        applied = bool(torch.isfinite(loss.detach()).all() and torch.isfinite(grad_norm))
        if applied:
            self.optimizer.step()
            self.version += 1
        else:
            self.optimizer.zero_grad(set_to_none=True)
        mask = mb.loss_mask
        ent = (entropy * mask).sum() / mask.sum().clamp(min=1)
        return {**metrics, "loss": loss.item(), "grad_norm": float(grad_norm), "entropy": ent.item()}, applied
