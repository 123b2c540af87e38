"""The `trainer` section: its backend, precision, parallelism, speed-up switches and LoRA (`trainer.lora`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from factory.config.bounds import (
    MAX_STEP_SAMPLES,
)
from factory.config.section import _Section
from factory.protocols.trainer import TRAINERS

# A trainer speed-up switch: "auto" turns it on where the trainer computes on CUDA, so the CPU path stays exact.
Toggle = Literal["auto", "on", "off"]

class LoraSpec(_Section):
    """LoRA adapters (peft) instead of full fine-tuning: only the adapters train and are published to the rollout
    side, which merges them into its copy of the base weights; checkpoints are saved merged (a plain HF model)."""

    r: int = Field(16, ge=1, le=4096, description="the adapters' rank")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: each adapter's update is (alpha / r) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while training; 0 keeps the "
                           "trainer's logprobs those of the policy that sampled (dropout would add noise to the ratio)")
    target_modules: str | list[str] = Field(
        "all-linear", description="the modules that get adapters: 'all-linear' (every linear projection of attention "
        "and MLP, not the output head), or module names / suffixes (e.g. [q_proj, v_proj]); checked against the model "
        "when the run starts")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and (not v or any(not t.strip() for t in v)):
            raise ValueError(f"need at least one non-empty module name, got {v}")
        if isinstance(v, str) and not v.strip():
            raise ValueError("need 'all-linear' or module names, got an empty string")
        return v

class TrainerSpec(_Section):
    """Optimizer details the algorithm does not own, and how the trainer is laid out (processes, parallelism)."""

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = (
        "world_size", "strategy", "grad_accum", "precision", "tensor_parallel", "pipeline_parallel", "devices",
        "cpus", "lora", "activation_checkpointing", "packing", "fused_head", "compile", "fused_optimizer")

    backend: str = Field(
        "torch", description="torch (one process, or DDP/FSDP2 ranks under torchrun) or megatron (Megatron-core "
        "GPTModel built from the HF config; GPU only); or a backend registered in factory.protocols.TRAINERS (in "
        "process, a plugin's entry point in group factory.trainers), or an import path 'package.module:builder'")
    minibatches: int = Field(1, ge=1, le=MAX_STEP_SAMPLES)
    grad_clip: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    threads: int = Field(0, ge=0, description="torch CPU threads per trainer process; 0 keeps torch's default")
    world_size: int = Field(
        1, ge=1, le=1024, description="data-parallel trainer processes (torchrun ranks); 1: in the loop's process")
    strategy: Literal["fsdp", "ddp"] = Field(
        "fsdp", description="with world_size > 1: FSDP2 fully_shard (weights, gradients and optimizer state sharded "
        "over the ranks; rank 0 also keeps the full weights it publishes), or DDP (a full replica per rank)")
    grad_accum: int = Field(1, ge=1, description="micro-batches accumulated per optimizer step on each rank")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: bf16 compute on GPUs with a float32 master copy of the weights")
    tensor_parallel: int = Field(1, ge=1, description="Megatron tensor-parallel size")
    pipeline_parallel: int = Field(1, ge=1, description="Megatron pipeline-parallel size")
    devices: list[int] | None = Field(
        None, description="placement: CUDA device indices for the trainer ranks; unset: cuda:LOCAL_RANK where CUDA "
        "is available, else the CPU")
    cpus: list[int] | None = Field(
        None, min_length=1, description="placement: the CPU cores the trainer's threads run on (its torch threads "
        "stay on them); unset: any")
    lora: LoraSpec | None = Field(None, description="LoRA adapters through peft; unset: full fine-tuning")
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in backward instead of keeping them (less "
        "memory, about a third more compute); torch backend only")
    packing: Toggle = Field(
        "auto", description="pack a batch's rows into one row (position ids restart per sample, a document mask) so "
        "no FLOP goes to padding; auto: on where the trainer computes on CUDA (on the CPU the padded path keeps its "
        "numbers bit for bit)")
    fused_head: Toggle = Field(
        "auto", description="the log-prob + entropy head as one fused op over chunks of tokens (no float32 copy of "
        "the logits kept for backward); auto: on CUDA")
    compile: Toggle = Field(
        "auto", description="torch.compile each decoder layer in the trainer's forwards (dynamic batch and sequence "
        "sizes: no recompile per batch length; the engines and evals sharing the model stay eager); auto: on CUDA")
    fused_optimizer: Toggle = Field(
        "auto", description="fused AdamW, and a step with no host sync (a non-finite step skipped on the device); "
        "auto: on CUDA")

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        return TRAINERS.spec_name(v)

    @model_validator(mode="after")
    def _layout(self) -> TrainerSpec:
        if self.lora is not None and (self.backend != "torch" or self.world_size > 1 or self.grad_accum > 1
                                      or self.precision != "fp32"):
            raise ValueError(f"trainer.lora: LoRA runs on the one-process torch trainer (backend torch, world_size 1, "
                             f"grad_accum 1, precision fp32), got backend {self.backend!r}, world_size "
                             f"{self.world_size}, grad_accum {self.grad_accum}, precision {self.precision!r}")
        if self.activation_checkpointing and self.backend != "torch":
            raise ValueError(f"trainer.activation_checkpointing: only the torch backend checkpoints activations, got "
                             f"backend {self.backend!r}; set it to false")
        if self.backend != "megatron" and (self.tensor_parallel > 1 or self.pipeline_parallel > 1):
            raise ValueError(f"trainer.tensor_parallel / trainer.pipeline_parallel: need trainer.backend: megatron, "
                             f"got backend {self.backend!r} with tensor_parallel {self.tensor_parallel} and "
                             f"pipeline_parallel {self.pipeline_parallel}")
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.world_size % model_parallel:
            raise ValueError(f"trainer.world_size: must be a multiple of tensor_parallel * pipeline_parallel = "
                             f"{model_parallel}, got {self.world_size}")
        if self.devices is not None and len(self.devices) != self.world_size:
            raise ValueError(f"trainer.devices: one CUDA device per rank (world_size {self.world_size}), got "
                             f"{self.devices}")
        return self
