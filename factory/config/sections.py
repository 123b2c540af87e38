"""The sections of a spec other than the algorithm and the data blend: the model, the task, the SFT warm start, the
rollout buffer, rollouts (and SGLang), the trainer (and LoRA), the schedule and ops."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from factory.config.bounds import (
    MAX_ENV_PROCESSES,
    MAX_HELD_OUT,
    MAX_IN_FLIGHT,
    MAX_NEW_TOKENS,
    MAX_PASS_K,
    MAX_PROMPTS_PER_STEP,
    MAX_SFT_BATCH,
    MAX_STEP_SAMPLES,
    MAX_TASK_PROBLEMS,
)
from factory.config.errors import _clip
from factory.config.section import LR_HELP, _Section
from factory.presets import PRESETS

# A trainer speed-up switch: "auto" turns it on where the trainer computes on CUDA, so the CPU path stays exact.
Toggle = Literal["auto", "on", "off"]


class ModelSpec(_Section):
    """Which policy to start from: a preset built from a config, or `path`, a model with its own tokenizer: a
    local Hugging Face directory, a `.gguf` file or a Hugging Face Hub id in the local cache (factory/model_source.py).
    Nothing is downloaded either way. When `path` is set the preset is ignored (`factory validate` says so if both
    were given)."""

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("path", "trust_remote_code")

    preset: str = "tiny"
    path: str | None = Field(
        None, min_length=1, description="the model to start from, with its tokenizer (used for every prompt; "
        "replaces the preset): a local Hugging Face causal-LM directory (config.json, weights, tokenizer files), a "
        ".gguf file (converted once under FACTORY_HOME), or a Hugging Face Hub id org/name[@revision] found in the "
        "local HF cache (HF_HUB_CACHE; nothing is downloaded); an existing directory wins over a hub id; "
        "pkg:<package>/<path> names a file an installed Python package ships")
    trust_remote_code: bool = Field(
        False, description="let transformers run Python code shipped in model.path (custom architectures); off: "
        "only architectures transformers itself implements load")
    max_positions: int | None = Field(
        None, ge=16, le=8192, description="context length (prompt + completion); unset: the preset's (64), which "
        "fits arithmetic; word and code problems need about 256; with model.path: the model's own, and a value "
        "above it is refused when the model loads")

    def ignored_preset(self) -> str | None:
        """A one-line note when the spec names both a preset and a path (the path wins), else None."""
        if self.path is not None and "preset" in self.model_fields_set:
            return f"note: model.preset {self.preset!r} is ignored: model.path {self.path} is the model"
        return None

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"unknown model preset {_clip(v)}; valid presets: {', '.join(sorted(PRESETS))}")
        return v


Operation = Literal["add", "sub", "mul"]


MULTI_TURN_BUILTINS = ("calculator_tool", "python_tool")  # envs/registry.py BUILTINS that run episodes
MIN_N_TRAIN = 16


class TaskSpec(_Section):
    """The arithmetic task family; `digits` are the difficulty levels (operand lengths)."""

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("sandbox_cpus",)

    name: Literal["arithmetic", "word_problems", "code"] = Field(
        "arithmetic", description="the task family: generated arithmetic, or a shipped set of word problems or "
        "code problems (envs/tasks.py; their models use an ASCII character tokenizer)")
    operations: list[Operation] = Field(default_factory=lambda: ["add"], min_length=1)
    digits: list[int] = Field(default_factory=lambda: [2, 3], min_length=1)
    reverse_answer: bool = True
    reverse_operands: bool = False
    n_train: int = Field(20000, ge=MIN_N_TRAIN, le=MAX_TASK_PROBLEMS)
    n_eval: int = Field(500, ge=8, le=MAX_HELD_OUT)
    simulated_latency_s: float = Field(
        0.0, ge=0, description="unit of a heavy-tailed simulated verifier latency per episode (40% 1x, 50% 3x, "
        "10% 20x; see envs/latency.py); 0 disables it")
    environment: str | None = Field(
        None, description="a multi-turn environment (built-in name, e.g. calculator_tool, or an import path "
        "package.module:attr) that runs each episode against the rollout server; unset: the task's verifier "
        "scores single completions")
    episode_timeout_s: float = Field(300.0, gt=0, description="a multi-turn episode running longer scores 0")
    reward_timeout_s: float = Field(30.0, gt=0, description="a single-turn reward function (verifier or environment) "
                                    "running longer on one completion scores it 0, with the reason recorded")
    sandbox_workers: int = Field(4, ge=1, le=256, description="warm sandbox workers per scoring process (code "
                                 "rewards, tools); each execution takes milliseconds, so a few serve many rollouts")
    sandbox_isolation: Literal["bwrap", "none"] = Field(
        "bwrap", description="bwrap: generated code runs in bubblewrap namespaces, and the pool refuses to start "
        "without them; none: NOT isolated (rlimits and timeouts only), for trusted code, logged loudly")
    sandbox_cpus: list[int] | None = Field(
        None, min_length=1, description="placement: the CPU cores the sandbox workers (generated code) run on; "
        "unset: any")

    @field_validator("digits")
    @classmethod
    def _digits_range(cls, v: list[int]) -> list[int]:
        for d in v:
            if not 1 <= d <= 6:
                raise ValueError(f"each digit length must be between 1 and 6, got {d}")
        return sorted(set(v))


class SFTSpec(_Section):
    """Supervised warm start that teaches the answer format."""

    steps: int = Field(300, ge=0, description="maximum number of steps")
    batch_size: int = Field(64, ge=1, le=MAX_SFT_BATCH)
    lr: float = Field(3e-3, gt=0, le=1e30, description=LR_HELP)
    stop_at_accuracy: float | None = Field(
        None, gt=0, le=1,
        description="stop early once greedy accuracy on a sample of *train* problems reaches this",
    )
    check_every: int = Field(50, ge=1, description="steps between stop_at_accuracy checks")
    examples: int | None = Field(
        None, ge=1, description="labeled demonstrations SFT may use: the first N training problems (the warm start "
        "and the more-SFT control both see only these; GRPO prompts come from the whole training split, scored by "
        "the verifier, no labels needed); unset: every training problem")


class BufferSpec(_Section):
    """The rollout buffer between producers (rollouts) and the trainer; see `factory/core/buffer.py`.

    `max_staleness` is in weight versions (trainer steps). `policy`: `reject` drops groups staler than
    that (counted); `bound` trains every group within it and drops none: producers wait for room
    (depth <= max_staleness x groups per step) and the trainer waits for an episode that reaches its
    limit; `importance` keeps stale groups and corrects them with truncated IS weights
    (`algorithm.is_cap`). `depth` is in prompt groups (buffered + in flight); unset: max(max_staleness,
    1) x groups per step. The trainer takes groups from the oldest weights first.
    """

    policy: Literal["reject", "bound", "importance"] = "bound"
    max_staleness: int = Field(1, ge=0)
    depth: int | None = Field(None, ge=1, le=MAX_IN_FLIGHT,
                              description="capacity in prompt groups (buffered + reserved)")
    correct_stale: bool = Field(
        False, description="also apply the truncated IS correction (decoupled PPO) to stale groups under "
        "'reject' and 'bound'; 'importance' always does")

    @field_validator("max_staleness")
    @classmethod
    def _bound_needs_overlap(cls, v: int, info: ValidationInfo) -> int:
        if v < 1 and info.data.get("policy") == "bound":
            raise ValueError("policy 'bound' needs >= 1 (0 allows no overlap at all: use schedule.mode sync), "
                             f"got {v}")
        return v


class SGLangSpec(_Section):
    """SGLang rollout servers (`core/rollout/sglang*.py`): started and supervised by Factory from their own Python
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

    engine: Literal["embedded", "server", "sglang"] = Field(
        "embedded", description="overlapped modes: the continuous engine in-process, a supervised rollout "
        "server process reached over HTTP, or SGLang servers (rollout.sglang; GPU nodes) (sync always samples "
        "in-process)")
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

    backend: Literal["torch", "megatron"] = Field(
        "torch", description="torch (one process, or DDP/FSDP2 ranks under torchrun) or megatron (Megatron-core "
        "GPTModel built from the HF config; GPU only)")
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


