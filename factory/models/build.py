"""The run's starting policy: a causal LM built from a preset (a transformers config, random init) with a
character tokenizer, or loaded from `model.path` with its own tokenizer (`policy_for`). No download."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from factory.architectures import attention_window
from factory.envs.tasks import longest_prompts
from factory.home import FactoryPaths, factory_home
from factory.models.hf import load_model_dir
from factory.models.prompting import prompt_ids
from factory.models.resolve import resolve_model_path
from factory.models.tokenizer import tokenizer_for
from factory.presets import PRESETS
from factory.progress import Log

if TYPE_CHECKING:
    from factory.config import ExperimentSpec, ModelSpec


def build_model(preset: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0,
                max_positions: int | None = None) -> PreTrainedModel:
    """A freshly initialised Qwen2/Llama-architecture model sized by `preset` (context: `max_positions`, else the
    preset's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid presets: {', '.join(sorted(PRESETS))}")
    p = PRESETS[preset]
    config = AutoConfig.for_model(
        p.arch,
        vocab_size=len(tokenizer),
        hidden_size=p.hidden_size,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        intermediate_size=p.intermediate_size,
        max_position_embeddings=max_positions or p.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def policy_for(spec: ExperimentSpec, home: FactoryPaths | None = None,
               log: Log = print) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """(model, tokenizer) a run starts from: `model.path`'s (a directory, a GGUF file converted under `home`,
    default $FACTORY_HOME, or a cached hub id: models/resolve.py), or the preset's with the task's character
    tokenizer (seeded by `spec.seed`). A path model's context is checked here, with its real tokenizer, against
    the task's longest prompt plus `rollout.max_new_tokens` (the spec could not: it knows no tokenizer)."""
    m = spec.model
    if m.path is None:
        tok = tokenizer_for(spec.task.name)
        return build_model(m.preset, tok, seed=spec.seed, max_positions=m.max_positions), tok
    model_dir = resolve_model_path(m.path, home or factory_home(), log=log)
    model, tok = load_model_dir(model_dir, max_positions=m.max_positions, trust_remote_code=m.trust_remote_code)
    positions = policy_positions(spec.model, model)
    if positions is not None:
        window = attention_window(model.config)
        where = ("model.max_positions" if m.max_positions else f"the max_position_embeddings of the model in {m.path}")
        if window is not None and window == positions:
            where = f"the sliding window of the model in {m.path}: the rollout engines are exact within it"
        check_prompt_fits(spec, tok, positions, where)
    return model, tok


def policy_positions(spec: ModelSpec, model: PreTrainedModel) -> int | None:
    """The context the policy `model` (built or loaded as the `model` section `spec` says) has: `max_positions`,
    else a `path` model's own (`max_position_embeddings`; None if its config has none), else its preset's; never
    past the model's sliding window (`factory.architectures.attention_window`), beyond which the continuous engine
    would not be exact."""
    if spec.max_positions:
        positions = spec.max_positions
    elif spec.path is not None:
        positions = getattr(model.config, "max_position_embeddings", None)
    else:
        positions = PRESETS[spec.preset].max_positions
    window = attention_window(model.config)
    if window is None:
        return positions
    return window if positions is None else min(positions, window)


def check_prompt_fits(spec: ExperimentSpec, tokenizer: PreTrainedTokenizerFast, positions: int, where: str) -> None:
    """The task's longest prompt under `tokenizer`, plus rollout.max_new_tokens, must fit `positions`."""
    texts = longest_prompts(spec.task, spec.data)
    prompt = max(len(prompt_ids(tokenizer, t)) for t in texts)
    new = spec.rollout.max_new_tokens
    if prompt + new > positions:
        raise ValueError(f"model.max_positions: the longest prompt of task {spec.task.name} is {prompt} tokens under "
                         f"the tokenizer of {spec.model.path or spec.model.preset}; with rollout.max_new_tokens = "
                         f"{new} it needs {prompt + new} positions, but the model has {positions} ({where})")
