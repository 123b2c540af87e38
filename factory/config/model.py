"""The `model` section: which pretrained weights (a preset, a Hugging Face directory or a GGUF file) and how to
load them."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from factory.config.errors import _clip
from factory.config.section import _Section
from factory.presets import PRESETS


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

