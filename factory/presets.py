"""Model presets: the named sizes a spec's `model.preset` picks (small causal LMs described by a transformers
config, built by factory/models/build.py without any download). A plain table, so that the spec schema can
check a preset's name and its context length without importing the model code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    arch: str  # "qwen2" or "llama": a transformers model_type
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    max_positions: int = 64


PRESETS: dict[str, Preset] = {
    # ~0.1M params: unit tests and integration tests.
    "micro": Preset("qwen2", hidden_size=32, layers=2, heads=2, kv_heads=2, intermediate_size=64),
    # ~0.8M params: the quickstart; trains in minutes on 2 CPU cores.
    "tiny": Preset("qwen2", hidden_size=128, layers=4, heads=4, kv_heads=4, intermediate_size=384),
    "tiny-llama": Preset("llama", hidden_size=128, layers=4, heads=4, kv_heads=2, intermediate_size=384),
    # ~10M params: still CPU-trainable, for longer experiments.
    "small": Preset("qwen2", hidden_size=256, layers=8, heads=8, kv_heads=4, intermediate_size=768),
}
