"""The Megatron-core trainer backend (`trainer.backend: megatron`): a GPTModel built from the HF config with the
local (non-Transformer-Engine) layer spec, loaded from and read back into the HF model through
`megatron_convert`, trained with the same loss functions as `TorchTrainer` behind the same interface.

What ran where (megatron-core 0.16.1, CPU torch 2.13): the config, the model build, the parallel-state setup, the
conversion and strict loading run on CPU as they are. Megatron's forward assumes CUDA in two places (the rotary
table is moved to `torch.cuda.current_device()`, attention dropout forks the CUDA RNG tracker), so on CPU the tests
run the forward, `logprobs` and `step` only with those two replaced by CPU equivalents (tests/core/test_megatron.py,
`_cpu_stand_ins`); everything else in the forward and backward is Megatron's own, tensor_parallel 2 included (two
gloo ranks under torchrun: sharded load, gathered logits, the TP-aware gradient norm, the gather back to HF).
On a GPU nothing is replaced: `make_megatron_trainer` seeds Megatron's CUDA RNG tracker (`seed_cuda_rng`, from the
run's seed) whenever it runs on CUDA, and takes the device the run placed the HF model on. Nothing here has run on
CUDA yet, nor in bf16, nor with data-parallel ranks
(world_size > tensor_parallel: the gradient averaging is unexercised). Pipeline parallel > 1 is converted
(`megatron_convert.pipeline_stage`) but not trained: it needs Megatron's pipeline schedules, and `MegatronTrainer`
refuses it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel

try:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as tensor_parallel_random
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # the backend is optional: `pip install -e ".[megatron]"`
    raise ImportError(f"trainer.backend: megatron needs megatron-core (pip install -e '.[megatron]'): {e}") from e

from factory.core.batch import TrainBatch
from factory.core.trainer.logprobs import logprobs_from_logits
from factory.core.trainer.megatron_convert import (
    geometry,
    hf_to_megatron,
    megatron_to_hf,
    merge_pipeline,
    merge_tensor_parallel,
    pipeline_stage,
    rope_theta,
    split_tensor_parallel,
)
from factory.core.trainer.step import guarded_step
from factory.core.trainer.torch_trainer import LossFn, over_minibatches

if TYPE_CHECKING:
    from factory.config import ExperimentSpec


def megatron_config(hf_config: PretrainedConfig, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                    params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """The Megatron TransformerConfig that computes what the HF Qwen2/Llama config does (ValueError naming the
    field otherwise). Fusions are off: the local spec runs them in plain torch, and they need CUDA kernels."""
    g = geometry(hf_config)  # validates the architecture
    return TransformerConfig(
        num_layers=g.layers, hidden_size=g.hidden, num_attention_heads=g.heads, num_query_groups=g.groups,
        kv_channels=g.head_dim, ffn_hidden_size=g.ffn,
        normalization="RMSNorm", layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=g.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        # Initialised although every weight is then loaded from the HF model: Megatron marks its tensor-parallel
        # weights (`tensor_model_parallel`, read by the gradient norm) only while initialising them.
        use_cpu_initialization=True, perform_initialization=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )


def init_model_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, backend: str = "gloo") -> None:
    """Megatron's parallel state. Without a process group (one process, the loop's) a 1-rank group over an
    in-process store is started (no port: nothing else can take it); under torchrun the existing group is used.
    Already initialised with other sizes is an error."""
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size())
        if have != (tensor_parallel, pipeline_parallel):
            raise ValueError(f"trainer.tensor_parallel / pipeline_parallel: Megatron is already initialised with "
                             f"{have}, asked for {(tensor_parallel, pipeline_parallel)}")
        return
    if dist.get_world_size() % (tensor_parallel * pipeline_parallel):
        raise ValueError(f"trainer.world_size: {dist.get_world_size()} ranks are not a multiple of tensor_parallel * "
                         f"pipeline_parallel = {tensor_parallel * pipeline_parallel}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             pipeline_model_parallel_size=pipeline_parallel)


def build_gpt_model(hf_config: PretrainedConfig, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                    params_dtype: torch.dtype = torch.float32) -> GPTModel:
    """This rank's GPTModel for `hf_config`, on CPU with random weights (load them with `load_hf_state`), drawn
    from a forked RNG so that building leaves torch's global random stream as it was. Its logits are gathered over
    tensor-parallel ranks (full vocabulary everywhere) so logprobs and entropy are computed as the torch trainer
    does."""
    init_model_parallel(tensor_parallel, pipeline_parallel)
    g = geometry(hf_config)
    if g.vocab % tensor_parallel:
        raise ValueError(f"vocab_size: {g.vocab} is not divisible by trainer.tensor_parallel {tensor_parallel}")
    config = megatron_config(hf_config, tensor_parallel, pipeline_parallel, params_dtype)
    with torch.random.fork_rng(devices=[]):
        return GPTModel(
            config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=g.vocab,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=False, share_embeddings_and_output_weights=g.tied, position_embedding_type="rope",
            rotary_base=rope_theta(hf_config),
        )


def seed_cuda_rng(seed: int) -> None:
    """Megatron's CUDA RNG tracker, seeded from the run's seed (`model_parallel_cuda_manual_seed`: the default,
    data-parallel state gets `seed`, the tensor-parallel one `seed + 2718 + tp_rank`). Megatron's attention forks
    the 'model-parallel-rng' state on every forward and raises without it. Needs the parallel state initialised
    (`init_model_parallel`); it reseeds the current CUDA device's default generator with `seed`."""
    tensor_parallel_random.model_parallel_cuda_manual_seed(seed)


