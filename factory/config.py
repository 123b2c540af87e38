"""Experiment specs: pydantic models, YAML in and out, and error messages that name the field.

An `ExperimentSpec` is the whole description of a run. Everything that trains (the CLI, the
Dagster assets, a notebook) takes one; nothing else carries hyperparameters.

This module checks what the schema alone can tell. What only the task families know (how many distinct
problems a task has, how long its longest prompt is) is checked by `factory.envs.spec_check.check_spec`,
which the loaders (the CLI, the Dagster spec resource, sweeps, the deploy target) call after `load_spec` /
`parse_spec` / `apply_overrides`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from factory.digest import model_dir_digest
from factory.model_source import source_files
from factory.presets import PRESETS
from factory.source_spec import Seed, SourceError, parse_source_spec
from factory.text import clip


class SpecError(ValueError):
    """A spec that cannot be used; `str()` lists one `path: problem` line per error."""

    def __init__(self, errors: list[str], source: str | None = None):
        self.errors = errors
        self.source = source
        head = f"invalid spec {source}" if source else "invalid spec"
        super().__init__(head + ":\n" + "\n".join(f"  {e}" for e in errors))


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping names a key twice (PyYAML would silently keep the last)."""

    def __init__(self, key: Any, line: int, first: int):
        self.key, self.line, self.first = key, line, first
        super().__init__(f"duplicate key {_clip(key)} at line {line} (first at line {first})")


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping. Merge keys (`<<: *base`) may still be
    overridden: only a mapping's own keys are compared."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise DuplicateKeyError(key, key_node.start_mark.line + 1, first)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


# The most nodes a spec document may hold once its aliases are expanded. A spec is a few hundred nodes; an alias
# bomb (each level a list of 9 aliases to the one before) is 9**levels, and pydantic walks the expanded tree.
MAX_YAML_NODES = 100_000


class YAMLBombError(yaml.YAMLError):
    """A YAML document whose aliases expand past MAX_YAML_NODES nodes, or refer to themselves."""


