"""The `rollout` section: sampling, the engine (embedded, server, SGLang and its `sglang` subsection) and its limits."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from factory.config.bounds import (
    MAX_ENV_PROCESSES,
    MAX_IN_FLIGHT,
    MAX_NEW_TOKENS,
    MAX_PROMPTS_PER_STEP,
)
from factory.config.section import _Section
from factory.protocols.producer import PRODUCERS


class SGLangSpec(_Section):
    """SGLang rollout servers (`core/sglang/`): started and supervised by Factory from their own Python
    (sglang replaces the CPU torch, so it lives in its own venv on GPU nodes), or already running at `urls`."""

    servers: int = Field(1, ge=1, le=64, description="servers to start (one per GPU group of tp_size)")
    python: str | None = Field(
        None, min_length=1, description="the Python with sglang installed (its own venv); unset: this Python")
    urls: list[str] = Field(
        default_factory=list, description="already-running servers to use instead of starting any")
    tp_size: int = Field(1, ge=1, description="tensor parallel GPUs per server")
    base_port: int = Field(30000, ge=1024, le=65000)
    mem_fraction_static: float | None = Field(None, gt=0, le=1)
    weight_update: Literal["disk", "tensor", "distributed"] = Field(
        "disk", description="how new weights reach the servers: a safetensors directory they load, tensors sent "
        "over HTTP, or a torch.distributed group (NCCL)")
    startup_timeout_s: float = Field(600.0, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="more `sglang.launch_server` arguments")


class RolloutSpec(_Section):
    """How completions are sampled."""

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("sglang", "threads", "cpus", "env_cpus", "devices", "kv_budget_mb",
                                               "weight_transport", "round_weights")

    engine: str = Field(
        "embedded", min_length=1, description="the rollout backend (factory.protocols.PRODUCERS): in the "
        "overlapped modes the built-ins are the continuous engine in-process (embedded), a supervised rollout "
        "server process reached over HTTP (server), or SGLang servers (sglang; rollout.sglang; GPU nodes), and "
        "all three sample in-process in sync; or a registered backend's name, a plugin's (entry-point group "
        "factory.producers) or an import path 'package.module:build' (docs/extending.md)")
    prompts_per_step: int = Field(32, ge=1, le=MAX_PROMPTS_PER_STEP)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(8, ge=1, le=MAX_NEW_TOKENS)
    concurrency: int | None = Field(
        None, ge=1, le=MAX_IN_FLIGHT,
        description="prompt groups in flight at once (one_step_off/async); default: the buffer's depth")
    environment: Literal["in_process", "service"] = Field(
        "in_process", description="where episodes are scored: threads of the trainer's process, or supervised "
        "environment-worker processes over HTTP on 127.0.0.1 (`factory env-serve`)")
    env_processes: int = Field(1, ge=1, le=MAX_ENV_PROCESSES,
                               description="environment-worker processes when environment is 'service'")
    update_mode: Literal["in_flight", "finish_old"] = Field(
        "in_flight", description="what running requests do at a weight update: continue on the new weights, "
        "or finish on the old ones first")
    threads: int = Field(
        0, ge=0, description="placement: torch threads of the rollout engine (the continuous engine's thread "
        "in-process, or the rollout server process); 0: torch's default")
    cpus: list[int] | None = Field(
        None, min_length=1, description="placement: the CPU cores the rollout engine runs on; unset: any")
    env_cpus: list[int] | None = Field(
        None, min_length=1, description="placement: the CPU cores environment workers (scoring threads in-process, "
        "or env-serve processes) run on; unset: any")
    devices: list[int] | None = Field(
        None, min_length=1, description="placement: the GPU ids the rollout engine gets (SGLang: server i uses "
        "devices[i*tp_size:(i+1)*tp_size]); unset: SGLang's own choice from GPU 0")
    sglang: SGLangSpec | None = Field(None, description="the SGLang servers when rollout.engine is 'sglang'")
    kv_budget_mb: int | None = Field(
        None, ge=1, description="MiB the continuous engine's KV cache may hold (in-process, or the rollout server "
        "process); requests wait for room in it; unset: half the memory free when the engine starts")
    weight_transport: Literal["auto", "shared", "codec"] = Field(
        "auto", description="how each version reaches a rollout server (rollout.engine: server): 'shared', one "
        "double-buffered flat buffer in the serving dtype that the server maps once (the same GPU by CUDA IPC, or "
        "host shared memory) and reads each version from; 'codec', lossless deltas over HTTP (across hosts); "
        "auto: shared where the run computes on CUDA, codec otherwise (and with trainer.lora)")
    round_weights: Literal["bf16", "fp16"] | None = Field(
        None, description="the in-process engine samples from the trainer's weights rounded to this dtype (computing "
        "in fp32): a sampler/trainer gap of a lower-precision engine, reproduced on the CPU (benchmarks/mismatch.py); "
        "unset: the weights as they are")

    @field_validator("engine")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        return PRODUCERS.spec_name(name)

    @model_validator(mode="after")
    def _sglang_settings(self) -> RolloutSpec:
        if self.weight_transport == "shared" and self.engine == "sglang":
            raise ValueError("rollout.weight_transport: 'shared' is Factory's rollout server's (rollout.engine: "
                             "server); SGLang servers take weights by their own endpoints (rollout.sglang)")
        if self.engine == "sglang" and self.sglang is None:
            self.sglang = SGLangSpec()
        if self.sglang is not None and self.engine != "sglang":
            raise ValueError(f"rollout.sglang: only used with rollout.engine: sglang, got engine {self.engine!r}")
        if self.devices is not None:
            if self.engine != "sglang":
                raise ValueError(f"rollout.devices: GPUs for SGLang servers (rollout.engine: sglang); the "
                                 f"{self.engine} engine runs on the CPU, got {self.devices}")
            need = self.sglang.servers * self.sglang.tp_size
            if len(self.devices) != need:
                raise ValueError(f"rollout.devices: rollout.sglang.servers x tp_size = {need} GPUs, got "
                                 f"{len(self.devices)}: {self.devices}")
            if self.sglang.urls:
                raise ValueError("rollout.devices: servers at rollout.sglang.urls are already placed; leave "
                                 "rollout.devices unset")
        return self