class ScheduleSpec(_Section):
    """How long RL runs and how often it is measured."""

    mode: Literal["sync", "one_step_off", "async"] = "sync"
    wait_timeout_s: float = Field(600.0, gt=0, description="longest the trainer or a producer waits on the other")
    steps: int = Field(60, ge=1)
    eval_every: int = Field(0, ge=0, description="held-out eval every N steps; 0: only start and end")
    checkpoint_every: int = Field(0, ge=0, description="checkpoint every N steps; 0: only the final one")
    eval_pass_k: int = Field(8, ge=1, le=MAX_PASS_K)
    log_rollouts: int = Field(2, ge=0, le=MAX_PROMPTS_PER_STEP,
                              description="prompt groups per step kept in the `rollouts` table")


# The step-0 gate's and the run's default bounds on the mean |engine - trainer| log-prob of the same tokens. Same
# numerics (fp32 on the CPU, one process): float noise, 1e-7 to 3e-6 measured (the quickstart's SFT model, SmolLM2);
# an engine on fp16-rounded weights was 3.2e-4 off on the quickstart's SFT model, 1.6e-3 on SmolLM2: 1e-4 stops both
# with a 30x margin over the noise. Another precision or backend (bf16 engines, SGLang): SkyRL's CI holds 0.0104
# (sync) and 0.0193 (fully async) on a 1.5B model; 0.1 leaves room for smaller models and stops what is broken.
GAP_BOUND_SAME_NUMERICS = 1e-4
GAP_BOUND_OTHER_NUMERICS = 0.1