def _expanded_nodes(root: yaml.Node) -> int:
    """How many nodes `root` holds with every alias expanded, counted without expanding (an anchored node's size is
    computed once); YAMLBombError past MAX_YAML_NODES or on an alias inside the node it names."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise YAMLBombError(f"a recursive alias at line {node.start_mark.line + 1} (an anchor used inside "
                                f"itself)")
        open_.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise YAMLBombError(f"the document expands to more than {MAX_YAML_NODES} nodes through its aliases "
                                    f"(*name); a spec needs far fewer: write the repeated parts out or use fewer "
                                    f"aliases")
        open_.discard(key)
        sizes[key] = total
        return total

    return size(root)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, but a key given twice in a mapping raises DuplicateKeyError, and a document whose aliases
    expand past MAX_YAML_NODES nodes (an alias bomb) or recurse raises YAMLBombError (both YAMLErrors), before
    anything is built from it."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()  # composed: aliases are shared nodes here, not yet copies
        if node is None:
            return None
        _expanded_nodes(node)
        return loader.construct_document(node)
    except RecursionError:  # composing and constructing recurse once per nesting level
        raise YAMLBombError("the document nests too deeply (thousands of levels); a spec needs a handful") from None
    finally:
        loader.dispose()


_ECHO_CHARS = 100  # longest input echoed whole in an error; longer ones are clipped
_MESSAGE_CHARS = 600


def _clip(value: Any) -> str:
    """repr(value), clipped: an error must not echo a 10 MB field back."""
    return clip(repr(value), _ECHO_CHARS, mark="…", unit="chars", size=len(value) if isinstance(value, str) else None)


class _Section(BaseModel):
    # No inf/NaN anywhere: an infinite learning rate or timeout validates against gt=0 but wrecks the run.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # Fields added after specs were first fingerprinted: left out of dumps while they hold their default, so an
    # older spec's dump, fingerprint and warm-start cache key stay what they were.
    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_late_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._LATE_FIELDS:
            if name in data and getattr(self, name) == type(self).model_fields[name].default:
                data.pop(name)
        return data


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
        "local HF cache (HF_HUB_CACHE; nothing is downloaded); an existing directory wins over a hub id")
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
    n_train: int = Field(20000, ge=MIN_N_TRAIN)
    n_eval: int = Field(500, ge=8)
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


LR_HELP = "AdamW learning rate (torch holds it as a float32: far past 1e30 the optimizer step overflows)"


class SFTSpec(_Section):
    """Supervised warm start that teaches the answer format."""

    steps: int = Field(300, ge=0, description="maximum number of steps")
    batch_size: int = Field(64, ge=1)
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


class AlgorithmSpec(_Section):
    """The RL objective: advantages and policy loss. `name` picks the algorithm; fields left unset
    (None) take that algorithm's published default (see `DEFAULTS`), so `name: dapo` alone is DAPO.

    `clip_eps` is the symmetric clip of GRPO and Dr.GRPO and DAPO's lower clip; `clip_eps_low` /
    `clip_eps_high` override either side for any algorithm (CISPO has no lower bound by default;
    GSPO's are sequence-level and tiny). `is_cap` truncates the importance weights the rollout buffer
    attaches to stale samples in its `importance` policy.
    """

    # Per-algorithm defaults for the fields left unset (None). Each entry follows its paper:
    # - grpo: symmetric clip `clip_eps`, per-sequence token mean, std-scaled advantages (DeepSeekMath).
    # - dr_grpo: no std scaling, token sums divided by a constant max length (Liu et al. 2025, "Understanding
    #   R1-Zero-Like Training").
    # - dapo: clip-higher 0.2/0.28, token-level mean over the batch, overlong shaping, dynamic sampling
    #   (Yu et al. 2025).
    # - cispo: clipped IS weight with no lower bound, upper 1 + 0.28, token-level mean (MiniMax-M1, 2025).
    # - gspo: sequence-level ratio clipped to [1 - 3e-4, 1 + 4e-4], per-sequence mean (Zheng et al. 2025).
    DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        "grpo": {"clip_eps_low": "clip_eps", "clip_eps_high": "clip_eps", "loss_agg": "seq_mean_token_mean",
                 "scale_rewards": True, "dynamic_sampling": False, "overlong": False},
        "dr_grpo": {"clip_eps_low": "clip_eps", "clip_eps_high": "clip_eps", "loss_agg": "seq_mean_token_sum_norm",
                    "scale_rewards": False, "dynamic_sampling": False, "overlong": False},
        "dapo": {"clip_eps_low": "clip_eps", "clip_eps_high": 0.28, "loss_agg": "token_mean",
                 "scale_rewards": True, "dynamic_sampling": True, "overlong": True},
        "cispo": {"clip_eps_low": None, "clip_eps_high": 0.28, "loss_agg": "token_mean",
                  "scale_rewards": True, "dynamic_sampling": False, "overlong": False},
        "gspo": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "loss_agg": "seq_mean_token_mean",
                 "scale_rewards": True, "dynamic_sampling": False, "overlong": False},
    }

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("dual_clip",)

    name: Literal["grpo", "dr_grpo", "dapo", "cispo", "gspo"] = "grpo"
    group_size: int = Field(8, ge=2)
    lr: float = Field(3e-4, gt=0, le=1e30, description=LR_HELP)
    clip_eps: float = Field(0.2, gt=0, lt=1)
    clip_eps_low: float | None = Field(None, gt=0, lt=1, description="lower clip: ratio >= 1 - clip_eps_low")
    clip_eps_high: float | None = Field(None, gt=0, description="upper clip: ratio <= 1 + clip_eps_high")
    kl_coef: float = Field(0.0, ge=0)
    scale_rewards: bool | None = Field(None, description="divide advantages by the group's reward std")
    loss_agg: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"] | None = Field(
        None, description="seq_mean_token_mean: mean per sequence then over sequences; token_mean: over all "
                          "tokens of the batch; seq_mean_token_sum_norm: token sum / a constant max length",
    )
    max_len_norm: int | None = Field(
        None, ge=1, description="Dr.GRPO's constant divisor; unset: the rollout's max_new_tokens",
    )
    overlong_max_len: int | None = Field(
        None, ge=1, description="DAPO's L_max for overlong shaping; unset: the rollout's max_new_tokens",
    )
    overlong_buffer: int | None = Field(
        None, ge=0, description="DAPO's L_cache: lengths past overlong_max_len - overlong_buffer are penalized "
                                "linearly; 0 turns shaping off; unset: dapo uses a fifth of overlong_max_len "
                                "(the paper's 4096 of 20480), others 0",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="scale of the overlong penalty (reaches -this)")
    dynamic_sampling: bool | None = Field(
        None, description="drop groups whose rewards are all equal and refill the batch (DAPO)",
    )
    is_cap: float = Field(2.0, ge=1, description="truncation of importance weights on stale samples")
    dual_clip: float | None = Field(
        None, gt=1, description="dual-clip PPO's c (Ye et al. 2020; verl's clip_ratio_c, 3.0 there): a token with "
        "negative advantage loses at most -A * c, and past it passes no gradient; grpo, dr_grpo and dapo only; "
        "unset: off")

    @field_validator("scale_rewards")
    @classmethod
    def _dr_grpo_unscaled(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        if v and info.data.get("name") == "dr_grpo":
            raise ValueError("dr_grpo does not divide advantages by the reward std (that is its point); "
                             "leave it unset or set false")
        return v

    @field_validator("overlong_buffer")
    @classmethod
    def _buffer_fits(cls, v: int | None, info: ValidationInfo) -> int | None:
        max_len = info.data.get("overlong_max_len")
        if v is not None and max_len is not None and v >= max_len:
            raise ValueError(f"must be < overlong_max_len = {max_len}, got {v}")
        return v

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_ppo_only(cls, v: float | None, info: ValidationInfo) -> float | None:
        name = info.data.get("name")
        if v is not None and name in ("cispo", "gspo"):
            raise ValueError(f"the dual clip bounds the PPO-clip losses (grpo, dr_grpo, dapo), not {name}; "
                             "leave it unset")
        return v

    def _default(self, key: str) -> Any:
        return self.DEFAULTS[self.name][key]

    def clip_bounds(self) -> tuple[float | None, float]:
        """(eps_low, eps_high): the ratio is kept in [1 - eps_low, 1 + eps_high]; eps_low None: no lower bound."""
        def side(value: float | None, key: str) -> float | None:
            if value is not None:
                return value
            d = self._default(key)
            return self.clip_eps if d == "clip_eps" else d
        high = side(self.clip_eps_high, "clip_eps_high")
        assert high is not None  # every algorithm has an upper clip
        return side(self.clip_eps_low, "clip_eps_low"), high

    def aggregation(self) -> str:
        return self.loss_agg or self._default("loss_agg")

    def scales_rewards(self) -> bool:
        return self._default("scale_rewards") if self.scale_rewards is None else self.scale_rewards

    def uses_dynamic_sampling(self) -> bool:
        return self._default("dynamic_sampling") if self.dynamic_sampling is None else self.dynamic_sampling

    def overlong(self, max_new_tokens: int | None = None) -> tuple[int, int] | None:
        """(L_max, L_cache) of DAPO's soft overlong punishment, or None when shaping is off.

        L_max is `overlong_max_len`, else the rollout's `max_new_tokens`; L_cache is `overlong_buffer`,
        else (dapo) a fifth of L_max, the paper's 4096 of 20480.
        """
        if self.overlong_buffer == 0 or (self.overlong_buffer is None and not self._default("overlong")):
            return None
        max_len = self.overlong_max_len or max_new_tokens
        if max_len is None:
            raise ValueError("algorithm.overlong_max_len: overlong shaping needs a max length "
                             "(set it, or pass the rollout's max_new_tokens)")
        buffer = self.overlong_buffer if self.overlong_buffer is not None else max(1, max_len // 5)
        if buffer >= max_len:
            raise ValueError(f"algorithm.overlong_buffer: must be < the max length {max_len}, got {buffer}")
        return max_len, buffer


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
    depth: int | None = Field(None, ge=1, description="capacity in prompt groups (buffered + reserved)")
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

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("sglang", "threads", "cpus", "env_cpus", "devices", "kv_budget_mb")

    engine: Literal["embedded", "server", "sglang"] = Field(
        "embedded", description="overlapped modes: the continuous engine in-process, a supervised rollout "
        "server process reached over HTTP, or SGLang servers (rollout.sglang; GPU nodes) (sync always samples "
        "in-process)")
    prompts_per_step: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(8, ge=1)
    concurrency: int | None = Field(
        None, ge=1, description="prompt groups in flight at once (one_step_off/async); default: the buffer's depth")
    environment: Literal["in_process", "service"] = Field(
        "in_process", description="where episodes are scored: threads of the trainer's process, or supervised "
        "environment-worker processes over HTTP on 127.0.0.1 (`factory env-serve`)")
    env_processes: int = Field(1, ge=1, description="environment-worker processes when environment is 'service'")
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

    @model_validator(mode="after")
    def _sglang_settings(self) -> RolloutSpec:
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
        "cpus", "lora", "activation_checkpointing")

    backend: Literal["torch", "megatron"] = Field(
        "torch", description="torch (one process, or DDP/FSDP2 ranks under torchrun) or megatron (Megatron-core "
        "GPTModel built from the HF config; GPU only)")
    minibatches: int = Field(1, ge=1)
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
    eval_pass_k: int = Field(8, ge=1)
    log_rollouts: int = Field(2, ge=0, description="prompt groups per step kept in the `rollouts` table")


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

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("lake_outage_s",)

    @field_validator("preflight", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML reads a bare `off` as false (and `on` as true): take them as meant.
        return {False: "off", True: "gate"}.get(v, v) if isinstance(v, bool) else v


class CurriculumSpec(_Section):
    """Where rollouts are spent, from the rewards of trained groups (factory/data/curriculum.py).

    none: every prompt the blend serves is generated. online: a prompt is dropped once its last `attempts`
    groups were all solved (every sample right) or all unsolved (none right), per `drop`, and served again
    after `retry_after` further draws (0: never). priority: a prompt seen before is generated with
    probability max(floor, 4 p (1 - p)) (p: its pass rate so far), so prompts near p = 0.5, where a group's
    advantages carry most signal, are preferred; unseen prompts always are. level: `levels` are source names,
    easiest first; the blend's weight sits on the current level (earlier ones keep `review` of it) and moves
    to the next once the level's accuracy over its last `window` groups reaches `threshold`."""

    kind: Literal["none", "online", "priority", "level"] = "none"
    attempts: int = Field(1, ge=1, description="online: groups of a prompt judged before it may be dropped")
    drop: Literal["solved", "unsolved", "both"] = Field("both", description="online: which prompts are dropped")
    retry_after: int = Field(0, ge=0, description="online: draws after which a dropped prompt is served again; "
                             "0: never")
    floor: float = Field(0.05, gt=0, le=1, description="priority: least probability of generating a seen prompt")
    levels: list[str] = Field(default_factory=list, description="level: source names, easiest first")
    threshold: float = Field(0.8, gt=0, le=1, description="level: rolling accuracy that moves to the next level")
    window: int = Field(32, ge=1, description="level: groups in a level's rolling accuracy")
    review: float = Field(0.0, ge=0, lt=1, description="level: share of draws kept on the levels already passed")


class PromptFilterSpec(_Section):
    """Offline curriculum: prompts whose pass rate over earlier runs (the lake's `prompt_stats`) lies outside
    [min_pass_rate, max_pass_rate] are skipped; prompts with fewer than `min_attempts` recorded samples
    are kept (nothing is known about them)."""

    min_pass_rate: float = Field(0.0, ge=0, le=1)
    max_pass_rate: float = Field(1.0, ge=0, le=1)
    min_attempts: int = Field(8, ge=1, description="samples recorded before a prompt's pass rate is trusted")

    @model_validator(mode="after")
    def _window(self) -> PromptFilterSpec:
        if self.min_pass_rate > self.max_pass_rate:
            raise ValueError(f"min_pass_rate {self.min_pass_rate} must be <= max_pass_rate {self.max_pass_rate}")
        return self


class DataSpec(_Section):
    """The prompts GRPO trains on: a blend of sources (factory/data/), with fixed weights or a schedule over
    steps, and a curriculum. Without a `data` section a run blends one source, the task's training split.
    The SFT warm start and the `heldout` benchmark stay the task's; each generated source adds its own
    held-out benchmark (`source:<name>`, the `held_out` problems after its training rows)."""

    sources: list[dict[str, Any]] = Field(min_length=1, description="source specs (factory/source_spec.py)")
    weights: dict[str, float] | None = Field(None, description="source -> weight (normalized); unset and no "
                                             "schedule: equal weights")
    schedule: dict[int, dict[str, float]] | None = Field(
        None, description="step -> {source: weight}: the weights from that training step on (first at step 0)")
    seed: Seed | None = Field(None, description="the blend's shuffle seed; unset: the spec's seed")
    curriculum: CurriculumSpec = Field(default_factory=CurriculumSpec)
    filter: PromptFilterSpec | None = Field(None, description="offline: skip prompts by their recorded pass rate")
    held_out: int = Field(100, ge=0, description="held-out problems per generated source: arithmetic, "
                          "reasoning_gym, humaneval (0: none)")

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out, seen = [], set()
        for i, raw in enumerate(v):
            try:
                spec = parse_source_spec(raw)
            except SourceError as e:
                raise ValueError(f"entry {i}: {e}") from None
            if spec.name in seen:
                raise ValueError(f"entry {i}: source name {spec.name!r} is used twice")
            seen.add(spec.name)
            out.append(spec.model_dump(mode="json"))
        return out

    def names(self) -> list[str]:
        return [s["name"] for s in self.sources]

    def blend_weights(self) -> dict[int, dict[str, float]]:
        """The schedule the blender follows: step -> weights (fixed weights are the schedule {0: weights})."""
        if self.schedule is not None:
            return {int(k): dict(v) for k, v in self.schedule.items()}
        return {0: dict(self.weights) if self.weights is not None else {n: 1.0 for n in self.names()}}

    @model_validator(mode="after")
    def _consistent(self) -> DataSpec:
        names = self.names()
        if self.weights is not None and self.schedule is not None:
            raise ValueError("weights and schedule: give one (fixed weights are the schedule {0: weights})")
        entries = ([("weights", self.weights)] if self.weights is not None else
                   [(f"schedule.{k}", w) for k, w in sorted((self.schedule or {}).items())])
        for where, weights in entries:
            unknown = sorted(set(weights) - set(names))
            if unknown:
                raise ValueError(f"{where}: unknown source(s) {unknown} (sources: {names})")
            bad = {n: w for n, w in weights.items() if w < 0}
            if bad:
                raise ValueError(f"{where}: weights must be >= 0, got {bad}")
            if sum(weights.values()) <= 0:
                raise ValueError(f"{where}: all weights are 0 (at least one source must be drawn)")
        if self.schedule is not None:
            if any(k < 0 for k in self.schedule):
                raise ValueError(f"schedule: steps must be >= 0, got {sorted(self.schedule)}")
            if 0 not in self.schedule:
                raise ValueError(f"schedule: the first entry must be step 0 (weights from the start), got steps "
                                 f"{sorted(self.schedule)}")
        c = self.curriculum
        if c.kind == "level":
            if not c.levels:
                raise ValueError("curriculum.levels: a level curriculum needs the source names, easiest first")
            unknown = sorted(set(c.levels) - set(names))
            if unknown:
                raise ValueError(f"curriculum.levels: unknown source(s) {unknown} (sources: {names})")
            if len(set(c.levels)) != len(c.levels):
                raise ValueError(f"curriculum.levels: a source is listed twice: {c.levels}")
            if self.schedule is not None:
                raise ValueError("curriculum: a level curriculum sets the weights itself; drop data.schedule")
        elif c.levels:
            raise ValueError(f"curriculum.levels: only used by kind 'level', got kind {c.kind!r}")
        return self


class ExperimentSpec(_Section):
    """A whole experiment: model, task, SFT warm start, algorithm, rollout, trainer, schedule, ops, data, seed,
    and the device it computes on."""

    _LATE_FIELDS: ClassVar[tuple[str, ...]] = ("device",)

    name: str = Field("experiment", min_length=1, max_length=80, pattern=r"^[A-Za-z0-9_.-]+$")
    seed: Seed = 0
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="where the run computes: SFT, the trainer, the "
        "in-process rollout engines, evals, the KL reference and the rollout server (factory/infra/device.py). auto: "
        "the current CUDA device when torch sees one, else the CPU; cpu; cuda (the current CUDA device); cuda:N. "
        "trainer.devices still places the ranks of a multi-process trainer")
    model: ModelSpec = Field(default_factory=ModelSpec)
    task: TaskSpec = Field(default_factory=TaskSpec)
    sft: SFTSpec = Field(default_factory=SFTSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    buffer: BufferSpec = Field(default_factory=BufferSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    ops: OpsSpec = Field(default_factory=OpsSpec)
    data: DataSpec | None = Field(None, description="GRPO's prompt blend; unset: the task's training split")

    @model_validator(mode="after")
    def _fits_together(self) -> ExperimentSpec:
        b, per_step = self.buffer, self.rollout.prompts_per_step
        if b.policy == "bound" and b.depth is not None and b.depth > b.max_staleness * per_step:
            raise ValueError(
                f"buffer.depth: with policy 'bound' must be <= buffer.max_staleness * rollout.prompts_per_step "
                f"= {b.max_staleness * per_step} (deeper lets groups grow staler than allowed), got {b.depth}"
            )
        # Built-in multi-turn environments are known here; one named by import path is checked when the run
        # starts (importing user code while validating a spec would run it).
        if self.task.environment in MULTI_TURN_BUILTINS and (self.rollout.engine != "server"
                                                             or self.schedule.mode == "sync"):
            raise ValueError(
                f"task.environment: a multi-turn environment talks to the rollout server, so it needs "
                f"rollout.engine: server and schedule.mode one_step_off or async (got engine "
                f"{self.rollout.engine!r}, mode {self.schedule.mode!r})")
        text = [s["name"] for s in (self.data.sources if self.data else [])
                if s["kind"] in ("suite", "reasoning_gym", "humaneval")]
        if text and self.task.name == "arithmetic" and getattr(self.model, "path", None) is None:
            raise ValueError(f"data.sources: {text} hold text prompts, but the model's tokenizer is task arithmetic's "
                             f"(digits and + - * =): use task.name word_problems or code (an ASCII tokenizer, which "
                             f"also reads arithmetic)")
        if self.sft.examples is not None and self.sft.examples > self.task.n_train:
            raise ValueError(f"sft.examples: must be <= task.n_train = {self.task.n_train} (the demonstrations are "
                             f"the first training problems), got {self.sft.examples}")
        if self.trainer.lora is not None and self.rollout.engine == "sglang":
            raise ValueError("trainer.lora: not wired to rollout.engine sglang yet (it would load each version's "
                             "adapter through SGLang's /load_lora_adapter); use engine embedded or server")
        batch = self.rollout.prompts_per_step * self.algorithm.group_size
        if batch % self.trainer.minibatches:
            raise ValueError(
                f"trainer.minibatches: must divide rollout.prompts_per_step * algorithm.group_size "
                f"= {batch}, got {self.trainer.minibatches}"
            )
        return self

    def fingerprint(self) -> str:
        """Stable short hash of the spec's content (key order and formatting do not matter)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def warm_start_fingerprint(self) -> str:
        """What the SFT warm start depends on (model, task, SFT settings, seed, generation budget, and a
        `model.path` directory's contents): runs that differ only in RL settings share one warm start."""
        parts = {"model": self.model.model_dump(mode="json"), "task": self.task.model_dump(mode="json"),
                 "sft": self.sft.model_dump(mode="json"), "seed": self.seed,
                 "max_new_tokens": self.rollout.max_new_tokens}
        if self.model.path is not None:  # a path names where a model is, not its weights: key by what is there
            files = source_files(self.model.path)  # the directory, the GGUF file or the hub id's cached snapshot
            parts["model_dir_sha256"] = model_dir_digest(files) if files is not None else None
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _describe(err: dict[str, Any]) -> str:
    return _shorten(_describe_one(err))


def _shorten(line: str) -> str:
    return line if len(line) <= _MESSAGE_CHARS else f"{line[:_MESSAGE_CHARS]}… ({len(line)} chars)"


def spec_error(message: str, source: str | None = None) -> SpecError:
    """A SpecError for a check made outside the schema (`factory.envs.spec_check.check_spec`), worded as the
    schema words its own whole-spec checks."""
    return SpecError([_shorten(message)], source)


def _describe_one(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "<spec>"
    kind = err["type"]
    ctx = err.get("ctx") or {}
    got = _clip(err.get("input"))
    if kind == "extra_forbidden":
        return f"{loc}: unknown key (not a field of this section)"
    if kind == "missing":
        return f"{loc}: required field is missing"
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        op, key = bounds[kind]
        return f"{loc}: must be {op} {ctx.get(key)}, got {got}"
    if kind == "finite_number":
        return f"{loc}: must be a finite number, got {got}"
    if kind == "literal_error":
        return f"{loc}: expected {ctx.get('expected')}, got {got}"
    if kind == "value_error":
        # Our own validators: the message already says what was expected.
        msg = str(ctx.get("error", err["msg"]))
        if loc.startswith("<spec>") or loc == "":
            return msg
        return f"{loc}: {msg}"
    # pydantic's own message, as written (lowercasing it mangled patterns and names).
    return f"{loc}: {err['msg']}, got {got}"


def parse_spec(data: Any, source: str | None = None) -> ExperimentSpec:
    """Validate a mapping as an ExperimentSpec; raise SpecError naming every bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"<spec>: expected a mapping of sections, got {type(data).__name__}"], source)
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError([_describe(err) for err in e.errors(include_url=False)], source) from None


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read a YAML spec file; errors name the file and the field path."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([f"<file>: no such spec file: {path}"], str(path))
    try:
        data = load_yaml(path.read_text())
    except (DuplicateKeyError, YAMLBombError) as e:
        raise SpecError([f"<file>: {e}"], str(path)) from None
    except yaml.YAMLError as e:
        raise SpecError([f"<file>: not valid YAML: {e}"], str(path)) from None
    anchor_source_paths(data, path.parent)
    return parse_spec(data, str(path))


FILE_SOURCE_KINDS = ("jsonl", "parquet", "hf_disk")


def anchor_source_paths(data: Any, folder: str | Path) -> None:
    """Make each relative `path:` of the file sources in raw spec `data` absolute under `folder` (the spec file's
    folder), in place, so a spec means the same files wherever the command runs (and in a run's own copy of it).
    A spec built in Python keeps its paths as given: relative ones are then relative to the working directory of
    the process that opens the sources. Malformed entries are left for validation to report."""
    sources = data.get("data", {}).get("sources") if isinstance(data, dict) and isinstance(data.get("data"), dict) \
        else None
    if not isinstance(sources, list):
        return
    for s in sources:
        if isinstance(s, dict) and s.get("kind") in FILE_SOURCE_KINDS and isinstance(s.get("path"), str) \
                and s["path"]:
            p = os.path.expanduser(s["path"])
            if not os.path.isabs(p):
                s["path"] = os.path.normpath(os.path.join(os.path.abspath(folder), p))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["algorithm.lr=1e-4", "task.digits=[2,3]"]` → `{"algorithm.lr": 0.0001, ...}` (values are YAML)."""
    pairs: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError([f"{item}: expected path=value, e.g. algorithm.lr=1e-4"])
        try:
            pairs[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise SpecError([f"{key.strip()}: value {value!r} is not valid YAML: {e}"]) from None
    return pairs


def apply_overrides(spec: ExperimentSpec, overrides: dict[str, Any]) -> ExperimentSpec:
    """Return a copy with dotted-path overrides applied (`{"algorithm.lr": 1e-4}`), re-validated."""
    data = spec.model_dump(mode="json")
    if "preset" not in spec.model.model_fields_set:  # a preset left to its default stays implicit (see ignored_preset)
        data["model"].pop("preset", None)
    for dotted, value in overrides.items():
        node: Any = data
        parts = dotted.split(".")
        for i, p in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):  # a list entry by index, e.g. data.sources.1.n
                if not p.isdigit() or int(p) >= len(node):
                    raise SpecError([f"{dotted}: {p!r} is not an index of the {len(node)} entries of "
                                     f"{'.'.join(parts[:i])}"])
                if last:
                    node[int(p)] = value
                else:
                    node = node[int(p)]
                continue
            if not isinstance(node, dict):
                raise SpecError([f"{dotted}: {parts[i - 1]!r} is a value, not a section"])
            if last:
                node[p] = value
            else:
                # An unknown section is created so validation names it as an unknown key.
                node = node.setdefault(p, {})
    return parse_spec(data)
