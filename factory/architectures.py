"""Which causal-LM architectures Factory's engines can run, judged from a model's config alone (no weights).

The continuous engine (factory/core/rollout/engines/continuous.py) keeps attention K/V in its own slotted cache and
hands every layer one explicit 4-D mask. That fits any decoder-only model whose layers are all softmax attention:
full attention, or sliding-window attention whose window is at least the sequence length (then the window
never hides a column and the full mask is the sliding one too). It cannot hold recurrent or linear-attention
state, chunked attention, or an encoder's cross-attention. `architecture_problem` says why a config is refused
(`factory validate` reads config.json with it; the engine checks the loaded model's config with it), and
`attention_window` gives the smallest sliding window, which caps the engine's sequence length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Layer types (config `layer_types`) whose K/V the engine's slot cache holds.
ENGINE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

# Model types whose layers keep recurrent or state-space state instead of (or beside) attention K/V; their
# configs do not always list `layer_types`.
RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "zamba", "zamba2", "rwkv", "recurrent_gemma", "xlstm",
    "bamba", "granitemoehybrid", "nemotron_h", "lfm2", "qwen3_next", "minimax",
})

# Endings of causal-LM class names in config `architectures` (Llama/Qwen "...ForCausalLM", GPT-2 "...LMHeadModel").
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def architecture_problem(config: Mapping[str, Any] | Any) -> str | None:
    """Why the continuous engine cannot run a model with this config (a config.json dict or a transformers
    config object), or None if it can. The message names the architecture."""
    arch = _name(config)
    if _field(config, "is_encoder_decoder"):
        return f"{arch} is an encoder-decoder model; Factory samples from decoder-only causal LMs"
    if _field(config, "text_config") is not None or _field(config, "vision_config") is not None:
        return (f"{arch} is a multimodal wrapper (it has a text_config/vision_config); point model.path at a "
                f"text-only causal LM")
    classes = _field(config, "architectures") or []
    if classes and not any(str(c).endswith(CAUSAL_LM_SUFFIXES) for c in classes):
        return f"{arch} is not a causal LM (expected a class ending in {' or '.join(CAUSAL_LM_SUFFIXES)})"
    model_type = _field(config, "model_type")
    if model_type in RECURRENT_MODEL_TYPES:
        return (f"{arch} keeps recurrent/state-space state, which the continuous engine's attention KV cache "
                f"cannot hold")
    other = sorted({str(t) for t in _field(config, "layer_types") or []} - ENGINE_LAYER_TYPES)
    if other:
        return (f"{arch} has layer types {other}; the continuous engine's KV cache holds only "
                f"{sorted(ENGINE_LAYER_TYPES)} layers")
    return None


def attention_window(config: Mapping[str, Any] | Any) -> int | None:
    """The sliding window of the model's windowed layers (tokens a query may see, itself included), or None if
    every layer attends to the whole sequence. Qwen2-style configs keep `sliding_window` when
    `use_sliding_window` is off; it counts only when a layer is sliding or the config has no `layer_types`."""
    window = _field(config, "sliding_window")
    if not window or _field(config, "use_sliding_window") is False:
        return None
    layer_types = _field(config, "layer_types")
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _field(config: Mapping[str, Any] | Any, name: str) -> Any:
    """`name` of a config.json dict or a config object; None where it has none."""
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def _name(config: Mapping[str, Any] | Any) -> str:
    classes = _field(config, "architectures") or []
    model_type = _field(config, "model_type") or "unknown model_type"
    return f"{classes[0]} ({model_type})" if classes else str(model_type)
