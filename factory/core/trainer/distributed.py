"""The data-parallel torch trainer: the `TorchTrainer` interface, run by every rank of a torchrun process group.

Each rank holds the whole batch (the test builds it identically on every rank; `follow.py` broadcasts it from
rank 0) and trains on its share of every minibatch's rows: the minibatch (the same shuffled split as `TorchTrainer`)
is cut into `world_size` contiguous row shards, and each shard into `grad_accum` micro-batches. So the same rows go
the same way whatever the world size, and the optimizer steps once per minibatch, as in one process.

Loss normalization. The algorithms' losses are means over the batch they are given: over sequences that have a
target token (seq_mean_token_mean, seq_mean_token_sum_norm: GRPO, Dr.GRPO, GSPO) or over all target tokens
(token_mean: DAPO, CISPO). A micro-batch's mean is not the minibatch's mean, and averaging the ranks' gradients is
the minibatch's gradient only when every shard holds as many of those units. So each micro-batch's loss is
weighted by its share of the minibatch's units (counted locally: every rank has the whole minibatch) times the
world size, which the gradient average divides away again: the sum over ranks and micro-batches is exactly the
minibatch loss and its gradient, up to float summation order, for any shard sizes. `aggregation` must therefore
name the loss's aggregation (`spec.algorithm.aggregation()`); a wrong one gives a wrongly weighted gradient.

Strategies. `fsdp`: FSDP2 `fully_shard` on every decoder layer (the model's `_no_split_modules`) and the root;
parameters, gradients and AdamW state are sharded, so the optimizer's fp32 parameters are the master copy.
FSDP2 runs on CPU with gloo in this torch (2.13: all-gather, reduce-scatter and DTensor grad-norm clipping work;
checked by tests/core/test_distributed_trainer.py), so it is the default here too. `ddp`: DistributedDataParallel,
every rank a full replica, for models or backends FSDP2 cannot shard. Gradient sync happens on the last
micro-batch only (`no_sync` / `set_requires_gradient_sync`).

Precision. bf16 computes in bfloat16 while the parameters the optimizer steps stay float32: FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, or `torch.autocast` for DDP and one process. Logprobs
and the loss are taken in float32 (`token_logprobs` upcasts the logits). Tested on CPU: fp32 on 2 ranks, bf16
autocast in one process; bf16 on 2 CPU ranks (both strategies) was measured once (loss within 1e-3 of fp32);
bf16 on GPUs (nccl) has not been run.

A minibatch whose loss or gradient norm is non-finite is skipped on every rank alike: the non-finite rule
(`trainer/step.py`'s `guarded_step`) is applied to all-reduced values (the loss sum and the ranks' gradient norms
summed) that every rank holds bit for bit.
A rank whose shard of a minibatch is empty (fewer rows than world_size * grad_accum) still runs its forward and
backward, on the minibatch's first row at weight 0, since FSDP and DDP need every rank in every collective.

Under both strategies every rank starts from rank 0's weights (broadcast at construction).

Packing (`packing`, trainer.packing; auto: on CUDA): every log-prob forward (`logprobs`, each micro-batch) runs on
packed rows through `_net`, DDP's wrapper or the FSDP2 module alike (both pass `position_ids` through), and comes
back in the padded layout (`trainer/packing.py`); the loss weighting above reads the padded batch, unchanged.

Device: alone (world_size 1) it computes where the model already is, the run's device (`infra/device.run_device`),
so the in-process engines and evals that share the model are not left behind; a rank of a group is placed on its
own device (`rank_device`), and on rank 0 the loop's components follow the model there.

Weights leave through `full_state_dict` / `gathered_model` / `save_full_checkpoint`: collectives that every rank
calls, after which rank 0 holds the full, unsharded float32 state on CPU (for publication or an HF checkpoint).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from factory.core.batch import TrainBatch
from factory.core.trainer.packing import Packer
from factory.core.trainer.step import Metric, float64, guarded_step, make_adamw
from factory.core.trainer.torch_trainer import LossFn, batch_to, over_minibatches, toggle_on, token_logprobs
from factory.infra.device import host_copy, model_device
from factory.infra.liveness import pulse_from_layers
from factory.models.checkpoint import save_checkpoint

Strategy = Literal["fsdp", "ddp"]
Precision = Literal["fp32", "bf16"]
SEQUENCE_AGGREGATIONS = ("seq_mean_token_mean", "seq_mean_token_sum_norm")
TOKEN_AGGREGATIONS = ("token_mean",)


def loss_units(batch: TrainBatch, aggregation: str) -> int:
    """How many things `aggregation` averages over in `batch`: sequences with a target token, or target tokens."""
    if aggregation in SEQUENCE_AGGREGATIONS:
        return int(batch.loss_mask.any(dim=-1).sum())
    if aggregation in TOKEN_AGGREGATIONS:
        return batch.n_tokens
    raise ValueError(f"aggregation: expected one of {', '.join(SEQUENCE_AGGREGATIONS + TOKEN_AGGREGATIONS)}, "
                     f"got {aggregation!r}")


def load_full_state(model: PreTrainedModel, state: dict[str, Tensor]) -> PreTrainedModel:
    """Load a gathered full state into a plain model of the same architecture (tied weights tied again)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"gathered state does not fit {type(model).__name__}: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
    if tied:
        model.tie_weights()
    return model


