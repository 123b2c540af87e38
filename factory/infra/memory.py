"""Whether this machine can hold one step of a spec: a lower bound of the memory a step needs, from the spec's sizes
and the model's, against the memory the machine has. `factory validate` and `factory run` refuse a spec past it
before any work starts (one line naming the field); without it a spec asking for a billion samples per step passed
validation and every attempt of its run died of MemoryError.

What a step holds at least (bytes), with T = 1 + rollout.max_new_tokens tokens per sample (a prompt of at least one
token and a completion as long as the spec allows; the batch is as wide as its longest sample):
- the batch on the host: samples x T x 37: the packed tensors (token ids and attention mask int64, loss mask bool,
  sampler logprobs float32: 21) and the samples' token-id and logprob lists (a pointer each: 16);
- the trainer's weights, gradients and AdamW moments: 16 bytes per parameter (float32; a bf16 run keeps a float32
  master copy), 4 with LoRA (the frozen base only), counting the decoder's projections alone (no embeddings, norms);
- the trainer's activations: the input of every decoder layer of a minibatch's micro-batch, kept for backward (even
  with activation checkpointing): samples / minibatches / grad_accum x T x hidden x layers x 4 (2 in bf16).
On the CPU all three share the host's memory; on GPUs the trainer's two (shared over the ranks) are held per GPU
and the batch on the host. The model's size is known for presets and for a `model.path` directory or cached hub
id with a config.json; for a GGUF file only the batch is counted.

The machine's memory: the host's is the least of MemTotal (/proc/meminfo), the cgroup's limit (memory.max, v1's
memory.limit_in_bytes) and RLIMIT_AS; a GPU's is its total memory from `nvidia-smi` (not counted when that cannot be
read). Totals, not what is free now: a spec refused here can never run on this machine.
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from factory.infra.gpus import SMI_TIMEOUT_S, count_gpus
from factory.model_source import model_source, source_files
from factory.presets import PRESETS

if TYPE_CHECKING:
    from factory.config import ExperimentSpec, ModelSpec, Resolved

BATCH_BYTES_PER_TOKEN = 37
STATE_BYTES_PER_PARAM, LORA_BYTES_PER_PARAM = 16, 4
GIB = float(1 << 30)


@dataclass(frozen=True)
class ModelDims:
    """What the bound needs of a model: its decoder's hidden size and layers, and the projections' parameters."""

    hidden: int
    layers: int
    params: int


@dataclass(frozen=True)
class Memory:
    """Bytes of memory and where the figure was read."""

    bytes: int
    source: str


@dataclass(frozen=True)
class StepNeed:
    """A lower bound of what one step holds, in bytes: the batch on the host, the trainer's state and activations."""

    batch: int
    state: int
    activations: int