def _rank_state(hf_state: Mapping[str, Tensor], hf_config: PretrainedConfig) -> dict[str, Tensor]:
    """This rank's share (tensor-parallel shard of its pipeline stage) of the converted HF state."""
    full = hf_to_megatron(hf_state, hf_config)
    tp, pp = (parallel_state.get_tensor_model_parallel_world_size(),
              parallel_state.get_pipeline_model_parallel_world_size())
    shard = split_tensor_parallel(full, hf_config, tp)[parallel_state.get_tensor_model_parallel_rank()]
    return pipeline_stage(shard, hf_config, parallel_state.get_pipeline_model_parallel_rank(), pp)


def load_hf_state(model: GPTModel, hf_state: Mapping[str, Tensor], hf_config: PretrainedConfig) -> None:
    """Load an HF state dict into this rank's GPTModel, strictly: every parameter is written, nothing is left
    over. `_extra_state` entries (Transformer-Engine bookkeeping, None in the local spec) are kept as the model
    has them, as Megatron's own checkpoint loading ignores them."""
    state = _rank_state(hf_state, hf_config)
    state.update({k: v for k, v in model.state_dict().items() if k.endswith("._extra_state")})
    model.load_state_dict(state, strict=True)


def _gather(obj: dict[str, Tensor], group) -> list[dict[str, Tensor]]:
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    out: list = [None] * size
    dist.all_gather_object(out, obj, group=group)  # rank order within the group: tp / pp rank order
    return out


def megatron_state_to_hf(model: GPTModel, hf_config: PretrainedConfig) -> dict[str, Tensor]:
    """The HF state dict of the (possibly sharded) GPTModel, gathered over tensor- and pipeline-parallel ranks
    (a collective: every rank calls it). Tensors are detached CPU copies."""
    mine = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    shards = _gather(mine, parallel_state.get_tensor_model_parallel_group())
    stage = merge_tensor_parallel(shards, hf_config) if len(shards) > 1 else mine
    stages = _gather(stage, parallel_state.get_pipeline_model_parallel_group())
    full = merge_pipeline(stages, hf_config) if len(stages) > 1 else stage
    return megatron_to_hf(full, hf_config)


def megatron_attention_mask(attention_mask: Tensor) -> Tensor:
    """[B, T] HF padding mask (1 = token) → Megatron's [B, 1, T, T] boolean mask (True = may not attend): causal,
    and no attending to padding. Passed explicitly because Megatron's default causal mask is built on CUDA."""
    t = attention_mask.shape[1]
    future = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).triu(1)
    pad = attention_mask[:, None, None, :] == 0
    return future[None, None] | pad