class OpsSpec(_Section):
    """Surviving faults: resume points, automatic restarts, hang detection, circuit breakers, the preflight gate
    (see factory/ops/)."""

    resume_every: int = Field(
        10, ge=0, description="write a full-state resume point (model, optimizer, RNGs, data position, buffered "
        "and in-flight rollouts) every N steps, in the background; also at every schedule.checkpoint_every, on "
        "SIGTERM/SIGINT and at the end; 0: only those")
    keep_resume: int = Field(2, ge=1, description="resume points kept per run (older ones are deleted)")
    max_restarts: int = Field(3, ge=0, description="automatic resumes after a crash, a kill or a hang before the "
                              "run is marked failed")
    hang_timeout_s: float = Field(60.0, gt=0, description="a run whose trainer makes no progress (no step, no "
                                  "sign of life) for this long is treated as crashed: killed and resumed")
    max_nonfinite_steps: int = Field(3, ge=1, description="steps in a row skipped for a non-finite loss or "
                                     "gradient before the run stops at its last good state")
    breaker_restarts: int = Field(3, ge=1, description="a service (rollout server, environment workers, sandbox "
                                  "pool) restarted this many times within breaker_window_s trips the breaker: the "
                                  "run checkpoints and stops, naming the service")
    breaker_window_s: float = Field(60.0, gt=0)
    preflight: Literal["gate", "off"] = Field(
        "gate", description="gate: a node whose latest preflight failed gets no training run (one missing or older "
        "than preflight_max_age_s is run first, quick mode); off: no gate (env FACTORY_PREFLIGHT=off also)")
    preflight_max_age_s: float = Field(86400.0, gt=0)
    lake_outage_s: float = Field(300.0, ge=0, description="how long the lake/catalog may be unreachable while the "
                                 "run keeps training (rows are spooled under the run's directory and flushed when "
                                 "it returns); past that the run stops at a resume point (exit code 5)")

    max_logprob_gap: float | None = Field(
        None, gt=0, description="bound on the mean |engine log-prob - trainer log-prob| of the same tokens under the "
        "same weights: the step-0 gate (and `factory preflight`) stop a run past it, and a gap past it for "
        "max_gap_steps steps in a row stops the run at its last good resume point (exit code 8); unset: 1e-4 where "
        "the engine should compute as the trainer does (fp32 on the CPU, in-process), 0.1 where it computes in "
        "another precision or backend")
    max_gap_steps: int = Field(3, ge=1, description="steps in a row with the gap past max_logprob_gap before the run "
                               "stops at its last good state")

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("lake_outage_s", "max_logprob_gap", "max_gap_steps")

    def logprob_gap_bound(self, engine_differs: bool) -> float:
        """`max_logprob_gap`, or its default for an engine that does (not) compute as the trainer does."""
        if self.max_logprob_gap is not None:
            return self.max_logprob_gap
        return GAP_BOUND_OTHER_NUMERICS if engine_differs else GAP_BOUND_SAME_NUMERICS

    @field_validator("preflight", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML reads a bare `off` as false (and `on` as true): take them as meant.
        return {False: "off", True: "gate"}.get(v, v) if isinstance(v, bool) else v
