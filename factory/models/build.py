"""Build a causal LM from a preset and a tokenizer: a transformers config, random init, no download."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from factory.models.presets import PRESETS


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