def decoder_params(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> int:
    """Parameters of a Llama/Qwen-style decoder's projections: q and o (hidden^2 each), k and v (hidden x kv_heads
    x head_dim each) and the MLP's gate, up and down (hidden x intermediate each), per layer."""
    kv = kv_heads * (hidden // heads)
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate)


def model_dims(model: ModelSpec) -> ModelDims | None:
    """The model's dims: its preset's, or a `model.path` directory's (or cached hub id's) config.json; None
    when they cannot be read cheaply (a GGUF file, an unreadable config)."""
    if model.path is None:
        p = PRESETS[model.preset]
        return ModelDims(p.hidden_size, p.layers, decoder_params(p.hidden_size, p.layers, p.heads, p.kv_heads,
                                                                 p.intermediate_size))
    if model_source(model.path).kind == "gguf":
        return None
    where = source_files(model.path)  # the directory, or the hub id's cached snapshot
    try:
        c = json.loads((where / "config.json").read_text()) if where is not None else None
        if not isinstance(c, dict):
            return None
        hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        return ModelDims(hidden, layers, decoder_params(hidden, layers, heads, kv, int(c["intermediate_size"])))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def step_need(spec: ExperimentSpec, dims: ModelDims | None) -> StepNeed:
    """The lower bound of one step's memory (module docstring); the trainer's terms are 0 when `dims` is None."""
    samples = spec.rollout.prompts_per_step * spec.algorithm.group_size
    tokens = 1 + spec.rollout.max_new_tokens
    batch = samples * tokens * BATCH_BYTES_PER_TOKEN
    if dims is None:
        return StepNeed(batch, 0, 0)
    per_param = LORA_BYTES_PER_PARAM if spec.trainer.lora is not None else STATE_BYTES_PER_PARAM
    micro = math.ceil(samples / spec.trainer.minibatches / spec.trainer.grad_accum)
    width = 2 if spec.trainer.precision == "bf16" else 4
    return StepNeed(batch, dims.params * per_param, micro * tokens * dims.hidden * dims.layers * width)


def host_memory() -> Memory:
    """The most memory a process started here may use: the least of MemTotal, the cgroup's limit and RLIMIT_AS."""
    found: list[Memory] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                found.append(Memory(int(line.split()[1]) * 1024, "MemTotal in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    for f in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or v1's huge number: no limit
            found.append(Memory(int(text), f"the cgroup's limit ({f})"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append(Memory(soft, "RLIMIT_AS"))
    return min(found, key=lambda m: m.bytes) if found else Memory(0, "unknown")


def gpu_memory() -> Memory | None:
    """The smallest total memory of this machine's GPUs (`nvidia-smi`), or None when it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
        mib = [int(x) for x in out.stdout.split()] if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return Memory(min(mib) << 20, "nvidia-smi's memory.total") if mib else None


def uses_cuda(resolved: Resolved) -> bool:
    """Whether the spec's trainer computes on GPUs here (a CUDA setting, or device auto on a machine with one)."""
    if resolved.device == "cpu":
        return False
    return bool(resolved.cuda_asked) or count_gpus().count > 0


def memory_problem(spec: ExperimentSpec, host: Memory | None = None, gpu: Memory | None = None,
                   on_gpu: bool | None = None, dims: ModelDims | None = None) -> str | None:
    """The one-line error naming the field when one step of `spec` cannot fit this machine's memory, else None.
    `host`, `gpu`, `on_gpu` and `dims` default to this machine's and the spec's model's."""
    need = step_need(spec, dims if dims is not None else model_dims(spec.model))
    on_gpu = uses_cuda(spec.resolved) if on_gpu is None else on_gpu
    host = host or host_memory()
    trainer = need.state + need.activations
    if on_gpu:
        gpu = gpu or gpu_memory()
        per_gpu = trainer // spec.trainer.world_size
        if gpu is not None and per_gpu > gpu.bytes:
            return _refusal(spec, need, per_gpu, gpu, "each GPU", trainer_only=True)
        on_host = need.batch
    else:
        on_host = need.batch + trainer
    if host.bytes and on_host > host.bytes:
        return _refusal(spec, need, on_host, host, "this machine", trainer_only=False)
    return None


def _refusal(spec: ExperimentSpec, need: StepNeed, total: int, have: Memory, where: str, trainer_only: bool) -> str:
    samples = spec.rollout.prompts_per_step * spec.algorithm.group_size
    batch = 0 if trainer_only else need.batch
    parts = {"the batch": batch, "the weights, gradients and optimizer state": need.state,
             "the trainer's activations": need.activations}
    # the field to change: one whose term alone does not fit, else the one with the biggest term
    if batch > have.bytes:
        culprit = "the batch"
    elif need.state > have.bytes:
        culprit = "the weights, gradients and optimizer state"
    else:
        culprit = max(parts, key=lambda k: parts[k])
    field, fix = {
        "the batch": ("rollout.prompts_per_step x algorithm.group_size x rollout.max_new_tokens",
                      "fewer prompts per step, a smaller group or shorter completions"),
        "the weights, gradients and optimizer state": ("model.path" if spec.model.path else "model.preset",
                                                       "a smaller model, LoRA (trainer.lora) or more ranks "
                                                       "(trainer.world_size, with strategy fsdp)"),
        "the trainer's activations": ("trainer.minibatches",
                                      f"more minibatches (each holds {samples} / trainer.minibatches samples) or "
                                      f"shorter completions"),
    }[culprit]
    shown = ", ".join(f"{k} {_size(v)}" for k, v in parts.items() if v)
    return (f"{field}: one step needs at least {_size(total)} ({shown}; {samples} samples of up to "
            f"{1 + spec.rollout.max_new_tokens} tokens; factory/infra/memory.py), but {where} has "
            f"{_size(have.bytes)} ({have.source}); use {fix}")


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"