def init_ranks(threads: int = 1, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the torchrun process group (gloo on CPU, nccl for CUDA tensors); returns (rank, world_size).

    `threads` > 0 sets torch's intra-op threads for this rank; `timeout_s` bounds every collective."""
    if "RANK" not in os.environ:
        raise RuntimeError("init_ranks: RANK is not set; run under torchrun (factory.core.trainer.launch.run_ranks)")
    if threads > 0:
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def rank_device(devices: list[int] | None = None) -> torch.device:
    """This rank's device: `devices[rank]` (trainer.devices) or cuda:LOCAL_RANK where CUDA is present, else CPU."""
    if not torch.cuda.is_available():
        if devices:
            raise ValueError(f"trainer.devices: {devices} names CUDA devices, but CUDA is not available here")
        return torch.device("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    index = devices[rank] if devices else int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class DistributedTrainer:
    """Owns this rank's part of the model being trained and its optimizer; `TorchTrainer`'s interface.

    Every method except `version` is a collective when world_size > 1: all ranks call it with the same arguments.
    Outside a process group it runs alone (world_size 1, no wrapping), which still gives grad_accum and bf16."""

    def __init__(self, model: PreTrainedModel, lr: float, grad_clip: float = 1.0, weight_decay: float = 0.0,
                 temperature: float = 1.0, *, aggregation: str = "seq_mean_token_mean", strategy: Strategy = "fsdp",
                 grad_accum: int = 1, precision: Precision = "fp32", device: torch.device | None = None,
                 packing: str = "auto", fused_head: str = "auto", fused_optimizer: str = "auto"):
        if aggregation not in SEQUENCE_AGGREGATIONS + TOKEN_AGGREGATIONS:
            raise ValueError(f"aggregation: expected one of {', '.join(SEQUENCE_AGGREGATIONS + TOKEN_AGGREGATIONS)}"
                             f" (algorithm.loss_agg), got {aggregation!r}")
        if strategy not in ("fsdp", "ddp"):
            raise ValueError(f"trainer.strategy: expected 'fsdp' or 'ddp', got {strategy!r}")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"trainer.precision: expected 'fp32' or 'bf16', got {precision!r}")
        if grad_accum < 1:
            raise ValueError(f"trainer.grad_accum: expected >= 1, got {grad_accum}")
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        # One process computes where the run placed the model (the engines and evals share it); a rank of a group
        # goes to its own device (trainer.devices / LOCAL_RANK), and the loop's components follow the model there.
        if device is None:
            device = model_device(model) if self.world_size == 1 else rank_device()
        self.device = device
        # trainer.fused_head; it reaches a plain head only (strategy single: DDP and FSDP wrap the model's forward)
        self.fused_head = toggle_on("trainer.fused_head", fused_head, device)
        self.aggregation, self.grad_accum, self.precision = aggregation, grad_accum, precision
        self.temperature, self.grad_clip = temperature, grad_clip
        self.strategy = strategy if self.world_size > 1 else "single"
        model.to(self.device)
        self.model = model  # the HF model (sharded in place under fsdp)
        pulse_from_layers(model)  # a long forward and backward beats block by block (infra/liveness.py)
        bf16 = precision == "bf16"
        self._autocast = bf16 and self.strategy != "fsdp"
        self._net: torch.nn.Module = model  # what the training forward goes through
        if self.strategy == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415 heavy (~3 s): fsdp only

            # Rank 0's weights everywhere (DDP does this itself): followers need only the architecture, and a
            # leader that loaded a resume point or an SFT start passes it on.
            with torch.no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t.data, src=0)
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
            kw = {"mp_policy": mp} if mp is not None else {}
            blocks = set(getattr(model, "_no_split_modules", None) or ())
            for module in list(model.modules()):
                if module is not model and type(module).__name__ in blocks:
                    fully_shard(module, **kw)
            fully_shard(model, **kw)
        elif self.strategy == "ddp":
            self._net = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda"
                                                else None)
        # trainer.fused_optimizer (auto: on CUDA): fused AdamW, and the skip decided on the device (trainer/step.py)
        self.fused = toggle_on("trainer.fused_optimizer", fused_optimizer, self.device)
        self.optimizer = make_adamw(model.parameters(), lr=lr, weight_decay=weight_decay, fused=self.fused)
        self.version = 0  # optimizer steps taken: the weight version it would publish
        # trainer.packing: packed rows through the wrapper as through the model (trainer/packing.py)
        self.packing = toggle_on("trainer.packing", packing, self.device)
        self.packer = Packer()

    # ------------------------------------------------------------ forward passes

    def _token_logprobs(self, net: torch.nn.Module, batch: TrainBatch, with_entropy: bool = False,
                        host: TrainBatch | None = None) -> tuple[Tensor, Tensor | None]:
        """`token_logprobs` through `net` (the model or its wrapper), on packed rows where packing is on, planned
        from `host` (the same rows still on the CPU: no read back from the device) when given."""
        if self.packing:
            plan = None if host is None else self.packer.plan(net, host, self.device)
            return self.packer.token_logprobs(net, batch, self.temperature, with_entropy, plan, fused=self.fused_head)
        return token_logprobs(net, batch, self.temperature, with_entropy=with_entropy, fused=self.fused_head)

    def _amp(self) -> contextlib.AbstractContextManager:
        if self._autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> Tensor:
        """Target-token logprobs [B, T-1] on CPU; with ranks, each computes an equal row share and all get all."""
        self.model.eval()
        n = len(batch)
        if self.world_size == 1:
            with self._amp():
                return self._token_logprobs(self.model, batch_to(batch, self.device), host=batch)[0].float().cpu()
        per = max(1, math.ceil(n / self.world_size))
        rows = torch.arange(self.rank * per, (self.rank + 1) * per)
        rows = torch.where(rows < n, rows, torch.zeros_like(rows))  # past the end: row 0 again, dropped below
        with self._amp():
            host = batch.select(rows)
            lp = self._token_logprobs(self.model, batch_to(host, self.device), host=host)[0].float()
        if self.strategy == "fsdp":
            # A forward without backward leaves the root's parameters unsharded: reshard, so the parameters the
            # module and the optimizer hold are the same objects again (its state dicts map one to the other).
            self.model.reshard()
        parts = [torch.empty_like(lp) for _ in range(self.world_size)]
        dist.all_gather(parts, lp.contiguous())
        return torch.cat(parts)[:n].cpu()

    # ------------------------------------------------------------ training

    @contextlib.contextmanager
    def _grad_sync(self, sync: bool) -> Iterator[None]:
        if self.strategy == "ddp" and not sync:
            with self._net.no_sync():
                yield
            return
        if self.strategy == "fsdp":
            self.model.set_requires_gradient_sync(sync)
        yield

    def step(self, batch: TrainBatch, loss_fn: LossFn, minibatches: int = 1,
             generator: torch.Generator | None = None) -> dict[str, float]:
        """One optimizer step per minibatch over a shuffled split of `batch` (as `TorchTrainer.step`), each
        rank on its rows; returns the minibatches' mean metrics, identical on every rank.

        `generator` must be in the same state on every rank (it draws the shuffle)."""
        self.model.train()
        sums, applied = over_minibatches(batch, minibatches, generator, lambda mb: self._minibatch(mb, loss_fn))
        self.version += applied
        return sums

    def _minibatch(self, mb: TrainBatch, loss_fn: LossFn) -> tuple[dict[str, Metric], bool | Tensor]:
        """One optimizer step. The micro-batches' weights are counted on the CPU batch (no device read); with the
        fused optimizer the only device reads left are the loop's, once per `step`; without it, one per minibatch
        (the skip decision)."""
        units_total = max(loss_units(mb, self.aggregation), 1)
        tokens_total = max(mb.n_tokens, 1)
        shard = torch.arange(len(mb)).tensor_split(self.world_size)[self.rank]
        micros = shard.tensor_split(self.grad_accum)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        entropy_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        metric_sums: dict[str, Tensor] = {}
        for i, idx in enumerate(micros):
            empty = len(idx) == 0
            host = mb.select(idx if not empty else torch.zeros(1, dtype=torch.long))
            units_w = 0.0 if empty else loss_units(host, self.aggregation) / units_total
            tokens_w = 0.0 if empty else host.n_tokens / tokens_total
            part = batch_to(host, self.device)
            with self._grad_sync(i == len(micros) - 1):
                with self._amp():
                    logp, entropy = self._token_logprobs(self._net, part, with_entropy=True, host=host)
                loss, metrics = loss_fn(logp.float(), part)
                # x world_size: the gradient all-reduce averages over ranks, and we want the sum of shares.
                (loss * (units_w * self.world_size)).backward()
            for k, v in metrics.items():  # every rank the same keys (same loss fn, same batch fields)
                # float64 on the device: the same products and sums as Python floats, without reading v
                total = metric_sums.get(k, torch.zeros((), dtype=torch.float64, device=self.device))
                metric_sums[k] = total + (0.0 if empty else float64(v, self.device) * tokens_w)
            if not empty:  # a stand-in row's values are not the minibatch's (its gradient is 0 already)
                loss_sum += loss.detach().double() * units_w
                entropy_sum += (entropy.detach().double() * part.loss_mask).sum()
        if self.strategy == "fsdp":
            self.model.set_requires_gradient_sync(True)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        keys = sorted(metric_sums)
        # The gradient norms summed over ranks: non-finite exactly when one rank's is (a norm is >= 0 or NaN/inf).
        vec = torch.stack([loss_sum, entropy_sum, grad_norm.detach().double(), *[metric_sums[k] for k in keys]])
        if self.world_size > 1:
            dist.all_reduce(vec)
        # The non-finite rule (trainer/step.py) on the reduced values, which every rank holds bit for bit: every
        # rank skips alike (fused: on the device; else one host read per minibatch).
        applied = guarded_step(self.optimizer, vec[0], vec[2], on_device=self.fused)
        # The loss fn's metrics are token means (clip_frac, kl, ...): weighted by tokens they are the minibatch's
        # (a per-sequence one, GSPO's seq_ratio_mean, comes out token-weighted). Read on the host by the caller.
        out: dict[str, Metric] = {k: vec[3 + j] for j, k in enumerate(keys)}
        out.update(loss=vec[0], grad_norm=grad_norm.detach(), entropy=vec[1] / tokens_total)
        return out, applied

    # ------------------------------------------------------------ weights out

    def full_state_dict(self) -> dict[str, Tensor]:
        """The full, unsharded state on CPU on rank 0 ({} on the others). A collective under fsdp."""
        if self.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 heavy: loads fsdp (~3 s); fsdp only
                StateDictOptions,
                get_model_state_dict,
            )

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}
        return {k: host_copy(v) for k, v in self.model.state_dict().items()}  # from a GPU: pinned buffers

    def optimizer_state(self) -> dict:
        """The optimizer's state for a resume point: as `state_dict()` where each rank holds all of it, the full
        (unsharded, CPU) state keyed by parameter name under fsdp (a collective; {} on ranks other than 0)."""
        if self.strategy != "fsdp":
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 heavy: loads fsdp (~3 s); fsdp only
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, state: dict) -> None:
        """Load what `optimizer_state` returned (every rank gets the same full state; a collective under fsdp)."""
        if self.strategy != "fsdp":
            self.optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 heavy: loads fsdp (~3 s); fsdp only
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))

    def gathered_model(self) -> PreTrainedModel | None:
        """On rank 0, a plain (unsharded, CPU, float32) copy of the model with the trained weights; None elsewhere.
        A collective under fsdp."""
        state = self.full_state_dict()
        if self.rank != 0:
            return None
        return load_full_state(AutoModelForCausalLM.from_config(self.model.config), state).eval()

    def save_full_checkpoint(self, tokenizer: PreTrainedTokenizerFast, path: str | Path,
                             meta: dict | None = None):
        """Gather the weights and write an HF checkpoint from rank 0 (`models.checkpoint.save_checkpoint`); every
        rank returns once it is written (rank 0: its CheckpointInfo, others: None)."""
        model = self.gathered_model()
        info = save_checkpoint(model, tokenizer, path, meta) if model is not None else None
        if self.world_size > 1:
            dist.barrier()
        return info
