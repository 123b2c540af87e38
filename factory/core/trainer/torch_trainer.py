"""The torch trainer: computes token logprobs, applies a loss function it is given, steps AdamW.

It knows nothing of the algorithm: the loss function receives the new logprobs and the batch
(with whatever per-token tensors the algorithm put there) and returns (loss, metrics).

Device and precision: it computes on the device of the model it is given (the run placed it there: nothing here
moves the model, so the rollout engines and evals that share it keep finding it where they left it). Batches
arrive as CPU tensors and are moved to that device per minibatch; `logprobs` comes back on the CPU. `precision`
"bf16" runs the forward under bf16 autocast over the float32 master weights (`factory.infra.device.autocast`);
the log-softmax and the loss are taken in float32.

A minibatch whose loss or gradient norm is NaN/inf is not applied (the non-finite rule, `trainer/step.py`'s
`guarded_step`, shared by every trainer): `step` reports the share of such minibatches as `nonfinite`.

Host syncs. With `trainer.fused_optimizer` on (auto: on CUDA) AdamW runs fused and that skip is decided on the
device (`trainer/step.py`), so a step reads the device once, after its last optimizer step: the metrics, the
loss functions' included, stay 0-dim tensors until `over_minibatches` reads them together. Off (the CPU default),
the skip is decided on the host per minibatch, as before; the metrics are read once either way. Batches reach
CUDA from pinned memory without blocking the host. With `trainer.compile` on (auto: on CUDA) each decoder layer
runs compiled in the trainer's forwards (`trainer/compiled.py`), and eager wherever else the model is called.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from factory.core.batch import TrainBatch
from factory.core.trainer.compiled import CompiledLayers
from factory.core.trainer.logprobs import token_logprobs as chunked_token_logprobs
from factory.core.trainer.packing import Packer, PackPlan
from factory.core.trainer.step import Metric, guarded_step, host_floats, make_adamw
from factory.infra.device import autocast, model_device
from factory.infra.liveness import pulse_from_layers

# A loss function's metrics are numbers or 0-dim tensors (read on the host once per step, not per minibatch).
LossFn = Callable[[Tensor, TrainBatch], tuple[Tensor, dict[str, Metric]]]


def token_logprobs(model: PreTrainedModel, batch: TrainBatch, temperature: float = 1.0,
                   with_entropy: bool = False, fused: bool = False) -> tuple[Tensor, Tensor | None]:
    """Logprob of each target token [B, T-1] (and the policy entropy there, detached: a metric) under `model`,
    chunked over tokens so no full-vocabulary float32 tensor is kept through backward (`trainer/logprobs.py`);
    `fused`: the head as one fused op (`trainer/fused_head.py`, trainer.fused_head)."""
    return chunked_token_logprobs(model, batch, temperature, with_entropy, fused=fused)


SPEEDUPS = ("packing", "fused_head", "compile", "fused_optimizer")  # TorchTrainer's switches, trainer.<name>


def toggle_on(field: str, value: str, device: torch.device) -> bool:
    """Whether a trainer speed-up switch is on: "on" / "off", or "auto" (on where the trainer computes on CUDA, so
    the CPU path keeps its numbers bit for bit)."""
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{field}: expected 'auto', 'on' or 'off', got {value!r}")
    return value == "on" or (value == "auto" and device.type == "cuda")


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """`batch` with every tensor on `device` (itself when it is there already: no copy on the CPU). To CUDA each
    CPU tensor goes through pinned memory without blocking the host (the caching host allocator keeps the pinned
    copy alive until the transfer is done)."""
    if batch.input_ids.device == device:
        return batch

    def to(t: Tensor) -> Tensor:
        if device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    return TrainBatch(to(batch.input_ids), to(batch.attention_mask), to(batch.loss_mask),
                      {k: to(v) for k, v in batch.per_token.items()}, {k: to(v) for k, v in batch.per_seq.items()})


# A minibatch's metrics and whether its update was applied (a bool, or a 0-dim device tensor: 1 applied, 0 not).
MinibatchFn = Callable[[TrainBatch], tuple[dict[str, Metric], bool | Tensor]]


def over_minibatches(batch: TrainBatch, minibatches: int, generator: torch.Generator | None,
                     one: MinibatchFn) -> tuple[dict[str, float], int]:
    """What every trainer's `step` shares: split `batch` into `minibatches` shuffled by `generator`, run `one` on
    each (its metrics, and whether the update was applied), read every device value at once after the last, and
    return the mean metrics with `nonfinite` (the share not applied), `train_s` and `tokens`, and the number of
    updates applied (what the trainer's `version` advances by)."""
    t0 = time.perf_counter()
    order = torch.randperm(len(batch), generator=generator) if minibatches > 1 else torch.arange(len(batch))
    chunks = order.chunk(minibatches)
    results = [one(batch.select(chunk)) for chunk in chunks]
    names = [name for metrics, _ in results for name in ("applied", *metrics)]
    read = iter(host_floats([v for metrics, applied in results for v in (applied, *metrics.values())], names))
    sums: dict[str, float] = {}
    skipped = 0
    for metrics, _ in results:  # summed in the order they came, as when each was read on its own
        skipped += not next(read)
        for k in metrics:
            sums[k] = sums.get(k, 0.0) + next(read) / minibatches
    sums["nonfinite"] = skipped / len(chunks)
    sums["train_s"] = time.perf_counter() - t0
    sums["tokens"] = float(batch.n_tokens)
    return sums, len(chunks) - skipped


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
        # Fused or not is decided here, on the device the model is on now (the run placed it before).
        self.fused = self.uses("fused_optimizer")
        self.optimizer = make_adamw([p for p in model.parameters() if p.requires_grad], lr=lr,
                                    weight_decay=weight_decay, fused=self.fused)
        self.version = 0  # number of optimizer steps taken: the weight version it would publish
        self.packer = Packer()
        self._layers: CompiledLayers | None = None  # built at the first forward with trainer.compile on

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    def uses(self, name: str) -> bool:
        """Whether the speed-up `name` (a key of `toggles`) is on where the model is now."""
        return toggle_on(f"trainer.{name}", self.toggles[name], self.device)

    def _compiled(self) -> contextlib.AbstractContextManager:
        """Where the trainer's forwards run: with `trainer.compile` on, a context in which this thread's calls of
        the model's decoder layers go compiled (built once per trainer; `trainer/compiled.py`)."""
        if not self.uses("compile"):
            return contextlib.nullcontext()
        if self._layers is None:
            self._layers = CompiledLayers(self.model)
        return self._layers.active()

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
        with self._compiled():
            return self._logprobs(batch_to(batch, self.device), plan=plan)[0].cpu()

    def step(self, batch: TrainBatch, loss_fn: LossFn, minibatches: int = 1,
             generator: torch.Generator | None = None) -> dict[str, float]:
        """One optimizer step per minibatch over a shuffled split of `batch`; returns mean metrics.

        A minibatch with a non-finite loss or gradient norm is skipped (gradients dropped, no optimizer step,
        `version` not advanced); `nonfinite` is the fraction of minibatches skipped (0.0 or 1.0 with one), and
        `loss` / `grad_norm` are the values observed, NaN or inf included."""
        self.model.train()
        sums, applied = over_minibatches(batch, minibatches, generator, lambda mb: self._minibatch(mb, loss_fn))
        self.version += applied
        return sums

    def _minibatch(self, mb: TrainBatch, loss_fn: LossFn) -> tuple[dict[str, Metric], bool | Tensor]:
        plan = self.packer.plan(self.model, mb, self.device) if self.uses("packing") else None  # from the CPU mask
        mb = batch_to(mb, self.device)
        with self._compiled():
            logp, entropy = self._logprobs(mb, with_entropy=True, plan=plan)
        loss, metrics = loss_fn(logp, mb)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # The total norm before clipping: NaN/inf if any gradient element is (clipping cannot repair it).
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        # The non-finite rule (trainer/step.py); fused: decided on the device, the kernels skip on found_inf 1.0
        applied = guarded_step(self.optimizer, loss, grad_norm, on_device=self.fused)
        mask = mb.loss_mask
        ent = (entropy * mask).sum() / mask.sum().clamp(min=1)
        return {**metrics, "loss": loss.detach(), "grad_norm": grad_norm.detach(), "entropy": ent}, applied