def megatron_token_logprobs(model: GPTModel, batch: TrainBatch, temperature: float = 1.0, with_entropy: bool = False,
                            autocast_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None]:
    """Logprob of each target token [B, T-1] (and the entropy there, detached) under `model`, as `token_logprobs`
    computes them. Megatron's RoPE uses positions 0..T-1 whatever `position_ids` says, which is what HF uses for
    right-padded batches without position ids (`batch.pack`'s layout)."""
    device = next(model.parameters()).device
    ids = batch.input_ids.to(device)
    b, t = ids.shape
    position_ids = torch.arange(t, device=device).unsqueeze(0).expand(b, t)
    mask = megatron_attention_mask(batch.attention_mask.to(device))
    compute = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
    with compute:
        logits = model(ids, position_ids, mask)[:, :-1, :]  # [B, T, V]: GPTModel returns batch-first logits
    # Chunked and checkpointed as the torch trainer's: no [B, T, V] float32 tensor kept through backward.
    return logprobs_from_logits(logits, ids[:, 1:], temperature, with_entropy)


def _clip_grads(params: list[torch.nn.Parameter], max_norm: float) -> Tensor:
    """Total gradient norm over the whole model (tensor-parallel shards summed, replicated tensors counted once),
    then clipped as `torch.nn.utils.clip_grad_norm_` clips. Returns the norm before clipping (NaN/inf kept)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    sq = torch.zeros((), device=grads[0].device, dtype=torch.float32)
    for p in params:
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            sq = sq + p.grad.detach().float().pow(2).sum()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


class MegatronTrainer:
    """`TorchTrainer`'s interface (`logprobs`, `step`, `version`, `optimizer`) over a Megatron GPTModel.

    `hf_model`, when given, is kept in step with the trained weights after every `step` (`sync_hf`), so the loop
    can publish, checkpoint and evaluate the HF model as it does with the torch backend.
    Pipeline parallel > 1 is refused: it needs Megatron's pipeline schedules. Data-parallel ranks (world_size >
    tensor_parallel) average their gradients over Megatron's data-parallel group."""

    def __init__(self, model: GPTModel, hf_config: PretrainedConfig, lr: float, grad_clip: float = 1.0,
                 weight_decay: float = 0.0, temperature: float = 1.0, hf_model: PreTrainedModel | None = None,
                 autocast_dtype: torch.dtype | None = None):
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("trainer.pipeline_parallel: the Megatron trainer trains with pipeline_parallel 1 only "
                             "(weights convert per stage, but training needs Megatron's pipeline schedules)")
        self.model = model
        self.hf_config = hf_config
        self.hf_model = hf_model
        self.temperature = temperature
        self.grad_clip = grad_clip
        self.autocast_dtype = autocast_dtype
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        self.version = 0

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> Tensor:
        self.model.eval()
        return megatron_token_logprobs(self.model, batch, self.temperature, autocast_dtype=self.autocast_dtype)[0].cpu()

    def _average_over_data_parallel(self) -> None:
        dp = parallel_state.get_data_parallel_world_size()
        if dp == 1:
            return
        group = parallel_state.get_data_parallel_group()
        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(dp)

    def step(self, batch: TrainBatch, loss_fn: LossFn, minibatches: int = 1,
             generator: torch.Generator | None = None) -> dict[str, float]:
        """As `TorchTrainer.step`: one AdamW step per minibatch of a shuffled split; a minibatch with a non-finite
        loss or gradient norm is skipped (`nonfinite` is the share skipped). The loss function gets CPU-side batch
        tensors moved to the model's device with the logprobs."""
        self.model.train()
        sums, applied = over_minibatches(batch, minibatches, generator, lambda mb: self._minibatch(mb, loss_fn))
        self.version += applied
        if self.hf_model is not None:
            t0 = time.perf_counter()
            self.sync_hf()
            sums["train_s"] += time.perf_counter() - t0
        return sums

    def _minibatch(self, mb: TrainBatch, loss_fn: LossFn) -> tuple[dict[str, float], bool]:
        mb = _to(mb, next(self.model.parameters()).device)
        logp, entropy = megatron_token_logprobs(self.model, mb, self.temperature, with_entropy=True,
                                                autocast_dtype=self.autocast_dtype)
        loss, metrics = loss_fn(logp, mb)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self._average_over_data_parallel()
        grad_norm = _clip_grads(list(self.model.parameters()), self.grad_clip)
        applied = guarded_step(self.optimizer, loss, grad_norm, on_device=False)  # the non-finite rule (step.py)
        assert entropy is not None
        ent = (entropy * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1)
        return {**metrics, "loss": loss.item(), "grad_norm": float(grad_norm), "entropy": ent.item()}, applied

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The trained weights as an HF state dict (CPU tensors; a collective over model-parallel ranks)."""
        return megatron_state_to_hf(self.model, self.hf_config)

    @torch.no_grad()
    def sync_hf(self) -> None:
        """Copy the trained weights into `hf_model` in place (its tensors keep their identity and device)."""
        if self.hf_model is None:
            raise ValueError("MegatronTrainer.sync_hf: no hf_model was given")
        state = self.hf_state_dict()
        for name, t in self.hf_model.state_dict().items():
            if name in state:
                t.copy_(state[name])


def _to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    if device.type == "cpu":
        return batch
    return TrainBatch(batch.input_ids.to(device), batch.attention_mask.to(device), batch.loss_mask.to(device),
                      {k: v.to(device) for k, v in batch.per_token.items()},
                      {k: v.to(device) for k, v in batch.per_seq.items()})


def megatron_backend(spec: ExperimentSpec, hf_model: PreTrainedModel) -> MegatronTrainer:
    """The `megatron` trainer backend (`factory.protocols.TRAINERS`): the loop drives it from one process."""
    if spec.trainer.world_size > 1:
        raise ValueError(f"trainer.world_size: the loop drives Megatron from one process (tensor_parallel = "
                         f"pipeline_parallel = 1); {spec.trainer.world_size} ranks would each need to run the loop's "
                         f"calls")
    return make_megatron_trainer(spec, hf_model)


def make_megatron_trainer(spec: ExperimentSpec, hf_model: PreTrainedModel,
                          device: torch.device | str | None = None) -> MegatronTrainer:
    """The Megatron trainer for `spec` (trainer.backend: megatron) starting from `hf_model`'s weights, which it keeps
    in step. `device` defaults, in one process, to the CUDA device the run placed `hf_model` on; else this rank's
    CUDA device (`trainer.devices[rank]`, else cuda:<local rank>); the backend is GPU-only, so without CUDA that is
    an error (tests pass device='cpu' explicitly). On CUDA, Megatron's RNG tracker is seeded from `spec.seed`."""
    t = spec.trainer
    if t.backend != "megatron":
        raise ValueError(f"trainer.backend: make_megatron_trainer needs 'megatron', got {t.backend!r}")
    if device is None:
        placed = next(hf_model.parameters()).device
        if placed.type == "cuda" and not (dist.is_initialized() and dist.get_world_size() > 1):
            device = placed  # one process: where the run placed the model (the loop's engines share it)
        elif not torch.cuda.is_available():
            raise ValueError("trainer.backend: megatron runs on CUDA GPUs; none is available here")
        else:
            rank = dist.get_rank() if dist.is_initialized() else 0
            device = torch.device("cuda", t.devices[rank] if t.devices else rank % torch.cuda.device_count())
    device = torch.device(device)
    if device.type == "cpu" and t.precision == "bf16":
        raise ValueError("trainer.precision: bf16 with the Megatron backend needs a CUDA device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_model_parallel(t.tensor_parallel, t.pipeline_parallel, backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        seed_cuda_rng(spec.seed)
    model = build_gpt_model(hf_model.config, t.tensor_parallel, t.pipeline_parallel)
    load_hf_state(model, hf_model.state_dict(), hf_model.config)
    model.to(device)
    autocast = torch.bfloat16 if t.precision == "bf16" else None  # fp32 master weights, bf16 compute
    return MegatronTrainer(model, hf_model.config, lr=spec.algorithm.lr, grad_clip=t.grad_clip,
                           weight_decay=t.weight_decay, temperature=spec.rollout.temperature, hf_model=hf_model,
                           autocast_dtype=autocast)
